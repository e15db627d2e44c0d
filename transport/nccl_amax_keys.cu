#include "transport/nccl_amax_keys.h"

#include <cstdint>
#include <cstring>

namespace paramd {
namespace nccl_internal {
namespace {

__host__ __device__ inline uint32_t Encode(uint32_t u) {
  const bool nan = (u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu) != 0;
  if (nan) return 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__host__ __device__ inline uint32_t Decode(uint32_t k) {
  if (k == 0) return 0x7FC00000u;
  return (k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k;
}

__global__ void EncodeKernel(uint32_t* v, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    v[i] = Encode(v[i]);
  }
}

__global__ void DecodeKernel(uint32_t* v, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    v[i] = Decode(v[i]);
  }
}

int Blocks(size_t n) {
  size_t b = (n + 255) / 256;
  return static_cast<int>(b < 1 ? 1 : (b > 1024 ? 1024 : b));
}

}  // namespace

cudaError_t LaunchEncodeAmaxKeys(void* values, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  EncodeKernel<<<Blocks(count), 256, 0, stream>>>(static_cast<uint32_t*>(values), count);
  return cudaGetLastError();
}

cudaError_t LaunchDecodeAmaxKeys(void* values, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  DecodeKernel<<<Blocks(count), 256, 0, stream>>>(static_cast<uint32_t*>(values), count);
  return cudaGetLastError();
}

unsigned EncodeAmaxKeyHost(float value) {
  uint32_t u;
  std::memcpy(&u, &value, 4);
  return Encode(u);
}

float DecodeAmaxKeyHost(unsigned key) {
  uint32_t u = Decode(key);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace nccl_internal
}  // namespace paramd
