// FP8 per-tensor scaling (§1, §2, D13, D15): hand-computed bytes.
#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/reference.h"
#include "kernels/test_util.h"

namespace paramd::ref {
namespace {

using testing::F;

const float kNaN = std::numeric_limits<float>::quiet_NaN();

// W = [[1, -2, 3.5, 0.01], [-0, 0.001, NaN, 1.5*2^-16]]; amax = 3.5 (NaN
// ignored), scale = 448/3.5 = 128, scale_inv = 2^-7. x*128 and E4M3:
//   1     -> 128 = 2^7               -> e=7+7=14, m=0 -> 0x70
//   -2    -> -256 = -2^8             -> e=15, m=0    -> 0xF8
//   3.5   -> 448 (max)                                -> 0x7E
//   0.01  -> 1.28: step 1/8, 10.24 -> 10 -> 1.25, e=7, m=2 -> 0x3A
//   -0    -> -0                                       -> 0x80
//   0.001 -> 0.128: step 2^-6, 8.192 -> 8 -> 0.125, e=4, m=0 -> 0x20
//   NaN   ->                                          -> 0x7F (D14)
//   1.5*2^-16 -> 1.5*2^-9: tie between subnormals 1 and 2 -> 2 -> 0x02
const std::vector<float> kW = {1.0f,  -2.0f,  3.5f, 0.01f,
                               -0.0f, 0.001f, kNaN, std::ldexp(1.5f, -16)};
const std::vector<uint8_t> kRowwise = {0x70, 0xF8, 0x7E, 0x3A, 0x80, 0x20, 0x7F, 0x02};
// [K][M] byte transpose (D13).
const std::vector<uint8_t> kColumnwise = {0x70, 0x80, 0xF8, 0x20, 0x7E, 0x7F, 0x3A, 0x02};

TEST(PerTensorFp8, CurrentScalingHandComputed) {
  const QuantSpec spec = DefaultQuantSpec(Format::kFp8Current);
  const TensorScaling scaling = ScalingFromAmax(spec, Amax(kW));
  ASSERT_EQ(scaling.scale, 128.0f);
  ASSERT_OK_AND_ASSIGN(auto row, Quantize(kW, 2, 4, spec, Direction::kRowwise, scaling));
  EXPECT_EQ(row.data, kRowwise);
  EXPECT_TRUE(row.scales.empty());
  EXPECT_EQ(row.scale_inv, 0.0078125f);
  EXPECT_EQ(row.amax, 3.5f);
  EXPECT_EQ(row.format, Format::kFp8Current);
  EXPECT_EQ(row.rows, 2);
  EXPECT_EQ(row.cols, 4);

  ASSERT_OK_AND_ASSIGN(auto col, Quantize(kW, 2, 4, spec, Direction::kColumnwise, scaling));
  EXPECT_EQ(col.data, kColumnwise);
  EXPECT_EQ(col.scale_inv, 0.0078125f);
  EXPECT_EQ(col.amax, 3.5f);
  EXPECT_EQ(col.direction, Direction::kColumnwise);
}

TEST(PerTensorFp8, DequantizeIsValueTimesScaleInv) {  // D15
  const QuantSpec spec = DefaultQuantSpec(Format::kFp8Current);
  const TensorScaling scaling{128.0f, 3.5f};
  for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
    ASSERT_OK_AND_ASSIGN(auto q, Quantize(kW, 2, 4, spec, d, scaling));
    ASSERT_OK_AND_ASSIGN(auto x, Dequantize(q, spec));
    // Values in [M][K] order whatever the direction.
    const std::vector<float> want = {1.0f,  -2.0f,        3.5f,         1.25f / 128,
                                     -0.0f, 0.125f / 128, 0.0f /*NaN*/, std::ldexp(1.0f, -15)};
    ASSERT_EQ(x.size(), 8u);
    for (int i = 0; i < 8; ++i) {
      if (i == 6) {
        EXPECT_TRUE(std::isnan(x[i]));
        continue;
      }
      EXPECT_EQ(x[i], want[i]) << i;
      EXPECT_EQ(std::signbit(x[i]), std::signbit(want[i])) << i;
    }
  }
}

TEST(PerTensorFp8, DelayedUsesTheGivenScaleAndReportsAmax) {
  // Delayed scaling casts with the scale of the previous step (here 64:
  // 3.5 * 64 = 224 = 1.75 * 2^7 -> e=14, m=6 -> 0x76; -1 * 64 = -2^6 ->
  // e=13, m=0 -> 0xE8) and reports amax for the history.
  const QuantSpec spec = DefaultQuantSpec(Format::kFp8Delayed);
  DelayedScalingState state = InitialDelayedState(spec);
  state.scale = 64.0f;
  ASSERT_OK_AND_ASSIGN(auto q, Quantize({3.5f, -1.0f}, 1, 2, spec, Direction::kRowwise,
                                        TensorScaling{state.scale, 0.0f}));
  EXPECT_EQ(q.data, std::vector<uint8_t>({0x76, 0xE8}));
  EXPECT_EQ(q.scale_inv, 1.0f / 64);
  EXPECT_EQ(q.amax, 3.5f);
  DelayedRecordAmax(state, q.amax);
  EXPECT_EQ(state.amax_history[0], 3.5f);
}

TEST(PerTensorFp8, E5M2) {
  // amax 1 -> scale 57344. 1 -> 57344 = max -> 0x7B; -0.5 -> -28672 =
  // -1.75*2^14: e=29, m=3 -> 0x77|0x80 = 0xF7. scale_inv = RN(1/57344).
  QuantSpec spec = DefaultQuantSpec(Format::kFp8Current);
  spec.fp8_type = Fp8Type::kE5M2;
  const TensorScaling scaling = ScalingFromAmax(spec, 1.0f);
  ASSERT_OK_AND_ASSIGN(auto q,
                       Quantize({1.0f, -0.5f, -1e30f}, 1, 3, spec, Direction::kRowwise, scaling));
  EXPECT_EQ(q.data, std::vector<uint8_t>({0x7B, 0xF7, 0xFB}));
  EXPECT_EQ(q.scale_inv, F(0x37924925));
  ASSERT_OK_AND_ASSIGN(auto x, Dequantize(q, spec));
  EXPECT_EQ(x[1], -28672.0f * F(0x37924925));
}

TEST(PerTensorFp8, InfinityAndOverflowSaturate) {
  // With a fixed scale of 1: Inf -> 448, -1000 -> -448, 1e-3 -> subnormal
  // 2^-9 * 0.512 -> RNE 1 * 2^-9 -> 0x01 (1e-3 / 2^-9 = 0.512).
  const QuantSpec spec = DefaultQuantSpec(Format::kFp8Delayed);
  const float inf = std::numeric_limits<float>::infinity();
  ASSERT_OK_AND_ASSIGN(auto q, Quantize({inf, -1000.0f, 1e-3f, -inf}, 2, 2, spec,
                                        Direction::kColumnwise, TensorScaling{1.0f, 0.0f}));
  EXPECT_EQ(q.data, std::vector<uint8_t>({0x7E, 0x01, 0xFE, 0xFE}));
  EXPECT_EQ(q.amax, inf);
}

TEST(PerTensorFp8, AllZeroTensor) {
  const QuantSpec spec = DefaultQuantSpec(Format::kFp8Current);
  const std::vector<float> zeros(6, 0.0f);
  const TensorScaling scaling = ScalingFromAmax(spec, Amax(zeros));
  EXPECT_EQ(scaling.scale, 1.0f);
  ASSERT_OK_AND_ASSIGN(auto q, Quantize(zeros, 3, 2, spec, Direction::kRowwise, scaling));
  EXPECT_EQ(q.data, std::vector<uint8_t>(6, 0));
  EXPECT_EQ(q.scale_inv, 1.0f);
}

}  // namespace
}  // namespace paramd::ref
