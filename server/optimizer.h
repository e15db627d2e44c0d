// File: server/optimizer.h
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
#ifndef PARAMD_SERVER_OPTIMIZER_H_
#define PARAMD_SERVER_OPTIMIZER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/adamw_fold.h"

namespace paramd {

enum class OptimizerKind : uint8_t { kAdamW = 0, kSgd = 1 };

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
};

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

// One step on `master` with `grad` (same size). `step` is the 1-based
// number of this optimizer step (bias correction; SGD's first momentum step
// copies the gradient).
void ApplyOptimizer(const OptimizerOptions& options, int64_t step, absl::Span<float> master,
                    absl::Span<const float> grad, OptimizerState& state);

}  // namespace paramd

#endif  // PARAMD_SERVER_OPTIMIZER_H_
