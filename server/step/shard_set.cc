#include "server/step/shard_set.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/reference.h"
#include "server/step/grad_norm.h"
#include "server/step/step_scaling.h"

namespace paramd {
namespace {

constexpr int kRow = 0;
constexpr int kCol = 1;

using step_scaling::ColumnwiseNeedsReduce;
using step_scaling::ColumnwiseNeedsSecondRound;
using step_scaling::DirectionScaling;
using step_scaling::InitialDelayed;
using step_scaling::RowwiseNeedsReduce;

}  // namespace

absl::StatusOr<double> GlobalGradSumSq(const std::vector<TensorDef>& tensors,
                                       const std::vector<ShardDef>& shards,
                                       const std::vector<std::vector<double>>& row_sum_sq,
                                       const AllReduceMaxFn& all_reduce) {
  std::vector<int64_t> rows;
  std::vector<bool> frozen;
  for (const TensorDef& t : tensors) {
    rows.push_back(t.rows);
    frozen.push_back(t.optimizer.frozen);
  }
  const GradNormSlots slots = MakeGradNormSlots(rows, frozen);
  std::vector<float> encoded(kGradNormFloatsPerSlot * slots.num_slots, 0.0f);
  for (size_t i = 0; i < shards.size(); ++i) {
    const ShardDef& d = shards[i];
    if (tensors[d.tensor].optimizer.frozen) continue;
    if (d.row_begin % kGradNormBlockRows != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradient norm: shard of ", tensors[d.tensor].name, " starts at row ",
                       d.row_begin, ", not a multiple of ", kGradNormBlockRows));
    }
    const std::vector<double>& r = row_sum_sq[i];
    for (int64_t b0 = 0; b0 < d.rows(); b0 += kGradNormBlockRows) {
      double block = 0.0;
      const int64_t b1 = std::min(d.rows(), b0 + kGradNormBlockRows);
      for (int64_t row = b0; row < b1; ++row) block += r[row];
      const int64_t slot = slots.slot_begin[d.tensor] + (d.row_begin + b0) / kGradNormBlockRows;
      EncodeGradNormSlot(block, &encoded[kGradNormFloatsPerSlot * slot]);
    }
  }
  absl::Status s = all_reduce(absl::MakeSpan(encoded));
  if (!s.ok()) {
    return absl::AbortedError(absl::StrCat("gradient norm all-reduce failed: ", s.message()));
  }
  return SumGradNormSlots(encoded);
}

absl::StatusOr<std::unique_ptr<ShardSet>> ShardSet::Create(std::vector<TensorDef> tensors,
                                                           std::vector<ShardDef> shards,
                                                           const OptimizerOptions& optimizer) {
  RETURN_IF_ERROR(ValidateOptimizerOptions(optimizer));
  std::unique_ptr<ShardSet> s(new ShardSet());
  for (const TensorDef& t : tensors) {
    if (t.rows < 1 || t.cols < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", t.name, ": bad shape [", t.rows, ", ", t.cols, "]"));
    }
  }
  std::vector<ShardDef> sorted = std::move(shards);
  std::sort(sorted.begin(), sorted.end(), [](const ShardDef& a, const ShardDef& b) {
    return std::make_pair(a.tensor, a.row_begin) < std::make_pair(b.tensor, b.row_begin);
  });
  for (size_t i = 0; i < sorted.size(); ++i) {
    const ShardDef& d = sorted[i];
    if (d.tensor < 0 || d.tensor >= static_cast<int>(tensors.size()) || d.row_begin < 0 ||
        d.row_end <= d.row_begin || d.row_end > tensors[d.tensor].rows) {
      return absl::InvalidArgumentError(absl::StrCat("bad shard: tensor ", d.tensor, " rows [",
                                                     d.row_begin, ", ", d.row_end, ")"));
    }
    if (i > 0 && sorted[i - 1].tensor == d.tensor && sorted[i - 1].row_end > d.row_begin) {
      return absl::InvalidArgumentError(
          absl::StrCat("overlapping shards of tensor ", tensors[d.tensor].name));
    }
  }
  s->tensors_ = std::move(tensors);
  s->shards_ = std::move(sorted);
  s->optimizer_ = optimizer;
  for (const ShardDef& d : s->shards_) {
    const size_t n = static_cast<size_t>(d.rows() * s->tensors_[d.tensor].cols);
    s->masters_.emplace_back(n, 0.0f);
    s->grads_.emplace_back(n, 0.0f);
    s->opt_.emplace_back();
    s->row_sum_sq_.emplace_back(d.rows(), 0.0);
    s->fresh_rows_.push_back(0);
  }
  for (const TensorDef& t : s->tensors_) {
    s->delayed_.push_back({InitialDelayed(t.spec.rowwise), InitialDelayed(t.spec.columnwise)});
  }
  return s;
}

int ShardSet::FindShard(int tensor, int64_t row_begin, int64_t row_end) const {
  for (size_t i = 0; i < shards_.size(); ++i) {
    const ShardDef& d = shards_[i];
    if (d.tensor == tensor && d.row_begin <= row_begin && row_end <= d.row_end &&
        row_begin < row_end) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

const DelayedScalingState& ShardSet::delayed_state(int t, Direction d) const {
  return delayed_[t][d == Direction::kRowwise ? kRow : kCol];
}

absl::Status ShardSet::RestoreMaster(int shard, absl::Span<const float> values) {
  if (shard < 0 || shard >= static_cast<int>(masters_.size()) ||
      values.size() != masters_[shard].size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "master of ", values.size(), " values for shard ", shard, " (",
        shard >= 0 && shard < static_cast<int>(masters_.size()) ? masters_[shard].size() : 0,
        " here)"));
  }
  std::copy(values.begin(), values.end(), masters_[shard].begin());
  return absl::OkStatus();
}

absl::Status ShardSet::SetOptimizerState(int shard, OptimizerState state) {
  const size_t n = masters_.at(shard).size();
  if ((!state.m.empty() && state.m.size() != n) || (!state.v.empty() && state.v.size() != n)) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer state of shard ", shard, " has ",
                                                   state.m.size(), "/", state.v.size(),
                                                   " values, want ", n));
  }
  opt_[shard] = std::move(state);
  return absl::OkStatus();
}

absl::Status ShardSet::AccumulateGradient(int i, int64_t offset, absl::Span<const float> values,
                                          bool last_pusher) {
  absl::Span<float> g = gradient(i);
  if (offset < 0 || offset + values.size() > g.size()) {
    return absl::InvalidArgumentError("gradient piece outside its shard");
  }
  const int64_t cols = tensors_[shards_[i].tensor].cols;
  const int64_t n = static_cast<int64_t>(values.size());
  float* dst = g.data() + offset;
  if (!last_pusher || !optimizer_.needs_grad_norm() || offset % cols != 0 || n % cols != 0) {
    for (int64_t k = 0; k < n; ++k) dst[k] += values[k];
    return absl::OkStatus();
  }
  // Row by row: the row sum reads the row just written (still in cache).
  for (int64_t r = 0; r < n / cols; ++r) {
    float* row = dst + r * cols;
    const float* add = values.data() + r * cols;
    for (int64_t k = 0; k < cols; ++k) row[k] += add[k];
    row_sum_sq_[i][offset / cols + r] = RowSumSq(row, cols);
  }
  fresh_rows_[i] += n / cols;
  return absl::OkStatus();
}

absl::Status ShardSet::SetOptimizer(const OptimizerOptions& optimizer) {
  RETURN_IF_ERROR(ValidateOptimizerOptions(optimizer));
  if (optimizer.kind != optimizer_.kind) {
    return absl::InvalidArgumentError(absl::StrCat("the loaded model steps with ",
                                                   OptimizerName(optimizer_.kind), ", not ",
                                                   OptimizerName(optimizer.kind)));
  }
  optimizer_ = optimizer;
  return absl::OkStatus();
}

void ShardSet::SetDelayedState(int tensor, Direction d, DelayedScalingState state) {
  delayed_.at(tensor)[d == Direction::kRowwise ? kRow : kCol] = std::move(state);
}

absl::StatusOr<std::shared_ptr<const PublishedVersion>> ShardSet::Step(
    int64_t new_version, bool apply_optimizer, const AllReduceMaxFn& all_reduce,
    bool update_delayed) {
  const int num_tensors = static_cast<int>(tensors_.size());
  const int num_shards = static_cast<int>(shards_.size());

  // 1. Optimizer, into copies (committed at the end); first the global
  // gradient norm if the config needs it.
  StepReport report = last_report_;
  bool skip = false;
  if (apply_optimizer && optimizer_.needs_grad_norm()) {
    for (int i = 0; i < num_shards; ++i) {
      if (fresh_rows_[i] == shards_[i].rows()) continue;
      const int64_t cols = tensors_[shards_[i].tensor].cols;
      for (int64_t r = 0; r < shards_[i].rows(); ++r) {
        row_sum_sq_[i][r] = RowSumSq(grads_[i].data() + r * cols, cols);
      }
      fresh_rows_[i] = shards_[i].rows();
    }
    ASSIGN_OR_RETURN(const double sum_sq,
                     GlobalGradSumSq(tensors_, shards_, row_sum_sq_, all_reduce));
    report.grad_norm = std::sqrt(sum_sq);
    report.clip_factor = ClipFactor(optimizer_, sum_sq);
    skip = !std::isfinite(sum_sq) && optimizer_.non_finite == NonFinitePolicy::kSkipStep;
  }
  std::vector<std::vector<float>> masters = masters_;
  std::vector<OptimizerState> opt = opt_;
  if (apply_optimizer && !skip) {
    const int64_t step = optimizer_steps_ + 1;
    for (int i = 0; i < num_shards; ++i) {
      const TensorOptimizer& t = tensors_[shards_[i].tensor].optimizer;
      if (t.frozen) continue;
      ApplyOptimizerStep(optimizer_, TensorStepHyper(optimizer_, t, step, report.clip_factor), step,
                         absl::MakeSpan(masters[i]), grads_[i], opt[i]);
    }
    report.lr = ScheduledLr(optimizer_, step);
  }

  // 2. Partial amaxes, packed as [tensor][direction]; tensors without a
  // piece here contribute 0. Which rounds run depends on the manifest only,
  // so every daemon makes the same all-reduce calls.
  std::vector<float> amax(2 * num_tensors, 0.0f);
  bool round1 = false;
  bool round2 = false;
  for (const TensorDef& t : tensors_) {
    round1 |= RowwiseNeedsReduce(t.spec) || ColumnwiseNeedsReduce(t.spec);
    round2 |= ColumnwiseNeedsSecondRound(t.spec);
  }
  std::vector<std::array<DelayedScalingState, 2>> delayed = delayed_;
  for (int i = 0; i < num_shards; ++i) {
    const int t = shards_[i].tensor;
    RETURN_IF_ERROR(step_scaling::AddPartialAmaxes(tensors_[t], shards_[i], masters[i],
                                                   delayed[t][kRow], &amax[2 * t + kRow],
                                                   &amax[2 * t + kCol]));
  }
  if (round1) {
    absl::Status s = all_reduce(absl::MakeSpan(amax));
    if (!s.ok()) {
      return absl::AbortedError(absl::StrCat("amax all-reduce failed: ", s.message()));
    }
  }

  // 3. Rowwise scaling from the global amaxes.
  std::vector<ref::HybridScaling> scaling(num_tensors);
  for (int t = 0; t < num_tensors; ++t) {
    scaling[t].rowwise =
        DirectionScaling(tensors_[t].spec.rowwise, delayed[t][kRow], amax[2 * t + kRow]);
  }
  if (round2) {
    std::vector<float> amax2(num_tensors, 0.0f);
    for (int i = 0; i < num_shards; ++i) {
      const ShardDef& d = shards_[i];
      const TensorDef& t = tensors_[d.tensor];
      if (!ColumnwiseNeedsSecondRound(t.spec)) continue;
      ASSIGN_OR_RETURN(const float a,
                       step_scaling::SecondRoundAmax(t, d, masters[i], scaling[d.tensor].rowwise));
      amax2[d.tensor] = std::max(amax2[d.tensor], a);
    }
    absl::Status s = all_reduce(absl::MakeSpan(amax2));
    if (!s.ok()) {
      return absl::AbortedError(absl::StrCat("amax all-reduce (round 2) failed: ", s.message()));
    }
    for (int t = 0; t < num_tensors; ++t) {
      if (ColumnwiseNeedsSecondRound(tensors_[t].spec)) amax[2 * t + kCol] = amax2[t];
    }
  }
  for (int t = 0; t < num_tensors; ++t) {
    scaling[t].columnwise =
        DirectionScaling(tensors_[t].spec.columnwise, delayed[t][kCol], amax[2 * t + kCol]);
  }

  // 4. Quantize every shard with the global scaling.
  auto published = std::make_shared<PublishedVersion>();
  published->version = new_version;
  report.optimizer_steps = optimizer_steps_ + (apply_optimizer && !skip ? 1 : 0);
  report.skipped_steps = skipped_steps_ + (skip ? 1 : 0);
  published->report = report;
  published->tensors.resize(num_tensors);
  for (int i = 0; i < num_shards; ++i) {
    const ShardDef& d = shards_[i];
    const TensorDef& t = tensors_[d.tensor];
    RETURN_IF_ERROR(step_scaling::QuantizeShard(
        i, d, t, masters[i], scaling[d.tensor], amax[2 * d.tensor + kRow],
        amax[2 * d.tensor + kCol], [&] { return &published->pieces.emplace_back(); }));
    published->tensors[d.tensor].held = true;
  }

  // 5. Delayed scaling: the casts above used the scale from the previous
  // update; record the reduced amax of this cast and compute the next scale
  // (FORMATS.md §1). Tensors not held here are updated too, harmlessly:
  // their state is never used by this daemon.
  for (int t = 0; t < num_tensors; ++t) {
    step_scaling::FinishTensorScaling(tensors_[t].spec, update_delayed, amax[2 * t + kRow],
                                      amax[2 * t + kCol], scaling[t], delayed[t],
                                      &published->tensors[t]);
  }

  // 6. Commit.
  masters_ = std::move(masters);
  opt_ = std::move(opt);
  delayed_ = std::move(delayed);
  if (apply_optimizer) {
    optimizer_steps_ = report.optimizer_steps;
    skipped_steps_ = report.skipped_steps;
    for (auto& g : grads_) std::fill(g.begin(), g.end(), 0.0f);
    std::fill(fresh_rows_.begin(), fresh_rows_.end(), 0);
  }
  last_report_ = report;
  return std::shared_ptr<const PublishedVersion>(std::move(published));
}

}  // namespace paramd
