// File: server/step/step_scaling.h
//
// Which all-reduce rounds a tensor's step needs and the scaling of one
// direction from its global amax: the rules shared by the whole-version step
// (ShardSet::Step, server/step/shard_set.cc) and the per-bucket one
// (server/step/step_pipeline.h), and the per-shard stages both run, so that
// both publish the same bytes. Pure functions (thread-compatible).
#ifndef PARAMD_SERVER_STEP_STEP_SCALING_H_
#define PARAMD_SERVER_STEP_STEP_SCALING_H_

#include <algorithm>
#include <array>
#include <functional>

#include "absl/status/status.h"
#include "absl/types/span.h"

#include "kernels/format.h"
#include "kernels/reference.h"
#include "server/step/shard_set.h"

namespace paramd {
namespace step_scaling {

inline bool IsDelayed(const QuantSpec& s) { return s.format == Format::kFp8Delayed; }

// Whether the rowwise copy is computed at all (published, or as the
// temporary source of a rowwise_dequantized columnwise copy).
inline bool RowwiseComputed(const HybridSpec& s) {
  return s.rowwise_usage ||
         (s.columnwise_usage && s.columnwise_source == ColumnwiseSource::kRowwiseDequantized);
}

inline bool RowwiseNeedsReduce(const HybridSpec& s) {
  return RowwiseComputed(s) && NeedsGlobalAmax(s.rowwise.format);
}

inline bool ColumnwiseNeedsReduce(const HybridSpec& s) {
  return s.columnwise_usage && NeedsGlobalAmax(s.columnwise.format);
}

// The columnwise amax can only be taken after the rowwise scale is global:
// rowwise_dequantized from a current-scaling or NVFP4 rowwise copy.
inline bool ColumnwiseNeedsSecondRound(const HybridSpec& s) {
  return ColumnwiseNeedsReduce(s) && s.columnwise_source == ColumnwiseSource::kRowwiseDequantized &&
         NeedsGlobalAmax(s.rowwise.format) && !IsDelayed(s.rowwise);
}

inline DelayedScalingState InitialDelayed(const QuantSpec& spec) {
  DelayedScalingState d;
  d.amax_history.assign(std::max(spec.amax_history_len, 1), 0.0f);
  return d;
}

// The TensorScaling of one direction from its (global) amax and state.
inline TensorScaling DirectionScaling(const QuantSpec& spec, const DelayedScalingState& delayed,
                                      float global_amax) {
  if (IsDelayed(spec)) {
    TensorScaling t;
    t.scale = delayed.scale;
    t.global_amax = global_amax;
    return t;
  }
  return ref::ScalingFromAmax(spec, global_amax);
}

// First all-reduce round: raises `*row_amax` / `*col_amax` to shard `d`'s
// partial amaxes of the directions that need a global one (the columnwise
// one only when it needs no second round). `master`: after the optimizer;
// `row_delayed`: the tensor's rowwise delayed state.
absl::Status AddPartialAmaxes(const TensorDef& t, const ShardDef& d, absl::Span<const float> master,
                              const DelayedScalingState& row_delayed, float* row_amax,
                              float* col_amax);

// Second round (ColumnwiseNeedsSecondRound): the shard's columnwise amax
// from the global rowwise scaling.
absl::StatusOr<float> SecondRoundAmax(const TensorDef& t, const ShardDef& d,
                                      absl::Span<const float> master, const TensorScaling& rowwise);

// Quantizes shard `shard` (`d` of tensor `t`) with the tensor's global
// scaling and global amaxes; each published direction (rowwise first) goes
// into the piece `next_piece()` returns.
absl::Status QuantizeShard(int shard, const ShardDef& d, const TensorDef& t,
                           absl::Span<const float> master, const ref::HybridScaling& scaling,
                           float row_amax, float col_amax,
                           const std::function<PublishedPiece*()>& next_piece);

// Delayed scaling after the cast (records the reduced amaxes, next scale;
// only with `update_delayed`) and the tensor's published scaling numbers.
void FinishTensorScaling(const HybridSpec& spec, bool update_delayed, float row_amax,
                         float col_amax, const ref::HybridScaling& scaling,
                         std::array<DelayedScalingState, 2>& delayed, TensorScalingInfo* info);

}  // namespace step_scaling
}  // namespace paramd

#endif  // PARAMD_SERVER_STEP_STEP_SCALING_H_
