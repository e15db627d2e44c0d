#include "deploy/model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>

namespace paramd {
namespace demo {
namespace {

ModelConfig Tiny() {
  ModelConfig c;
  c.input_dim = 5;
  c.hidden = {7, 6};
  c.num_classes = 4;
  c.teacher_hidden = 3;
  c.names.clear();
  return c;
}

TEST(Model, DefaultShapesHaveLargeShardableWeights) {
  auto shapes = ModelShapes(ModelConfig());
  ASSERT_TRUE(shapes.ok());
  ASSERT_EQ(shapes->size(), 4u);
  EXPECT_EQ((*shapes)[0].name, "layers.0.mlp.up.weight");
  EXPECT_EQ((*shapes)[3].name, "head.weight");
  EXPECT_EQ((*ModelShapes(Tiny()))[2].name, "layers.2.weight");
  EXPECT_EQ((*shapes)[0].rows, 1024);
  EXPECT_EQ((*shapes)[0].cols, 64);
  EXPECT_EQ((*shapes)[1].rows, 256);
  EXPECT_EQ((*shapes)[1].cols, 1024);
  EXPECT_EQ((*shapes)[3].rows, 16);
  EXPECT_EQ((*shapes)[3].cols, 64);
}

TEST(Model, RejectsEmptyLayer) {
  ModelConfig c = Tiny();
  c.hidden = {7, 0};
  EXPECT_EQ(ModelShapes(c).status().code(), absl::StatusCode::kInvalidArgument);
  c.hidden = {7, 6};
  c.names = {"a", "b"};
  EXPECT_EQ(ModelShapes(c).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Model, InitIsDeterministicAndHeScaled) {
  auto a = InitialWeights(ModelConfig());
  auto b = InitialWeights(ModelConfig());
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  ModelConfig other;
  other.init_seed = 7;
  EXPECT_NE(*a, *InitialWeights(other));
  // layers.1 has K = 1024: variance 2/1024.
  const std::vector<float>& w = (*a)[1];
  double sq = 0;
  for (float v : w) sq += v * v;
  EXPECT_NEAR(sq / w.size(), 2.0 / 1024, 0.1 * 2.0 / 1024);
}

TEST(Model, BatchesAreDeterministicAndUseManyClasses) {
  SyntheticTask task(ModelConfig{});
  Batch a = task.MakeBatch(3, 256);
  Batch b = task.MakeBatch(3, 256);
  EXPECT_EQ(a.inputs, b.inputs);
  EXPECT_EQ(a.labels, b.labels);
  EXPECT_NE(a.inputs, task.MakeBatch(4, 256).inputs);
  EXPECT_NE(a.inputs, task.MakeEvalBatch(256).inputs);
  std::set<int32_t> classes(a.labels.begin(), a.labels.end());
  EXPECT_GE(classes.size(), 8u);
  for (int32_t l : a.labels) EXPECT_TRUE(l >= 0 && l < 16);
}

TEST(Model, GradientsMatchFiniteDifferences) {
  const ModelConfig c = Tiny();
  auto weights = *InitialWeights(c);
  const Batch batch = SyntheticTask(c).MakeBatch(0, 8);
  auto g = ComputeGradients(c, ViewsOf(weights), ViewsOf(weights), batch, 0, 8, 8);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_NEAR(g->loss_sum / 8, *MeanLoss(c, ViewsOf(weights), batch), 1e-6);
  int checked = 0;
  for (size_t l = 0; l < weights.size(); ++l) {
    for (size_t i = 0; i < weights[l].size(); i += 3) {
      const float saved = weights[l][i];
      const float h = 1e-2f;
      weights[l][i] = saved + h;
      const double up = *MeanLoss(c, ViewsOf(weights), batch);
      weights[l][i] = saved - h;
      const double down = *MeanLoss(c, ViewsOf(weights), batch);
      weights[l][i] = saved;
      const double numeric = (up - down) / (2 * h);
      EXPECT_NEAR(g->weight_grads[l][i], numeric, 2e-3 + 2e-2 * std::fabs(numeric))
          << "layer " << l << " index " << i;
      ++checked;
    }
  }
  EXPECT_GT(checked, 30);
}

TEST(Model, SlicesWithSharedNormalizerSumToWholeBatch) {
  const ModelConfig c = Tiny();
  const auto weights = *InitialWeights(c);
  const Batch batch = SyntheticTask(c).MakeBatch(1, 10);
  const WeightViews v = ViewsOf(weights);
  auto all = *ComputeGradients(c, v, v, batch, 0, 10, 10);
  auto lo = *ComputeGradients(c, v, v, batch, 0, 4, 10);
  auto hi = *ComputeGradients(c, v, v, batch, 4, 10, 10);
  EXPECT_EQ(lo.samples + hi.samples, 10);
  EXPECT_NEAR(lo.loss_sum + hi.loss_sum, all.loss_sum, 1e-9);
  for (size_t l = 0; l < all.weight_grads.size(); ++l) {
    for (size_t i = 0; i < all.weight_grads[l].size(); ++i) {
      EXPECT_NEAR(lo.weight_grads[l][i] + hi.weight_grads[l][i], all.weight_grads[l][i], 1e-6);
    }
  }
}

TEST(Model, BackwardWeightsFeedOnlyDataGradients) {
  const ModelConfig c = Tiny();
  const auto weights = *InitialWeights(c);
  auto scaled = weights;
  for (auto& w : scaled) {
    for (float& x : w) x *= 2.0f;
  }
  const Batch batch = SyntheticTask(c).MakeBatch(2, 6);
  auto base = *ComputeGradients(c, ViewsOf(weights), ViewsOf(weights), batch, 0, 6, 6);
  auto other = *ComputeGradients(c, ViewsOf(weights), ViewsOf(scaled), batch, 0, 6, 6);
  EXPECT_EQ(base.loss_sum, other.loss_sum);
  // The last layer's weight gradient needs no data gradient.
  EXPECT_EQ(base.weight_grads.back(), other.weight_grads.back());
  // Layer l < last gets dY through the backward weights of layers > l: doubled
  // once per layer above it (ReLU masks come from the forward pass).
  for (size_t i = 0; i < base.weight_grads[0].size(); ++i) {
    EXPECT_NEAR(other.weight_grads[0][i], 4.0f * base.weight_grads[0][i],
                1e-5 + 1e-5 * std::fabs(base.weight_grads[0][i]));
  }
}

TEST(Model, RejectsBadInputs) {
  const ModelConfig c = Tiny();
  const auto weights = *InitialWeights(c);
  const Batch batch = SyntheticTask(c).MakeBatch(0, 4);
  WeightViews v = ViewsOf(weights);
  EXPECT_EQ(ComputeGradients(c, v, v, batch, 2, 2, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeGradients(c, v, v, batch, 0, 5, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
  WeightViews short_views = v;
  short_views[1] = short_views[1].subspan(1);
  EXPECT_EQ(ComputeGradients(c, v, short_views, batch, 0, 4, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
  short_views.pop_back();
  EXPECT_EQ(MeanLoss(c, short_views, batch).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace demo
}  // namespace paramd
