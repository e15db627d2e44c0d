// Element codecs against FORMATS.md §0, D6, D7, D14. Expected values come
// from the bit definitions evaluated here independently (ldexp on the
// fields), or are written out by hand.
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include <gtest/gtest.h>

#include "kernels/reference.h"

namespace paramd::ref {
namespace {

float F(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}
uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// value = (-1)^s * 2^(e - bias) * (1 + m / 2^mbits), or 2^(1 - bias) * m /
// 2^mbits for e == 0: the textbook definition, evaluated in double.
double FieldValue(int s, int e, int m, int mbits, int bias) {
  const double mag =
      e == 0 ? std::ldexp(m, 1 - bias - mbits) : std::ldexp((1 << mbits) + m, e - bias - mbits);
  return s ? -mag : mag;
}

// ---------------- E4M3 ----------------

TEST(E4M3, DecodesAll256CodesPerBitDefinition) {
  for (int c = 0; c < 256; ++c) {
    const int s = c >> 7, e = (c >> 3) & 0xF, m = c & 7;
    const float got = DecodeE4M3(static_cast<uint8_t>(c));
    if (e == 15 && m == 7) {  // 0x7F, 0xFF: NaN; E4M3 "fn" has no Inf
      EXPECT_TRUE(std::isnan(got)) << c;
      continue;
    }
    EXPECT_EQ(got, static_cast<float>(FieldValue(s, e, m, 3, 7))) << c;
    EXPECT_EQ(std::signbit(got), s == 1) << c;  // 0x80 is -0
  }
  EXPECT_EQ(DecodeE4M3(0x7E), 448.0f);
  EXPECT_EQ(DecodeE4M3(0x01), std::ldexp(1.0f, -9));  // min subnormal
  EXPECT_EQ(DecodeE4M3(0x08), std::ldexp(1.0f, -6));  // min normal
}

TEST(E4M3, EncodeInvertsDecodeForEveryFiniteCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    EXPECT_EQ(EncodeE4M3(DecodeE4M3(static_cast<uint8_t>(c))), c) << c;
  }
}

// Between every two adjacent finite positive codes: the midpoint goes to
// the even code, one float ulp either side goes to the nearer code. This
// covers every binade boundary, including subnormal -> normal (0x07/0x08).
template <typename Enc, typename Dec>
void CheckTiesBetweenNeighbours(Enc enc, Dec dec, int max_code) {
  for (int c = 0; c < max_code; ++c) {
    const float lo = dec(static_cast<uint8_t>(c));
    const float hi = dec(static_cast<uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;  // exact: a short binary fraction
    ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(lo) + hi) / 2);
    const int even = (c % 2 == 0) ? c : c + 1;
    EXPECT_EQ(enc(mid), even) << c;
    EXPECT_EQ(enc(std::nextafter(mid, 0.0f)), c) << c;
    EXPECT_EQ(enc(std::nextafter(mid, kInf)), c + 1) << c;
    EXPECT_EQ(enc(-mid), 0x80 | even) << c;
  }
}

TEST(E4M3, RoundsToNearestEvenAtEveryMidpoint) {
  CheckTiesBetweenNeighbours(EncodeE4M3, DecodeE4M3, 0x7E);
}

TEST(E4M3, SaturatesFiniteOverflowAndInfinity) {
  EXPECT_EQ(EncodeE4M3(448.0f), 0x7E);
  EXPECT_EQ(EncodeE4M3(463.99f), 0x7E);  // rounds down to 448
  EXPECT_EQ(EncodeE4M3(464.0f), 0x7E);   // tie 448/480: 480 is NaN -> sat 448
  EXPECT_EQ(EncodeE4M3(1e6f), 0x7E);
  EXPECT_EQ(EncodeE4M3(FLT_MAX), 0x7E);
  EXPECT_EQ(EncodeE4M3(kInf), 0x7E);
  EXPECT_EQ(EncodeE4M3(-500.0f), 0xFE);
  EXPECT_EQ(EncodeE4M3(-kInf), 0xFE);
}

TEST(E4M3, NaNIsCanonical0x7FForBothSignsAndAnyPayload) {  // D14
  EXPECT_EQ(EncodeE4M3(kNaN), 0x7F);
  EXPECT_EQ(EncodeE4M3(-kNaN), 0x7F);
  EXPECT_EQ(EncodeE4M3(F(0x7F800001)), 0x7F);  // signalling payload
  EXPECT_EQ(EncodeE4M3(F(0xFFFFFFFF)), 0x7F);
}

TEST(E4M3, SignedZeroAndSubnormalsAreKept) {  // D6
  EXPECT_EQ(EncodeE4M3(0.0f), 0x00);
  EXPECT_EQ(EncodeE4M3(-0.0f), 0x80);
  const float min_sub = std::ldexp(1.0f, -9);
  EXPECT_EQ(EncodeE4M3(min_sub), 0x01);
  EXPECT_EQ(EncodeE4M3(min_sub / 2), 0x00);   // tie with 0: even
  EXPECT_EQ(EncodeE4M3(-min_sub / 2), 0x80);  // signed zero
  EXPECT_EQ(EncodeE4M3(std::nextafter(min_sub / 2, 1.0f)), 0x01);
  EXPECT_EQ(EncodeE4M3(1.5f * min_sub), 0x02);  // tie 1/2: even
  EXPECT_EQ(EncodeE4M3(2.5f * min_sub), 0x02);  // tie 2/3: even
  EXPECT_EQ(EncodeE4M3(F(0x00000001)), 0x00);   // fp32 subnormal input
  EXPECT_EQ(EncodeE4M3(F(0x80000001)), 0x80);
  EXPECT_EQ(EncodeE4M3(std::ldexp(1.0f, -6)), 0x08);  // min normal
}

// ---------------- E5M2 ----------------

TEST(E5M2, DecodesAll256CodesPerBitDefinition) {
  for (int c = 0; c < 256; ++c) {
    const int s = c >> 7, e = (c >> 2) & 0x1F, m = c & 3;
    const float got = DecodeE5M2(static_cast<uint8_t>(c));
    if (e == 31) {
      if (m == 0) {
        EXPECT_EQ(got, s ? -kInf : kInf) << c;
      } else {
        EXPECT_TRUE(std::isnan(got)) << c;
      }
      continue;
    }
    EXPECT_EQ(got, static_cast<float>(FieldValue(s, e, m, 2, 15))) << c;
    EXPECT_EQ(std::signbit(got), s == 1) << c;
  }
  EXPECT_EQ(DecodeE5M2(0x7B), 57344.0f);
  EXPECT_EQ(DecodeE5M2(0x01), std::ldexp(1.0f, -16));
}

TEST(E5M2, EncodeInvertsDecodeForEveryFiniteCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7C) == 0x7C) continue;  // Inf, NaN
    EXPECT_EQ(EncodeE5M2(DecodeE5M2(static_cast<uint8_t>(c))), c) << c;
  }
}

TEST(E5M2, RoundsToNearestEvenAtEveryMidpoint) {
  CheckTiesBetweenNeighbours(EncodeE5M2, DecodeE5M2, 0x7B);
}

TEST(E5M2, SaturatesInfinityAndNaNIsCanonical) {
  EXPECT_EQ(EncodeE5M2(57344.0f), 0x7B);
  EXPECT_EQ(EncodeE5M2(61440.0f), 0x7B);  // tie 57344/65536 -> sat
  EXPECT_EQ(EncodeE5M2(1e30f), 0x7B);
  EXPECT_EQ(EncodeE5M2(kInf), 0x7B);  // satfinite: Inf -> max, never 0x7C
  EXPECT_EQ(EncodeE5M2(-kInf), 0xFB);
  EXPECT_EQ(EncodeE5M2(kNaN), 0x7F);  // D14
  EXPECT_EQ(EncodeE5M2(-kNaN), 0x7F);
  EXPECT_EQ(EncodeE5M2(-0.0f), 0x80);
  EXPECT_EQ(EncodeE5M2(std::ldexp(1.0f, -17)), 0x00);  // half min subnormal
  EXPECT_EQ(EncodeE5M2(-std::ldexp(1.0f, -17)), 0x80);
  EXPECT_EQ(EncodeE5M2(std::ldexp(3.0f, -17)), 0x02);  // tie 1/2: even
}

TEST(Fp8, DispatchAndMax) {
  EXPECT_EQ(Fp8Max(Fp8Type::kE4M3), 448.0f);
  EXPECT_EQ(Fp8Max(Fp8Type::kE5M2), 57344.0f);
  EXPECT_EQ(EncodeFp8(448.0f, Fp8Type::kE4M3), 0x7E);
  EXPECT_EQ(EncodeFp8(448.0f, Fp8Type::kE5M2), 0x5F);  // 1.75 * 2^8: e=23, m=3
  EXPECT_EQ(DecodeFp8(0x5F, Fp8Type::kE5M2), 448.0f);
  EXPECT_EQ(DecodeFp8(0x5F, Fp8Type::kE4M3), 30.0f);  // e=11, m=7: 1.875*2^4
}

// ---------------- E2M1 ----------------

TEST(E2M1, Decodes16Codes) {
  const float grid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int c = 0; c < 16; ++c) {
    const float got = DecodeE2M1(static_cast<uint8_t>(c));
    EXPECT_EQ(got, c & 8 ? -grid[c & 7] : grid[c & 7]) << c;
    EXPECT_EQ(std::signbit(got), (c & 8) != 0) << c;
    // And from the fields: E2M1 is bias 1, one mantissa bit.
    EXPECT_EQ(got, static_cast<float>(FieldValue(c >> 3, (c >> 1) & 3, c & 1, 1, 1))) << c;
  }
}

TEST(E2M1, EncodeInvertsDecodeForAll16Codes) {
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(EncodeE2M1(DecodeE2M1(static_cast<uint8_t>(c))), c) << c;
  }
}

TEST(E2M1, TiesListedInFormats) {
  // §0: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
  EXPECT_EQ(EncodeE2M1(0.25f), 0x0);
  EXPECT_EQ(EncodeE2M1(0.75f), 0x2);
  EXPECT_EQ(EncodeE2M1(1.25f), 0x2);
  EXPECT_EQ(EncodeE2M1(1.75f), 0x4);
  EXPECT_EQ(EncodeE2M1(2.5f), 0x4);
  EXPECT_EQ(EncodeE2M1(3.5f), 0x6);
  EXPECT_EQ(EncodeE2M1(5.0f), 0x6);
  EXPECT_EQ(EncodeE2M1(-5.0f), 0xE);
  EXPECT_EQ(EncodeE2M1(-0.75f), 0xA);
  // Just off the ties.
  EXPECT_EQ(EncodeE2M1(std::nextafter(0.25f, 1.0f)), 0x1);
  EXPECT_EQ(EncodeE2M1(std::nextafter(5.0f, 6.0f)), 0x7);
  EXPECT_EQ(EncodeE2M1(std::nextafter(2.5f, 0.0f)), 0x4);
  EXPECT_EQ(EncodeE2M1(std::nextafter(2.5f, 3.0f)), 0x5);
}

TEST(E2M1, SaturationNaNAndSignedZero) {
  EXPECT_EQ(EncodeE2M1(6.0f), 0x7);
  EXPECT_EQ(EncodeE2M1(6.5f), 0x7);
  EXPECT_EQ(EncodeE2M1(1e20f), 0x7);
  EXPECT_EQ(EncodeE2M1(kInf), 0x7);
  EXPECT_EQ(EncodeE2M1(-kInf), 0xF);
  EXPECT_EQ(EncodeE2M1(-7.0f), 0xF);
  EXPECT_EQ(EncodeE2M1(kNaN), 0x7);  // NaN -> +6 (D14)
  EXPECT_EQ(EncodeE2M1(-kNaN), 0x7);
  EXPECT_EQ(EncodeE2M1(0.0f), 0x0);
  EXPECT_EQ(EncodeE2M1(-0.0f), 0x8);  // D7
  EXPECT_EQ(EncodeE2M1(-0.1f), 0x8);  // rounds to zero, keeps the sign
  EXPECT_EQ(EncodeE2M1(-0.25f), 0x8);
  EXPECT_EQ(EncodeE2M1(F(0x80000001)), 0x8);
}

// ---------------- E8M0 ----------------

TEST(E8M0, DecodesAll256Codes) {
  for (int e = 0; e < 255; ++e) {
    EXPECT_EQ(DecodeE8M0(static_cast<uint8_t>(e)), static_cast<float>(std::ldexp(1.0, e - 127)))
        << e;
  }
  EXPECT_TRUE(std::isnan(DecodeE8M0(0xFF)));
  EXPECT_EQ(Bits(DecodeE8M0(0)), 0x00400000u);  // 2^-127, an fp32 subnormal
}

// §3: the smallest e with 2^(e-127) >= v, clamped to [0, 254].
int SmallestCoveringE(double v) {
  for (int e = 0; e < 254; ++e) {
    if (std::ldexp(1.0, e - 127) >= v) return e;
  }
  return 254;
}

TEST(E8M0, FromScaledAmaxIsCeilingOfLog2) {
  for (int k = -149; k <= 127; ++k) {
    const float p = std::ldexp(1.0f, k);
    for (float v : {p, std::nextafter(p, 0.0f), std::nextafter(p, kInf), 1.5f * p}) {
      if (v == 0.0f || std::isinf(v)) continue;
      EXPECT_EQ(E8M0FromScaledAmax(v), SmallestCoveringE(v)) << v;
    }
  }
  EXPECT_EQ(E8M0FromScaledAmax(1.0f), 127);
  EXPECT_EQ(E8M0FromScaledAmax(1.0f / 448), 119);   // 2^-8 >= 1/448 > 2^-9
  EXPECT_EQ(E8M0FromScaledAmax(F(0x00400000)), 0);  // 2^-127 exactly
  EXPECT_EQ(E8M0FromScaledAmax(F(0x00400001)), 1);
  EXPECT_EQ(E8M0FromScaledAmax(F(0x00000001)), 0);
  EXPECT_EQ(E8M0FromScaledAmax(FLT_MAX), 254);  // clamped
  EXPECT_EQ(E8M0FromScaledAmax(0.0f), 0);
  EXPECT_EQ(E8M0FromScaledAmax(kInf), 0xFE);
  EXPECT_EQ(E8M0FromScaledAmax(kNaN), 0xFF);
}

// ---------------- BF16 ----------------

TEST(Bf16, RoundTripsAllNonNaNCodes) {
  for (uint32_t c = 0; c < 0x10000; ++c) {
    if ((c & 0x7FFF) > 0x7F80) continue;  // NaN
    EXPECT_EQ(EncodeBf16(DecodeBf16(static_cast<uint16_t>(c))), c) << c;
    EXPECT_EQ(Bits(DecodeBf16(static_cast<uint16_t>(c))), c << 16);
  }
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(EncodeBf16(1.0f), 0x3F80);
  EXPECT_EQ(EncodeBf16(F(0x3F808000)), 0x3F80);  // tie, even stays
  EXPECT_EQ(EncodeBf16(F(0x3F818000)), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(EncodeBf16(F(0x3F808001)), 0x3F81);
  EXPECT_EQ(EncodeBf16(F(0x3F807FFF)), 0x3F80);
  EXPECT_EQ(EncodeBf16(F(0x7F7F7FFF)), 0x7F7F);
  EXPECT_EQ(EncodeBf16(F(0x7F7F8000)), 0x7F80);  // tie at the top: to Inf
  EXPECT_EQ(EncodeBf16(FLT_MAX), 0x7F80);
  EXPECT_EQ(EncodeBf16(-FLT_MAX), 0xFF80);
  EXPECT_EQ(EncodeBf16(kInf), 0x7F80);
  EXPECT_EQ(EncodeBf16(-0.0f), 0x8000);
  EXPECT_EQ(EncodeBf16(F(0x00008000)), 0x0000);  // subnormal tie to even
  EXPECT_EQ(EncodeBf16(F(0x00018000)), 0x0002);
  EXPECT_EQ(EncodeBf16(F(0x00008001)), 0x0001);
  EXPECT_EQ(EncodeBf16(kNaN), 0x7FFF);  // D14
  EXPECT_EQ(EncodeBf16(-kNaN), 0x7FFF);
  EXPECT_EQ(EncodeBf16(F(0x7F800001)), 0x7FFF);
}

// Random floats against a double-precision nearest-even choice between the
// two bf16 neighbours.
TEST(Bf16, MatchesIndependentRoundingOnRandomFloats) {
  std::mt19937 rng(7);
  for (int n = 0; n < 200000; ++n) {
    const uint32_t b = rng();
    const float x = F(b);
    if (std::isnan(x) || std::isinf(x)) continue;
    const uint32_t lo = b & 0xFFFF0000u;
    const uint32_t hi = lo + 0x10000u;
    const double dlo = std::fabs(static_cast<double>(F(lo)) - x);
    const double dhi = std::isinf(F(hi)) ? std::ldexp(1.0, 128) - std::fabs(x)
                                         : std::fabs(static_cast<double>(F(hi)) - x);
    uint32_t want = dlo < dhi ? lo : dhi < dlo ? hi : ((lo >> 16) & 1 ? hi : lo);
    EXPECT_EQ(EncodeBf16(x), want >> 16) << std::hex << b;
  }
}

}  // namespace
}  // namespace paramd::ref
