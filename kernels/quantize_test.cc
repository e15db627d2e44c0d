// Properties every format must have, over formats x directions x shapes
// (1x1, 1xN, Nx1, primes, non-multiples of 16/32/128): buffer sizes,
// zero padding (D8, D11), round-trip error bounds at several magnitudes,
// the relations between the two directions, NaN/Inf and all-zero inputs,
// and argument errors.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/reference.h"
#include "kernels/test_util.h"

namespace paramd::ref {
namespace {

struct Case {
  Format format;
  bool two_d;
};

const Case kCases[] = {
    {Format::kIdentityBf16, false},    {Format::kIdentityFp32, false},
    {Format::kFp8Delayed, false},      {Format::kFp8Current, false},
    {Format::kMxfp8, false},           {Format::kMxfp8, true},
    {Format::kNvfp4, false},           {Format::kNvfp4, true},
    {Format::kFp8Block128x128, false}, {Format::kFp8Block1x128, false},
};

struct Shape {
  int64_t m, k;
};
const Shape kShapes[] = {{1, 1},   {1, 7},   {7, 1},   {1, 300}, {300, 1},   {37, 131},
                         {33, 17}, {16, 16}, {32, 32}, {31, 33}, {128, 128}, {129, 257}};

std::string CaseName(const Case& c) {
  return std::string(FormatName(c.format)) + (c.two_d ? "_2d" : "");
}

// Block extent in W coordinates (rows, cols) for a format and direction,
// from FORMATS.md's prose (not from the implementation).
Shape BlockOf(const Case& c, Direction d, Shape w) {
  const bool row = d == Direction::kRowwise;
  switch (c.format) {
    case Format::kMxfp8:
      return c.two_d ? Shape{32, 32} : row ? Shape{1, 32} : Shape{32, 1};
    case Format::kNvfp4:
      return c.two_d ? Shape{16, 16} : row ? Shape{1, 16} : Shape{16, 1};
    case Format::kFp8Block128x128:
      return {128, 128};
    case Format::kFp8Block1x128:
      return row ? Shape{1, 128} : Shape{128, 1};
    default:
      return w;  // one block: the tensor
  }
}

// amax of the block holding each element.
std::vector<float> BlockAmaxPerElement(const std::vector<float>& x, Shape w, Shape b) {
  std::vector<float> out(x.size());
  for (int64_t bi = 0; bi < w.m; bi += b.m) {
    for (int64_t bj = 0; bj < w.k; bj += b.k) {
      float a = 0;
      for (int64_t i = bi; i < std::min(bi + b.m, w.m); ++i)
        for (int64_t j = bj; j < std::min(bj + b.k, w.k); ++j)
          if (std::fabs(x[i * w.k + j]) > a) a = std::fabs(x[i * w.k + j]);
      for (int64_t i = bi; i < std::min(bi + b.m, w.m); ++i)
        for (int64_t j = bj; j < std::min(bj + b.k, w.k); ++j) out[i * w.k + j] = a;
    }
  }
  return out;
}

// Non-zero values whose magnitude varies over 2^-4..2^4 by row and by column
// (so a scale applied to the wrong block shows), times 2^log2_scale.
std::vector<float> RandomTensor(Shape w, int log2_scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.5f, 1.0f);
  std::vector<float> x(w.m * w.k);
  for (int64_t i = 0; i < w.m; ++i) {
    for (int64_t j = 0; j < w.k; ++j) {
      const int e = static_cast<int>((i * 7) % 5 + (j * 5) % 5) - 4 + log2_scale;
      const float v = std::ldexp(u(rng), e);
      x[i * w.k + j] = (rng() & 1) ? -v : v;
    }
  }
  return x;
}

QuantSpec SpecFor(const Case& c) {
  QuantSpec s = DefaultQuantSpec(c.format);
  s.two_d = c.two_d;
  return s;
}

// What the caller would pass: per-tensor scale / global amax from the data.
TensorScaling ScalingFor(const QuantSpec& spec, const std::vector<float>& x) {
  TensorScaling t = ScalingFromAmax(spec, Amax(x));
  if (spec.format == Format::kFp8Delayed) {
    // As if the previous step saw the same amax.
    t.scale = ComputeScale(t.global_amax, 448.0f, false, 0.0f, 3.4028235e38f);
  }
  return t;
}

// |x^ - x| <= rel*|x| + abs*block_amax for every element.
struct Bound {
  double rel, abs;
};
Bound BoundFor(Format f) {
  switch (f) {
    case Format::kIdentityFp32:
      return {0, 0};
    case Format::kIdentityBf16:
      return {std::ldexp(1.0, -8), 0};  // 7 mantissa bits: half an ulp
    case Format::kNvfp4:
      // E2M1 grid: <= 20% relative; values under a quarter grid step flush,
      // a step being ~amax/6 after the UE4M3 scale's own rounding.
      return {0.25, 0.05};
    default:
      // E4M3: half an ulp is <= 2^-4 relative; subnormal floor 2^-10 of a
      // scale_inv that is at most 2*amax/448.
      return {std::ldexp(1.0, -4), std::ldexp(1.0, -8)};
  }
}

// Valid (rows, cols) of the scale buffer, per FORMATS.md tables.
Shape ValidScales(const Case& c, Direction d, Shape w) {
  auto cdiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const bool row = d == Direction::kRowwise;
  switch (c.format) {
    case Format::kMxfp8:
      return row ? Shape{w.m, cdiv(w.k, 32)} : Shape{cdiv(w.m, 32), w.k};
    case Format::kNvfp4:
      return row ? Shape{w.m, cdiv(w.k, 16)} : Shape{w.k, cdiv(w.m, 16)};
    case Format::kFp8Block128x128:
      return row ? Shape{cdiv(w.m, 128), cdiv(w.k, 128)} : Shape{cdiv(w.k, 128), cdiv(w.m, 128)};
    case Format::kFp8Block1x128:
      return row ? Shape{cdiv(w.k, 128), w.m} : Shape{cdiv(w.m, 128), w.k};
    default:
      return {0, 0};
  }
}

class QuantizeTest : public ::testing::TestWithParam<std::tuple<Case, Shape>> {
 protected:
  Case c() const { return std::get<0>(GetParam()); }
  Shape w() const { return std::get<1>(GetParam()); }
};

TEST_P(QuantizeTest, SizesPaddingAndRoundTrip) {
  const QuantSpec spec = SpecFor(c());
  for (int log2_scale : {-20, 0, 20}) {
    const std::vector<float> x = RandomTensor(w(), log2_scale, 17 + log2_scale);
    const TensorScaling scaling = ScalingFor(spec, x);
    for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
      SCOPED_TRACE(std::string(DirectionName(d)) + " 2^" + std::to_string(log2_scale));
      ASSERT_OK_AND_ASSIGN(const Layout layout, ComputeLayout(spec, d, w().m, w().k));
      ASSERT_OK_AND_ASSIGN(const QuantizedTensor q, Quantize(x, w().m, w().k, spec, d, scaling));
      ASSERT_EQ(static_cast<int64_t>(q.data.size()), layout.data_bytes());
      ASSERT_EQ(static_cast<int64_t>(q.scales.size()), layout.scale_bytes());
      EXPECT_EQ(q.rows, w().m);
      EXPECT_EQ(q.cols, w().k);
      EXPECT_EQ(q.direction, d);

      // Every valid scale entry is set (all blocks are non-zero), every
      // padding entry is 0 (D8).
      const Shape valid = ValidScales(c(), d, w());
      const int eb = layout.scale_elem_bytes;
      for (int64_t r = 0; r < layout.scale_rows; ++r) {
        for (int64_t s = 0; s < layout.scale_cols; ++s) {
          bool zero = true;
          for (int b = 0; b < eb; ++b) zero &= q.scales[(r * layout.scale_cols + s) * eb + b] == 0;
          EXPECT_EQ(zero, !(r < valid.m && s < valid.k)) << r << "," << s;
        }
      }
      // An odd FP4 count leaves the last nibble of each packed row 0 (D11).
      if (c().format == Format::kNvfp4 && (layout.transposed ? w().m : w().k) % 2 == 1) {
        for (int64_t r = 0; r < layout.data_rows; ++r) {
          EXPECT_EQ(q.data[(r + 1) * layout.data_row_bytes - 1] & 0xF0, 0) << r;
        }
      }

      ASSERT_OK_AND_ASSIGN(const std::vector<float> y, Dequantize(q, spec));
      ASSERT_EQ(y.size(), x.size());
      const std::vector<float> amax = BlockAmaxPerElement(x, w(), BlockOf(c(), d, w()));
      const Bound bound = BoundFor(c().format);
      for (size_t n = 0; n < x.size(); ++n) {
        const double err = std::fabs(static_cast<double>(y[n]) - x[n]);
        ASSERT_LE(err, bound.rel * std::fabs(x[n]) + bound.abs * amax[n])
            << "element " << n << ": " << x[n] << " -> " << y[n];
      }
    }
  }
}

// The two directions, where FORMATS.md says how they relate.
TEST_P(QuantizeTest, DirectionsRelateAsSpecified) {
  const QuantSpec spec = SpecFor(c());
  const std::vector<float> x = RandomTensor(w(), 0, 5);
  const TensorScaling scaling = ScalingFor(spec, x);
  ASSERT_OK_AND_ASSIGN(auto row, Quantize(x, w().m, w().k, spec, Direction::kRowwise, scaling));
  ASSERT_OK_AND_ASSIGN(auto col, Quantize(x, w().m, w().k, spec, Direction::kColumnwise, scaling));
  const int64_t m = w().m, k = w().k;
  auto byte_transpose = [](const std::vector<uint8_t>& in, int64_t rows, int64_t cols) {
    std::vector<uint8_t> out(in.size());
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) out[j * rows + i] = in[i * cols + j];
    return out;
  };
  auto nibble = [](const std::vector<uint8_t>& d, int64_t row_bytes, int64_t i, int64_t j) {
    return (d[i * row_bytes + j / 2] >> ((j % 2) * 4)) & 0xF;
  };
  bool same_values = true;
  switch (c().format) {
    case Format::kIdentityBf16:
    case Format::kIdentityFp32:
      EXPECT_EQ(col.data, row.data);
      break;
    case Format::kFp8Delayed:
    case Format::kFp8Current:  // D13: byte transpose, same scale_inv
      EXPECT_EQ(col.data, byte_transpose(row.data, m, k));
      EXPECT_EQ(col.scale_inv, row.scale_inv);
      break;
    case Format::kFp8Block128x128: {  // §5: derived from rowwise
      EXPECT_EQ(col.data, byte_transpose(row.data, m, k));
      const int64_t mb = (m + 127) / 128, kb = (k + 127) / 128;
      const int64_t row_cols = (kb + 3) / 4 * 4, col_cols = (mb + 3) / 4 * 4;
      for (int64_t a = 0; a < mb; ++a)
        for (int64_t b = 0; b < kb; ++b)
          for (int byte = 0; byte < 4; ++byte)
            EXPECT_EQ(col.scales[(b * col_cols + a) * 4 + byte],
                      row.scales[(a * row_cols + b) * 4 + byte]);
      break;
    }
    case Format::kMxfp8:
      if (c().two_d) {
        EXPECT_EQ(col.data, row.data);
      } else {
        same_values = false;
      }
      break;
    case Format::kNvfp4:
      if (c().two_d) {  // §4: nibble transpose with equal global scales
        const int64_t rb = (k + 1) / 2, cb = (m + 1) / 2;
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < k; ++j)
            ASSERT_EQ(nibble(col.data, cb, j, i), nibble(row.data, rb, i, j)) << i << "," << j;
      } else {
        same_values = false;
      }
      break;
    case Format::kFp8Block1x128:
      same_values = false;
      break;
  }
  ASSERT_OK_AND_ASSIGN(auto yr, Dequantize(row, spec));
  ASSERT_OK_AND_ASSIGN(auto yc, Dequantize(col, spec));
  if (same_values) {
    EXPECT_EQ(yr, yc);
  }
}

TEST_P(QuantizeTest, AllZeroTensor) {
  const QuantSpec spec = SpecFor(c());
  const std::vector<float> x(w().m * w().k, 0.0f);
  const TensorScaling scaling = ScalingFor(spec, x);
  for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
    ASSERT_OK_AND_ASSIGN(auto q, Quantize(x, w().m, w().k, spec, d, scaling));
    EXPECT_TRUE(std::all_of(q.data.begin(), q.data.end(), [](uint8_t b) { return b == 0; }));
    ASSERT_OK_AND_ASSIGN(auto y, Dequantize(q, spec));
    EXPECT_EQ(y, x);
  }
}

// A NaN changes only its own element: amax ignores it (§0), so every scale
// is what it would be with a 0 there.
TEST_P(QuantizeTest, NaNAffectsOnlyItsElement) {
  const QuantSpec spec = SpecFor(c());
  std::vector<float> with_zero = RandomTensor(w(), 0, 9);
  const int64_t at = (w().m / 2) * w().k + w().k / 2;
  with_zero[at] = 0.0f;
  std::vector<float> with_nan = with_zero;
  with_nan[at] = std::numeric_limits<float>::quiet_NaN();
  const TensorScaling scaling = ScalingFor(spec, with_zero);
  for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
    ASSERT_OK_AND_ASSIGN(auto qz, Quantize(with_zero, w().m, w().k, spec, d, scaling));
    ASSERT_OK_AND_ASSIGN(auto qn, Quantize(with_nan, w().m, w().k, spec, d, scaling));
    EXPECT_EQ(qn.scales, qz.scales);
    EXPECT_EQ(qn.scale_inv, qz.scale_inv);
    ASSERT_OK_AND_ASSIGN(auto yz, Dequantize(qz, spec));
    ASSERT_OK_AND_ASSIGN(auto yn, Dequantize(qn, spec));
    for (size_t n = 0; n < yz.size(); ++n) {
      if (static_cast<int64_t>(n) == static_cast<int64_t>(at)) {
        // FP4 has no NaN: NaN encodes +6 (D14), times the block's decode
        // scale (0 when the NaN is alone in its block); the others keep NaN.
        EXPECT_EQ(std::isnan(yn[n]), c().format != Format::kNvfp4);
        if (c().format == Format::kNvfp4) {
          EXPECT_FALSE(std::signbit(yn[n]));
        }
      } else {
        ASSERT_EQ(yn[n], yz[n]) << n;
      }
    }
  }
}

// +-Inf saturates in every FP8/FP4 format and survives the identities.
TEST_P(QuantizeTest, InfinitySaturatesOrPassesThrough) {
  const QuantSpec spec = SpecFor(c());
  std::vector<float> x = RandomTensor(w(), 0, 11);
  x[0] = -std::numeric_limits<float>::infinity();
  const TensorScaling scaling = ScalingFor(spec, x);
  for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
    ASSERT_OK_AND_ASSIGN(auto q, Quantize(x, w().m, w().k, spec, d, scaling));
    ASSERT_OK_AND_ASSIGN(auto y, Dequantize(q, spec));
    EXPECT_TRUE(y[0] < 0 && !std::isnan(y[0])) << y[0];
    const bool identity =
        c().format == Format::kIdentityBf16 || c().format == Format::kIdentityFp32;
    if (identity) {
      EXPECT_TRUE(std::isinf(y[0]));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllFormats, QuantizeTest,
                         ::testing::Combine(::testing::ValuesIn(kCases),
                                            ::testing::ValuesIn(kShapes)),
                         [](const ::testing::TestParamInfo<std::tuple<Case, Shape>>& info) {
                           const Shape s = std::get<1>(info.param);
                           return CaseName(std::get<0>(info.param)) + "_" + std::to_string(s.m) +
                                  "x" + std::to_string(s.k);
                         });

TEST(Quantize, RejectsBadArguments) {
  const QuantSpec spec = DefaultQuantSpec(Format::kMxfp8);
  const std::vector<float> x(6, 1.0f);
  EXPECT_EQ(Quantize(x, 2, 4, spec, Direction::kRowwise, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Quantize(x, 0, 6, spec, Direction::kRowwise, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  QuantSpec bad = spec;
  bad.format = static_cast<Format>(77);
  EXPECT_EQ(Quantize(x, 2, 3, bad, Direction::kRowwise, {}).status().code(),
            absl::StatusCode::kInvalidArgument);

  ASSERT_OK_AND_ASSIGN(auto q, Quantize(x, 2, 3, spec, Direction::kColumnwise, {}));
  EXPECT_EQ(Dequantize(q, DefaultQuantSpec(Format::kNvfp4)).status().code(),
            absl::StatusCode::kInvalidArgument);
  QuantizedTensor short_data = q;
  short_data.data.pop_back();
  EXPECT_EQ(Dequantize(short_data, spec).status().code(), absl::StatusCode::kInvalidArgument);
  QuantizedTensor short_scales = q;
  short_scales.scales.pop_back();
  EXPECT_EQ(Dequantize(short_scales, spec).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Quantize, IdentityBytesHandComputed) {
  // BF16: 1 -> 0x3F80; -0.3 = 0xBE99999A -> 0xBE9A (round up); NaN -> 0x7FFF.
  // Little-endian, [M][K] in both directions.
  const std::vector<float> x = {1.0f, -0.3f, std::numeric_limits<float>::quiet_NaN()};
  for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
    ASSERT_OK_AND_ASSIGN(auto b, Quantize(x, 3, 1, DefaultQuantSpec(Format::kIdentityBf16), d, {}));
    EXPECT_EQ(b.data, std::vector<uint8_t>({0x80, 0x3F, 0x9A, 0xBE, 0xFF, 0x7F}));
    EXPECT_TRUE(b.scales.empty());
    ASSERT_OK_AND_ASSIGN(
        auto f, Quantize({1.0f, -2.0f}, 1, 2, DefaultQuantSpec(Format::kIdentityFp32), d, {}));
    EXPECT_EQ(f.data, std::vector<uint8_t>({0, 0, 0x80, 0x3F, 0, 0, 0, 0xC0}));
  }
}

}  // namespace
}  // namespace paramd::ref
