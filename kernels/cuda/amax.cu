// Multi-tensor amax (§0: NaN ignored, Inf counts) of the source values (D1:
// optionally rounded to BF16 first), max-updated into per-tensor slots.
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/codecs.cuh"
#include "kernels/cuda/misc_launch.h"

namespace paramd {
namespace gpu {
namespace detail {
namespace {

using namespace ::paramd::gpu::dev;  // NOLINT

constexpr int kThreads = 512;

__device__ __forceinline__ float Load(const AmaxItem& t, int64_t i) {
  return t.src_bf16 ? __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(t.src)[i]) << 16)
                    : static_cast<const float*>(t.src)[i];
}

__global__ void __launch_bounds__(kThreads) AmaxKernel(const __grid_constant__ AmaxBatch batch) {
  __shared__ float warp_max[kThreads / 32];
  const int64_t chunk = blockIdx.x;
  int lo = 0, hi = batch.num - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (batch.t[mid].chunk_begin <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const AmaxItem& t = batch.t[lo];
  const int64_t begin = (chunk - t.chunk_begin) * kAmaxChunk;
  const int64_t end = begin + kAmaxChunk < t.count ? begin + kAmaxChunk : t.count;
  const bool rb = t.round_bf16;
  float m = 0.0f;
  if (t.vec && !t.src_bf16) {
    // Float4 body (begin is a multiple of 4), scalar tail.
    const int64_t end4 = begin + ((end - begin) & ~int64_t{3});
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(t.src) + begin);
    const int64_t n4 = (end4 - begin) / 4;
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < n4; i += kThreads) {
      const float4 v = __ldg(p + i);
      m = AbsMax(m, ToSource(v.x, rb));
      m = AbsMax(m, ToSource(v.y, rb));
      m = AbsMax(m, ToSource(v.z, rb));
      m = AbsMax(m, ToSource(v.w, rb));
    }
    for (int64_t i = end4 + threadIdx.x; i < end; i += kThreads) m = AbsMax(m, ToSource(Load(t, i), rb));
  } else if (t.vec) {
    const int64_t end8 = begin + ((end - begin) & ~int64_t{7});
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(t.src) + begin);
    const int64_t n8 = (end8 - begin) / 8;
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < n8; i += kThreads) {
      const uint4 v = __ldg(p + i);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        m = AbsMax(m, __uint_as_float(w[k] << 16));
        m = AbsMax(m, __uint_as_float(w[k] & 0xFFFF0000u));
      }
    }
    for (int64_t i = end8 + threadIdx.x; i < end; i += kThreads) m = AbsMax(m, Load(t, i));
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) m = AbsMax(m, ToSource(Load(t, i), rb));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0.0f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
    if (threadIdx.x == 0) AtomicMaxNonNeg(t.out, m);
  }
}

}  // namespace

cudaError_t LaunchAmax(const AmaxBatch& batch, cudaStream_t stream) {
  if (batch.total_chunks <= 0) return cudaSuccess;
  AmaxKernel<<<static_cast<unsigned>(batch.total_chunks), kThreads, 0, stream>>>(batch);
  return cudaGetLastError();
}

}  // namespace detail
}  // namespace gpu
}  // namespace paramd
