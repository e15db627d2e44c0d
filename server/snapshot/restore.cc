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
                                                               int64_t version,
                                                               ShardStateSink& shards) {
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
    const ShardDef& d = shards.shards()[i];
    const size_t want = static_cast<size_t>(d.rows() * shards.tensors()[d.tensor].cols);
    if (p.master.size() != want) {
      return absl::DataLossError(absl::StrCat("checkpoint rows of ", p.tensor, " have ",
                                              p.master.size(), " values, want ", want));
    }
    RETURN_IF_ERROR(shards.RestoreMaster(static_cast<int>(i), p.master));
    p.master = std::vector<float>();  // the host copy goes as soon as it is used
    std::vector<float> m = std::move(p.moments[moments[0]]);
    std::vector<float> v =
        moments.size() > 1 ? std::move(p.moments[moments[1]]) : std::vector<float>();
    RETURN_IF_ERROR(shards.RestoreOptimizerState(static_cast<int>(i), m, v));
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
      RETURN_IF_ERROR(shards.RestoreDelayedState(static_cast<int>(t), d, std::move(cast)));
      next.push_back({static_cast<int>(t), d, std::move(after)});
    }
  }
  RETURN_IF_ERROR(shards.RestoreStepCounts(steps, skipped));
  return next;
}

absl::Status ApplyDelayedStates(const std::vector<SavedDelayedState>& states,
                                ShardStateSink& shards) {
  for (const SavedDelayedState& s : states) {
    RETURN_IF_ERROR(shards.RestoreDelayedState(s.tensor, s.direction, s.state));
  }
  return absl::OkStatus();
}

}  // namespace paramd
