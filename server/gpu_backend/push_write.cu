#include "server/gpu_backend/push_write.h"

#include <cuda_bf16.h>

#include <algorithm>

namespace paramd {
namespace gpu_backend {
namespace {

__device__ __forceinline__ float Widen(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}
__device__ __forceinline__ bool Bad(uint16_t bits) { return (bits & 0x7f80u) == 0x7f80u; }

// 8 BF16 per thread per iteration: one 16-byte load, two 16-byte stores.
__global__ void WriteCheckedBf16(float* __restrict__ acc, const uint16_t* __restrict__ g, int64_t n,
                                 uint32_t* flag) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t vec = n / 8;
  bool bad = false;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < vec; i += stride) {
    const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(g) + i);  // read once
    const uint16_t* h = reinterpret_cast<const uint16_t*>(&raw);
    float4 a0, a1;
    a0.x = 0.0f + Widen(h[0]);
    a0.y = 0.0f + Widen(h[1]);
    a0.z = 0.0f + Widen(h[2]);
    a0.w = 0.0f + Widen(h[3]);
    a1.x = 0.0f + Widen(h[4]);
    a1.y = 0.0f + Widen(h[5]);
    a1.z = 0.0f + Widen(h[6]);
    a1.w = 0.0f + Widen(h[7]);
#pragma unroll
    for (int k = 0; k < 8; ++k) bad |= Bad(h[k]);
    float4* a = reinterpret_cast<float4*>(acc + 8 * i);
    a[0] = a0;
    a[1] = a1;
  }
  for (int64_t i = 8 * vec + blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += stride) {
    bad |= Bad(g[i]);
    acc[i] = 0.0f + Widen(g[i]);
  }
  if (bad) *flag = 1;
}

// Unaligned BF16 (a piece starting mid-vector) and FP32: element by element.
__global__ void WriteCheckedBf16Scalar(float* __restrict__ acc, const uint16_t* __restrict__ g,
                                       int64_t n, uint32_t* flag) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  bool bad = false;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += stride) {
    bad |= Bad(g[i]);
    acc[i] = 0.0f + Widen(g[i]);
  }
  if (bad) *flag = 1;
}

__global__ void WriteCheckedFp32(float* __restrict__ acc, const float* __restrict__ g, int64_t n,
                                 uint32_t* flag) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  bool bad = false;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += stride) {
    const float v = g[i];
    bad |= (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
    acc[i] = 0.0f + v;
  }
  if (bad) *flag = 1;
}

}  // namespace

cudaError_t LaunchWriteChecked(float* acc, const void* grad, bool bf16, int64_t count,
                               uint32_t* flag, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  const int blocks =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((count + 2047) / 2048, 132 * 16)));
  const bool aligned =
      reinterpret_cast<uintptr_t>(acc) % 16 == 0 && reinterpret_cast<uintptr_t>(grad) % 16 == 0;
  if (bf16 && aligned) {
    WriteCheckedBf16<<<blocks, 256, 0, stream>>>(acc, static_cast<const uint16_t*>(grad), count,
                                                 flag);
  } else if (bf16) {
    WriteCheckedBf16Scalar<<<blocks, 256, 0, stream>>>(acc, static_cast<const uint16_t*>(grad),
                                                       count, flag);
  } else {
    WriteCheckedFp32<<<blocks, 256, 0, stream>>>(acc, static_cast<const float*>(grad), count, flag);
  }
  return cudaGetLastError();
}

}  // namespace gpu_backend
}  // namespace paramd
