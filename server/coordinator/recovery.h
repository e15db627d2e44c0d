// File: server/coordinator/recovery.h
//
// The coordinator's side of a recovery (docs/ARCHITECTURE.md "Recovery"),
// once a replacement has taken the rank of a daemon that went DOWN: every
// daemon leaves the old data-plane world and opens a new endpoint
// (Daemon.PrepareRecovery), then, with the new address book, connects the
// new world and goes back to the recovered state (Daemon.Recover): its
// rank's shards of an in-memory snapshot (server/snapshot/snapshot.h; its own copy,
// or for a replacement the buddy's) or of a checkpoint, republished. This
// file picks the source from what the daemons hold and talks to them; the
// coordinator commits the result.
//
// Threading: blocking (waits for every daemon); call it from a thread of
// the coordinator's own, never from a gRPC callback.
#ifndef PARAMD_SERVER_COORDINATOR_RECOVERY_H_
#define PARAMD_SERVER_COORDINATOR_RECOVERY_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/paramd.grpc.pb.h"

namespace paramd {

struct RecoveryPlan {
  int64_t epoch = 0;  // the epoch this recovery completes
  // Every daemon, by rank, and its gRPC address (where a replacement reads
  // its rank's snapshot from the buddy).
  std::vector<std::shared_ptr<rpc::Daemon::Stub>> stubs;
  std::vector<std::string> addresses;
  std::string transport;  // DataPlane.transport
  // What every daemon goes back to, chosen once PrepareRecovery has said
  // which snapshots each daemon holds: the newest version of which every
  // rank's snapshot is held by some daemon, unless the newest complete
  // checkpoint (disk_version; -1: none) is newer. No model (have_model
  // false): only the data plane is rebuilt.
  bool have_model = false;
  // The loaded model's manifest with the daemons' current addresses
  // (RelocatedManifest), for a snapshot.
  rpc::Manifest snapshot_manifest;
  int64_t disk_version = -1;
  std::string checkpoint_path;  // the store of disk_version
  // Builds the manifest of checkpoint disk_version (called only if chosen)
  // and sets the version it found.
  std::function<absl::StatusOr<rpc::Manifest>(int64_t* version)> disk_manifest;
  // Why a newer checkpoint than disk_version, of another model generation,
  // is not used (server/coordinator/model_generation.h); "" if none is. Part of the
  // error when there is nothing to recover from.
  std::string disk_refused;
  int expected_pushers = 0;
  absl::Duration prepare_timeout = absl::Seconds(10);
  absl::Duration recover_timeout = absl::Minutes(10);
};

struct RecoveryResult {
  std::vector<std::string> data_plane_addresses;  // the new world, by rank
  int64_t published_version = -1;                 // -1: no model
  rpc::Manifest manifest;                         // what the daemons run now (no tensors: no model)
  // "snapshot v<N>" / "checkpoint <path> v<N>" / "none (no model loaded)".
  std::string source;
  // prepare, recover and the parts of the slowest daemon (the one whose
  // parts add up to the most); `wait` is the caller's.
  rpc::RecoveryPhases phases;
};

// The newest version of which every rank in [0, n) has a snapshot of model
// `generation` held by some daemon (`held[d]`: what daemon d holds), with
// the daemon holding each rank's (the rank itself when it can); -1 when
// there is none. Snapshots of another generation never count.
int64_t NewestCompleteSnapshot(const std::vector<std::vector<rpc::SnapshotHeld>>& held, int n,
                               int64_t generation, std::vector<int>* holders);

// `manifest` with every piece's and daemon's address the one of its rank
// now (`addresses`), and a new plan fingerprint when they changed.
rpc::Manifest RelocatedManifest(rpc::Manifest manifest, const std::vector<std::string>& addresses);

// Errors name the daemon rank and the phase (PrepareRecovery / Recover);
// the daemons are then left out of any world until the next attempt. The
// first daemon whose Recover fails ends the attempt at once (the others'
// calls are cancelled), so the coordinator reports it and tries again.
// FAILED_PRECONDITION marked NothingToRecoverFrom when a model is loaded
// and there is neither a snapshot every rank has nor a checkpoint.
absl::StatusOr<RecoveryResult> RunRecovery(const RecoveryPlan& plan);

// `status` marked as a recovery that failed for want of a source: no
// snapshot or checkpoint holds the lost rank's state, so retrying cannot
// mend it and only a new load (or a checkpoint restore) brings the cluster
// back. The mark is a status payload, so callers never match messages.
absl::Status NothingToRecoverFrom(absl::Status status);
bool IsNothingToRecoverFrom(const absl::Status& status);

}  // namespace paramd

#endif  // PARAMD_SERVER_COORDINATOR_RECOVERY_H_
