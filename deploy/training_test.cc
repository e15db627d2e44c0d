#include "deploy/training.h"

#include <gtest/gtest.h>

#include <chrono>

namespace paramd {
namespace demo {
namespace {

TEST(Training, SlicesCoverTheBatch) {
  TrainSchedule s;
  s.batch_size = 257;
  s.num_trainers = 2;
  EXPECT_EQ(TrainerSlice(s, 0), std::make_pair(int64_t{0}, int64_t{128}));
  EXPECT_EQ(TrainerSlice(s, 1), std::make_pair(int64_t{128}, int64_t{257}));
}

TEST(Training, SgdMomentumMatchesTorchRule) {
  OptimizerSpec spec;
  spec.kind = OptimizerSpec::Kind::kSgdMomentum;
  spec.learning_rate = 0.5f;
  spec.momentum = 0.9f;
  HostOptimizer opt(spec, {1});
  std::vector<float> w = {1.0f};
  ASSERT_TRUE(opt.Step(0, absl::MakeSpan(w), std::vector<float>{2.0f}).ok());
  EXPECT_FLOAT_EQ(w[0], 0.0f);   // buf = 2
  ASSERT_TRUE(opt.Step(0, absl::MakeSpan(w), std::vector<float>{1.0f}).ok());
  EXPECT_FLOAT_EQ(w[0], -1.4f);  // buf = 0.9 * 2 + 1
  EXPECT_EQ(opt.Step(0, absl::MakeSpan(w), std::vector<float>{1.0f, 2.0f}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(opt.Step(1, absl::MakeSpan(w), std::vector<float>{1.0f}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Training, AdamWFirstStepMovesByLearningRate) {
  OptimizerSpec spec;
  spec.learning_rate = 0.01f;
  spec.weight_decay = 0.1f;
  HostOptimizer opt(spec, {2});
  std::vector<float> w = {1.0f, -1.0f};
  ASSERT_TRUE(opt.Step(0, absl::MakeSpan(w), std::vector<float>{3.0f, -0.5f}).ok());
  // Decoupled decay, then a step of lr * sign(g) (bias-corrected m/sqrt(v)).
  EXPECT_NEAR(w[0], 1.0f * (1 - 0.001f) - 0.01f, 1e-6);
  EXPECT_NEAR(w[1], -1.0f * (1 - 0.001f) + 0.01f, 1e-6);
}

TEST(Training, BaselineLearnsDeterministicallyAndFast) {
  TrainSchedule s;
  s.steps = 30;
  const auto start = std::chrono::steady_clock::now();
  auto a = TrainBaseline(ModelConfig(), s, OptimizerSpec());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->losses.size(), 30u);
  EXPECT_NEAR(a->losses[0], std::log(16.0), 0.8);
  EXPECT_LT(TailMean(a->losses, 5), 0.7 * a->losses[0]);
  EXPECT_LT(a->eval_loss, 0.75 * a->losses[0]);
  auto b = TrainBaseline(ModelConfig(), s, OptimizerSpec());
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(a->losses, b->losses);
  EXPECT_EQ(a->weights, b->weights);
  // The demo trains the same model twice (baseline and distributed): keep a
  // step well under a second on one core.
  EXPECT_LT(seconds / s.steps, 0.5);
  std::printf("baseline: %.3f s/step, loss %.4f -> %.4f, eval %.4f\n", seconds / s.steps,
              a->losses[0], a->losses.back(), a->eval_loss);
}

TEST(Training, TailMean) {
  EXPECT_DOUBLE_EQ(TailMean({1, 2, 3, 4}, 2), 3.5);
  EXPECT_DOUBLE_EQ(TailMean({1, 2}, 5), 1.5);
  EXPECT_DOUBLE_EQ(TailMean({}, 5), 0.0);
}

}  // namespace
}  // namespace demo
}  // namespace paramd
