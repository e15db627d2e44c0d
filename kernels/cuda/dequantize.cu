// Dequantization of every format and direction back to [M][K] FP32 or BF16,
// bit for bit as ref::Dequantize (then RNE to BF16 for BF16 output). One
// thread per output element; not on the daemon's hot path.
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/codecs.cuh"
#include "kernels/cuda/misc_launch.h"
#include "kernels/cuda/quantize_launch.h"

namespace paramd {
namespace gpu {
namespace detail {
namespace {

using namespace ::paramd::gpu::dev;  // NOLINT

__device__ __forceinline__ float ValueAt(const DequantItem& t, int64_t i, int64_t j) {
  const int64_t M = t.rows, K = t.cols;
  const uint8_t* data = static_cast<const uint8_t*>(t.data);
  const bool col = t.columnwise;
  switch (t.fmt) {
    case kKBf16:
      return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(t.data)[i * K + j])
                             << 16);
    case kKFp32:
      return static_cast<const float*>(t.data)[i * K + j];
    case kKFp8Tensor: {
      const uint8_t q = col ? data[j * M + i] : data[i * K + j];
      return __fmul_rn(DecodeFp8(q, t.e5m2), *t.scale_inv);
    }
    case kKMxfp8: {
      const uint8_t* sc = static_cast<const uint8_t*>(t.scales);
      const uint32_t e = col ? sc[(i / 32) * t.scale_cols + j] : sc[i * t.scale_cols + j / 32];
      return __fmul_rn(DecodeFp8(data[i * K + j], t.e5m2), DecodeE8M0(e));
    }
    case kKNvfp4: {
      const uint8_t* sc = static_cast<const uint8_t*>(t.scales);
      uint32_t code, sd;
      if (col) {
        code = (data[j * ((M + 1) / 2) + i / 2] >> (4 * (i & 1))) & 0xFu;
        sd = sc[j * t.scale_cols + i / 16];
      } else {
        code = (data[i * ((K + 1) / 2) + j / 2] >> (4 * (j & 1))) & 0xFu;
        sd = sc[i * t.scale_cols + j / 16];
      }
      const float f =
          __fmul_rn(__fmul_rn(DecodeFp8(sd, false), *t.global_amax), Fbits(kRcp2688Bits));
      return __fmul_rn(DecodeE2M1(code), f);
    }
    case kKBlock2d: {
      const float* sc = static_cast<const float*>(t.scales);
      const uint8_t q = col ? data[j * M + i] : data[i * K + j];
      const float si =
          col ? sc[(j / 128) * t.scale_cols + i / 128] : sc[(i / 128) * t.scale_cols + j / 128];
      return __fmul_rn(DecodeFp8(q, t.e5m2), si);
    }
    case kKBlock1d: {
      const float* sc = static_cast<const float*>(t.scales);
      const uint8_t q = col ? data[j * M + i] : data[i * K + j];
      const float si = col ? sc[(i / 128) * t.scale_cols + j] : sc[(j / 128) * t.scale_cols + i];
      return __fmul_rn(DecodeFp8(q, t.e5m2), si);
    }
    default:
      return 0.0f;
  }
}

__global__ void DequantizeKernel(const __grid_constant__ DequantItem t) {
  const int64_t n = t.rows * t.cols;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = e / t.cols, j = e % t.cols;
    const float v = ValueAt(t, i, j);
    if (t.out_bf16) {
      static_cast<uint16_t*>(t.out)[e] = static_cast<uint16_t>(Bf16Bits(v));
    } else {
      static_cast<float*>(t.out)[e] = v;
    }
  }
}

}  // namespace

cudaError_t LaunchDequantize(const DequantItem& item, cudaStream_t stream) {
  const int64_t n = item.rows * item.cols;
  if (n <= 0) return cudaSuccess;
  int64_t blocks = (n + 255) / 256;
  if (blocks > 65536) blocks = 65536;
  DequantizeKernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(item);
  return cudaGetLastError();
}

}  // namespace detail
}  // namespace gpu
}  // namespace paramd
