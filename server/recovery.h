// File: server/recovery.h
//
// The coordinator's side of a recovery (docs/ARCHITECTURE.md "Recovery"),
// once a replacement has taken the rank of a daemon that went DOWN: every
// daemon leaves the old data-plane world and opens a new endpoint
// (Daemon.PrepareRecovery), then, with the new address book, connects the
// new world and goes back to the recovered state (Daemon.Recover): its
// rank's shards of a checkpoint, republished. The coordinator chooses the
// source and commits the result; this file only talks to the daemons.
//
// Threading: blocking (waits for every daemon); call it from a thread of
// the coordinator's own, never from a gRPC callback.
#ifndef PARAMD_SERVER_RECOVERY_H_
#define PARAMD_SERVER_RECOVERY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/paramd.grpc.pb.h"

namespace paramd {

struct RecoveryPlan {
  int64_t epoch = 0;  // the epoch this recovery completes
  // Every daemon, by rank.
  std::vector<std::shared_ptr<rpc::Daemon::Stub>> stubs;
  std::string transport;  // DataPlane.transport
  // What every daemon goes back to: the manifest (no tensors: no model yet,
  // only the data plane is rebuilt), the checkpoint store and version.
  rpc::Manifest manifest;
  std::string checkpoint_path;
  int64_t checkpoint_version = -1;
  int expected_pushers = 0;
  absl::Duration prepare_timeout = absl::Seconds(10);
  absl::Duration recover_timeout = absl::Minutes(10);
};

struct RecoveryResult {
  std::vector<std::string> data_plane_addresses;  // the new world, by rank
  int64_t published_version = -1;                 // -1: no model
};

// Errors name the daemon rank and the phase (PrepareRecovery / Recover);
// the daemons are then left out of any world until the next attempt.
absl::StatusOr<RecoveryResult> RunRecovery(const RecoveryPlan& plan);

}  // namespace paramd

#endif  // PARAMD_SERVER_RECOVERY_H_
