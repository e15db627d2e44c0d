#include "deploy/gpu_trainer/kernels.h"

#include <cuda_bf16.h>

namespace paramd {
namespace gpu_trainer {
namespace {

__global__ void MseGrad(const float* y, const float* t, float* dy, float* loss, int64_t n) {
  float local = 0;
  const float inv = 1.0f / static_cast<float>(n);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float d = y[i] - t[i];
    dy[i] = 2.0f * d * inv;
    local += d * d * inv;
  }
  for (int o = 16; o > 0; o /= 2) local += __shfl_down_sync(0xffffffffu, local, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(loss, local);
}

__global__ void ToBf16(const float* in, __nv_bfloat16* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __float2bfloat16_rn(in[i]);
  }
}

__global__ void FromBf16(const __nv_bfloat16* in, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __bfloat162float(in[i]);
  }
}

__global__ void ScaleProduct(const float* a, const float* b, float* out) { *out = *a * *b; }

int Blocks(int64_t n) { return static_cast<int>(std::min<int64_t>((n + 255) / 256, 1024)); }

}  // namespace

cudaError_t LaunchMseGrad(const float* y, const float* t, float* dy, float* loss, int64_t n,
                          cudaStream_t stream) {
  MseGrad<<<Blocks(n), 256, 0, stream>>>(y, t, dy, loss, n);
  return cudaGetLastError();
}

cudaError_t LaunchToBf16(const float* in, void* out, int64_t n, cudaStream_t stream) {
  ToBf16<<<Blocks(n), 256, 0, stream>>>(in, static_cast<__nv_bfloat16*>(out), n);
  return cudaGetLastError();
}

cudaError_t LaunchScaleProduct(const float* a, const float* b, float* out, cudaStream_t stream) {
  ScaleProduct<<<1, 1, 0, stream>>>(a, b, out);
  return cudaGetLastError();
}

cudaError_t LaunchFromBf16(const void* in, float* out, int64_t n, cudaStream_t stream) {
  FromBf16<<<Blocks(n), 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(in), out, n);
  return cudaGetLastError();
}

}  // namespace gpu_trainer
}  // namespace paramd
