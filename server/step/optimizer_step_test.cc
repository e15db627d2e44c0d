// The cpu backend's optimizer step (server/step/shard_set.h) with an lr schedule,
// global-norm clipping, per-rule weight decay and lr multiplier, a frozen
// tensor and skip_step, against an independent float64 reference, for 20
// steps of random gradients from 3 pushers; and the same model on 1 daemon
// vs 3 daemons with tensors split across them, which must agree bit for bit
// (the clip norm included).
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/format.h"
#include "server/step/optimizer.h"
#include "server/step/optimizer_test_model.h"
#include "server/step/shard_set.h"
#include "server/step/thread_all_reduce.h"

namespace paramd {
namespace {

constexpr int kPushers = 3;
constexpr int kSteps = 20;

using testing::OptimizerTestLayout;

std::vector<TensorDef> Model() {
  HybridSpec fp32;
  fp32.rowwise = DefaultQuantSpec(Format::kIdentityFp32);
  fp32.columnwise = DefaultQuantSpec(Format::kIdentityFp32);
  return testing::OptimizerTestModel(fp32);
}

std::vector<ShardDef> ThreeDaemonShards(int d) { return OptimizerTestLayout(3)[d]; }

std::vector<std::vector<float>> Random(const std::vector<TensorDef>& model, uint32_t seed,
                                       float scale) {
  std::vector<std::vector<float>> out;
  for (size_t t = 0; t < model.size(); ++t) {
    out.push_back(testing::RandomGradient(model[t].rows * model[t].cols,
                                          seed + 7919 * static_cast<uint32_t>(t), scale));
  }
  return out;
}

// A world of daemons (ShardSets) over one model stepping together.
struct World {
  std::vector<std::unique_ptr<ShardSet>> daemons;
  std::unique_ptr<ThreadAllReduce> reduce;

  World(const std::vector<TensorDef>& model, const std::vector<std::vector<ShardDef>>& layout,
        const OptimizerOptions& o, const std::vector<std::vector<float>>& init) {
    reduce = std::make_unique<ThreadAllReduce>(static_cast<int>(layout.size()));
    for (const auto& shards : layout) {
      absl::StatusOr<std::unique_ptr<ShardSet>> s = ShardSet::Create(model, shards, o);
      EXPECT_TRUE(s.ok()) << s.status();
      daemons.push_back(*std::move(s));
      ShardSet& set = *daemons.back();
      for (size_t i = 0; i < set.shards().size(); ++i) {
        const ShardDef& d = set.shards()[i];
        const int64_t cols = model[d.tensor].cols;
        std::memcpy(set.master(i).data(), init[d.tensor].data() + d.row_begin * cols,
                    set.master(i).size() * sizeof(float));
      }
    }
  }

  // Each pusher's gradient goes to every daemon, rows routed to shards; the
  // last pusher's adds take the norm's row sums (as the daemon does).
  void Push(const std::vector<std::vector<std::vector<float>>>& pushes) {
    for (int p = 0; p < kPushers; ++p) {
      for (auto& set : daemons) {
        for (size_t i = 0; i < set->shards().size(); ++i) {
          const ShardDef& d = set->shards()[i];
          const int64_t cols = set->tensors()[d.tensor].cols;
          const float* src = pushes[p][d.tensor].data() + d.row_begin * cols;
          ASSERT_TRUE(set->AccumulateGradient(static_cast<int>(i), 0,
                                              absl::MakeConstSpan(src, d.rows() * cols),
                                              p == kPushers - 1)
                          .ok());
        }
      }
    }
  }

  std::vector<StepReport> Step(int64_t version) {
    std::vector<absl::StatusOr<std::shared_ptr<const PublishedVersion>>> r(daemons.size());
    std::vector<std::thread> threads;
    for (size_t d = 0; d < daemons.size(); ++d) {
      threads.emplace_back([&, d] { r[d] = daemons[d]->Step(version, true, reduce->Member()); });
    }
    for (std::thread& t : threads) t.join();
    std::vector<StepReport> reports;
    for (auto& x : r) {
      EXPECT_TRUE(x.ok()) << x.status();
      if (x.ok()) reports.push_back((*x)->report);
    }
    return reports;
  }

  // Tensor t's masters assembled from the shards.
  std::vector<float> Master(int t, const TensorDef& def) const {
    std::vector<float> out(def.rows * def.cols);
    for (const auto& set : daemons) {
      for (size_t i = 0; i < set->shards().size(); ++i) {
        const ShardDef& d = set->shards()[i];
        if (d.tensor != t) continue;
        std::memcpy(out.data() + d.row_begin * def.cols, set->master(i).data(),
                    set->master(i).size() * sizeof(float));
      }
    }
    return out;
  }
};

// The float64 reference: torch.optim.AdamW / SGD with
// clip_grad_norm_(max_norm) and the schedule written out on its own.
struct Reference {
  OptimizerOptions o;
  std::vector<TensorDef> model;
  std::vector<std::vector<double>> w, m, v;
  int64_t t = 0;
  int64_t skipped = 0;

  double Lr(int64_t step) const {
    const double peak = o.lr;
    const LrSchedule& s = o.schedule;
    if (step <= s.warmup_steps) return peak * step / s.warmup_steps;
    const double p = std::min(1.0, double(step - s.warmup_steps) / s.decay_steps);
    switch (s.decay) {
      case LrDecay::kConstant:
        return peak;
      case LrDecay::kLinear:
        return peak + (s.min_lr - peak) * p;
      case LrDecay::kCosine:
        return s.min_lr + 0.5 * (peak - s.min_lr) * (1.0 + std::cos(3.14159265358979323846 * p));
    }
    return peak;
  }

  // Returns the gradient norm of this step.
  double Step(const std::vector<std::vector<std::vector<float>>>& pushes) {
    std::vector<std::vector<double>> g(model.size());
    double sq = 0.0;
    for (size_t i = 0; i < model.size(); ++i) {
      g[i].assign(w[i].size(), 0.0);
      for (int p = 0; p < kPushers; ++p) {
        for (size_t k = 0; k < g[i].size(); ++k) g[i][k] += pushes[p][i][k];
      }
      if (model[i].optimizer.frozen) continue;
      for (double x : g[i]) sq += x * x;
    }
    const double norm = std::sqrt(sq);
    if (!std::isfinite(norm) && o.non_finite == NonFinitePolicy::kSkipStep) {
      ++skipped;
      return norm;
    }
    ++t;
    double clip = 1.0;
    if (o.max_grad_norm > 0) clip = std::min(1.0, o.max_grad_norm / (norm + 1e-6));
    for (size_t i = 0; i < model.size(); ++i) {
      const TensorOptimizer& to = model[i].optimizer;
      if (to.frozen) continue;
      const double lr = Lr(t) * to.lr_multiplier;
      const double wd = to.weight_decay.value_or(o.weight_decay);
      for (size_t k = 0; k < w[i].size(); ++k) {
        double gk = g[i][k] * clip;
        if (o.kind == OptimizerKind::kAdamW) {
          w[i][k] *= 1.0 - lr * wd;
          m[i][k] = o.beta1 * m[i][k] + (1.0 - o.beta1) * gk;
          v[i][k] = o.beta2 * v[i][k] + (1.0 - o.beta2) * gk * gk;
          const double mh = m[i][k] / (1.0 - std::pow(double(o.beta1), double(t)));
          const double vh = v[i][k] / (1.0 - std::pow(double(o.beta2), double(t)));
          w[i][k] -= lr * mh / (std::sqrt(vh) + o.eps);
        } else {
          gk += wd * w[i][k];
          m[i][k] = t == 1 ? gk : o.momentum * m[i][k] + gk;
          w[i][k] -= lr * (o.momentum != 0 ? m[i][k] : gk);
        }
      }
    }
    return norm;
  }
};

struct Case {
  const char* name;
  OptimizerOptions options;
};

OptimizerOptions AdamWCosine() {
  OptimizerOptions o;
  o.kind = OptimizerKind::kAdamW;
  o.lr = 1e-2f;
  o.beta1 = 0.9f;
  o.beta2 = 0.99f;
  o.eps = 1e-8f;
  o.weight_decay = 0.1f;
  o.schedule = {3, LrDecay::kCosine, 12, 1e-3f};
  o.max_grad_norm = 20.0f;
  return o;
}

OptimizerOptions SgdLinear() {
  OptimizerOptions o;
  o.kind = OptimizerKind::kSgd;
  o.lr = 5e-3f;
  o.momentum = 0.9f;
  o.weight_decay = 0.01f;
  o.schedule = {2, LrDecay::kLinear, 10, 5e-4f};
  o.max_grad_norm = 20.0f;
  return o;
}

class OptimizerStepTest : public ::testing::TestWithParam<Case> {};

TEST_P(OptimizerStepTest, MatchesFloat64ReferenceAndOneVsThreeDaemons) {
  const OptimizerOptions o = GetParam().options;
  const std::vector<TensorDef> model = Model();
  const auto init = Random(model, 1, 0.5f);
  World single(model, OptimizerTestLayout(1), o, init);
  World three(model, {ThreeDaemonShards(0), ThreeDaemonShards(1), ThreeDaemonShards(2)}, o, init);
  Reference ref{o, model, {}, {}, {}};
  for (const auto& x : init) {
    ref.w.emplace_back(x.begin(), x.end());
    ref.m.emplace_back(x.size(), 0.0);
    ref.v.emplace_back(x.size(), 0.0);
  }
  int clipped = 0;
  for (int step = 0; step < kSteps; ++step) {
    // Large gradients on even steps (clipped), small ones on odd steps.
    const float scale = step % 2 == 0 ? 0.5f : 0.01f;
    std::vector<std::vector<std::vector<float>>> pushes;
    for (int p = 0; p < kPushers; ++p) pushes.push_back(Random(model, 100 + 10 * step + p, scale));
    single.Push(pushes);
    three.Push(pushes);
    const std::vector<StepReport> r1 = single.Step(step + 1);
    const std::vector<StepReport> r3 = three.Step(step + 1);
    const double norm = ref.Step(pushes);
    ASSERT_EQ(r1.size(), 1u);
    ASSERT_EQ(r3.size(), 3u);
    for (const StepReport& r : r3) {
      // The same bits on every daemon of either layout.
      EXPECT_EQ(std::memcmp(&r.grad_norm, &r1[0].grad_norm, sizeof(double)), 0)
          << "step " << step << ": " << r.grad_norm << " vs " << r1[0].grad_norm;
      EXPECT_EQ(r.clip_factor, r1[0].clip_factor);
      EXPECT_EQ(r.lr, r1[0].lr);
      EXPECT_EQ(r.optimizer_steps, step + 1);
    }
    EXPECT_NEAR(r1[0].grad_norm, norm, 1e-6 * norm) << "step " << step;
    EXPECT_NEAR(r1[0].lr, ref.Lr(step + 1), 1e-12) << "step " << step;
    if (r1[0].clip_factor < 1.0f) ++clipped;
  }
  EXPECT_GE(clipped, kSteps / 2 - 1);  // the large steps were clipped
  EXPECT_LE(clipped, kSteps / 2);      // the small ones were not
  for (int t = 0; t < static_cast<int>(model.size()); ++t) {
    const std::vector<float> a = single.Master(t, model[t]);
    const std::vector<float> b = three.Master(t, model[t]);
    ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << model[t].name;
    double max_err = 0.0;
    double max_move = 0.0;
    for (size_t k = 0; k < a.size(); ++k) {
      max_err = std::max(max_err, std::fabs(a[k] - ref.w[t][k]));
      max_move = std::max(max_move, std::fabs(double(a[k]) - init[t][k]));
    }
    EXPECT_LT(max_err, 2e-6) << model[t].name;
    if (model[t].optimizer.frozen) {
      EXPECT_EQ(max_move, 0.0) << model[t].name << " is frozen";
    } else {
      EXPECT_GT(max_move, 1e-3) << model[t].name << " did not move";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Optimizers, OptimizerStepTest,
                         ::testing::Values(Case{"AdamWWarmupCosine", AdamWCosine()},
                                           Case{"SgdMomentumWarmupLinear", SgdLinear()}),
                         [](const auto& info) { return std::string(info.param.name); });

// A NaN gradient with non_finite: SKIP_STEP: the version advances with the
// masters and moments unchanged, the skip is counted, the step counter (bias
// correction, schedule) does not move; the next finite step goes on.
TEST(OptimizerSkipStepTest, NanSkipsTheStepOnEveryDaemon) {
  OptimizerOptions o = AdamWCosine();
  o.non_finite = NonFinitePolicy::kSkipStep;
  const std::vector<TensorDef> model = Model();
  const auto init = Random(model, 1, 0.5f);
  World three(model, {ThreeDaemonShards(0), ThreeDaemonShards(1), ThreeDaemonShards(2)}, o, init);
  Reference ref{o, model, {}, {}, {}};
  for (const auto& x : init) {
    ref.w.emplace_back(x.begin(), x.end());
    ref.m.emplace_back(x.size(), 0.0);
    ref.v.emplace_back(x.size(), 0.0);
  }
  for (int step = 0; step < 4; ++step) {
    std::vector<std::vector<std::vector<float>>> pushes;
    for (int p = 0; p < kPushers; ++p) pushes.push_back(Random(model, 7 + 10 * step + p, 0.1f));
    // Step 1: one NaN in a row held by daemon 2 only.
    if (step == 1) pushes[1][2][200 * 300 + 7] = std::nanf("");
    std::vector<std::vector<float>> before;
    for (int t = 0; t < 4; ++t) before.push_back(three.Master(t, model[t]));
    three.Push(pushes);
    const std::vector<StepReport> r = three.Step(step + 1);
    ref.Step(pushes);
    for (const StepReport& x : r) {
      EXPECT_EQ(x.skipped_steps, step >= 1 ? 1 : 0);
      EXPECT_EQ(x.optimizer_steps, step >= 1 ? step : step + 1);
      if (step == 1) {
        EXPECT_TRUE(std::isnan(x.grad_norm));
      }
    }
    for (int t = 0; t < 4; ++t) {
      const std::vector<float> after = three.Master(t, model[t]);
      const bool same = std::memcmp(after.data(), before[t].data(), after.size() * 4) == 0;
      EXPECT_EQ(same, step == 1 || model[t].optimizer.frozen) << "step " << step << " " << t;
    }
  }
  for (int t = 0; t < 4; ++t) {
    const std::vector<float> a = three.Master(t, model[t]);
    for (size_t k = 0; k < a.size(); ++k) ASSERT_NEAR(a[k], ref.w[t][k], 2e-6) << t << " " << k;
  }
  // The accumulators were cleared by the skipped step (no NaN left behind).
  for (const auto& set : three.daemons) {
    for (size_t i = 0; i < set->shards().size(); ++i) {
      for (float g : set->gradient(static_cast<int>(i))) ASSERT_EQ(g, 0.0f);
    }
  }
}

// With non_finite: REFUSE (the default) the norm is not needed and not
// reported without clipping; with clipping on it is.
TEST(OptimizerSkipStepTest, NormOnlyWhenNeeded) {
  OptimizerOptions o;
  EXPECT_FALSE(o.needs_grad_norm());
  o.max_grad_norm = 1.0f;
  EXPECT_TRUE(o.needs_grad_norm());
  o.max_grad_norm = 0.0f;
  o.non_finite = NonFinitePolicy::kSkipStep;
  EXPECT_TRUE(o.needs_grad_norm());
}

}  // namespace
}  // namespace paramd
