// Hybrid quantization (§6, D1, D2, D16).
#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/reference.h"
#include "kernels/test_util.h"

namespace paramd::ref {
namespace {

using testing::F;
using testing::Fp32At;

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = d(rng);
  return x;
}

HybridSpec Make(Format row, Format col, ColumnwiseSource source) {
  HybridSpec spec;
  spec.rowwise = DefaultQuantSpec(row);
  spec.columnwise = DefaultQuantSpec(col);
  spec.columnwise_source = source;
  return spec;
}

// The scalings a daemon computes: rowwise from the source, columnwise from
// what the columnwise quantizer reads.
absl::StatusOr<HybridScaling> ScalingsFor(const std::vector<float>& master, int64_t m, int64_t k,
                                          const HybridSpec& spec) {
  HybridScaling s;
  s.rowwise = ScalingFromAmax(spec.rowwise, Amax(RoundToSource(master, spec.source_dtype)));
  auto col = ColumnwiseSourceValues(master, m, k, spec, s.rowwise);
  if (!col.ok()) return col.status();
  s.columnwise = ScalingFromAmax(spec.columnwise, Amax(*col));
  return s;
}

// master = [0.3, 1.0]; BF16 source: 0.3 = 0x3E99999A -> 0x3E9A (0.30078125).
// Rowwise FP8 current: amax 1 -> scale 448:
//   0.30078125 * 448 = 134.75: step 16, 8.42 -> 8 -> 128 = 2^7 (e=14, 0x70);
//   1 -> 448 (0x7E).
// Dequantized: 128 * RN(1/448) = 0x3E924925 (exact power-of-2 scaling),
// 448 * RN(1/448) = 1.0; to BF16: 0x3E92 (0.28515625), 1.0 (D2).
TEST(Hybrid, RowwiseDequantizedHandComputed) {
  HybridSpec spec =
      Make(Format::kFp8Current, Format::kIdentityFp32, ColumnwiseSource::kRowwiseDequantized);
  const std::vector<float> master = {0.3f, 1.0f};
  ASSERT_OK_AND_ASSIGN(auto scaling, ScalingsFor(master, 1, 2, spec));
  ASSERT_EQ(scaling.rowwise.scale, 448.0f);
  ASSERT_OK_AND_ASSIGN(auto r, QuantizeHybrid(master, 1, 2, spec, scaling));
  ASSERT_TRUE(r.rowwise.has_value());
  ASSERT_TRUE(r.columnwise.has_value());
  EXPECT_EQ(r.rowwise->data, std::vector<uint8_t>({0x70, 0x7E}));
  EXPECT_EQ(r.rowwise->scale_inv, F(0x3B124925));
  EXPECT_EQ(r.columnwise->data, Fp32At(2, {{0, F(0x3E920000)}, {1, 1.0f}}));
  ASSERT_OK_AND_ASSIGN(auto values, ColumnwiseSourceValues(master, 1, 2, spec, scaling.rowwise));
  EXPECT_EQ(values, std::vector<float>({F(0x3E920000), 1.0f}));

  // Rowwise usage off: a temporary rowwise copy still feeds the columnwise
  // one (same bytes), and is not published.
  spec.rowwise_usage = false;
  ASSERT_OK_AND_ASSIGN(auto c, QuantizeHybrid(master, 1, 2, spec, scaling));
  EXPECT_FALSE(c.rowwise.has_value());
  ASSERT_TRUE(c.columnwise.has_value());
  EXPECT_EQ(c.columnwise->data, r.columnwise->data);

  // FP32 source (D1): 0.3f * 448 = 134.4 -> 128 as well, and the dequantized
  // 0x3E924925 is kept unrounded.
  spec.rowwise_usage = true;
  spec.source_dtype = SourceDtype::kFp32;
  ASSERT_OK_AND_ASSIGN(auto f, QuantizeHybrid(master, 1, 2, spec, scaling));
  EXPECT_EQ(f.rowwise->data, std::vector<uint8_t>({0x70, 0x7E}));
  EXPECT_EQ(f.columnwise->data, Fp32At(2, {{0, F(0x3E924925)}, {1, 1.0f}}));
}

TEST(Hybrid, OriginalSourceQuantizesTheRoundedMaster) {
  const HybridSpec spec =
      Make(Format::kFp8Current, Format::kIdentityFp32, ColumnwiseSource::kOriginal);
  const std::vector<float> master = {0.3f, 1.0f};
  ASSERT_OK_AND_ASSIGN(auto scaling, ScalingsFor(master, 1, 2, spec));
  ASSERT_OK_AND_ASSIGN(auto r, QuantizeHybrid(master, 1, 2, spec, scaling));
  EXPECT_EQ(r.columnwise->data, Fp32At(2, {{0, F(0x3E9A0000)}, {1, 1.0f}}));
  ASSERT_OK_AND_ASSIGN(auto values, ColumnwiseSourceValues(master, 1, 2, spec, scaling.rowwise));
  EXPECT_EQ(values, std::vector<float>({F(0x3E9A0000), 1.0f}));
}

// Against the definition, on a random tensor, for both sources and several
// format pairs: the hybrid is exactly the two single-direction quantizations.
TEST(Hybrid, EqualsTheSingleDirectionQuantizations) {
  const int64_t m = 37, k = 70;
  const std::vector<float> master = Random(m * k, 3);
  const Format pairs[][2] = {{Format::kFp8Current, Format::kMxfp8},
                             {Format::kMxfp8, Format::kFp8Block1x128},
                             {Format::kNvfp4, Format::kNvfp4},
                             {Format::kFp8Block128x128, Format::kFp8Delayed},
                             {Format::kIdentityBf16, Format::kNvfp4}};
  for (const auto& pair : pairs) {
    for (ColumnwiseSource source :
         {ColumnwiseSource::kOriginal, ColumnwiseSource::kRowwiseDequantized}) {
      for (SourceDtype dtype : {SourceDtype::kBf16, SourceDtype::kFp32}) {
        SCOPED_TRACE(std::string(FormatName(pair[0])) + "/" + std::string(FormatName(pair[1])) +
                     (source == ColumnwiseSource::kOriginal ? " original" : " dequantized") +
                     (dtype == SourceDtype::kBf16 ? " bf16" : " fp32"));
        HybridSpec spec = Make(pair[0], pair[1], source);
        spec.source_dtype = dtype;
        ASSERT_OK_AND_ASSIGN(auto scaling, ScalingsFor(master, m, k, spec));
        if (pair[1] == Format::kFp8Delayed) scaling.columnwise.scale = 16.0f;
        ASSERT_OK_AND_ASSIGN(auto r, QuantizeHybrid(master, m, k, spec, scaling));

        const std::vector<float> src = RoundToSource(master, dtype);
        QuantSpec row_spec = spec.rowwise, col_spec = spec.columnwise;
        row_spec.source_dtype = col_spec.source_dtype = dtype;
        ASSERT_OK_AND_ASSIGN(auto row,
                             Quantize(src, m, k, row_spec, Direction::kRowwise, scaling.rowwise));
        std::vector<float> col_src = src;
        if (source == ColumnwiseSource::kRowwiseDequantized) {
          ASSERT_OK_AND_ASSIGN(auto deq, Dequantize(row, row_spec));
          col_src = RoundToSource(deq, dtype);
        }
        ASSERT_OK_AND_ASSIGN(auto values,
                             ColumnwiseSourceValues(master, m, k, spec, scaling.rowwise));
        EXPECT_EQ(values, col_src);
        ASSERT_OK_AND_ASSIGN(auto col, Quantize(col_src, m, k, col_spec, Direction::kColumnwise,
                                                scaling.columnwise));
        EXPECT_EQ(r.rowwise->data, row.data);
        EXPECT_EQ(r.rowwise->scales, row.scales);
        EXPECT_EQ(r.columnwise->data, col.data);
        EXPECT_EQ(r.columnwise->scales, col.scales);
        EXPECT_EQ(r.columnwise->scale_inv, col.scale_inv);
        EXPECT_EQ(r.columnwise->amax, col.amax);
        EXPECT_EQ(r.columnwise->direction, Direction::kColumnwise);
      }
    }
  }
}

TEST(Hybrid, UsageFlagsSelectDirections) {
  const std::vector<float> master = Random(6, 1);
  for (bool row : {false, true}) {
    for (bool col : {false, true}) {
      for (ColumnwiseSource source :
           {ColumnwiseSource::kOriginal, ColumnwiseSource::kRowwiseDequantized}) {
        HybridSpec spec = Make(Format::kMxfp8, Format::kMxfp8, source);
        spec.rowwise_usage = row;
        spec.columnwise_usage = col;
        ASSERT_OK_AND_ASSIGN(auto r, QuantizeHybrid(master, 2, 3, spec, {}));
        EXPECT_EQ(r.rowwise.has_value(), row);
        EXPECT_EQ(r.columnwise.has_value(), col);
      }
    }
  }
}

TEST(Hybrid, PerTensorColumnwiseIsByteTransposeOfRowwise) {  // D13
  const int64_t m = 19, k = 23;
  const std::vector<float> master = Random(m * k, 5);
  const HybridSpec spec =
      Make(Format::kFp8Current, Format::kFp8Current, ColumnwiseSource::kOriginal);
  ASSERT_OK_AND_ASSIGN(auto scaling, ScalingsFor(master, m, k, spec));
  ASSERT_OK_AND_ASSIGN(auto r, QuantizeHybrid(master, m, k, spec, scaling));
  ASSERT_TRUE(r.rowwise.has_value() && r.columnwise.has_value());
  const QuantizedTensor& row = r.rowwise.value();
  const QuantizedTensor& col = r.columnwise.value();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < k; ++j) ASSERT_EQ(col.data[j * m + i], row.data[i * k + j]);
  EXPECT_EQ(col.scale_inv, row.scale_inv);
}

TEST(Hybrid, Nvfp4TwoDimensionalColumnwiseIsNibbleTranspose) {  // §4
  const int64_t m = 35, k = 21;  // odd both ways: padded nibbles in both copies
  const std::vector<float> master = Random(m * k, 6);
  const HybridSpec spec = Make(Format::kNvfp4, Format::kNvfp4, ColumnwiseSource::kOriginal);
  ASSERT_OK_AND_ASSIGN(auto scaling, ScalingsFor(master, m, k, spec));
  ASSERT_EQ(scaling.rowwise.global_amax, scaling.columnwise.global_amax);
  ASSERT_OK_AND_ASSIGN(auto r, QuantizeHybrid(master, m, k, spec, scaling));
  ASSERT_TRUE(r.rowwise.has_value() && r.columnwise.has_value());
  const std::vector<uint8_t>& row = r.rowwise.value().data;
  const std::vector<uint8_t>& col = r.columnwise.value().data;
  const int64_t rb = (k + 1) / 2, cb = (m + 1) / 2;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < k; ++j) {
      const int row_code = (row[i * rb + j / 2] >> (4 * (j % 2))) & 0xF;
      const int col_code = (col[j * cb + i / 2] >> (4 * (i % 2))) & 0xF;
      ASSERT_EQ(col_code, row_code) << i << "," << j;
    }
  }
}

TEST(Hybrid, SourceDtypeReachesBlockwiseInfValue) {
  // A 128x128 tile whose amax is tiny: 448/amax overflows to inf_value:
  // FLT_MAX for an FP32 source (scale_inv 0x00200000), the BF16 maximum for
  // a BF16 source (scale_inv 0x00202020), whatever the child spec says.
  HybridSpec spec =
      Make(Format::kFp8Block128x128, Format::kIdentityBf16, ColumnwiseSource::kOriginal);
  spec.rowwise.pow2_scales = false;
  spec.rowwise.source_dtype = SourceDtype::kBf16;  // overridden by the hybrid
  spec.columnwise_usage = false;
  spec.source_dtype = SourceDtype::kFp32;
  ASSERT_OK_AND_ASSIGN(auto a, QuantizeHybrid({1e-37f, 0.0f}, 1, 2, spec, {}));
  EXPECT_EQ(a.rowwise->scales, Fp32At(4, {{0, F(0x00200000)}}));
  spec.source_dtype = SourceDtype::kBf16;
  ASSERT_OK_AND_ASSIGN(auto b, QuantizeHybrid({1e-37f, 0.0f}, 1, 2, spec, {}));
  EXPECT_EQ(b.rowwise->scales, Fp32At(4, {{0, F(0x00202020)}}));
}

TEST(Hybrid, RejectsBadShapes) {
  const HybridSpec spec;
  EXPECT_EQ(QuantizeHybrid(std::vector<float>(5), 2, 3, spec, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeHybrid(std::vector<float>(0), 0, 3, spec, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ColumnwiseSourceValues(std::vector<float>(5), 2, 3, spec, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace paramd::ref
