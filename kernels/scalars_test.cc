// Amax, source rounding, compute_scale (§2) and delayed scaling (§1, D9),
// against hand-computed values.
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/reference.h"

namespace paramd::ref {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

float F(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

TEST(Amax, IgnoresNaNCountsInfEmptyIsZero) {
  EXPECT_EQ(Amax({}), 0.0f);
  EXPECT_EQ(Amax({1.0f, -3.0f, 2.0f}), 3.0f);
  EXPECT_EQ(Amax({kNaN, -2.0f, kNaN}), 2.0f);
  EXPECT_EQ(Amax({kNaN, kNaN}), 0.0f);
  EXPECT_EQ(Amax({1.0f, -kInf}), kInf);
  EXPECT_EQ(Amax({-0.0f}), 0.0f);
  EXPECT_FALSE(std::signbit(Amax({-0.0f})));
  EXPECT_EQ(Amax({F(0x00000001)}), F(0x00000001));  // subnormal kept (D6)
}

TEST(RoundToSource, Bf16IsRneFp32IsCopy) {
  const std::vector<float> master = {0.3f, 1.0f, F(0x3F808000), F(0x3F818000), kNaN};
  const std::vector<float> bf16 = RoundToSource(master, SourceDtype::kBf16);
  EXPECT_EQ(bf16[0], F(0x3E9A0000));  // 0.3 = 0x3E99999A rounds up
  EXPECT_EQ(bf16[1], 1.0f);
  EXPECT_EQ(bf16[2], 1.0f);           // tie to even
  EXPECT_EQ(bf16[3], F(0x3F820000));  // tie, odd -> up
  EXPECT_TRUE(std::isnan(bf16[4]));
  const std::vector<float> fp32 = RoundToSource(master, SourceDtype::kFp32);
  EXPECT_EQ(fp32[0], 0.3f);
  EXPECT_EQ(fp32[2], F(0x3F808000));
}

TEST(ComputeScale, FollowsSection2) {
  EXPECT_EQ(ComputeScale(3.5f, 448.0f, false, 0.0f, FLT_MAX), 128.0f);
  EXPECT_EQ(ComputeScale(5.0f, 448.0f, false, 0.0f, FLT_MAX), 448.0f / 5.0f);
  EXPECT_EQ(ComputeScale(5.0f, 448.0f, true, 0.0f, FLT_MAX), 64.0f);  // 89.6 -> 64
  EXPECT_EQ(ComputeScale(0.0f, 448.0f, false, 0.0f, FLT_MAX), 1.0f);
  EXPECT_EQ(ComputeScale(kInf, 448.0f, false, 0.0f, FLT_MAX), 1.0f);
  EXPECT_EQ(ComputeScale(kNaN, 448.0f, false, 0.0f, FLT_MAX), 1.0f);
  // eps clamps small amaxes up (and an amax of 0 too).
  EXPECT_EQ(ComputeScale(0.001f, 448.0f, false, 1.0f, FLT_MAX), 448.0f);
  EXPECT_EQ(ComputeScale(0.0f, 448.0f, false, 2.0f, FLT_MAX), 224.0f);
  // 448 / 1e-37 overflows: inf_value, then pow2 clears its mantissa.
  EXPECT_EQ(ComputeScale(1e-37f, 448.0f, false, 0.0f, FLT_MAX), FLT_MAX);
  EXPECT_EQ(ComputeScale(1e-37f, 448.0f, false, 0.0f, F(0x7F7F0000)), F(0x7F7F0000));
  EXPECT_EQ(ComputeScale(1e-37f, 448.0f, true, 0.0f, F(0x7F7F0000)), F(0x7F000000));
  // Any subnormal amax overflows 448 / amax (D6: it is not flushed to 0,
  // which would give scale 1).
  EXPECT_EQ(ComputeScale(std::ldexp(1.0f, -130), 448.0f, false, 0.0f, FLT_MAX), FLT_MAX);
  EXPECT_EQ(ComputeScale(std::ldexp(1.0f, -100), 448.0f, false, 0.0f, FLT_MAX),
            std::ldexp(448.0f, 100));
  EXPECT_EQ(ComputeScale(57344.0f, 57344.0f, false, 0.0f, FLT_MAX), 1.0f);
}

TEST(ScalingFromAmax, CurrentScalingAndNvfp4) {
  const TensorScaling current = ScalingFromAmax(DefaultQuantSpec(Format::kFp8Current), 3.5f);
  EXPECT_EQ(current.scale, 128.0f);
  EXPECT_EQ(current.global_amax, 3.5f);
  QuantSpec pow2 = DefaultQuantSpec(Format::kFp8Current);
  pow2.pow2_scales = true;
  EXPECT_EQ(ScalingFromAmax(pow2, 5.0f).scale, 64.0f);
  QuantSpec e5m2 = DefaultQuantSpec(Format::kFp8Current);
  e5m2.fp8_type = Fp8Type::kE5M2;
  EXPECT_EQ(ScalingFromAmax(e5m2, 7.0f).scale, 8192.0f);  // 57344 / 7
  // Current scaling overflow uses FLT_MAX (§2), not the BF16 maximum.
  EXPECT_EQ(ScalingFromAmax(DefaultQuantSpec(Format::kFp8Current), 1e-37f).scale, FLT_MAX);
  const TensorScaling nvfp4 = ScalingFromAmax(DefaultQuantSpec(Format::kNvfp4), 6.0f);
  EXPECT_EQ(nvfp4.global_amax, 6.0f);
  EXPECT_EQ(nvfp4.scale, 1.0f);
}

// ---- Delayed scaling ----

// One step as a trainer runs it: the casts of the step record amaxes (here
// two casts, the larger second), then the update with no all-reduce.
void Step(DelayedScalingState& s, float amax, const QuantSpec& spec) {
  DelayedRecordAmax(s, amax / 2);
  DelayedRecordAmax(s, amax);
  DelayedUpdate(s, s.amax_history[0], spec);
}

TEST(DelayedScaling, TwentyStepsWithHistoryOfThree) {
  QuantSpec spec = DefaultQuantSpec(Format::kFp8Delayed);
  spec.amax_history_len = 3;
  DelayedScalingState s = InitialDelayedState(spec);
  ASSERT_EQ(s.amax_history, std::vector<float>({0, 0, 0}));
  ASSERT_EQ(s.scale, 1.0f);
  const float tiny = 1e-38f;  // an fp32 subnormal: 448/tiny overflows
  // Hand trace of §1 with L = 3: sel = max(h1, h2, a) before the roll,
  // then h1 <- h2, h2 <- a, h0 <- 0; scale = 448 / sel when sel is finite
  // and > 0; a == 0 changes nothing (D9).
  struct Row {
    float a, h1, h2, scale;
  };
  const Row trace[20] = {
      {2, 0, 2, 224},               // sel 2
      {4, 2, 4, 112},               // sel 4
      {1, 4, 1, 112},               // sel max(2,4,1) = 4
      {0, 4, 1, 112},               // D9: no roll, scale kept
      {0.5, 1, 0.5, 112},           // sel max(4,1,.5) = 4
      {0.5, 0.5, 0.5, 448},         // sel max(1,.5,.5) = 1
      {0.5, 0.5, 0.5, 896},         // sel 0.5
      {8, 0.5, 8, 56},              // sel 8
      {0, 0.5, 8, 56},              // D9
      {1, 8, 1, 56},                // sel max(.5,8,1) = 8
      {1, 1, 1, 56},                // sel max(8,1,1) = 8
      {1, 1, 1, 448},               // sel 1
      {kInf, 1, kInf, 448},         // sel Inf: not finite, scale kept
      {2, kInf, 2, 448},            // sel Inf
      {2, 2, 2, 448},               // sel Inf (slot 1 still counts)
      {2, 2, 2, 224},               // sel 2
      {tiny, 2, tiny, 224},         // sel 2
      {tiny, tiny, tiny, 224},      // sel 2
      {tiny, tiny, tiny, FLT_MAX},  // sel tiny: 448/tiny = Inf -> FLT_MAX
      {3, tiny, 3, F(0x43155555)},  // sel 3: RN(448/3) = 149.33333
  };
  for (int t = 0; t < 20; ++t) {
    Step(s, trace[t].a, spec);
    SCOPED_TRACE(t + 1);
    EXPECT_EQ(s.amax_history[0], 0.0f);
    EXPECT_EQ(s.amax_history[1], trace[t].h1);
    EXPECT_EQ(s.amax_history[2], trace[t].h2);
    EXPECT_EQ(s.scale, trace[t].scale);
  }
}

TEST(DelayedScaling, ZeroAmaxKeepsUnreducedLocalSlotIntact) {
  // D9 is about the REDUCED amax; a zero reduced amax returns before
  // touching anything, including history[0].
  QuantSpec spec = DefaultQuantSpec(Format::kFp8Delayed);
  spec.amax_history_len = 2;
  DelayedScalingState s = InitialDelayedState(spec);
  s.scale = 5.0f;
  DelayedUpdate(s, 0.0f, spec);
  EXPECT_EQ(s.scale, 5.0f);
  EXPECT_EQ(s.amax_history, std::vector<float>({0, 0}));
}

TEST(DelayedScaling, MostRecentMarginAndLengthOne) {
  QuantSpec spec = DefaultQuantSpec(Format::kFp8Delayed);
  spec.amax_history_len = 4;
  spec.amax_algo = AmaxAlgo::kMostRecent;
  DelayedScalingState s = InitialDelayedState(spec);
  Step(s, 8, spec);
  EXPECT_EQ(s.scale, 56.0f);
  Step(s, 1, spec);
  EXPECT_EQ(s.scale, 448.0f);  // "max" would have kept 8
  EXPECT_EQ(s.amax_history, std::vector<float>({0, 0, 8, 1}));

  spec.amax_algo = AmaxAlgo::kMax;
  spec.margin = 2;  // scaled_max = 448 * 2^-2 = 112
  Step(s, 2, spec);
  EXPECT_EQ(s.scale, 14.0f);  // 112 / max(0, 8, 1, 2)
  EXPECT_EQ(s.amax_history, std::vector<float>({0, 8, 1, 2}));

  QuantSpec one = DefaultQuantSpec(Format::kFp8Delayed);
  one.amax_history_len = 1;
  DelayedScalingState s1 = InitialDelayedState(one);
  ASSERT_EQ(s1.amax_history.size(), 1u);
  Step(s1, 4, one);
  EXPECT_EQ(s1.scale, 112.0f);
  EXPECT_EQ(s1.amax_history, std::vector<float>({0}));
  Step(s1, 7, one);  // L == 1 remembers nothing: sel = a
  EXPECT_EQ(s1.scale, 64.0f);
  Step(s1, 1, one);
  EXPECT_EQ(s1.scale, 448.0f);

  QuantSpec e5m2 = DefaultQuantSpec(Format::kFp8Delayed);
  e5m2.fp8_type = Fp8Type::kE5M2;
  e5m2.amax_history_len = 2;
  DelayedScalingState s2 = InitialDelayedState(e5m2);
  Step(s2, 7, e5m2);
  EXPECT_EQ(s2.scale, 8192.0f);
}

TEST(DelayedScaling, RecordIgnoresNaNAndUsesTheReducedAmax) {
  QuantSpec spec = DefaultQuantSpec(Format::kFp8Delayed);
  spec.amax_history_len = 2;
  DelayedScalingState s = InitialDelayedState(spec);
  DelayedRecordAmax(s, 3.0f);
  DelayedRecordAmax(s, kNaN);
  EXPECT_EQ(s.amax_history[0], 3.0f);
  // Another rank saw 14: the all-reduced value drives the update.
  DelayedUpdate(s, 14.0f, spec);
  EXPECT_EQ(s.scale, 32.0f);
  EXPECT_EQ(s.amax_history, std::vector<float>({0, 14}));
  // An empty state (not from InitialDelayedState) is sized on first use.
  DelayedScalingState empty;
  DelayedUpdate(empty, 7.0f, spec);
  EXPECT_EQ(empty.amax_history, std::vector<float>({0, 7}));
  EXPECT_EQ(empty.scale, 64.0f);
}

}  // namespace
}  // namespace paramd::ref
