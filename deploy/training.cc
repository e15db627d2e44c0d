#include "deploy/training.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace paramd {
namespace demo {

std::pair<int64_t, int64_t> TrainerSlice(const TrainSchedule& schedule, int64_t rank) {
  const int64_t n = schedule.batch_size;
  const int64_t t = schedule.num_trainers;
  return {n * rank / t, n * (rank + 1) / t};
}

absl::StatusOr<BaselineRun> TrainBaseline(const ModelConfig& model, const TrainSchedule& schedule,
                                          const OptimizerOptions& optimizer) {
  ASSIGN_OR_RETURN(const std::vector<WeightShape> shapes, ModelShapes(model));
  BaselineRun run;
  ASSIGN_OR_RETURN(run.weights, InitialWeights(model));
  RETURN_IF_ERROR(ValidateOptimizerOptions(optimizer));
  std::vector<OptimizerState> states(shapes.size());
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
    // Schedule and global-norm clipping as the daemons apply them (the
    // norm in float64 over every weight's summed gradient).
    double sum_sq = 0;
    for (const std::vector<float>& g : sum) {
      for (float x : g) sum_sq += static_cast<double>(x) * x;
    }
    const float clip = ClipFactor(optimizer, sum_sq);
    for (size_t l = 0; l < shapes.size(); ++l) {
      ApplyOptimizerStep(optimizer, TensorStepHyper(optimizer, TensorOptimizer(), step + 1, clip),
                         step + 1, absl::MakeSpan(run.weights[l]), sum[l], states[l]);
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
