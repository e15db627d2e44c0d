// File: kernels/cuda/codecs.cuh
//
// Device-side element codecs and scale rules of docs/FORMATS.md, written
// to give the same bits as the CPU reference (kernels/codecs.cc,
// kernels/scalars.cc): every float operation is a single IEEE op with an
// explicit rounding intrinsic (__fmul_rn, __fdiv_rn, __frcp_rn), so neither
// FMA contraction nor fast-math can change a result. Included by .cu files
// only (no Abseil, no host code).
#ifndef PARAMD_KERNELS_CUDA_CODECS_CUH_
#define PARAMD_KERNELS_CUDA_CODECS_CUH_

#include <cstdint>

#include <cuda_runtime.h>

namespace paramd {
namespace gpu {
namespace dev {

constexpr uint32_t kRcp448Bits = 0x3B124925u;
constexpr uint32_t kRcp57344Bits = 0x37924925u;
constexpr uint32_t kRcp6Bits = 0x3E2AAAABu;
constexpr uint32_t kRcp2688Bits = 0x39C30C31u;
constexpr uint32_t kFltMaxBits = 0x7F7FFFFFu;
constexpr uint32_t kBf16MaxBits = 0x7F7F0000u;

__device__ __forceinline__ float Fbits(uint32_t b) { return __uint_as_float(b); }

// ---- BF16 (D14: NaN -> 0x7FFF) ----
__device__ __forceinline__ uint32_t Bf16Bits(float x) {
  const uint32_t b = __float_as_uint(x);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;
  return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ float Bf16Round(float x) { return __uint_as_float(Bf16Bits(x) << 16); }
// Hardware RNE of two floats to BF16 (cvt.rn.bf16x2.f32; NaN -> 0x7FFF on
// sm_90, D14): the packed pair, `lo` in the low half.
__device__ __forceinline__ uint32_t Bf16x2Bits(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// Both values rounded to BF16 in place (one instruction for two).
__device__ __forceinline__ void RoundPairBf16(float& lo, float& hi) {
  const uint32_t r = Bf16x2Bits(lo, hi);
  lo = __uint_as_float(r << 16);
  hi = __uint_as_float(r & 0xFFFF0000u);
}
// D1: the value the quantizer reads.
__device__ __forceinline__ float ToSource(float x, bool round_bf16) {
  return round_bf16 ? Bf16Round(x) : x;
}

// ---- FP8 (hardware satfinite conversion: RNE, Inf -> max, NaN -> 0x7F) ----
// Two values -> two bytes, `lo` in the low byte.
__device__ __forceinline__ uint32_t CvtFp8x2(float lo, float hi, bool e5m2) {
  uint16_t r;
  if (e5m2) {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  }
  return r;
}
__device__ __forceinline__ uint32_t CvtFp8(float x, bool e5m2) {
  return CvtFp8x2(x, 0.0f, e5m2) & 0xFFu;
}
// Four values -> four bytes, v0 in the low byte.
__device__ __forceinline__ uint32_t CvtFp8x4(float v0, float v1, float v2, float v3, bool e5m2) {
  return CvtFp8x2(v0, v1, e5m2) | (CvtFp8x2(v2, v3, e5m2) << 16);
}
// FP8 code -> float, exact (through f16; E4M3 0x7F/0xFF and E5M2 NaNs -> NaN).
__device__ __forceinline__ float DecodeFp8(uint32_t code, bool e5m2) {
  const uint16_t in = static_cast<uint16_t>(code & 0xFFu);
  uint32_t h2;
  if (e5m2) {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h2) : "h"(in));
  } else {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
  }
  float f;
  const uint16_t h = static_cast<uint16_t>(h2 & 0xFFFFu);
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ float Fp8Max(bool e5m2) { return e5m2 ? 57344.0f : 448.0f; }

// ---- E2M1 (FP4): RNE on {0,.5,1,1.5,2,3,4,6}, sat to 6, NaN -> +6 (0x7),
// sign kept for zero (D7). Ties go to the even code. ----
__device__ __forceinline__ uint32_t EncodeE2M1(float x) {
  const float a = fabsf(x);
  if (a != a) return 0x7u;
  const uint32_t c = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                     (a >= 3.5f) + (a > 5.0f);
  return c | ((__float_as_uint(x) >> 28) & 0x8u);
}
// The same codes with saturating FMAs (FMA pipe, no compares): for a > t,
// a*2^25 - t*2^25 >= 1 once a exceeds t by one ulp (the smallest gap above
// any threshold here is 2^-25), so sat() gives exactly 1, and 0 for a <= t.
// ">= t" is "> pred(t)" (pred = the float just below t). NaN gives 0 in
// every step: callers route NaN to EncodeE2M1. Sign kept for -0 (D7).
__device__ __forceinline__ uint32_t E2M1MagnitudeNoNaN(float a_abs) {
  constexpr float kK = 33554432.0f;                                   // 2^25
  const float h1 = __saturatef(__fmaf_rn(a_abs, kK, -8388608.0f));    // > 0.25        (0.25 * 2^25)
  const float h2 = __saturatef(__fmaf_rn(a_abs, kK, -25165822.0f));   // >= 0.75: > 0.75 - 2^-24
  const float h3 = __saturatef(__fmaf_rn(a_abs, kK, -41943040.0f));   // > 1.25
  const float h4 = __saturatef(__fmaf_rn(a_abs, kK, -58720252.0f));   // >= 1.75: > 1.75 - 2^-23
  const float h5 = __saturatef(__fmaf_rn(a_abs, kK, -83886080.0f));   // > 2.5
  const float h6 = __saturatef(__fmaf_rn(a_abs, kK, -117440504.0f));  // >= 3.5: > 3.5 - 2^-22
  const float h7 = __saturatef(__fmaf_rn(a_abs, kK, -167772160.0f));  // > 5
  // A tree of exact small-integer sums; 2^23 makes the bits - 0x4B000000 the code.
  const float s = ((h1 + h2) + (h3 + h4)) + ((h5 + h6) + (h7 + 8388608.0f));
  return __float_as_uint(s) - 0x4B000000u;
}
// Two codes, y0 in bits 0..3 and y1 in bits 4..7.
__device__ __forceinline__ uint32_t EncodeE2M1x2(float y0, float y1) {
  if (__builtin_expect(isnan(y0 + y1), 0)) {  // a NaN (or Inf - Inf): exact slow path
    return EncodeE2M1(y0) | (EncodeE2M1(y1) << 4);
  }
  const uint32_t c0 = E2M1MagnitudeNoNaN(fabsf(y0)) | ((__float_as_uint(y0) >> 28) & 0x8u);
  const uint32_t c1 = E2M1MagnitudeNoNaN(fabsf(y1)) | ((__float_as_uint(y1) >> 28) & 0x8u);
  return c0 | (c1 << 4);
}
// The same codes without compares or branches (the quantize kernel, quantize.cu).
// s = clamp(y, -6, 6) (fminf/fmaxf return the non-NaN operand, so NaN -> +6
// and +-Inf -> +-6). With a = |s| and 2^E = the power of two of max(a, 1)
// (E = 0, 1, 2), the grid spacing around a is q = 2^(E-1), and
// RN(a + 2^(E+22)) lies in [2^(E+22), 2^(E+23)) where one ulp is q: its
// mantissa field is k = RNE(a / q) (ties to even k, and k's parity is the
// code's), and the code is k + 2E; the exponent field of t is E + 149, so
// 2E = (bits(t) >> 22) - 298. Checked against the compare encoder over all
// 2^32 inputs on the device (codec_check check 6, run on every quantize_test)
// and with the same float operations on the CPU.
// Sign kept for -0 (D7).
__device__ __forceinline__ uint32_t EncodeE2M1Fast(float y) {
  const float s = fmaxf(fminf(y, 6.0f), -6.0f);
  const float a = fabsf(s);
  const float m = __uint_as_float(__float_as_uint(fmaxf(a, 1.0f)) & 0x7F800000u);
  const uint32_t bt = __float_as_uint(__fmaf_rn(m, 4194304.0f, a));
  return ((bt & 0x7FFFFFu) + (bt >> 22) - 298u) | ((__float_as_uint(s) >> 28) & 0x8u);
}
// Two codes, y0 in bits 0..3 and y1 in bits 4..7.
__device__ __forceinline__ uint32_t EncodeE2M1x2Fast(float y0, float y1) {
  return EncodeE2M1Fast(y0) | (EncodeE2M1Fast(y1) << 4);
}
// hi32(a * b) + c: with b = 2^(32-n), c + (a >> n) on the FMA pipe (IMAD.HI)
// instead of a shift-add on the ALU pipe, which the NVFP4 passes saturate
// (ncu: ALU 75 %, docs/GPU_NOTES.md).
__device__ __forceinline__ uint32_t MadHiU32(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("mad.hi.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
// prmt.b32 (default mode): byte n of the result is byte sel[n] & 7 of
// {b, a} (a = bytes 0..3), or, with bit 3 of that selector nibble set, that
// byte's sign bit replicated (0x00 / 0xFF). (__byte_perm documents only the
// plain selection.)
__device__ __forceinline__ uint32_t Prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
// EncodeE2M1Fast's rounding for one element, its bit extraction left for the
// packed step: the low byte of the result is the magnitude code + 42 (with
// t's exponent field E + 149, the low byte of bits(t) + (bits(t) >> 22) is
// k + 2E + 298 - 256); `sbits` gets the bits of the clamped value, whose
// sign is the code's (NaN -> +6).
// kClamp = false skips the clamp (two of the encoder's five ALU-pipe
// instructions) and is exact only for finite |y| < 7: in [6, 7) the grid
// spacing is 2 and RNE(|y| / 2) = 3 already gives code 7 (6.0).
template <bool kClamp = true>
__device__ __forceinline__ uint32_t E2M1MagnitudeWord(float y, uint32_t& sbits) {
  const float s = kClamp ? fmaxf(fminf(y, 6.0f), -6.0f) : y;
  const float a = fabsf(s);
  const float m = __uint_as_float(__float_as_uint(fmaxf(a, 1.0f)) & 0x7F800000u);
  const uint32_t bt = __float_as_uint(__fmaf_rn(m, 4194304.0f, a));
  sbits = __float_as_uint(s);
  return MadHiU32(bt, 1u << 10, bt);  // bt + (bt >> 22)
}
// Four codes as the bytes of one word (y0 in byte 0; sign in bit 3 of each
// byte): the same codes as EncodeE2M1Fast, with the extraction done four at
// a time (three byte permutes gather the magnitudes, three the signs as
// 0x00 / 0xFF, one subtract and one LOP3 finish all four). Checked against
// the compare encoder over all 2^32 inputs in every byte position on the
// device (codec_check check 7).
// kClamp = false: only for finite |y| < 7 (E2M1MagnitudeWord).
template <bool kClamp = true>
__device__ __forceinline__ uint32_t EncodeE2M1x4Bytes(float y0, float y1, float y2, float y3) {
  uint32_t s0, s1, s2, s3;
  const uint32_t b0 = E2M1MagnitudeWord<kClamp>(y0, s0), b1 = E2M1MagnitudeWord<kClamp>(y1, s1);
  const uint32_t b2 = E2M1MagnitudeWord<kClamp>(y2, s2), b3 = E2M1MagnitudeWord<kClamp>(y3, s3);
  const uint32_t mag = Prmt(Prmt(b0, b1, 0x0040u), Prmt(b2, b3, 0x0040u), 0x5410u);
  const uint32_t sgn = Prmt(Prmt(s0, s1, 0x00FBu), Prmt(s2, s3, 0x00FBu), 0x5410u);
  return (mag - 0x2A2A2A2Au) | (sgn & 0x08080808u);
}
// Codes as bytes [c0 c1 c2 c3] -> byte 0 = c0 | c1 << 4, byte 2 = c2 | c3 << 4
// (bytes 1 and 3 are junk): one add, no carries (every byte is < 16).
__device__ __forceinline__ uint32_t E2M1PairBytes(uint32_t w) { return MadHiU32(w, 1u << 28, w); }
// Eight codes -> eight nibbles (y0 lowest) from two EncodeE2M1x4Bytes words.
__device__ __forceinline__ uint32_t E2M1Nibbles8(uint32_t lo, uint32_t hi) {
  return Prmt(E2M1PairBytes(lo), E2M1PairBytes(hi), 0x6420u);
}
__device__ __forceinline__ float DecodeE2M1(uint32_t code) {
  // Twice the magnitudes {0,1,2,3,4,6,8,12} packed in nibbles.
  const float v = static_cast<float>((0xC8643210u >> (4 * (code & 7u))) & 0xFu) * 0.5f;
  return (code & 8u) ? -v : v;
}

// ---- E8M0 (§3, TE's ceiling rule), branch-free (selects only) ----
__device__ __forceinline__ uint32_t E8M0FromScaledAmax(float v) {
  const uint32_t b = __float_as_uint(v) & 0x7FFFFFFFu;
  const uint32_t e = b >> 23;
  const uint32_t m = b & 0x7FFFFFu;
  // Round the exponent up for a non-zero mantissa, except at 254 and for
  // subnormals <= 2^-127 (which e = 0 already covers).
  const uint32_t inc = (m != 0u && e != 0xFEu && !(e == 0u && m <= 0x400000u)) ? 1u : 0u;
  const uint32_t r = e + inc;  // Inf: 0xFF; 0 stays 0
  return b > 0x7F800000u ? 0xFFu : (r > 0xFEu ? 0xFEu : r);
}
// 2^(127-e): the multiplier applied before the element cast.
__device__ __forceinline__ float E8M0Reciprocal(uint32_t e) {
  const uint32_t bits = e == 0xFFu ? 0x7FC00000u : (e == 254u ? 0x00400000u : (254u - e) << 23);
  return __uint_as_float(bits);
}
// 2^(e-127): the dequantization factor.
__device__ __forceinline__ float DecodeE8M0(uint32_t e) {
  const uint32_t bits = e == 0xFFu ? 0x7FC00000u : (e == 0u ? 0x00400000u : (e << 23));
  return __uint_as_float(bits);
}

// ---- §2 compute_scale ----
__device__ __forceinline__ float ComputeScale(float amax, float fp8_max, bool pow2, float eps,
                                              float inf_value) {
  if (amax < eps) amax = eps;
  if (isinf(amax) || isnan(amax) || amax == 0.0f) return 1.0f;
  float s = __fdiv_rn(fp8_max, amax);
  if (isinf(s)) s = inf_value;
  if (pow2) s = __uint_as_float(__float_as_uint(s) & 0xFF800000u);
  return s;
}

// ---- §4 NVFP4 global encode scale (D4) ----
__device__ __forceinline__ float Nvfp4GlobalEncodeScale(float a) {
  if (a == 0.0f || isnan(a) || isinf(a)) return 1.0f;
  const float s = fminf(__fdiv_rn(2688.0f, a), Fbits(kFltMaxBits));
  return s == 0.0f ? 1.0f : s;
}

// Non-negative float max on the bit pattern (amax values are >= +0 and never NaN).
__device__ __forceinline__ void AtomicMaxNonNeg(float* addr, float v) {
  if (v > *reinterpret_cast<volatile float*>(addr)) {
    atomicMax(reinterpret_cast<unsigned int*>(addr), __float_as_uint(v));
  }
}

// amax update ignoring NaN (fmaxf returns the non-NaN operand).
__device__ __forceinline__ float AbsMax(float m, float x) { return fmaxf(m, fabsf(x)); }

// One stage of a transposing butterfly: this lane keeps the half of its 2N
// partial row maxima that its `mask` bit selects and sends the other half
// to lane ^ mask, whose half it receives (N shuffles for 2N rows). The
// arrays have constant indices once unrolled, so they stay in registers.
template <int N>
__device__ __forceinline__ void RowMaxStage(const float (&x)[2 * N], float (&y)[N], int mask) {
  const bool upper = (threadIdx.x & mask) != 0;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float send = upper ? x[k] : x[k + N], keep = upper ? x[k + N] : x[k];
    y[k] = fmaxf(keep, __shfl_xor_sync(0xFFFFFFFFu, send, mask));
  }
}

// Row maxima of 8 rows over groups of 8 lanes: x[k] is this lane's partial
// max of row k; returns the group's max of row (lane & 7). A transposing
// butterfly (xor 4, 2, 1): 7 shuffles for the 8 rows instead of 24, and each
// row's result lands in the lane that owns it. fmaxf throughout, so NaN is
// ignored as by a plain shuffle reduction.
__device__ __forceinline__ float GroupRowMax8(const float (&x)[8]) {
  float y[4], z[2], w[1];
  RowMaxStage<4>(x, y, 4);
  RowMaxStage<2>(y, z, 2);
  RowMaxStage<1>(z, w, 1);
  return w[0];
}

// Row maxima of 16 rows over the whole warp: x[k] is this lane's partial max
// of row k; returns the warp's max of row (lane >> 1), in lanes 2k and
// 2k + 1 (xor 16, 8, 4, 2 halve the rows each lane holds, xor 1 completes
// the last): 16 shuffles for the 16 rows instead of 80.
__device__ __forceinline__ float WarpRowMax16(const float (&x)[16]) {
  float y[8], z[4], u[2], w[1];
  RowMaxStage<8>(x, y, 16);
  RowMaxStage<4>(y, z, 8);
  RowMaxStage<2>(z, u, 4);
  RowMaxStage<1>(u, w, 2);
  return fmaxf(w[0], __shfl_xor_sync(0xFFFFFFFFu, w[0], 1));
}

}  // namespace dev
}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_CODECS_CUH_
