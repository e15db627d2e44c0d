#include "server/snapshot/restore.h"

#include <map>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/daemon_io.h"
#include "checkpoint/store.h"
#include "common/status_macros.h"
#include "server/snapshot/shard_set_adapter.h"

namespace paramd {

absl::StatusOr<std::vector<SavedDelayedState>> RestoreShardSet(const std::string& path,
                                                               int64_t version, ShardSet& shards) {
  ASSIGN_OR_RETURN(checkpoint::CheckpointStore store,
                   checkpoint::CheckpointStore::Open(path, /*create=*/false));
  ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::CheckpointReader> reader,
                   checkpoint::CheckpointReader::Open(store, static_cast<uint64_t>(version)));
  std::vector<checkpoint::PieceInfo> pieces;
  for (const ShardDef& d : shards.shards()) {
    checkpoint::PieceInfo p;
    p.set_tensor(shards.tensors()[d.tensor].name);
    p.set_row_begin(d.row_begin);
    p.set_row_end(d.row_end);
    pieces.push_back(std::move(p));
  }
  ASSIGN_OR_RETURN(checkpoint::RestoredDaemonState saved,
                   checkpoint::ReadDaemonState(*reader, pieces));
  OptimizerOptions saved_optimizer;
  RETURN_IF_ERROR(checkpoint::DecodeOptimizerOptions(saved.daemon_blob, &saved_optimizer));
  if (saved_optimizer.kind != shards.optimizer().kind) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", version, " was written with optimizer ", OptimizerName(saved_optimizer.kind),
        ", this daemon runs ", OptimizerName(shards.optimizer().kind)));
  }
  const std::vector<std::string> moments = checkpoint::MomentNames(shards.optimizer().kind);
  if (saved.pieces.size() != shards.shards().size()) {
    return absl::InternalError("checkpoint reader returned a different number of pieces");
  }
  for (size_t i = 0; i < saved.pieces.size(); ++i) {
    checkpoint::RestoredPiece& p = saved.pieces[i];
    absl::Span<float> m = shards.master(static_cast<int>(i));
    if (p.master.size() != m.size()) {
      return absl::DataLossError(absl::StrCat("checkpoint rows of ", p.tensor, " have ",
                                              p.master.size(), " values, want ", m.size()));
    }
    std::copy(p.master.begin(), p.master.end(), m.begin());
    OptimizerState state;
    state.m = std::move(p.moments[moments[0]]);
    if (moments.size() > 1) state.v = std::move(p.moments[moments[1]]);
    RETURN_IF_ERROR(shards.SetOptimizerState(static_cast<int>(i), std::move(state)));
  }
  std::vector<SavedDelayedState> next;
  int64_t steps = -1;
  int64_t skipped = -1;
  for (size_t t = 0; t < shards.tensors().size(); ++t) {
    const TensorDef& def = shards.tensors()[t];
    auto it = saved.tensor_states.find(def.name);
    if (it == saved.tensor_states.end()) continue;  // no piece of it here
    steps = it->second.optimizer_step();
    skipped = it->second.skipped_steps();
    for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
      const checkpoint::DirectionScaling& ds =
          d == Direction::kRowwise ? it->second.rowwise() : it->second.columnwise();
      DelayedScalingState after;
      after.scale = ds.scale();
      after.amax_history.assign(ds.amax_history().begin(), ds.amax_history().end());
      DelayedScalingState cast = after;
      // The scale version V was cast with, exactly; checkpoints without it
      // (cast_scale 0) only give rcp(scale_inv), which may be one ulp off.
      if (ds.cast_scale() != 0.0f) {
        cast.scale = ds.cast_scale();
      } else if (ds.scale_inv() != 0.0f) {
        cast.scale = 1.0f / ds.scale_inv();
      }
      shards.SetDelayedState(static_cast<int>(t), d, std::move(cast));
      next.push_back({static_cast<int>(t), d, std::move(after)});
    }
  }
  if (steps >= 0) shards.SetOptimizerSteps(steps);
  if (skipped >= 0) shards.SetSkippedSteps(skipped);
  return next;
}

void ApplyDelayedStates(const std::vector<SavedDelayedState>& states, ShardSet& shards) {
  for (const SavedDelayedState& s : states) shards.SetDelayedState(s.tensor, s.direction, s.state);
}

}  // namespace paramd
