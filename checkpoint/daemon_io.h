// File: checkpoint/daemon_io.h
//
// A daemon's side of a checkpoint, without RPC: save its state of one
// version as its shard file (WriteDaemonShard), and on restore read back the
// rows of the pieces a (possibly different) plan gives it, with the
// optimizer moments and per-tensor state (ReadDaemonState). The coordinator
// side: OpenForRestore picks and verifies a checkpoint, BuildManifest
// assembles the manifest from the daemons' shard files.
//
// Thread-safe (no shared state); every call blocks on the file system.
#ifndef PARAMD_CHECKPOINT_DAEMON_IO_H_
#define PARAMD_CHECKPOINT_DAEMON_IO_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "checkpoint/daemon_state.h"
#include "checkpoint/store.h"
#include "proto/checkpoint.pb.h"

namespace paramd {
namespace checkpoint {

// Name of the daemon-wide blob (DaemonStateView::daemon_blob); it must be
// the same on every daemon.
inline constexpr char kDaemonBlobSection[] = "daemon";

// Writes `state` (of version state.version) as daemon `rank` of `world`
// into `store`: per piece the master and every moment as ROWS sections, per
// held tensor its TensorState, and the daemon blob. Returns what the
// coordinator puts in the manifest. AlreadyExists if the version is already
// complete in `store`. The directories it creates are added to `created`
// (if given), also when it fails, for RemoveCreatedDirs.
absl::StatusOr<ShardFileInfo> WriteDaemonShard(const CheckpointStore& store, int rank, int world,
                                               const DaemonStateView& state,
                                               std::vector<std::string>* created = nullptr);

// The manifest of a checkpoint from the tensors and every daemon's
// ShardFileInfo (in any order); metadata as given.
Manifest BuildManifest(uint64_t version, const std::vector<TensorInfo>& tensors,
                       std::vector<ShardFileInfo> shards,
                       const std::map<std::string, std::string>& metadata);

// Opens checkpoint `version` of `store` (-1: the newest complete one) and,
// if `verify`, checks every shard file's size and XXH3-64 first (DataLoss
// naming the damaged file). NotFound if there is no such checkpoint.
absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenForRestore(const CheckpointStore& store,
                                                                 int64_t version, bool verify);

// One piece restored for a daemon of the new plan.
struct RestoredPiece {
  std::string tensor;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  int64_t cols = 0;
  std::vector<float> master;
  std::map<std::string, std::vector<float>> moments;  // by section name
};

struct RestoredDaemonState {
  uint64_t version = 0;
  std::vector<RestoredPiece> pieces;                 // in the order asked for
  std::map<std::string, TensorState> tensor_states;  // tensors of those pieces
  std::string daemon_blob;
  std::map<std::string, std::string> metadata;
};

// Reads `pieces` (the rows a daemon owns under the new plan; any cut) from
// `reader`. NotFound for an unknown tensor or rows outside it.
absl::StatusOr<RestoredDaemonState> ReadDaemonState(const CheckpointReader& reader,
                                                    const std::vector<PieceInfo>& pieces);

}  // namespace checkpoint
}  // namespace paramd

#endif  // PARAMD_CHECKPOINT_DAEMON_IO_H_
