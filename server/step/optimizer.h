// File: server/step/optimizer.h
//
// The optimizers a daemon applies to its FP32 master shards on the CPU:
// AdamW (decoupled weight decay, bias-corrected, torch.optim.AdamW's
// algorithm) and SGD with momentum (torch.optim.SGD, dampening 0, no
// Nesterov).
//
// One arithmetic for the host and the device: the GPU kernels
// (kernels/cuda/optimizer_math.cuh, per-step constants folded by
// kernels/cuda/optimizer.cc) produce exactly these bits. Per-step constants
// are folded in float64 from the float options and rounded once to float
// (FoldAdamW); every per-element operation is one IEEE float operation
// (explicit fmaf where the device uses __fmaf_rn, correctly rounded sqrt and
// division, no contraction: this file is built with -std=c++17, i.e.
// -ffp-contract=off, and no fast math).
//
// Pure functions over caller-owned spans; thread-safe; no allocation.
#ifndef PARAMD_SERVER_STEP_OPTIMIZER_H_
#define PARAMD_SERVER_STEP_OPTIMIZER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/adamw_fold.h"

namespace paramd {

enum class OptimizerKind : uint8_t { kAdamW = 0, kSgd = 1 };

// The learning-rate schedule by optimizer step (proto/optimizer.proto
// LrSchedule gives the formulas; ScheduledLr computes them).
enum class LrDecay : uint8_t { kConstant = 0, kLinear = 1, kCosine = 2 };
struct LrSchedule {
  int64_t warmup_steps = 0;
  LrDecay decay = LrDecay::kConstant;
  int64_t decay_steps = 0;
  float min_lr = 0.0f;
};

// What a step does with a non-finite gradient (proto NonFinitePolicy).
enum class NonFinitePolicy : uint8_t { kRefuse = 0, kSkipStep = 1 };

// The cluster's optimizer config (the coordinator's; proto/optimizer.proto
// OptimizerConfig, converted by server/step/optimizer_config.h).
struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::kAdamW;
  float lr = 1e-3f;
  // AdamW.
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  // AdamW: decoupled (w *= 1 - lr * weight_decay). SGD: added to the
  // gradient (g += weight_decay * w), as PyTorch does.
  float weight_decay = 0.0f;
  // SGD momentum (0 = plain SGD).
  float momentum = 0.0f;
  LrSchedule schedule;
  // > 0: global-norm gradient clipping (proto OptimizerConfig.max_grad_norm).
  float max_grad_norm = 0.0f;
  NonFinitePolicy non_finite = NonFinitePolicy::kRefuse;

  // Whether a step needs the global gradient norm (clipping or skip_step).
  bool needs_grad_norm() const {
    return max_grad_norm > 0.0f || non_finite == NonFinitePolicy::kSkipStep;
  }
};

// One tensor's optimizer overrides (recipe Rule.optimizer, resolved by the
// coordinator into the manifest).
struct TensorOptimizer {
  float lr_multiplier = 1.0f;
  std::optional<float> weight_decay;  // unset: the config's
  bool frozen = false;                // never updated; left out of the gradient norm
};

// The per-tensor numbers of one optimizer step.
struct StepHyper {
  double lr = 1e-3;  // schedule * lr_multiplier, float64
  float weight_decay = 0.0f;
  // Multiplies every gradient element before the update (float multiply;
  // the clip factor). Identity at 1.
  float grad_scale = 1.0f;
};

// lr(t) of 1-based optimizer step `step` (float64, proto/optimizer.proto).
double ScheduledLr(const OptimizerOptions& options, int64_t step);

// The hyperparameters of tensor `t` at step `step` with clip factor
// `grad_scale`.
StepHyper TensorStepHyper(const OptimizerOptions& options, const TensorOptimizer& t, int64_t step,
                          float grad_scale);

// The clip factor of a global gradient norm^2 `sum_sq`: min(1, max_grad_norm
// / (sqrt(sum_sq) + 1e-6)) in float64 rounded to float; 1 without clipping
// or for a non-finite sum (the step is then skipped or, with REFUSE, taken
// unclipped as before clipping existed).
float ClipFactor(const OptimizerOptions& options, double sum_sq);

// "adamw" or "sgd"; InvalidArgument otherwise.
absl::StatusOr<OptimizerKind> ParseOptimizerKind(absl::string_view name);
absl::string_view OptimizerName(OptimizerKind kind);

// InvalidArgument for a negative or non-finite lr, betas outside [0, 1), ...
absl::Status ValidateOptimizerOptions(const OptimizerOptions& options);

// Optimizer state of one shard: AdamW keeps exp_avg (m) and exp_avg_sq (v);
// SGD keeps the momentum buffer in `m` (v stays empty). Sized lazily by
// ApplyOptimizer.
struct OptimizerState {
  std::vector<float> m;
  std::vector<float> v;
};

// AdamW constants of step `step` (1-based): kernels/adamw_fold.h's fold
// (the one the device optimizer uses too) of the float options.
AdamWConstants FoldAdamW(const OptimizerOptions& options, int64_t step);
// The same with a tensor's step numbers (lr, weight decay).
AdamWConstants FoldAdamW(const OptimizerOptions& options, const StepHyper& hyper, int64_t step);

// One step on `master` with `grad` (same size). `step` is the 1-based
// number of this optimizer step (bias correction; SGD's first momentum step
// copies the gradient).
void ApplyOptimizer(const OptimizerOptions& options, int64_t step, absl::Span<float> master,
                    absl::Span<const float> grad, OptimizerState& state);
// The same with per-tensor numbers (schedule, overrides, clip factor):
// ApplyOptimizer is this with {options.lr, options.weight_decay, 1}.
void ApplyOptimizerStep(const OptimizerOptions& options, const StepHyper& hyper, int64_t step,
                        absl::Span<float> master, absl::Span<const float> grad,
                        OptimizerState& state);

}  // namespace paramd

#endif  // PARAMD_SERVER_STEP_OPTIMIZER_H_
