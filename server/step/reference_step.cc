#include "server/step/reference_step.h"

#include <algorithm>

#include "common/status_macros.h"

namespace paramd {

ReferenceTensorState InitialReferenceState(const HybridSpec& spec) {
  ReferenceTensorState s;
  s.rowwise.amax_history.assign(std::max(spec.rowwise.amax_history_len, 1), 0.0f);
  s.columnwise.amax_history.assign(std::max(spec.columnwise.amax_history_len, 1), 0.0f);
  return s;
}

absl::StatusOr<ref::HybridResult> ReferencePublish(const std::vector<float>& master, int64_t rows,
                                                   int64_t cols, const HybridSpec& spec,
                                                   ReferenceTensorState& state) {
  auto scaling_of = [](const QuantSpec& q, const DelayedScalingState& d, float amax) {
    if (q.format == Format::kFp8Delayed) return TensorScaling{d.scale, amax};
    return ref::ScalingFromAmax(q, amax);
  };
  ref::HybridScaling scaling;
  const float row_amax = ref::Amax(ref::RoundToSource(master, spec.source_dtype));
  scaling.rowwise = scaling_of(spec.rowwise, state.rowwise, row_amax);
  ASSIGN_OR_RETURN(std::vector<float> col_source,
                   ref::ColumnwiseSourceValues(master, rows, cols, spec, scaling.rowwise));
  const float col_amax = ref::Amax(col_source);
  scaling.columnwise = scaling_of(spec.columnwise, state.columnwise, col_amax);
  ASSIGN_OR_RETURN(ref::HybridResult result,
                   ref::QuantizeHybrid(master, rows, cols, spec, scaling));
  if (spec.rowwise.format == Format::kFp8Delayed && spec.rowwise_usage) {
    ref::DelayedRecordAmax(state.rowwise, row_amax);
    ref::DelayedUpdate(state.rowwise, state.rowwise.amax_history[0], spec.rowwise);
  }
  if (spec.columnwise.format == Format::kFp8Delayed && spec.columnwise_usage) {
    ref::DelayedRecordAmax(state.columnwise, col_amax);
    ref::DelayedUpdate(state.columnwise, state.columnwise.amax_history[0], spec.columnwise);
  }
  return result;
}

}  // namespace paramd
