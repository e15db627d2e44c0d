// File: server/snapshot/restore.h
//
// Restoring a daemon's shards from a checkpoint (checkpoint/, docs/CHECKPOINTS.md)
// onto whatever rows the current plan gives it (resharding is the
// checkpoint reader's job): masters, optimizer moments, optimizer step count
// and per-tensor delayed-scaling state.
//
// Republishing the checkpoint's version V must quantize V as the saved run
// did, then continue with the saved next scale. So RestoreShardSet leaves
// each delayed direction's scale at the exact scale V was cast with (the
// saved cast_scale; rcp(saved scale_inv) for older checkpoints), and returns the saved post-update
// states to put back with ApplyDelayedStates() after the republishing step (which runs with
// update_delayed = false).
//
// Pure host code over the file system; call on the daemon's worker.
#ifndef PARAMD_SERVER_SNAPSHOT_RESTORE_H_
#define PARAMD_SERVER_SNAPSHOT_RESTORE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/format.h"
#include "server/step/shard_set.h"
#include "server/step/state_sink.h"

namespace paramd {

struct SavedDelayedState {
  int tensor = 0;
  Direction direction = Direction::kRowwise;
  DelayedScalingState state;
};

// Reads checkpoint `version` of the store at `path` (no checksum pass: the
// coordinator verified it) into `shards` (the backend's state_sink()). FAILED_PRECONDITION if the
// checkpoint's optimizer kind differs from `shards`'; NOT_FOUND / DATA_LOSS
// from the reader.
absl::StatusOr<std::vector<SavedDelayedState>> RestoreShardSet(const std::string& path,
                                                               int64_t version,
                                                               ShardStateSink& shards);

absl::Status ApplyDelayedStates(const std::vector<SavedDelayedState>& states,
                                ShardStateSink& shards);

}  // namespace paramd

#endif  // PARAMD_SERVER_SNAPSHOT_RESTORE_H_
