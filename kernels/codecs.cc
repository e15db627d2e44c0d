// Element codecs of FORMATS.md §0 (with D6, D7, D14), in exact integer
// arithmetic on the float's bits: no float rounding mode, FTZ setting or
// FMA contraction can change a result.
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "kernels/reference.h"
#include "kernels/reference_internal.h"

namespace paramd {
namespace ref {
namespace {

using internal::FloatBits;
using internal::FloatFromBits;

// A small binary float: 1 sign bit above `ebits` exponent bits above
// `mbits` mantissa bits. E4M3, E5M2 and E2M1 differ only in these numbers and
// in which codes are special.
struct Minifloat {
  int ebits;
  int mbits;
  int bias;
  uint32_t max_code;  // largest finite magnitude (satfinite target)
  uint32_t nan_code;  // D14 canonical NaN, sign bit clear
};
constexpr Minifloat kE4M3 = {4, 3, 7, 0x7E, 0x7F};
constexpr Minifloat kE5M2 = {5, 2, 15, 0x7B, 0x7F};
constexpr Minifloat kE2M1 = {2, 1, 1, 0x7, 0x7};  // "NaN" is +6 (§0)

// enc8 / enc4: round |x| to nearest even on the format's grid with an
// unbounded exponent range, then saturate to ±max. Saturating after
// rounding is exactly satfinite: anything that would round above max is
// finite overflow and becomes max.
uint32_t EncodeMinifloat(float x, const Minifloat& f) {
  const uint32_t b = FloatBits(x);
  const uint32_t sign = (b >> 31) << (f.ebits + f.mbits);
  const uint32_t mag = b & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return f.nan_code;          // NaN of either sign (D14)
  if (mag == 0x7F800000u) return sign | f.max_code;  // ±Inf -> ±max

  // |x| = sig * 2^lsb_exp exactly (fp32 subnormals included, D6).
  const int biased = static_cast<int>(mag >> 23);
  const uint32_t sig = biased != 0 ? (mag & 0x7FFFFFu) | 0x800000u : mag;
  const int lsb_exp = (biased != 0 ? biased : 1) - 150;
  // Exponent of the target binade: below the format's smallest normal
  // exponent everything shares the subnormal spacing. fp32 subnormals lie far
  // below every target's normal range.
  const int emin = 1 - f.bias;
  const int e = biased != 0 ? biased - 127 : emin;
  const int binade = std::max(e, emin);
  // The grid step there is 2^(binade - mbits): drop `shift` low bits of sig
  // and round to nearest, ties to even. shift >= 20 for every format.
  const int shift = (binade - f.mbits) - lsb_exp;
  uint32_t n = 0;     // |x| rounds to n * 2^(binade - mbits)
  if (shift <= 24) {  // otherwise sig < 2^24 <= half a step: rounds to 0
    n = sig >> shift;
    const uint32_t rem = sig & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (n & 1))) ++n;
  }
  // In binade b (>= emin) the code of n * 2^(b - mbits) is
  // ((b + bias - 1) << mbits) + n: n in [2^mbits, 2^(mbits+1)] carries the
  // implicit bit into the exponent field, and a round-up to 2^(mbits+1)
  // lands on the next binade's first code. In the subnormal binade the
  // prefix is 0 and n (< 2^mbits, or == 2^mbits = min normal) is the code.
  uint32_t code = (static_cast<uint32_t>(binade + f.bias - 1) << f.mbits) + n;
  if (code > f.max_code) code = f.max_code;  // finite overflow saturates
  return sign | code;
}

// Value of a finite code, from its fields.
float DecodeFiniteMinifloat(uint32_t code, const Minifloat& f) {
  const uint32_t mag = code & ((1u << (f.ebits + f.mbits)) - 1);
  const int exp_field = static_cast<int>(mag >> f.mbits);
  const int mant = static_cast<int>(mag & ((1u << f.mbits) - 1));
  const float v = exp_field == 0 ? std::ldexp(static_cast<float>(mant), 1 - f.bias - f.mbits)
                                 : std::ldexp(static_cast<float>((1 << f.mbits) + mant),
                                              exp_field - f.bias - f.mbits);
  return (code >> (f.ebits + f.mbits)) & 1 ? -v : v;
}

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

}  // namespace

uint8_t EncodeE4M3(float x) { return static_cast<uint8_t>(EncodeMinifloat(x, kE4M3)); }
uint8_t EncodeE5M2(float x) { return static_cast<uint8_t>(EncodeMinifloat(x, kE5M2)); }

float DecodeE4M3(uint8_t code) {
  if ((code & 0x7F) == 0x7F) return kNaN;  // 0x7F, 0xFF; E4M3 has no Inf
  return DecodeFiniteMinifloat(code, kE4M3);
}

float DecodeE5M2(uint8_t code) {
  if ((code & 0x7C) == 0x7C) {  // exponent field all ones
    if ((code & 0x03) != 0) return kNaN;
    return code & 0x80 ? -std::numeric_limits<float>::infinity()
                       : std::numeric_limits<float>::infinity();
  }
  return DecodeFiniteMinifloat(code, kE5M2);
}

uint8_t EncodeFp8(float x, Fp8Type type) {
  return type == Fp8Type::kE5M2 ? EncodeE5M2(x) : EncodeE4M3(x);
}

float DecodeFp8(uint8_t code, Fp8Type type) {
  return type == Fp8Type::kE5M2 ? DecodeE5M2(code) : DecodeE4M3(code);
}

float Fp8Max(Fp8Type type) { return type == Fp8Type::kE5M2 ? 57344.0f : 448.0f; }

uint8_t EncodeE2M1(float x) { return static_cast<uint8_t>(EncodeMinifloat(x, kE2M1)); }

float DecodeE2M1(uint8_t code) { return DecodeFiniteMinifloat(code & 0xF, kE2M1); }

float DecodeE8M0(uint8_t code) {
  if (code == 0xFF) return kNaN;
  // 2^(e-127): a normal float with exponent field e, except e = 0, which is
  // the fp32 subnormal 2^-127.
  return FloatFromBits(code == 0 ? 0x00400000u : static_cast<uint32_t>(code) << 23);
}

uint8_t E8M0FromScaledAmax(float v) {
  // §3, TE's float_to_e8m0: the smallest e with 2^(e-127) >= v, clamped to
  // [0, 254]. v is an amax times a positive constant, so its sign is ignored.
  if (std::isnan(v)) return 0xFF;
  if (std::isinf(v)) return 0xFE;
  if (v == 0.0f) return 0x00;
  const uint32_t b = FloatBits(v) & 0x7FFFFFFFu;
  uint32_t e = b >> 23;
  const uint32_t m = b & 0x7FFFFFu;
  // A non-zero mantissa means v is above 2^(e-127): round the exponent up,
  // except at the top (254 is the largest scale) and for subnormals
  // <= 2^-127, which 2^-127 (e = 0) already covers.
  if (m != 0 && e != 0xFE && !(e == 0 && m <= 0x400000u)) ++e;
  return static_cast<uint8_t>(e);
}

uint16_t EncodeBf16(float x) {
  const uint32_t b = FloatBits(x);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;  // canonical NaN (D14)
  // Round to nearest even on the upper 16 bits; a carry out of the mantissa
  // correctly bumps the exponent (up to Inf).
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

float DecodeBf16(uint16_t bits) { return FloatFromBits(static_cast<uint32_t>(bits) << 16); }

namespace internal {

const float* Fp8ValueTable(Fp8Type type) {
  using Table = std::array<float, 256>;
  static const Table* const kTables = [] {
    static Table t[2];
    for (int c = 0; c < 256; ++c) {
      t[0][c] = DecodeE4M3(static_cast<uint8_t>(c));
      t[1][c] = DecodeE5M2(static_cast<uint8_t>(c));
    }
    return t;
  }();
  return kTables[type == Fp8Type::kE5M2 ? 1 : 0].data();
}

}  // namespace internal
}  // namespace ref
}  // namespace paramd
