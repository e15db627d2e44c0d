#include "server/gpu_backend/finite_check.h"

#include <cuda_bf16.h>

#include <algorithm>

namespace paramd {
namespace gpu_backend {
namespace {

// Exponent bits all ones = NaN or infinity, for both element types.
__global__ void NonFiniteBf16(const uint16_t* __restrict__ g, int64_t n, uint32_t* flag) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  bool bad = false;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += stride) {
    bad |= (g[i] & 0x7f80u) == 0x7f80u;
  }
  if (bad) *flag = 1;
}

__global__ void NonFiniteFp32(const uint32_t* __restrict__ g, int64_t n, uint32_t* flag) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  bool bad = false;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += stride) {
    bad |= (g[i] & 0x7f800000u) == 0x7f800000u;
  }
  if (bad) *flag = 1;
}

}  // namespace

cudaError_t LaunchNonFiniteCheck(const void* data, bool bf16, int64_t count, uint32_t* flag,
                                 cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  const int blocks = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>((count + 2047) / 2048, 132 * 16)));
  if (bf16) {
    NonFiniteBf16<<<blocks, 256, 0, stream>>>(static_cast<const uint16_t*>(data), count, flag);
  } else {
    NonFiniteFp32<<<blocks, 256, 0, stream>>>(static_cast<const uint32_t*>(data), count, flag);
  }
  return cudaGetLastError();
}

}  // namespace gpu_backend
}  // namespace paramd
