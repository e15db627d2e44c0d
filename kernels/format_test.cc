// Layouts of FORMATS.md's tables, worked out by hand for M = 37, K = 131
// (primes: nothing divides evenly) and for 1 x 1, plus names and defaults.
#include "kernels/format.h"

#include <gtest/gtest.h>

namespace paramd {
namespace {

struct Expected {
  int64_t data_rows, data_row_bytes;
  bool transposed;
  int64_t scale_rows, scale_cols;
  int scale_elem_bytes;
};

void ExpectLayout(Format f, Direction d, int64_t m, int64_t k, const Expected& e,
                  bool two_d = false) {
  QuantSpec spec = DefaultQuantSpec(f);
  spec.two_d = two_d;
  auto l = ComputeLayout(spec, d, m, k);
  ASSERT_TRUE(l.ok()) << l.status();
  SCOPED_TRACE(std::string(FormatName(f)) + " " + std::string(DirectionName(d)));
  EXPECT_EQ(l->data_rows, e.data_rows);
  EXPECT_EQ(l->data_row_bytes, e.data_row_bytes);
  EXPECT_EQ(l->transposed, e.transposed);
  EXPECT_EQ(l->scale_rows, e.scale_rows);
  EXPECT_EQ(l->scale_cols, e.scale_cols);
  EXPECT_EQ(l->scale_elem_bytes, e.scale_elem_bytes);
  EXPECT_EQ(l->data_bytes(), e.data_rows * e.data_row_bytes);
  EXPECT_EQ(l->scale_bytes(), e.scale_rows * e.scale_cols * e.scale_elem_bytes);
}

constexpr auto kRow = Direction::kRowwise;
constexpr auto kCol = Direction::kColumnwise;

TEST(ComputeLayout, IdentityKeepsMByKInBothDirections) {  // §6
  ExpectLayout(Format::kIdentityBf16, kRow, 37, 131, {37, 262, false, 0, 0, 0});
  ExpectLayout(Format::kIdentityBf16, kCol, 37, 131, {37, 262, false, 0, 0, 0});
  ExpectLayout(Format::kIdentityFp32, kRow, 37, 131, {37, 524, false, 0, 0, 0});
  ExpectLayout(Format::kIdentityFp32, kCol, 37, 131, {37, 524, false, 0, 0, 0});
}

TEST(ComputeLayout, PerTensorFp8ColumnwiseIsTransposeWithoutScaleBuffer) {  // §1, §2, D13
  for (Format f : {Format::kFp8Delayed, Format::kFp8Current}) {
    ExpectLayout(f, kRow, 37, 131, {37, 131, false, 0, 0, 0});
    ExpectLayout(f, kCol, 37, 131, {131, 37, true, 0, 0, 0});
  }
}

TEST(ComputeLayout, Mxfp8) {  // §3 + D11
  // rowwise scale [roundup(37,128)=128][roundup(ceil(131/32)=5,4)=8]
  ExpectLayout(Format::kMxfp8, kRow, 37, 131, {37, 131, false, 128, 8, 1});
  // columnwise data NOT transposed; scale [roundup(ceil(37/32)=2,4)=4][roundup(131,128)=256]
  ExpectLayout(Format::kMxfp8, kCol, 37, 131, {37, 131, false, 4, 256, 1});
  // 2D tiles publish the same layouts.
  ExpectLayout(Format::kMxfp8, kCol, 37, 131, {37, 131, false, 4, 256, 1}, true);
  ExpectLayout(Format::kMxfp8, kRow, 1, 1, {1, 1, false, 128, 4, 1});
  ExpectLayout(Format::kMxfp8, kCol, 1, 1, {1, 1, false, 4, 128, 1});
  ExpectLayout(Format::kMxfp8, kRow, 256, 4096, {256, 4096, false, 256, 128, 1});
  ExpectLayout(Format::kMxfp8, kCol, 256, 4096, {256, 4096, false, 8, 4096, 1});
}

TEST(ComputeLayout, Nvfp4) {  // §4 + D11
  // rowwise data [37][ceil(131/2)=66]; scale [128][roundup(ceil(131/16)=9,4)=12]
  ExpectLayout(Format::kNvfp4, kRow, 37, 131, {37, 66, false, 128, 12, 1});
  // columnwise data [131][ceil(37/2)=19]; scale [roundup(131,128)=256][roundup(ceil(37/16)=3,4)=4]
  ExpectLayout(Format::kNvfp4, kCol, 37, 131, {131, 19, true, 256, 4, 1});
  ExpectLayout(Format::kNvfp4, kRow, 1, 1, {1, 1, false, 128, 4, 1});
  ExpectLayout(Format::kNvfp4, kCol, 1, 1, {1, 1, true, 128, 4, 1});
  ExpectLayout(Format::kNvfp4, kRow, 128, 64, {128, 32, false, 128, 4, 1});
}

TEST(ComputeLayout, Fp8Blockwise) {  // §5 GEMM-ready table
  // 2D rowwise: [ceil(37/128)=1][roundup(ceil(131/128)=2,4)=4] fp32
  ExpectLayout(Format::kFp8Block128x128, kRow, 37, 131, {37, 131, false, 1, 4, 4});
  // 2D columnwise: data [131][37]; scale [ceil(131/128)=2][roundup(1,4)=4]
  ExpectLayout(Format::kFp8Block128x128, kCol, 37, 131, {131, 37, true, 2, 4, 4});
  // 1D rowwise: scale [ceil(131/128)=2][roundup(37,4)=40] (transposed order)
  ExpectLayout(Format::kFp8Block1x128, kRow, 37, 131, {37, 131, false, 2, 40, 4});
  // 1D columnwise: data [131][37]; scale [ceil(37/128)=1][roundup(131,4)=132]
  ExpectLayout(Format::kFp8Block1x128, kCol, 37, 131, {131, 37, true, 1, 132, 4});
  ExpectLayout(Format::kFp8Block1x128, kRow, 1, 1, {1, 1, false, 1, 4, 4});
}

TEST(ComputeLayout, RejectsBadShapesAndFormats) {
  const QuantSpec spec = DefaultQuantSpec(Format::kMxfp8);
  EXPECT_EQ(ComputeLayout(spec, kRow, 0, 5).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeLayout(spec, kRow, 5, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeLayout(spec, kCol, -1, 5).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeLayout(spec, kRow, int64_t{1} << 30, int64_t{1} << 30).status().code(),
            absl::StatusCode::kInvalidArgument);  // 2^60 elements
  EXPECT_TRUE(ComputeLayout(spec, kRow, int64_t{1} << 24, int64_t{1} << 24).ok());
  QuantSpec bad = spec;
  bad.format = static_cast<Format>(99);
  EXPECT_EQ(ComputeLayout(bad, kRow, 4, 4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeLayout(spec, static_cast<Direction>(7), 4, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(FormatNames, RoundTripAndRejectUnknown) {
  for (int f = 0; f <= 7; ++f) {
    const Format format = static_cast<Format>(f);
    auto parsed = ParseFormatName(FormatName(format));
    ASSERT_TRUE(parsed.ok()) << FormatName(format);
    EXPECT_EQ(*parsed, format);
  }
  EXPECT_EQ(FormatName(Format::kFp8Block128x128), "fp8_block128x128");
  EXPECT_EQ(FormatName(Format::kNvfp4), "nvfp4");
  EXPECT_FALSE(ParseFormatName("fp8").ok());
  EXPECT_EQ(FormatName(static_cast<Format>(42)), "unknown");
  EXPECT_EQ(DirectionName(kRow), "rowwise");
  EXPECT_EQ(DirectionName(kCol), "columnwise");
}

TEST(DefaultQuantSpec, FollowsD10) {
  const QuantSpec delayed = DefaultQuantSpec(Format::kFp8Delayed);
  EXPECT_EQ(delayed.fp8_type, Fp8Type::kE4M3);
  EXPECT_EQ(delayed.amax_history_len, 1024);
  EXPECT_EQ(delayed.amax_algo, AmaxAlgo::kMax);
  EXPECT_EQ(delayed.margin, 0);
  EXPECT_FALSE(DefaultQuantSpec(Format::kFp8Current).pow2_scales);
  EXPECT_EQ(DefaultQuantSpec(Format::kFp8Current).eps, 0.0f);
  EXPECT_FALSE(DefaultQuantSpec(Format::kMxfp8).two_d);
  EXPECT_TRUE(DefaultQuantSpec(Format::kNvfp4).two_d);
  EXPECT_TRUE(DefaultQuantSpec(Format::kFp8Block128x128).pow2_scales);
  EXPECT_TRUE(DefaultQuantSpec(Format::kFp8Block1x128).pow2_scales);
  EXPECT_EQ(DefaultQuantSpec(Format::kFp8Block1x128).source_dtype, SourceDtype::kBf16);
  EXPECT_EQ(DefaultQuantSpec(Format::kIdentityFp32).format, Format::kIdentityFp32);
}

TEST(NeedsGlobalAmax, PerTensorFp8AndNvfp4Only) {
  EXPECT_TRUE(NeedsGlobalAmax(Format::kFp8Delayed));
  EXPECT_TRUE(NeedsGlobalAmax(Format::kFp8Current));
  EXPECT_TRUE(NeedsGlobalAmax(Format::kNvfp4));
  EXPECT_FALSE(NeedsGlobalAmax(Format::kMxfp8));
  EXPECT_FALSE(NeedsGlobalAmax(Format::kFp8Block128x128));
  EXPECT_FALSE(NeedsGlobalAmax(Format::kFp8Block1x128));
  EXPECT_FALSE(NeedsGlobalAmax(Format::kIdentityBf16));
}

}  // namespace
}  // namespace paramd
