// FP8 blockwise (§5, D5, D6, D8, D11): hand-computed bytes and fp32 scales
// in the GEMM-ready layouts.
//
// s = compute_scale(block amax, 448, pow2 = true, eps 0, inf_value), with
// pow2 rounding 448/amax down to a power of two:
//   3.5 -> 128; 5 -> 89.6 -> 64; 7 -> 64; 0.875 -> 512; 1 -> 448 -> 256;
//   0 / Inf -> 1 (D5); 1e-37 -> Inf -> inf_value (BF16 max 0x7F7F0000 for a
//   BF16 source) -> 2^127.
// scale_inv = RN(1/s). Elements: E4M3(x * s).
#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/reference.h"
#include "kernels/test_util.h"

namespace paramd::ref {
namespace {

using testing::BytesAt;
using testing::F;
using testing::Fp32At;

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

// 130 x 260: a 2 x 3 grid of 128x128 tiles, the last row and column partial.
constexpr int kM = 130, kK = 260;
std::vector<float> Tiles() {
  std::vector<float> w(kM * kK, 0.0f);
  auto at = [&](int i, int j) -> float& { return w[i * kK + j]; };
  at(0, 0) = 3.5f;        // tile (0,0): amax 3.5, s 128 -> 448 (0x7E)
  at(127, 127) = -1.0f;   //             -128 (e=14) -> 0xF0
  at(0, 128) = 5.0f;      // tile (0,1): s 64 -> 320 (e=15, m=2) -> 0x7A
  at(5, 200) = -0.0f;     // tile (0,2): zero, s 1 -> 0x80
  at(128, 0) = kInf;      // tile (1,0): amax Inf, s 1 (D5) -> 0x7E
  at(129, 1) = -3.0f;     //             -3 (e=8, m=4) -> 0xC4
  at(128, 128) = 1e-37f;  // tile (1,1): s 2^127 -> 17.01: step 2, 8.5+ -> 18
                          //             (e=11, m=1) -> 0x59
  at(129, 200) = kNaN;    // tile (1,2): amax 0 (NaN ignored), s 1 -> 0x7F
  return w;
}

TEST(Fp8Block128x128, RowwiseHandComputed) {
  const QuantSpec spec = DefaultQuantSpec(Format::kFp8Block128x128);
  ASSERT_OK_AND_ASSIGN(auto q, Quantize(Tiles(), kM, kK, spec, Direction::kRowwise, {}));
  EXPECT_EQ(q.data, BytesAt(kM * kK, {{0, 0x7E},
                                      {127 * kK + 127, 0xF0},
                                      {128, 0x7A},
                                      {5 * kK + 200, 0x80},
                                      {128 * kK, 0x7E},
                                      {129 * kK + 1, 0xC4},
                                      {128 * kK + 128, 0x59},
                                      {129 * kK + 200, 0x7F}}));
  // [ceil(130/128)=2][roundup(ceil(260/128)=3,4)=4], entry [mb][kb]; 2^-127
  // is an fp32 subnormal, kept (D6).
  EXPECT_EQ(
      q.scales,
      Fp32At(8, {{0, 0x1p-7f}, {1, 0x1p-6f}, {2, 1.0f}, {4, 1.0f}, {5, F(0x00400000)}, {6, 1.0f}}));
}

TEST(Fp8Block128x128, ColumnwiseIsByteTransposeWithTransposedScales) {
  const QuantSpec spec = DefaultQuantSpec(Format::kFp8Block128x128);
  ASSERT_OK_AND_ASSIGN(auto q, Quantize(Tiles(), kM, kK, spec, Direction::kColumnwise, {}));
  // Data [260][130]: W[i][j] at j*130 + i.
  EXPECT_EQ(q.data, BytesAt(kM * kK, {{0, 0x7E},
                                      {127 * kM + 127, 0xF0},
                                      {128 * kM, 0x7A},
                                      {200 * kM + 5, 0x80},
                                      {128, 0x7E},
                                      {1 * kM + 129, 0xC4},
                                      {128 * kM + 128, 0x59},
                                      {200 * kM + 129, 0x7F}}));
  // [ceil(260/128)=3][roundup(2,4)=4], entry [kb][mb].
  EXPECT_EQ(
      q.scales,
      Fp32At(12,
             {{0, 0x1p-7f}, {1, 1.0f}, {4, 0x1p-6f}, {5, F(0x00400000)}, {8, 1.0f}, {9, 1.0f}}));
}

TEST(Fp8Block128x128, DequantizeIsValueTimesScaleInv) {
  const QuantSpec spec = DefaultQuantSpec(Format::kFp8Block128x128);
  for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
    ASSERT_OK_AND_ASSIGN(auto q, Quantize(Tiles(), kM, kK, spec, d, {}));
    ASSERT_OK_AND_ASSIGN(auto x, Dequantize(q, spec));
    EXPECT_EQ(x[0], 3.5f);
    EXPECT_EQ(x[127 * kK + 127], -1.0f);
    EXPECT_EQ(x[128], 5.0f);
    EXPECT_EQ(x[128 * kK], 448.0f);
    EXPECT_EQ(x[128 * kK + 128], std::ldexp(18.0f, -127));
    EXPECT_TRUE(std::isnan(x[129 * kK + 200]));
  }
}

TEST(Fp8Block128x128, InfValueDependsOnSourceDtype) {
  // pow2 off, amax 1e-37: 448/amax overflows -> inf_value.
  //  fp32 source: s = FLT_MAX, scale_inv = RN(1/FLT_MAX) = 2^-128 (0x00200000);
  //    1e-37 * FLT_MAX = 34.03: step 4, 8.51 -> 36 (e=12, m=1) -> 0x61.
  //  bf16 source: s = 0x7F7F0000, scale_inv = RN(2^-128 * 256/255) = 0x00202020;
  //    1e-37 * s = 33.90: 8.47 -> 32 (e=12, m=0) -> 0x60.
  QuantSpec spec = DefaultQuantSpec(Format::kFp8Block128x128);
  spec.pow2_scales = false;
  spec.source_dtype = SourceDtype::kFp32;
  ASSERT_OK_AND_ASSIGN(auto a, Quantize({1e-37f, 0.0f}, 1, 2, spec, Direction::kRowwise, {}));
  EXPECT_EQ(a.data, std::vector<uint8_t>({0x61, 0x00}));
  EXPECT_EQ(a.scales, Fp32At(4, {{0, F(0x00200000)}}));
  spec.source_dtype = SourceDtype::kBf16;
  ASSERT_OK_AND_ASSIGN(auto b, Quantize({1e-37f, 0.0f}, 1, 2, spec, Direction::kRowwise, {}));
  EXPECT_EQ(b.data, std::vector<uint8_t>({0x60, 0x00}));
  EXPECT_EQ(b.scales, Fp32At(4, {{0, F(0x00202020)}}));
}

// 3 x 130: rows have a full 1x128 block and a 2-element edge block.
std::vector<float> Rows() {
  std::vector<float> w(3 * 130, 0.0f);
  w[0 * 130 + 0] = 3.5f;      // block (0,0): s 128 -> 0x7E
  w[0 * 130 + 129] = 0.875f;  // block (0,1): s 512 -> 448 -> 0x7E
  w[1 * 130 + 5] = -7.0f;     // block (1,0): s 64 -> -448 -> 0xFE
  w[2 * 130 + 128] = 1.0f;    // block (2,1): s 256 -> 256 (e=15) -> 0x78
  return w;
}

TEST(Fp8Block1x128, RowwiseScalesInTransposedOrder) {
  const QuantSpec spec = DefaultQuantSpec(Format::kFp8Block1x128);
  ASSERT_OK_AND_ASSIGN(auto q, Quantize(Rows(), 3, 130, spec, Direction::kRowwise, {}));
  EXPECT_EQ(q.data, BytesAt(390, {{0, 0x7E}, {129, 0x7E}, {135, 0xFE}, {388, 0x78}}));
  // [ceil(130/128)=2][roundup(3,4)=4], entry [kb][i]; zero blocks -> 1.
  EXPECT_EQ(
      q.scales,
      Fp32At(8, {{0, 0x1p-7f}, {1, 0x1p-6f}, {2, 1.0f}, {4, 0x1p-9f}, {5, 1.0f}, {6, 0x1p-8f}}));
}

TEST(Fp8Block1x128, ColumnwiseQuantizedAlongM) {
  // 128x1 blocks over M = 3: one block per column j. Data [130][3].
  const QuantSpec spec = DefaultQuantSpec(Format::kFp8Block1x128);
  ASSERT_OK_AND_ASSIGN(auto q, Quantize(Rows(), 3, 130, spec, Direction::kColumnwise, {}));
  EXPECT_EQ(
      q.data,
      BytesAt(390,
              {{0 * 3 + 0, 0x7E}, {129 * 3 + 0, 0x7E}, {5 * 3 + 1, 0xFE}, {128 * 3 + 2, 0x78}}));
  // [ceil(3/128)=1][roundup(130,4)=132], entry [mb][j]; entries 130, 131 pad 0.
  std::vector<uint8_t> want =
      Fp32At(132, {{0, 0x1p-7f}, {5, 0x1p-6f}, {128, 0x1p-8f}, {129, 0x1p-9f}});
  const std::vector<uint8_t> one = Fp32At(1, {{0, 1.0f}});
  for (int j = 0; j < 130; ++j) {
    if (j == 0 || j == 5 || j == 128 || j == 129) continue;
    std::copy(one.begin(), one.end(), want.begin() + 4 * j);
  }
  EXPECT_EQ(q.scales, want);
  ASSERT_OK_AND_ASSIGN(auto x, Dequantize(q, spec));
  EXPECT_EQ(x, Rows());
}

}  // namespace
}  // namespace paramd::ref
