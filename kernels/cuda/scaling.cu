// Device-side scaling updates: §2 current scaling and §1 delayed scaling
// (fused rule, D9), bit for bit as kernels/scalars.cc computes them.
#include <cfloat>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/codecs.cuh"
#include "kernels/cuda/misc_launch.h"

namespace paramd {
namespace gpu {
namespace detail {
namespace {

using namespace ::paramd::gpu::dev;  // NOLINT

__global__ void CurrentScalingKernel(const __grid_constant__ CurrentBatch batch) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= batch.num) return;
  const CurrentItem& t = batch.t[i];
  const float s = ComputeScale(*t.amax, t.fp8_max, t.pow2, t.eps, FLT_MAX);
  *t.scale = s;
  if (t.scale_inv != nullptr) *t.scale_inv = __frcp_rn(s);
}

constexpr int kDelayedThreads = 256;

// One block per tensor. The history is read into shared memory before any
// slot is rewritten, so the roll needs no second buffer in global memory.
__global__ void __launch_bounds__(kDelayedThreads)
    DelayedScalingKernel(const __grid_constant__ DelayedBatch batch) {
  extern __shared__ float hist[];
  __shared__ float warp_max[kDelayedThreads / 32];
  const DelayedItem& t = batch.t[blockIdx.x];
  const int len = t.len;
  const float a = t.reduced_amax != nullptr ? *t.reduced_amax : t.history[0];
  if (a == 0.0f) return;  // D9: no roll, scale unchanged (uniform over the block)
  float m = a;            // fmax over slots 1..len-1 (before rolling), starting from a
  for (int i = threadIdx.x; i < len; i += kDelayedThreads) {
    const float h = t.history[i];
    hist[i] = h;
    if (i >= 1 && t.algo_max) m = fmaxf(m, h);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  // Roll: slot i <- slot i+1 for i in 1..len-2, slot len-1 <- a, slot 0 <- 0.
  for (int i = threadIdx.x; i < len; i += kDelayedThreads) {
    float v;
    if (i == 0) {
      v = 0.0f;
    } else if (i == len - 1) {
      v = a;
    } else {
      v = hist[i + 1];
    }
    t.history[i] = v;
  }
  if (threadIdx.x == 0) {
    float sel = a;
    if (t.algo_max) {
      for (int w = 0; w < kDelayedThreads / 32; ++w) sel = fmaxf(sel, warp_max[w]);
    }
    float scale = *t.scale;
    if (!isinf(sel) && !isnan(sel) && sel > 0.0f) scale = __fdiv_rn(t.scaled_max, sel);
    if (isinf(scale)) scale = FLT_MAX;
    *t.scale = scale;
    if (t.scale_inv != nullptr) *t.scale_inv = __frcp_rn(scale);
  }
}

}  // namespace

cudaError_t LaunchCurrentScaling(const CurrentBatch& batch, cudaStream_t stream) {
  if (batch.num <= 0) return cudaSuccess;
  CurrentScalingKernel<<<(batch.num + 127) / 128, 128, 0, stream>>>(batch);
  return cudaGetLastError();
}

cudaError_t LaunchDelayedScaling(const DelayedBatch& batch, cudaStream_t stream) {
  if (batch.num <= 0) return cudaSuccess;
  const size_t smem = sizeof(float) * static_cast<size_t>(batch.max_len);
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        DelayedScalingKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  DelayedScalingKernel<<<batch.num, kDelayedThreads, smem, stream>>>(batch);
  return cudaGetLastError();
}

}  // namespace detail
}  // namespace gpu
}  // namespace paramd
