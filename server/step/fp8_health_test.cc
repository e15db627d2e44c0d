#include "server/step/fp8_health.h"

#include "gtest/gtest.h"

namespace paramd {
namespace {

QuantizedTensor Fp8(std::vector<uint8_t> codes) {
  QuantizedTensor q;
  q.format = Format::kFp8Current;
  q.rows = 1;
  q.cols = static_cast<int64_t>(codes.size());
  q.data = std::move(codes);
  return q;
}

TEST(Fp8HealthTest, CountsSaturatedAndZeroE4M3Codes) {
  // +448, -448, +0, -0, NaN (not saturated), 1.0, a subnormal.
  const auto c = CountCodes(Fp8({0x7E, 0xFE, 0x00, 0x80, 0x7F, 0x38, 0x01}), Fp8Type::kE4M3, 100);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->sampled, 7);
  EXPECT_EQ(c->saturated, 2);
  EXPECT_EQ(c->zero, 2);
}

TEST(Fp8HealthTest, E5M2HasItsOwnLargestCode) {
  const auto c = CountCodes(Fp8({0x7B, 0x7E, 0xFB}), Fp8Type::kE5M2, 100);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->saturated, 2);
}

TEST(Fp8HealthTest, Nvfp4PacksTwoCodesPerByte) {
  QuantizedTensor q;
  q.format = Format::kNvfp4;
  q.rows = 1;
  q.cols = 4;
  q.data = {0x07 | 0x80, 0xF0};  // 6, -0 | 0, -6
  const auto c = CountCodes(q, Fp8Type::kE4M3, 100);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->sampled, 4);
  EXPECT_EQ(c->saturated, 2);
  EXPECT_EQ(c->zero, 2);
}

TEST(Fp8HealthTest, SamplesAtMostTheBound) {
  std::vector<uint8_t> codes(100000, 0x7E);
  const auto c = CountCodes(Fp8(codes), Fp8Type::kE4M3, 1000);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->sampled, 1000);
  EXPECT_EQ(c->saturated, 1000);
}

TEST(Fp8HealthTest, PassthroughAndDeviceBuffersHaveNoCodes) {
  QuantizedTensor bf16 = Fp8({1, 2});
  bf16.format = Format::kIdentityBf16;
  EXPECT_FALSE(CountCodes(bf16, Fp8Type::kE4M3, 10).has_value());
  QuantizedTensor empty = Fp8({});
  empty.rows = 4;
  empty.cols = 4;
  EXPECT_FALSE(CountCodes(empty, Fp8Type::kE4M3, 10).has_value());
}

}  // namespace
}  // namespace paramd
