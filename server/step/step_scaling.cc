#include "server/step/step_scaling.h"

#include <optional>
#include <utility>

#include "common/status_macros.h"

namespace paramd {
namespace step_scaling {

absl::Status AddPartialAmaxes(const TensorDef& t, const ShardDef& d, absl::Span<const float> master,
                              const DelayedScalingState& row_delayed, float* row_amax,
                              float* col_amax) {
  const HybridSpec& spec = t.spec;
  const bool row = RowwiseNeedsReduce(spec);
  const bool col = ColumnwiseNeedsReduce(spec) && !ColumnwiseNeedsSecondRound(spec);
  if (!row && !col) return absl::OkStatus();
  const std::vector<float> source = ref::RoundToSource(master, spec.source_dtype);
  const float source_amax = ref::Amax(source);
  if (row) *row_amax = std::max(*row_amax, source_amax);
  if (col) {
    float a = source_amax;
    if (spec.columnwise_source == ColumnwiseSource::kRowwiseDequantized) {
      // The rowwise scale is known locally here (delayed, or block-local).
      const TensorScaling row_scaling = DirectionScaling(spec.rowwise, row_delayed, 0.0f);
      ASSIGN_OR_RETURN(std::vector<float> values,
                       ref::ColumnwiseSourceValues(master, d.rows(), t.cols, spec, row_scaling));
      a = ref::Amax(values);
    }
    *col_amax = std::max(*col_amax, a);
  }
  return absl::OkStatus();
}

absl::StatusOr<float> SecondRoundAmax(const TensorDef& t, const ShardDef& d,
                                      absl::Span<const float> master,
                                      const TensorScaling& rowwise) {
  ASSIGN_OR_RETURN(std::vector<float> values,
                   ref::ColumnwiseSourceValues(master, d.rows(), t.cols, t.spec, rowwise));
  return ref::Amax(values);
}

absl::Status QuantizeShard(int shard, const ShardDef& d, const TensorDef& t,
                           absl::Span<const float> master, const ref::HybridScaling& scaling,
                           float row_amax, float col_amax,
                           const std::function<PublishedPiece*()>& next_piece) {
  ASSIGN_OR_RETURN(ref::HybridResult r,
                   ref::QuantizeHybrid(master, d.rows(), t.cols, t.spec, scaling));
  for (int dir = 0; dir <= 1; ++dir) {
    std::optional<QuantizedTensor>& q = dir == 0 ? r.rowwise : r.columnwise;
    if (!q.has_value()) continue;
    const QuantSpec& qs = dir == 0 ? t.spec.rowwise : t.spec.columnwise;
    PublishedPiece* p = next_piece();
    if (p == nullptr) return absl::InternalError("step: more pieces than planned");
    p->shard = shard;
    p->tensor = d.tensor;
    p->row_begin = d.row_begin;
    p->row_end = d.row_end;
    p->direction = dir == 0 ? Direction::kRowwise : Direction::kColumnwise;
    ASSIGN_OR_RETURN(p->layout, ComputeLayout(qs, p->direction, d.rows(), t.cols));
    p->q = std::move(*q);
    if (NeedsGlobalAmax(qs.format)) p->q.amax = dir == 0 ? row_amax : col_amax;
    p->scale = dir == 0 ? scaling.rowwise.scale : scaling.columnwise.scale;
  }
  return absl::OkStatus();
}

void FinishTensorScaling(const HybridSpec& spec, bool update_delayed, float row_amax,
                         float col_amax, const ref::HybridScaling& scaling,
                         std::array<DelayedScalingState, 2>& delayed, TensorScalingInfo* info) {
  if (IsDelayed(spec.rowwise) && spec.rowwise_usage && update_delayed) {
    ref::DelayedRecordAmax(delayed[0], row_amax);
    ref::DelayedUpdate(delayed[0], delayed[0].amax_history[0], spec.rowwise);
  }
  if (IsDelayed(spec.columnwise) && spec.columnwise_usage && update_delayed) {
    ref::DelayedRecordAmax(delayed[1], col_amax);
    ref::DelayedUpdate(delayed[1], delayed[1].amax_history[0], spec.columnwise);
  }
  info->rowwise_scale = scaling.rowwise.scale;
  info->rowwise_amax = row_amax;
  info->columnwise_scale = scaling.columnwise.scale;
  info->columnwise_amax = col_amax;
}

}  // namespace step_scaling
}  // namespace paramd
