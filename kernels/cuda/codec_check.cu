// Exhaustive device self-check of the element codecs the kernels use, over
// all 2^32 float bit patterns: the hardware FP8 / BF16 conversions against a
// device port of the CPU reference's integer algorithm (kernels/codecs.cc
// EncodeMinifloat, EncodeBf16), and both fast E2M1 encoders (the FMA-pipe
// EncodeE2M1x2, the branch-free EncodeE2M1x2Fast and the packed
// EncodeE2M1x4Bytes of the quantize kernel) against the compare-based one. Used by quantize_test;
// not on any hot path.
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/codecs.cuh"
#include "kernels/cuda/misc_launch.h"

namespace paramd {
namespace gpu {
namespace detail {
namespace {

using namespace ::paramd::gpu::dev;  // NOLINT

// kernels/codecs.cc EncodeMinifloat, line for line.
__device__ uint32_t RefMinifloat(float x, int ebits, int mbits, int bias, uint32_t max_code,
                                 uint32_t nan_code) {
  const uint32_t b = __float_as_uint(x);
  const uint32_t sign = (b >> 31) << (ebits + mbits);
  const uint32_t mag = b & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return nan_code;
  if (mag == 0x7F800000u) return sign | max_code;
  const int biased = static_cast<int>(mag >> 23);
  const uint32_t sig = biased != 0 ? (mag & 0x7FFFFFu) | 0x800000u : mag;
  const int lsb_exp = (biased != 0 ? biased : 1) - 150;
  const int emin = 1 - bias;
  const int e = biased != 0 ? biased - 127 : emin;
  const int binade = e > emin ? e : emin;
  const int shift = (binade - mbits) - lsb_exp;
  uint32_t n = 0;
  if (shift <= 24) {
    n = sig >> shift;
    const uint32_t rem = sig & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (n & 1))) ++n;
  }
  uint32_t code = (static_cast<uint32_t>(binade + bias - 1) << mbits) + n;
  if (code > max_code) code = max_code;
  return sign | code;
}

// kernels/codecs.cc E8M0FromScaledAmax, line for line.
__device__ uint32_t RefE8M0(float v) {
  if (isnan(v)) return 0xFF;
  if (isinf(v)) return 0xFE;
  if (v == 0.0f) return 0x00;
  const uint32_t b = __float_as_uint(v) & 0x7FFFFFFFu;
  uint32_t e = b >> 23;
  const uint32_t m = b & 0x7FFFFFu;
  if (m != 0 && e != 0xFE && !(e == 0 && m <= 0x400000u)) ++e;
  return e;
}

// counts[k]: mismatches of check k; first[k]: the smallest failing input.
// 0: E4M3 cvt, 1: E5M2 cvt, 2: BF16 cvt vs bit formula, 3: E2M1 fast vs
// compare-based (both nibbles), 4: E2M1 compare-based vs the reference rule,
// 5: branch-free E8M0 vs the reference rule, 6: EncodeE2M1x2Fast (the v4
// kernel's E2M1 encoder) vs compare-based (both nibbles), 7: EncodeE2M1x4Bytes
// (the packed encoder of the NVFP4 passes) vs compare-based (every byte
// position; unclamped for |x| < 7) and E2M1Nibbles8.
__global__ void CodecCheckKernel(unsigned long long* counts, unsigned* first) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < (uint64_t{1} << 32);
       i += stride) {
    const uint32_t u = static_cast<uint32_t>(i);
    const float x = __uint_as_float(u);
    bool bad[kCodecChecks];
    bad[0] = CvtFp8(x, false) != RefMinifloat(x, 4, 3, 7, 0x7E, 0x7F);
    bad[1] = CvtFp8(x, true) != RefMinifloat(x, 5, 2, 15, 0x7B, 0x7F);
    bad[2] = (Bf16x2Bits(x, 0.0f) & 0xFFFFu) != Bf16Bits(x);
    const float y = __uint_as_float(u * 2654435761u);  // a second, unrelated input
    bad[3] = EncodeE2M1x2(x, y) != (EncodeE2M1(x) | (EncodeE2M1(y) << 4));
    bad[4] = EncodeE2M1(x) != RefMinifloat(x, 2, 1, 1, 0x7, 0x7);
    bad[5] = E8M0FromScaledAmax(x) != RefE8M0(x);
    bad[6] = EncodeE2M1x2Fast(x, y) != (EncodeE2M1(x) | (EncodeE2M1(y) << 4));
    {
      // x in every byte position (rotated), with three unrelated inputs.
      const float z = __uint_as_float(u ^ 0x80000000u), w = __uint_as_float(u * 40503u + 12345u);
      const uint32_t want =
          EncodeE2M1(x) | (EncodeE2M1(y) << 8) | (EncodeE2M1(z) << 16) | (EncodeE2M1(w) << 24);
      const int rot = static_cast<int>(u & 3u);
      const float v0 = rot == 0 ? x : rot == 1 ? w : rot == 2 ? z : y;
      const float v1 = rot == 0 ? y : rot == 1 ? x : rot == 2 ? w : z;
      const float v2 = rot == 0 ? z : rot == 1 ? y : rot == 2 ? x : w;
      const float v3 = rot == 0 ? w : rot == 1 ? z : rot == 2 ? y : x;
      const uint32_t got = EncodeE2M1x4Bytes(v0, v1, v2, v3);
      const uint32_t unrot = rot == 0 ? got : __funnelshift_r(got, got, 8 * rot);
      // The unclamped encoder where it applies (finite |x| < 7), in byte 0.
      const bool no_clamp_ok =
          !(fabsf(x) < 7.0f) ||
          (EncodeE2M1x4Bytes<false>(x, 0.0f, 0.0f, 0.0f) & 0xFFu) == EncodeE2M1(x);
      bad[7] = !no_clamp_ok || unrot != want ||
               E2M1Nibbles8(got, got) != ((got & 0xFu) | ((got >> 4) & 0xF0u) |
                                          ((got >> 8) & 0xF00u) | ((got >> 12) & 0xF000u)) *
                                             0x10001u;
    }
#pragma unroll
    for (int k = 0; k < kCodecChecks; ++k) {  // one atomic per warp (the loop is warp-uniform)
      const unsigned mask = __ballot_sync(0xFFFFFFFFu, bad[k]);
      if (mask != 0) {
        const int leader = __ffs(mask) - 1;
        if ((threadIdx.x & 31) == leader) {
          atomicAdd(&counts[k], static_cast<unsigned long long>(__popc(mask)));
          atomicMin(&first[k], u);  // the leader's input is the warp's smallest failing one
        }
      }
    }
  }
}

}  // namespace

cudaError_t LaunchCodecCheck(unsigned long long* counts, unsigned* first, cudaStream_t stream) {
  // 2^19 threads: every thread runs exactly 2^13 iterations (warp-uniform loop).
  CodecCheckKernel<<<2048, 256, 0, stream>>>(counts, first);
  return cudaGetLastError();
}

}  // namespace detail
}  // namespace gpu
}  // namespace paramd
