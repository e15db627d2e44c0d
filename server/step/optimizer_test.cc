#include "server/step/optimizer.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace paramd {
namespace {

TEST(OptimizerTest, PlainSgdIsExact) {
  OptimizerOptions o;
  o.kind = OptimizerKind::kSgd;
  o.lr = 0.5f;
  std::vector<float> w = {1.0f, -2.0f, 3.0f};
  const std::vector<float> g = {0.5f, 1.0f, -4.0f};
  OptimizerState state;
  ApplyOptimizer(o, 1, absl::MakeSpan(w), g, state);
  EXPECT_EQ(w, (std::vector<float>{0.75f, -2.5f, 5.0f}));
}

TEST(OptimizerTest, SgdMomentumFollowsPyTorch) {
  OptimizerOptions o;
  o.kind = OptimizerKind::kSgd;
  o.lr = 0.25f;
  o.momentum = 0.5f;
  std::vector<float> w = {1.0f};
  OptimizerState state;
  ApplyOptimizer(o, 1, absl::MakeSpan(w), std::vector<float>{1.0f}, state);  // buf = 1
  EXPECT_EQ(w[0], 0.75f);
  ApplyOptimizer(o, 2, absl::MakeSpan(w), std::vector<float>{1.0f}, state);  // buf = 1.5
  EXPECT_EQ(state.m[0], 1.5f);
  EXPECT_EQ(w[0], 0.375f);
}

TEST(OptimizerTest, AdamWFirstStepMovesByLr) {
  // Step 1: m_hat = g, v_hat = g^2, so the update is lr * g / (|g| + eps).
  OptimizerOptions o;
  o.lr = 0.01f;
  o.weight_decay = 0.1f;
  std::vector<float> w = {2.0f, -1.0f};
  OptimizerState state;
  ApplyOptimizer(o, 1, absl::MakeSpan(w), std::vector<float>{3.0f, -0.5f}, state);
  const float decay = 1.0f - 0.01f * 0.1f;
  EXPECT_NEAR(w[0], 2.0f * decay - 0.01f, 1e-6);
  EXPECT_NEAR(w[1], -1.0f * decay + 0.01f, 1e-6);
  ASSERT_EQ(state.m.size(), 2u);
  ASSERT_EQ(state.v.size(), 2u);
  EXPECT_FLOAT_EQ(state.m[0], (1.0f - 0.9f) * 3.0f);
  EXPECT_FLOAT_EQ(state.v[0], (1.0f - 0.999f) * 3.0f * 3.0f);
}

TEST(OptimizerTest, SgdWithoutWeightDecayKeepsInfiniteMasters) {
  for (float momentum : {0.0f, 0.9f}) {
    OptimizerOptions o;
    o.kind = OptimizerKind::kSgd;
    o.lr = 0.5f;
    o.momentum = momentum;
    o.weight_decay = 0.0f;
    std::vector<float> w = {std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), 1.0f};
    const std::vector<float> g = {1.0f, 1.0f, 1.0f};
    OptimizerState state;
    ApplyOptimizer(o, 1, absl::MakeSpan(w), g, state);
    EXPECT_EQ(w[0], std::numeric_limits<float>::infinity()) << momentum;
    EXPECT_EQ(w[1], -std::numeric_limits<float>::infinity()) << momentum;
    EXPECT_EQ(w[2], 0.5f) << momentum;
  }
}

TEST(OptimizerTest, ParsesAndValidates) {
  EXPECT_EQ(*ParseOptimizerKind("adamw"), OptimizerKind::kAdamW);
  EXPECT_EQ(*ParseOptimizerKind("sgd"), OptimizerKind::kSgd);
  EXPECT_FALSE(ParseOptimizerKind("adam").ok());
  OptimizerOptions o;
  EXPECT_TRUE(ValidateOptimizerOptions(o).ok());
  o.beta1 = 1.0f;
  EXPECT_FALSE(ValidateOptimizerOptions(o).ok());
  o = OptimizerOptions();
  o.lr = std::nanf("");
  EXPECT_FALSE(ValidateOptimizerOptions(o).ok());
}

}  // namespace
}  // namespace paramd
