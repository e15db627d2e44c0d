#include "server/gpu_backend/finite_check.h"

#include <algorithm>
#include <cstdint>

namespace paramd {
namespace gpu_backend {
namespace {

// Exponent bits all ones (`kMask`) = NaN or infinity: uint16_t BF16 bits
// with 0x7f80, uint32_t FP32 bits with 0x7f800000.
template <typename Bits, uint32_t kMask>
__global__ void NonFinite(const Bits* __restrict__ g, int64_t n, uint32_t* flag) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  bool bad = false;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += stride) {
    bad |= (g[i] & kMask) == kMask;
  }
  if (bad) *flag = 1;
}

}  // namespace

cudaError_t LaunchNonFiniteCheck(const void* data, bool bf16, int64_t count, uint32_t* flag,
                                 cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  const int blocks =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((count + 2047) / 2048, 132 * 16)));
  if (bf16) {
    NonFinite<uint16_t, 0x7f80u>
        <<<blocks, 256, 0, stream>>>(static_cast<const uint16_t*>(data), count, flag);
  } else {
    NonFinite<uint32_t, 0x7f800000u>
        <<<blocks, 256, 0, stream>>>(static_cast<const uint32_t*>(data), count, flag);
  }
  return cudaGetLastError();
}

}  // namespace gpu_backend
}  // namespace paramd
