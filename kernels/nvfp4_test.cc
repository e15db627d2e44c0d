// NVFP4 (§4, D4, D7, D8, D11): hand-computed bytes for 1D and 2D blocks.
//
// With global amax A = 6: S_enc = 2688/6 = 448, S_dec = RN(1/448) = RCP448,
// and the block factor mul(S_enc, RCP6) = RN(448 * RN(1/6)) = 74.66667
// (0x42955556, 5/8 ulp above 448/6, rounded up). Then per block:
//   sd  = E4M3(amax * 74.66667)     e.g. amax 6 -> 448.00003 -> 448 (0x7E)
//   enc = 1 / (value(sd) * RCP448)  448*RCP448 = 1 + 3*2^-26 rounds to 1, so
//         sd = 448 * 2^-k gives enc = 2^k exactly; other sd give an enc
//         that is only used below where every product is far from an E2M1
//         tie (noted as "~").
// E2M1 codes: 0:0 1:.5 2:1 3:1.5 4:2 5:3 6:4 7:6, bit 3 = sign; packed even
// index in the low nibble.
#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/reference.h"
#include "kernels/test_util.h"

namespace paramd::ref {
namespace {

using testing::BytesAt;

// W is 3 x 33: K = 33 gives rowwise blocks [0,16), [16,32), [32,33) and an
// odd packed row (D11); M = 3 gives one partial 16x1 block per column.
std::vector<float> ThreeByThirtyThree() {
  std::vector<float> w(3 * 33, 0.0f);
  float* r0 = w.data();
  float* r1 = w.data() + 33;
  float* r2 = w.data() + 66;
  r0[0] = 6.0f, r0[1] = -3.0f, r0[2] = 1.4f, r0[3] = 0.2f, r0[4] = -0.8f;
  r0[16] = 3.0f, r0[17] = 1.0f, r0[18] = -0.3f, r0[19] = 0.1f;
  r0[32] = -0.75f;
  r1[0] = -0.0f;
  r1[16] = 0.2f;
  r2[1] = 1.0f, r2[2] = 0.4f;
  r2[32] = 1e-39f;  // fp32 subnormal (D6)
  return w;
}

QuantSpec OneD() {
  QuantSpec spec = DefaultQuantSpec(Format::kNvfp4);
  spec.two_d = false;
  return spec;
}

TEST(Nvfp4, RowwiseOneDimensionalHandComputed) {
  // Row 0: block [0,16) amax 6: sd 0x7E, enc 1: 6->7, -3->D, 1.4->1.5 (3),
  //          0.2->0, -0.8->-1 (A).
  //        block [16,32) amax 3: 224.00002 -> sd 224 (e=14, m=6) 0x76, enc 2:
  //          3->6 (7), 1->2 (4), -0.3->-0.6->-0.5 (9), 0.1->0.2->0.
  //        block [32,33) amax 0.75: 56.000004 -> sd 56 (e=12, m=6) 0x66,
  //          enc 8: -0.75 -> -6 (F).
  // Row 1: block 0 all zero: sd 0, enc = min(1/0, FLT_MAX) = FLT_MAX;
  //          -0 -> -0 (8, D7).
  //        block 1 amax 0.2: 14.93 -> 15 (e=10, m=7) 0x57, enc ~29.87:
  //          0.2 -> ~5.97 -> 6 (7).
  // Row 2: block 0 amax 1: 74.67 -> step 8, 9.33 -> 72 (e=13, m=1) 0x69,
  //          enc ~6.22: 1 -> ~6.22 -> 6 (7); 0.4 -> ~2.49 -> 2 (4).
  //        block 2 amax 1e-39: 7.5e-38 -> sd 0, enc FLT_MAX:
  //          1e-39 * FLT_MAX = 0.34 -> 0.5 (1). (FTZ would give 0.)
  const QuantSpec spec = OneD();
  ASSERT_OK_AND_ASSIGN(auto q, Quantize(ThreeByThirtyThree(), 3, 33, spec, Direction::kRowwise,
                                        TensorScaling{1.0f, 6.0f}));
  // Data [3][17]; byte 16 of each row holds column 32 alone (high nibble 0).
  EXPECT_EQ(q.data, BytesAt(51, {{0, 0xD7},
                                 {1, 0x03},
                                 {2, 0x0A},
                                 {8, 0x47},
                                 {9, 0x09},
                                 {16, 0x0F},  // row 0
                                 {17 + 0, 0x08},
                                 {17 + 8, 0x07},  // row 1
                                 {34 + 0, 0x70},
                                 {34 + 1, 0x04},
                                 {34 + 16, 0x01}}));
  // Scale [roundup(3,128)=128][roundup(ceil(33/16)=3,4)=4], entry [i][j/16].
  EXPECT_EQ(q.scales, BytesAt(128 * 4, {{0, 0x7E}, {1, 0x76}, {2, 0x66}, {5, 0x57}, {8, 0x69}}));
  EXPECT_EQ(q.amax, 6.0f);  // A, not S_enc
}

TEST(Nvfp4, ColumnwiseOneDimensionalHandComputed) {
  // One 16x1 block per column j over rows {0,1,2}; data [33][ceil(3/2)=2],
  // byte (j,0) = row0 | row1<<4, byte (j,1) = row2 (high nibble 0).
  //  j0 {6,-0,0}: sd 0x7E enc 1 -> 7, 8, 0
  //  j1 {-3,0,1}: sd 0x76 enc 2 -> F, 0, 4
  //  j2 {1.4,0,0.4}: 104.53 -> 104 (e=13, m=5) 0x6D, enc ~4.31 -> 1.4: ~6.03
  //      -> 6 (7); 0.4: ~1.72 -> 1.5 (3)
  //  j3 {0.2,0,0}: sd 0x57 -> 7
  //  j4 {-0.8,0,0}: 59.73 -> step 4, 14.9 -> 60 (e=12, m=7) 0x67, enc ~7.47
  //      -> ~-5.97 -> -6 (F)
  //  j16 {3,0.2,0}: sd 0x76 enc 2 -> 7, 0.4 -> 0.5 (1)
  //  j17 {1,0,0}: sd 0x69 -> 7
  //  j18 {-0.3,0,0}: 22.4 -> step 2, 11.2 -> 22 (e=11, m=3) 0x5B, enc ~20.4
  //      -> ~-6.1 -> -6 (F)
  //  j19 {0.1,0,0}: 7.47 -> step .5, 14.9 -> 7.5 (e=9, m=7) 0x4F, enc ~59.7
  //      -> ~5.97 -> 6 (7)
  //  j32 {-0.75,0,1e-39}: sd 0x66 enc 8 -> F, 0, 0
  const QuantSpec spec = OneD();
  ASSERT_OK_AND_ASSIGN(auto q, Quantize(ThreeByThirtyThree(), 3, 33, spec, Direction::kColumnwise,
                                        TensorScaling{1.0f, 6.0f}));
  EXPECT_EQ(q.data, BytesAt(66, {{0, 0x87},
                                 {2, 0x0F},
                                 {3, 0x04},
                                 {4, 0x07},
                                 {5, 0x03},
                                 {6, 0x07},
                                 {8, 0x0F},
                                 {32, 0x17},
                                 {34, 0x07},
                                 {36, 0x0F},
                                 {38, 0x07},
                                 {64, 0x0F}}));
  // Scale [roundup(33,128)=128][roundup(ceil(3/16)=1,4)=4], entry [j][i/16].
  EXPECT_EQ(q.scales, BytesAt(128 * 4, {{0, 0x7E},
                                        {4, 0x76},
                                        {8, 0x6D},
                                        {12, 0x57},
                                        {16, 0x67},
                                        {64, 0x76},
                                        {68, 0x69},
                                        {72, 0x5B},
                                        {76, 0x4F},
                                        {128, 0x66}}));
  EXPECT_EQ(q.amax, 6.0f);
}

TEST(Nvfp4, DequantizeUsesARcp2688) {
  // dec = (value(sd) * A) * RN(1/2688): 448*6 = 2688 -> 1.0; 224*6 -> 0.5;
  // 56*6 -> 0.125 (2688 * RN(1/2688) rounds to exactly 1).
  const QuantSpec spec = OneD();
  ASSERT_OK_AND_ASSIGN(auto q, Quantize(ThreeByThirtyThree(), 3, 33, spec, Direction::kRowwise,
                                        TensorScaling{1.0f, 6.0f}));
  ASSERT_OK_AND_ASSIGN(auto x, Dequantize(q, spec));
  const std::vector<float> row0 = {6, -3, 1.5, 0, -1};
  for (int j = 0; j < 5; ++j) EXPECT_EQ(x[j], row0[j]) << j;
  EXPECT_EQ(x[16], 3.0f);
  EXPECT_EQ(x[17], 1.0f);
  EXPECT_EQ(x[18], -0.25f);
  EXPECT_EQ(x[32], -0.75f);
  EXPECT_TRUE(std::signbit(x[33]));  // row 1, -0 keeps its sign
  EXPECT_EQ(x[66 + 32], 0.0f);       // sd 0: dec 0
}

TEST(Nvfp4, TwoDimensionalTilesAndNibbleTranspose) {
  // W is 20 x 18, 16x16 tiles (2 x 2 grid, partial edges), A = 6:
  //  tile (0,0) amax 6: W[2][3] = 6 -> 7; W[15][15] = -1.4 -> -1.5 (B)
  //  tile (0,1) amax 3 (sd 0x76, enc 2): W[0][17] = 3 -> 7; W[10][16] = 1 -> 4
  //  tile (1,0) zero: W[19][0] = -0 -> 8 (D7)
  //  tile (1,1) amax 0.75 (sd 0x66, enc 8): W[16][16] = 0.75 -> 7
  std::vector<float> w(20 * 18, 0.0f);
  w[2 * 18 + 3] = 6.0f;
  w[15 * 18 + 15] = -1.4f;
  w[0 * 18 + 17] = 3.0f;
  w[10 * 18 + 16] = 1.0f;
  w[19 * 18 + 0] = -0.0f;
  w[16 * 18 + 16] = 0.75f;
  const QuantSpec spec = DefaultQuantSpec(Format::kNvfp4);  // 2D by default (D10)
  ASSERT_TRUE(spec.two_d);
  const TensorScaling scaling = ScalingFromAmax(spec, Amax(w));
  ASSERT_OK_AND_ASSIGN(auto row, Quantize(w, 20, 18, spec, Direction::kRowwise, scaling));
  ASSERT_OK_AND_ASSIGN(auto col, Quantize(w, 20, 18, spec, Direction::kColumnwise, scaling));
  // Rowwise data [20][9]: byte (i, j/2), odd j in the high nibble.
  EXPECT_EQ(row.data, BytesAt(180, {{2 * 9 + 1, 0x70},
                                    {15 * 9 + 7, 0xB0},
                                    {0 * 9 + 8, 0x70},
                                    {10 * 9 + 8, 0x04},
                                    {19 * 9 + 0, 0x08},
                                    {16 * 9 + 8, 0x07}}));
  // Columnwise data [18][10]: byte (j, i/2), odd i in the high nibble.
  EXPECT_EQ(col.data, BytesAt(180, {{3 * 10 + 1, 0x07},
                                    {15 * 10 + 7, 0xB0},
                                    {17 * 10 + 0, 0x07},
                                    {16 * 10 + 5, 0x04},
                                    {0 * 10 + 9, 0x80},
                                    {16 * 10 + 8, 0x07}}));
  // The tile byte goes into every row of the tile: rowwise [128][4] entry
  // [i][j/16]; columnwise [128][4] entry [j][i/16].
  std::vector<uint8_t> rs(128 * 4, 0), cs(128 * 4, 0);
  for (int i = 0; i < 16; ++i) rs[i * 4] = 0x7E, rs[i * 4 + 1] = 0x76;
  for (int i = 16; i < 20; ++i) rs[i * 4 + 1] = 0x66;
  for (int j = 0; j < 16; ++j) cs[j * 4] = 0x7E;
  for (int j = 16; j < 18; ++j) cs[j * 4] = 0x76, cs[j * 4 + 1] = 0x66;
  EXPECT_EQ(row.scales, rs);
  EXPECT_EQ(col.scales, cs);
  EXPECT_EQ(row.amax, 6.0f);
  EXPECT_EQ(col.amax, 6.0f);
}

TEST(Nvfp4, BlockFactorIsTheRoundedProductSEncTimesRcp6) {
  // §4 evaluates mul(S_enc, RCP6) = 74.66667 (0x42955556), not
  // div(S_enc, 6) = 74.666664 (0x42955555). For amax = 0x40B92492
  // (5.7857141) the two give 432.00003 and 431.99997 around the E4M3 tie at
  // 432 (between 416 and 448): only the product gives sd = 448 (0x7E); the
  // quotient would give 416 (0x7D). The element still encodes to 6 (7).
  std::vector<float> w(17, 0.0f);
  w[0] = 6.0f;
  w[16] = testing::F(0x40B92492);
  ASSERT_OK_AND_ASSIGN(auto q,
                       Quantize(w, 1, 17, OneD(), Direction::kRowwise, TensorScaling{1.0f, 6.0f}));
  EXPECT_EQ(q.scales, BytesAt(128 * 4, {{0, 0x7E}, {1, 0x7E}}));
  EXPECT_EQ(q.data, BytesAt(9, {{0, 0x07}, {8, 0x07}}));
}

TEST(Nvfp4, GlobalAmaxEdgeCases) {
  const QuantSpec spec = OneD();
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // A = Inf -> S_enc = 1 (D4), S_dec = 1, factor RCP6: block amax Inf ->
  // sd = E4M3(Inf) = 448 (0x7E), enc = RN(1/448): Inf -> 6 (7); 1 -> 0.0022 -> 0.
  ASSERT_OK_AND_ASSIGN(
      auto a, Quantize({inf, 1.0f}, 1, 2, spec, Direction::kRowwise, TensorScaling{1.0f, inf}));
  EXPECT_EQ(a.data, std::vector<uint8_t>({0x07}));
  EXPECT_EQ(a.scales, BytesAt(128 * 4, {{0, 0x7E}}));
  EXPECT_EQ(a.amax, inf);
  // A = NaN -> S_enc = 1: block amax 1 (NaN ignored) -> sd = E4M3(RCP6 =
  // 0.16667): step 2^-6, 10.67 -> 11 -> 0.171875 (e=4, m=3) 0x23; enc =
  // 1/0.171875 = 5.82: 1 -> 5.82 -> 6 (7); NaN -> +6 (7, D14).
  ASSERT_OK_AND_ASSIGN(
      auto n, Quantize({1.0f, nan}, 1, 2, spec, Direction::kRowwise, TensorScaling{1.0f, nan}));
  EXPECT_EQ(n.data, std::vector<uint8_t>({0x77}));
  EXPECT_EQ(n.scales, BytesAt(128 * 4, {{0, 0x23}}));
  // A = 0 (all-zero tensor) -> S_enc = 1; every sd is 0, data keeps -0 as 8.
  ASSERT_OK_AND_ASSIGN(auto z, Quantize({0.0f, -0.0f, 0.0f}, 1, 3, spec, Direction::kRowwise,
                                        TensorScaling{1.0f, 0.0f}));
  EXPECT_EQ(z.data, std::vector<uint8_t>({0x80, 0x00}));
  EXPECT_EQ(z.scales, std::vector<uint8_t>(128 * 4, 0));
}

}  // namespace
}  // namespace paramd::ref
