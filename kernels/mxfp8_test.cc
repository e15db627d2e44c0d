// MXFP8 (§3, D3, D8, D11): hand-computed bytes, both directions, 1D and 2D.
//
// Facts used below (RCP448 = RN(1/448) = 0x3B124925 = 1/448 + (3/7)*2^-32):
//  * 448 * RCP448 = 1 + 3*2^-26, which rounds to exactly 1.0f, so an amax of
//    448*2^k gives v = 2^k and e = 127 + k (no ceiling bump).
//  * Otherwise e = biased exponent of v, plus 1 when v is not a power of 2.
//  * enc = 2^(127-e); elements are E4M3(x * enc).
#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/reference.h"
#include "kernels/test_util.h"

namespace paramd::ref {
namespace {

using testing::BytesAt;

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

// W is 2 x 40: rowwise rows have one full 32-block and an 8-element edge
// block (D11); columnwise 32x1 blocks hold only the 2 real rows.
std::vector<float> TwoByForty() {
  std::vector<float> w(80, 0.0f);
  float* r0 = w.data();
  float* r1 = w.data() + 40;
  r0[0] = 1.0f, r0[1] = -0.5f, r0[2] = 0.3f;
  r0[32] = 1792.0f, r0[33] = 5.0f, r0[34] = -1000.0f, r0[35] = kNaN;
  r1[0] = -0.0f;
  r1[32] = kInf, r1[33] = 3.0f, r1[34] = -1.0f;
  return w;
}

TEST(Mxfp8, RowwiseHandComputed) {
  // Row 0, block 0: amax 1 -> v = RCP448 = 1.14*2^-9 -> e = 118+1 = 119
  //   (0x77), enc 2^8: 1 -> 256 (e=15) 0x78; -0.5 -> -128 0xF0;
  //   0.3 -> 76.8: step 8, 9.6 -> 10 -> 80 (e=13, m=2) 0x6A.
  // Row 0, block 1 (cols 32..39): amax 1792 = 448*4 (NaN ignored) -> e = 129
  //   (0x81), enc 2^-2: 1792 -> 448 0x7E; 5 -> 1.25 0x3A;
  //   -1000 -> -250: step 16, 15.6 -> 16 -> -256 0xF8; NaN -> 0x7F.
  // Row 1, block 0: only zeros -> e = 0; -0 -> 0x80.
  // Row 1, block 1: amax Inf -> e = 0xFE, enc 2^-127: Inf -> 448 0x7E;
  //   3 -> ~2^-125 -> 0x00; -1 -> -0 -> 0x80.
  const QuantSpec spec = DefaultQuantSpec(Format::kMxfp8);
  ASSERT_OK_AND_ASSIGN(auto q, Quantize(TwoByForty(), 2, 40, spec, Direction::kRowwise, {}));
  EXPECT_EQ(q.data, BytesAt(80, {{0, 0x78},
                                 {1, 0xF0},
                                 {2, 0x6A},
                                 {32, 0x7E},
                                 {33, 0x3A},
                                 {34, 0xF8},
                                 {35, 0x7F},
                                 {40, 0x80},
                                 {72, 0x7E},
                                 {74, 0x80}}));
  // Compact scale [roundup(2,128)=128][roundup(2,4)=4], padding 0 (D8).
  EXPECT_EQ(q.scales, BytesAt(128 * 4, {{0, 0x77}, {1, 0x81}, {4, 0x00}, {5, 0xFE}}));
  EXPECT_EQ(q.scale_inv, 1.0f);
}

TEST(Mxfp8, ColumnwiseHandComputed) {
  // One 32x1 block per column j, over rows {0, 1}:
  //  j0 {1, -0}: e 119, enc 2^8 -> 0x78, 0x80
  //  j1 {-0.5, 0}: v = RCP448/2 -> e 118 (0x76), enc 2^9: -256 -> 0xF8
  //  j2 {0.3, 0}: v = 6.7e-4 in [2^-11, 2^-10) -> e 117 (0x75), enc 2^10:
  //     307.2: step 32, 9.6 -> 10 -> 320 (e=15, m=2) 0x7A
  //  j32 {1792, Inf}: e 0xFE, enc 2^-127 -> 0x00, 0x7E
  //  j33 {5, 3}: v = 0.0112 in [2^-7, 2^-6) -> e 121 (0x79), enc 2^6:
  //     320 -> 0x7A; 192 = 1.5*2^7 (e=14, m=4) -> 0x74
  //  j34 {-1000, -1}: v = 2.23 -> e 129 (0x81), enc 2^-2: -256 0xF8; -0.25 0xA8
  //  j35 {NaN, 0}: amax 0 -> e 0: NaN 0x7F, 0 0x00
  //  other columns: zeros, e 0.
  const QuantSpec spec = DefaultQuantSpec(Format::kMxfp8);
  ASSERT_OK_AND_ASSIGN(auto q, Quantize(TwoByForty(), 2, 40, spec, Direction::kColumnwise, {}));
  // Data stays [M][K] (not transposed).
  EXPECT_EQ(q.data, BytesAt(80, {{0, 0x78},
                                 {1, 0xF8},
                                 {2, 0x7A},
                                 {33, 0x7A},
                                 {34, 0xF8},
                                 {35, 0x7F},
                                 {40, 0x80},
                                 {72, 0x7E},
                                 {73, 0x74},
                                 {74, 0xA8}}));
  // Compact scale [roundup(1,4)=4][roundup(40,128)=128], entry [i/32][j].
  EXPECT_EQ(
      q.scales,
      BytesAt(4 * 128, {{0, 0x77}, {1, 0x76}, {2, 0x75}, {32, 0xFE}, {33, 0x79}, {34, 0x81}}));
}

TEST(Mxfp8, DequantizeIsValueTimesPowerOfTwo) {
  const QuantSpec spec = DefaultQuantSpec(Format::kMxfp8);
  ASSERT_OK_AND_ASSIGN(auto row, Quantize(TwoByForty(), 2, 40, spec, Direction::kRowwise, {}));
  ASSERT_OK_AND_ASSIGN(auto x, Dequantize(row, spec));
  EXPECT_EQ(x[0], 1.0f);
  EXPECT_EQ(x[1], -0.5f);
  EXPECT_EQ(x[2], 0.3125f);  // 80 * 2^-8
  EXPECT_EQ(x[32], 1792.0f);
  EXPECT_EQ(x[33], 5.0f);
  EXPECT_EQ(x[34], -1024.0f);
  EXPECT_TRUE(std::isnan(x[35]));
  EXPECT_TRUE(std::signbit(x[40]));
  EXPECT_EQ(x[72], kInf);  // 448 * 2^127 overflows fp32
  EXPECT_EQ(x[73], 0.0f);
  ASSERT_OK_AND_ASSIGN(auto col, Quantize(TwoByForty(), 2, 40, spec, Direction::kColumnwise, {}));
  ASSERT_OK_AND_ASSIGN(auto y, Dequantize(col, spec));
  EXPECT_EQ(y[2], 0.3125f);  // 320 * 2^-10
  EXPECT_EQ(y[73], 3.0f);    // 192 * 2^-6
  EXPECT_EQ(y[74], -1.0f);   // -0.25 * 2^2
  EXPECT_EQ(y[32], 0.0f);    // flushed by the Inf in its block
}

TEST(Mxfp8, TwoDimensionalTilesShareOneScale) {
  // 40 x 40 with 32x32 tiles (2 x 2 grid, edge tiles partial):
  //  tile (0,0): W[5][7] = 1, W[31][31] = 0.25 -> amax 1, e 119, enc 2^8:
  //              0x78 and 64 = 2^6 -> 0x68
  //  tile (0,1): W[3][35] = 448 -> e 127, enc 1 -> 0x7E
  //  tile (1,0): W[33][2] = 0.5 -> e 118, enc 2^9 -> 256 -> 0x78
  //  tile (1,1): W[39][39] = -0 -> e 0 -> 0x80
  std::vector<float> w(40 * 40, 0.0f);
  w[5 * 40 + 7] = 1.0f;
  w[31 * 40 + 31] = 0.25f;
  w[3 * 40 + 35] = 448.0f;
  w[33 * 40 + 2] = 0.5f;
  w[39 * 40 + 39] = -0.0f;
  const auto data = BytesAt(1600, {{5 * 40 + 7, 0x78},
                                   {31 * 40 + 31, 0x68},
                                   {3 * 40 + 35, 0x7E},
                                   {33 * 40 + 2, 0x78},
                                   {39 * 40 + 39, 0x80}});
  QuantSpec spec = DefaultQuantSpec(Format::kMxfp8);
  spec.two_d = true;
  ASSERT_OK_AND_ASSIGN(auto row, Quantize(w, 40, 40, spec, Direction::kRowwise, {}));
  ASSERT_OK_AND_ASSIGN(auto col, Quantize(w, 40, 40, spec, Direction::kColumnwise, {}));
  EXPECT_EQ(row.data, data);
  EXPECT_EQ(col.data, data);  // §3: columnwise bytes equal rowwise bytes
  // Rowwise [128][4]: each row carries its tiles' e.
  std::vector<uint8_t> rs(128 * 4, 0);
  for (int i = 0; i < 32; ++i) rs[i * 4] = 0x77, rs[i * 4 + 1] = 0x7F;
  for (int i = 32; i < 40; ++i) rs[i * 4] = 0x76;
  EXPECT_EQ(row.scales, rs);
  // Columnwise [4][128]: entry [i/32][j].
  std::vector<uint8_t> cs(4 * 128, 0);
  for (int j = 0; j < 32; ++j) cs[j] = 0x77, cs[128 + j] = 0x76;
  for (int j = 32; j < 40; ++j) cs[j] = 0x7F;
  EXPECT_EQ(col.scales, cs);
}

TEST(Mxfp8, E5M2Elements) {
  // amax 1, v = RCP57344 = 1.14 * 2^-16 -> e = 111 + 1 = 112 (0x70), enc 2^15:
  // 1 -> 2^15 (E5M2 e=30) 0x78; 0.5 -> 2^14 (e=29) 0x74.
  QuantSpec spec = DefaultQuantSpec(Format::kMxfp8);
  spec.fp8_type = Fp8Type::kE5M2;
  ASSERT_OK_AND_ASSIGN(auto q, Quantize({1.0f, 0.5f}, 1, 2, spec, Direction::kRowwise, {}));
  EXPECT_EQ(q.data, std::vector<uint8_t>({0x78, 0x74}));
  EXPECT_EQ(q.scales, BytesAt(128 * 4, {{0, 0x70}}));
}

}  // namespace
}  // namespace paramd::ref
