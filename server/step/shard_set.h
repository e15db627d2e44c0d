// File: server/step/shard_set.h
//
// The compute state of one daemon, without any RPC: for every shard (a row
// range of a tensor that this daemon owns) the FP32 master, the optimizer
// state and the FP32 gradient accumulator; for every tensor with a piece
// here the per-direction delayed-scaling state; and the daemon's step
// on the CPU (optimizer, partial amaxes, all-reduce MAX across daemons,
// scaling update, quantization per the tensor's HybridSpec with the CPU
// reference of kernels/reference.h).
//
// A step is transactional: it computes into new buffers and commits them
// only if everything (including the all-reduce) succeeded, so a failed step
// changes nothing and can be retried.
//
// Threading: not thread-safe. The daemon calls it from one step thread and
// serialises gradient accumulation with its own mutex. PublishedVersion
// objects are immutable once returned and may be read from any thread.
#ifndef PARAMD_SERVER_STEP_SHARD_SET_H_
#define PARAMD_SERVER_STEP_SHARD_SET_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/format.h"
#include "server/step/optimizer.h"
#include "server/step/state_sink.h"

namespace paramd {

// All-reduce MAX of `values` across every daemon, in place. Blocking; every
// daemon calls it the same number of times with vectors of equal length
// (the manifest fixes the length). A failure aborts the step.
using AllReduceMaxFn = std::function<absl::Status(absl::Span<float> values)>;

// One tensor of the manifest, as the daemon sees it.
struct TensorDef {
  std::string name;
  int64_t rows = 0;
  int64_t cols = 0;
  HybridSpec spec;
  TensorOptimizer optimizer;  // the recipe rule's overrides (none by default)
};

// Rows [row_begin, row_end) of manifest tensor `tensor`.
struct ShardDef {
  int tensor = 0;
  int64_t row_begin = 0;
  int64_t row_end = 0;

  int64_t rows() const { return row_end - row_begin; }
};

// One published direction of one shard: the QuantizedTensor of the shard's
// rows, quantized with the tensor's global scaling. For per-tensor FP8 and
// NVFP4 `q.amax` is the tensor's global amax of that direction.
struct PublishedPiece {
  int shard = 0;  // index into ShardSet::shards()
  int tensor = 0;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  Direction direction = Direction::kRowwise;
  Layout layout;
  QuantizedTensor q;
  float scale = 1.0f;  // per-tensor FP8: the multiplier used for the cast
};

// Per-tensor scaling numbers after a step (identical on every daemon that
// holds a piece of the tensor).
struct TensorScalingInfo {
  bool held = false;  // this daemon holds a piece of the tensor
  float rowwise_scale = 1.0f;
  float rowwise_amax = 0.0f;
  float columnwise_scale = 1.0f;
  float columnwise_amax = 0.0f;
};

// The optimizer's side of the step that produced a version (DaemonStats).
struct StepReport {
  int64_t optimizer_steps = 0;  // applied so far, this version's included
  int64_t skipped_steps = 0;    // skipped for a non-finite norm (skip_step)
  double lr = 0.0;              // base lr(t) of the last applied step
  double grad_norm = -1.0;      // global norm of the last step; -1: not computed
  float clip_factor = 1.0f;     // applied to the last step's gradients
};

// The quantized buffers of one version. Immutable.
struct PublishedVersion {
  int64_t version = -1;
  std::vector<PublishedPiece> pieces;      // by (shard, direction)
  std::vector<TensorScalingInfo> tensors;  // by manifest index
  StepReport report;
};

// The global gradient norm^2 of the step about to run (server/step/grad_norm.h)
// from `row_sum_sq[i]`, the row sums of every row of shard i: this daemon's
// slots, gathered by one `all_reduce` call (every daemon makes it).
// InvalidArgument for a non-frozen shard not aligned to 128 rows.
absl::StatusOr<double> GlobalGradSumSq(const std::vector<TensorDef>& tensors,
                                       const std::vector<ShardDef>& shards,
                                       const std::vector<std::vector<double>>& row_sum_sq,
                                       const AllReduceMaxFn& all_reduce);

class ShardSet : public ShardStateSink {
 public:
  // InvalidArgument for a shard outside its tensor, overlapping shards, or
  // an invalid optimizer. Masters start at zero (see master()).
  static absl::StatusOr<std::unique_ptr<ShardSet>> Create(std::vector<TensorDef> tensors,
                                                          std::vector<ShardDef> shards,
                                                          const OptimizerOptions& optimizer);

  const std::vector<TensorDef>& tensors() const override { return tensors_; }
  const std::vector<ShardDef>& shards() const override { return shards_; }
  // Index of the shard of `tensor` containing rows [row_begin, row_end), or
  // -1 if no single shard here contains them.
  int FindShard(int tensor, int64_t row_begin, int64_t row_end) const;

  // Row-major [rows][cols] FP32 values of shard `i`; writable for loading.
  absl::Span<float> master(int i) { return absl::MakeSpan(masters_[i]); }
  absl::Span<const float> master(int i) const { return masters_[i]; }
  // The gradient accumulator of shard `i` (zeroed by every successful step).
  absl::Span<float> gradient(int i) { return absl::MakeSpan(grads_[i]); }
  // Adds `values` into gradient(i) from element `offset` on. With
  // `last_pusher` (the push that completes the version) and a config that
  // needs the gradient norm, the row sums of the rows it covers are taken in
  // the same pass (server/step/grad_norm.h); Step computes the others.
  absl::Status AccumulateGradient(int i, int64_t offset, absl::Span<const float> values,
                                  bool last_pusher);
  const OptimizerState& optimizer_state(int i) const { return opt_[i]; }
  // Delayed-scaling state of tensor `t`, per direction (meaningful only for
  // FP8 delayed formats of tensors held here).
  const DelayedScalingState& delayed_state(int t, Direction d) const;
  // Number of optimizer steps applied so far.
  int64_t optimizer_steps() const { return optimizer_steps_; }
  const OptimizerOptions& optimizer() const override { return optimizer_; }
  // Steps skipped for a non-finite gradient norm (non_finite: SKIP_STEP).
  int64_t skipped_steps() const { return skipped_steps_; }
  // A new config for the next steps (SetOptimizerSchedule): the kind must
  // stay (InvalidArgument otherwise; the moments belong to it).
  absl::Status SetOptimizer(const OptimizerOptions& optimizer);

  // Restore (checkpoint/): state saved by an earlier run. Shapes must match
  // (the optimizer moments may also be empty).
  absl::Status SetOptimizerState(int shard, OptimizerState state);
  void SetDelayedState(int tensor, Direction d, DelayedScalingState state);
  void SetOptimizerSteps(int64_t steps) { optimizer_steps_ = steps; }
  void SetSkippedSteps(int64_t steps) { skipped_steps_ = steps; }

  // ShardStateSink (server/step/state_sink.h): the Set* calls above.
  absl::Status RestoreOptimizer(const OptimizerOptions& optimizer) override {
    return SetOptimizer(optimizer);
  }
  absl::Status RestoreMaster(int shard, absl::Span<const float> values) override;
  absl::Status RestoreOptimizerState(int shard, absl::Span<const float> m,
                                     absl::Span<const float> v) override {
    if (shard < 0 || shard >= static_cast<int>(masters_.size())) {
      return absl::InvalidArgumentError("optimizer state of a shard not held here");
    }
    OptimizerState state;
    state.m.assign(m.begin(), m.end());
    state.v.assign(v.begin(), v.end());
    return SetOptimizerState(shard, std::move(state));
  }
  absl::Status RestoreDelayedState(int tensor, Direction d, DelayedScalingState state) override {
    SetDelayedState(tensor, d, std::move(state));
    return absl::OkStatus();
  }
  absl::Status RestoreStepCounts(int64_t optimizer_steps, int64_t skipped_steps) override {
    if (optimizer_steps >= 0) optimizer_steps_ = optimizer_steps;
    if (skipped_steps >= 0) skipped_steps_ = skipped_steps;
    return absl::OkStatus();
  }

  // Produces version `new_version`: if `apply_optimizer`, one optimizer step
  // with the accumulated gradients first (then the accumulators are zeroed):
  // lr from the schedule and each tensor's overrides, frozen tensors left
  // alone, the gradients clipped by the global norm (one all_reduce call
  // before the optimizer when the config needs the norm), or no update at
  // all (skip_step) when that norm is not finite;
  // then partial amaxes, `all_reduce` (once, or twice when a
  // rowwise_dequantized columnwise copy needs the global rowwise scale of a
  // current-scaling/NVFP4 rowwise copy), scaling update and quantization.
  // On error nothing changes. With `update_delayed` false the delayed
  // scaling state is left as is (republishing a restored version).
  absl::StatusOr<std::shared_ptr<const PublishedVersion>> Step(int64_t new_version,
                                                               bool apply_optimizer,
                                                               const AllReduceMaxFn& all_reduce,
                                                               bool update_delayed = true);

 private:
  // The per-bucket step of server/step/step_pipeline.h reads and commits this
  // state the way Step does.
  friend class PipelinedStepper;
  ShardSet() = default;

  std::vector<TensorDef> tensors_;
  std::vector<ShardDef> shards_;
  OptimizerOptions optimizer_;
  std::vector<std::vector<float>> masters_;
  std::vector<std::vector<float>> grads_;
  std::vector<OptimizerState> opt_;
  // [tensor][direction]
  std::vector<std::array<DelayedScalingState, 2>> delayed_;
  int64_t optimizer_steps_ = 0;
  int64_t skipped_steps_ = 0;
  // Per shard: the row sums of squares taken by the last pusher's adds,
  // and how many rows they cover (== rows: Step needs no pass of its own).
  std::vector<std::vector<double>> row_sum_sq_;
  std::vector<int64_t> fresh_rows_;
  StepReport last_report_;
};

}  // namespace paramd

#endif  // PARAMD_SERVER_STEP_SHARD_SET_H_
