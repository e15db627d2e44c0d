#include "safetensors/convert.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "safetensors/test_util.h"

namespace paramd::safetensors {
namespace {

std::vector<uint8_t> Bytes16(std::initializer_list<uint16_t> values) {
  std::vector<uint8_t> out;
  for (uint16_t v : values) {
    out.push_back(static_cast<uint8_t>(v & 0xFF));
    out.push_back(static_cast<uint8_t>(v >> 8));
  }
  return out;
}

TEST(DecodeToFloat, F16IncludingSubnormalsAndSpecials) {
  // 1.0, -2.0, 65504 (max), 2^-24 (min subnormal), +inf, -0.
  std::vector<uint8_t> bytes = Bytes16({0x3C00, 0xC000, 0x7BFF, 0x0001, 0x7C00, 0x8000, 0x7E00});
  std::vector<float> out(7);
  ASSERT_TRUE(DecodeToFloat(Dtype::kF16, bytes, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.0f);
  EXPECT_EQ(out[2], 65504.0f);
  EXPECT_EQ(out[3], std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::isinf(out[4]) && out[4] > 0);
  EXPECT_TRUE(out[5] == 0.0f && std::signbit(out[5]));
  EXPECT_TRUE(std::isnan(out[6]));
}

TEST(DecodeToFloat, Bf16F64Fp8) {
  std::vector<float> out(2);
  ASSERT_TRUE(DecodeToFloat(Dtype::kBF16, Bytes16({0x3F80, 0xC040}), absl::MakeSpan(out)).ok());
  EXPECT_EQ(out, (std::vector<float>{1.0f, -3.0f}));

  std::vector<uint8_t> f64(16);
  double d[2] = {0.1, -1e300};
  std::memcpy(f64.data(), d, 16);
  ASSERT_TRUE(DecodeToFloat(Dtype::kF64, f64, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out[0], 0.1f);
  EXPECT_TRUE(std::isinf(out[1]) && out[1] < 0);

  std::vector<uint8_t> fp8 = {0x7E, 0x38};  // E4M3: 448, 1.0
  ASSERT_TRUE(DecodeToFloat(Dtype::kF8E4M3, fp8, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out, (std::vector<float>{448.0f, 1.0f}));
  fp8 = {0x7B, 0x3C};  // E5M2: 57344, 1.0
  ASSERT_TRUE(DecodeToFloat(Dtype::kF8E5M2, fp8, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out, (std::vector<float>{57344.0f, 1.0f}));
}

TEST(DecodeToFloat, RefusesIntegersAndSizeMismatch) {
  std::vector<float> out(2);
  absl::Status s = DecodeToFloat(Dtype::kI32, std::vector<uint8_t>(8), absl::MakeSpan(out));
  EXPECT_EQ(s.message(), "dtype I32 does not convert to FP32");
  s = DecodeToFloat(Dtype::kF32, std::vector<uint8_t>(7), absl::MakeSpan(out));
  EXPECT_EQ(s.message(), "7 bytes of F32 do not make 2 values");
  EXPECT_FALSE(ConvertsToFloat(Dtype::kBool));
  EXPECT_TRUE(ConvertsToFloat(Dtype::kF8E4M3));
}

TEST(Encode, Bf16RoundsToNearestEvenAndF32IsExact) {
  std::vector<uint8_t> out;
  // 1 + 2^-8 is a tie between 1.0 and 1 + 2^-7: even -> 1.0 (0x3F80).
  // 1 + 3*2^-8 ties between 1+2^-7 and 1+2^-6: even -> 0x3F82.
  AppendBf16({1.0f + std::ldexp(1.0f, -8), 1.0f + 3 * std::ldexp(1.0f, -8)}, out);
  EXPECT_EQ(out, Bytes16({0x3F80, 0x3F82}));
  std::vector<float> back(2);
  ASSERT_TRUE(DecodeToFloat(Dtype::kBF16, out, absl::MakeSpan(back)).ok());
  EXPECT_EQ(back[1], 1.0f + std::ldexp(1.0f, -6));

  out.clear();
  AppendF32({0.1f, -7.5f}, out);
  ASSERT_TRUE(DecodeToFloat(Dtype::kF32, out, absl::MakeSpan(back)).ok());
  EXPECT_EQ(back, (std::vector<float>{0.1f, -7.5f}));
}

TEST(ReadTensorAsFloat, ReadsAFileAndRefusesNonFloat) {
  std::string path = testing::MakeTempDir() + "/c.safetensors";
  std::vector<uint8_t> bf16;
  AppendBf16({1.5f, -0.25f, 3.0f}, bf16);
  auto writer = SafetensorsWriter::Create(path, {{"w", Dtype::kBF16, {3}}, {"i", Dtype::kI8, {2}}});
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->WriteTensor("w", bf16).ok());
  ASSERT_TRUE((*writer)->WriteTensor("i", std::vector<uint8_t>{1, 2}).ok());
  ASSERT_TRUE((*writer)->Finish().ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  auto values = ReadTensorAsFloat(*file, *file->Find("w"));
  ASSERT_TRUE(values.ok());
  EXPECT_EQ(*values, (std::vector<float>{1.5f, -0.25f, 3.0f}));
  auto ints = ReadTensorAsFloat(*file, *file->Find("i"));
  EXPECT_NE(ints.status().message().find("tensor 'i' has dtype I8, which does not convert"),
            std::string::npos)
      << ints.status();
}

}  // namespace
}  // namespace paramd::safetensors
