#include "deploy/training.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>

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

TEST(Training, BaselineLearnsDeterministicallyAndFast) {
  TrainSchedule s;
  s.steps = 30;
  const auto start = std::chrono::steady_clock::now();
  auto a = TrainBaseline(ModelConfig(), s, OptimizerOptions());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->losses.size(), 30u);
  EXPECT_NEAR(a->losses[0], std::log(16.0), 0.8);
  EXPECT_LT(TailMean(a->losses, 5), 0.7 * a->losses[0]);
  EXPECT_LT(a->eval_loss, 0.75 * a->losses[0]);
  auto b = TrainBaseline(ModelConfig(), s, OptimizerOptions());
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
