#include "deploy/training.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace paramd {
namespace demo {

std::pair<int64_t, int64_t> TrainerSlice(const TrainSchedule& schedule, int64_t rank) {
  const int64_t n = schedule.batch_size;
  const int64_t t = schedule.num_trainers;
  return {n * rank / t, n * (rank + 1) / t};
}

HostOptimizer::HostOptimizer(const OptimizerSpec& spec, const std::vector<int64_t>& sizes)
    : spec_(spec), steps_(sizes.size(), 0) {
  for (int64_t size : sizes) {
    m_.emplace_back(size, 0.0f);
    v_.emplace_back(spec.kind == OptimizerSpec::Kind::kAdamW ? size : 0, 0.0f);
  }
}

absl::Status HostOptimizer::Step(size_t index, absl::Span<float> weights,
                                 absl::Span<const float> grads) {
  if (index >= m_.size() || weights.size() != m_[index].size() ||
      grads.size() != weights.size()) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer: bad tensor ", index));
  }
  const int64_t step = ++steps_[index];
  std::vector<float>& m = m_[index];
  const float lr = spec_.learning_rate;
  if (spec_.kind == OptimizerSpec::Kind::kSgdMomentum) {
    for (size_t i = 0; i < weights.size(); ++i) {
      float g = grads[i] + spec_.weight_decay * weights[i];
      m[i] = step == 1 ? g : spec_.momentum * m[i] + g;
      weights[i] -= lr * m[i];
    }
    return absl::OkStatus();
  }
  std::vector<float>& v = v_[index];
  const float b1 = spec_.beta1;
  const float b2 = spec_.beta2;
  const float bias1 = 1.0f - std::pow(b1, static_cast<float>(step));
  const float bias2_sqrt = std::sqrt(1.0f - std::pow(b2, static_cast<float>(step)));
  for (size_t i = 0; i < weights.size(); ++i) {
    const float g = grads[i];
    weights[i] *= 1.0f - lr * spec_.weight_decay;
    m[i] = b1 * m[i] + (1.0f - b1) * g;
    v[i] = b2 * v[i] + (1.0f - b2) * g * g;
    const float denom = std::sqrt(v[i]) / bias2_sqrt + spec_.epsilon;
    weights[i] -= (lr / bias1) * m[i] / denom;
  }
  return absl::OkStatus();
}

absl::StatusOr<BaselineRun> TrainBaseline(const ModelConfig& model,
                                          const TrainSchedule& schedule,
                                          const OptimizerSpec& optimizer) {
  ASSIGN_OR_RETURN(const std::vector<WeightShape> shapes, ModelShapes(model));
  BaselineRun run;
  ASSIGN_OR_RETURN(run.weights, InitialWeights(model));
  std::vector<int64_t> sizes;
  for (const WeightShape& s : shapes) sizes.push_back(s.size());
  HostOptimizer opt(optimizer, sizes);
  const SyntheticTask task(model);
  for (int64_t step = 0; step < schedule.steps; ++step) {
    const Batch batch = task.MakeBatch(step, schedule.batch_size);
    const WeightViews views = ViewsOf(run.weights);
    std::vector<std::vector<float>> sum;
    double loss_sum = 0;
    for (int64_t rank = 0; rank < schedule.num_trainers; ++rank) {
      const auto [begin, end] = TrainerSlice(schedule, rank);
      ASSIGN_OR_RETURN(StepGradients g, ComputeGradients(model, views, views, batch, begin, end,
                                                         schedule.batch_size));
      loss_sum += g.loss_sum;
      if (sum.empty()) {
        sum = std::move(g.weight_grads);
        continue;
      }
      for (size_t l = 0; l < sum.size(); ++l) {
        for (size_t i = 0; i < sum[l].size(); ++i) sum[l][i] += g.weight_grads[l][i];
      }
    }
    run.losses.push_back(loss_sum / schedule.batch_size);
    for (size_t l = 0; l < shapes.size(); ++l) {
      RETURN_IF_ERROR(opt.Step(l, absl::MakeSpan(run.weights[l]), sum[l]));
    }
  }
  ASSIGN_OR_RETURN(run.eval_loss, MeanLoss(model, ViewsOf(run.weights),
                                           task.MakeEvalBatch(schedule.eval_batch_size)));
  return run;
}

double TailMean(const std::vector<double>& values, size_t count) {
  if (values.empty()) return 0;
  const size_t n = std::min(count, values.size());
  double sum = 0;
  for (size_t i = values.size() - n; i < values.size(); ++i) sum += values[i];
  return sum / n;
}

}  // namespace demo
}  // namespace paramd
