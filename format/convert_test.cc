#include "format/convert.h"

#include <cstring>

#include "gtest/gtest.h"
#include "kernels/format.h"

namespace paramd {
namespace {

TEST(ConvertTest, HybridSpecRoundTrip) {
  HybridSpec spec;
  spec.rowwise = DefaultQuantSpec(Format::kFp8Delayed);
  spec.rowwise.amax_history_len = 16;
  spec.rowwise.amax_algo = AmaxAlgo::kMostRecent;
  spec.rowwise.margin = 2;
  spec.columnwise = DefaultQuantSpec(Format::kNvfp4);
  spec.columnwise.two_d = false;
  spec.columnwise_source = ColumnwiseSource::kRowwiseDequantized;
  spec.source_dtype = SourceDtype::kFp32;
  spec.rowwise_usage = false;
  absl::StatusOr<HybridSpec> back = HybridSpecFromProto(HybridSpecToProto(spec));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->rowwise.format, Format::kFp8Delayed);
  EXPECT_EQ(back->rowwise.amax_history_len, 16);
  EXPECT_EQ(back->rowwise.amax_algo, AmaxAlgo::kMostRecent);
  EXPECT_EQ(back->rowwise.margin, 2);
  EXPECT_EQ(back->columnwise.format, Format::kNvfp4);
  EXPECT_FALSE(back->columnwise.two_d);
  EXPECT_EQ(back->columnwise_source, ColumnwiseSource::kRowwiseDequantized);
  EXPECT_EQ(back->source_dtype, SourceDtype::kFp32);
  EXPECT_FALSE(back->rowwise_usage);
  EXPECT_TRUE(back->columnwise_usage);
}

TEST(ConvertTest, AbsentOptionalsTakeFormatDefaults) {
  rpc::HybridSpec p;
  p.mutable_rowwise()->set_format(rpc::FORMAT_FP8_BLOCK_128X128);
  p.mutable_columnwise()->set_format(rpc::FORMAT_NVFP4);
  absl::StatusOr<HybridSpec> s = HybridSpecFromProto(p);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->rowwise.pow2_scales);  // blockwise default
  EXPECT_TRUE(s->columnwise.two_d);     // NVFP4 weights: 16x16
  EXPECT_EQ(s->rowwise.amax_history_len, 1024);
  EXPECT_TRUE(s->rowwise_usage);
  EXPECT_TRUE(s->columnwise_usage);
}

TEST(ConvertTest, RefusesUnknownEnums) {
  rpc::HybridSpec p;
  p.mutable_rowwise()->set_format(static_cast<rpc::Format>(42));
  EXPECT_EQ(HybridSpecFromProto(p).status().code(), absl::StatusCode::kInvalidArgument);
  rpc::QuantSpec q;
  q.set_amax_history_len(0);
  EXPECT_EQ(QuantSpecFromProto(q).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DirectionFromProto(static_cast<rpc::Direction>(7)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ConvertTest, DecodesFp32AndBf16) {
  std::vector<float> out;
  const float values[2] = {1.5f, -2.25f};
  std::string fp32(reinterpret_cast<const char*>(values), sizeof values);
  ASSERT_TRUE(DecodeValues(rpc::DTYPE_FP32, fp32, out).ok());
  // BF16 1.0 = 0x3F80, -3.0 = 0xC040 (little-endian bytes).
  const std::string bf16("\x80\x3F\x40\xC0", 4);
  ASSERT_TRUE(DecodeValues(rpc::DTYPE_BF16, bf16, out).ok());
  EXPECT_EQ(out, (std::vector<float>{1.5f, -2.25f, 1.0f, -3.0f}));
  EXPECT_EQ(DecodeValues(rpc::DTYPE_BF16, std::string(3, '\0'), out).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeValues(rpc::DTYPE_UNSPECIFIED, fp32, out).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace paramd
