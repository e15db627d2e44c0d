// File: deploy/training.h
//
// The demo's training schedule (how a step's batch is split between data-
// parallel trainers) and the in-process FP32 baseline:
// the same model, data, seeds, batch split and optimizer as the distributed
// demo, but with FP32 weights in both GEMMs. The demo compares its final
// loss against this baseline.
//
// Pure, deterministic host code. Thread-compatible.
#ifndef PARAMD_DEPLOY_TRAINING_H_
#define PARAMD_DEPLOY_TRAINING_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "deploy/model.h"
#include "server/step/optimizer.h"

namespace paramd {
namespace demo {

struct TrainSchedule {
  int64_t steps = 40;
  int64_t batch_size = 256;  // global batch per step (all trainers)
  int64_t num_trainers = 2;
  int64_t eval_batch_size = 1024;
};

// Samples [first, second) of each step's batch that trainer `rank` owns:
// contiguous, near-equal slices in rank order. Every trainer normalizes its
// gradients by the global batch size, so the daemons' sum is the gradient
// of the global mean loss.
std::pair<int64_t, int64_t> TrainerSlice(const TrainSchedule& schedule, int64_t rank);

struct BaselineRun {
  // losses[t] = mean loss of step t's batch under the weights of version t
  // (the weights before update t), as the distributed trainers report it.
  std::vector<double> losses;
  double eval_loss = 0;                     // final weights on SyntheticTask::MakeEvalBatch
  std::vector<std::vector<float>> weights;  // final FP32 weights
};

// Trains from InitialWeights(model) with FP32 weights, splitting every batch
// as the trainers do, summing their gradients in rank order, and applying
// the daemons' own optimizer code (server/step/optimizer.h) with `optimizer`.
absl::StatusOr<BaselineRun> TrainBaseline(const ModelConfig& model, const TrainSchedule& schedule,
                                          const OptimizerOptions& optimizer);

// Mean of the last `count` entries (or all of them, if fewer).
double TailMean(const std::vector<double>& values, size_t count);

}  // namespace demo
}  // namespace paramd

#endif  // PARAMD_DEPLOY_TRAINING_H_
