#include "server/gpu_backend/accumulate.h"

#include <cuda_bf16.h>

namespace paramd {
namespace gpu_backend {
namespace {

// 8 elements per thread per iteration (16-byte BF16 loads).
__global__ void AccumulateBf16(float* __restrict__ acc, const __nv_bfloat16* __restrict__ g,
                               int64_t n) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t vec = n / 8;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < vec; i += stride) {
    uint4 raw = reinterpret_cast<const uint4*>(g)[i];
    const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
    float4* a = reinterpret_cast<float4*>(acc + 8 * i);
    float4 a0 = a[0], a1 = a[1];
    a0.x += __bfloat162float(h[0]);
    a0.y += __bfloat162float(h[1]);
    a0.z += __bfloat162float(h[2]);
    a0.w += __bfloat162float(h[3]);
    a1.x += __bfloat162float(h[4]);
    a1.y += __bfloat162float(h[5]);
    a1.z += __bfloat162float(h[6]);
    a1.w += __bfloat162float(h[7]);
    a[0] = a0;
    a[1] = a1;
  }
  for (int64_t i = 8 * vec + blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += stride) {
    acc[i] += __bfloat162float(g[i]);
  }
}

__global__ void AccumulateFp32(float* __restrict__ acc, const float* __restrict__ g, int64_t n) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += stride) {
    acc[i] += g[i];
  }
}

}  // namespace

cudaError_t LaunchAccumulate(float* acc, const void* grad, bool bf16, int64_t count,
                             cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  const bool aligned =
      (reinterpret_cast<uintptr_t>(acc) % 16 == 0) && (reinterpret_cast<uintptr_t>(grad) % 16 == 0);
  int blocks = static_cast<int>(std::min<int64_t>((count + 2047) / 2048, 132 * 16));
  if (blocks < 1) blocks = 1;
  if (bf16 && !aligned) return cudaErrorMisalignedAddress;
  if (bf16) {
    AccumulateBf16<<<blocks, 256, 0, stream>>>(acc, static_cast<const __nv_bfloat16*>(grad), count);
  } else {
    AccumulateFp32<<<blocks, 256, 0, stream>>>(acc, static_cast<const float*>(grad), count);
  }
  return cudaGetLastError();
}

}  // namespace gpu_backend
}  // namespace paramd
