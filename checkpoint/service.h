// File: checkpoint/service.h
//
// The gRPC side of checkpoints and exports (proto/checkpoint_service.proto):
//
//   CheckpointDaemonService       on every daemon, over a CheckpointableDaemon
//                                 (daemon_state.h): WriteShard (this daemon's
//                                 shard file of a version) and ExportRows
//                                 (BF16/FP32 rows of a version, from memory
//                                 or from a checkpoint on disk).
//   CheckpointCoordinatorService  on the coordinator: Checkpoint (every
//                                 daemon's WriteShard, then the manifest,
//                                 then KeepLast), ListCheckpoints,
//                                 DescribeCheckpoint.
//
// Register service() of each beside the paramd.rpc services
// (ServerOptions::extra_services). Every request names directories relative
// to the configured checkpoint root and is confined to it (SafeJoin).
// A checkpoint and the manifest assume that the coordinator and the daemons
// see the same checkpoint directory (one machine, or a shared file system).
//
// Threading: thread-safe. Long work (writing, verifying, exporting) runs on
// threads owned by the service, never on gRPC threads; the destructor waits
// for them (shut the gRPC server down first).
#ifndef PARAMD_CHECKPOINT_SERVICE_H_
#define PARAMD_CHECKPOINT_SERVICE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "auth/security.h"
#include "checkpoint/daemon_state.h"
#include "common/file_util.h"
#include "grpcpp/grpcpp.h"
#include "proto/checkpoint_service.pb.h"
#include "proto/paramd.pb.h"

namespace paramd {
namespace checkpoint {

struct CheckpointServiceOptions {
  // The configured checkpoint directory (--checkpoint_dir); created if
  // missing. Empty: checkpoints are refused with FAILED_PRECONDITION.
  std::string root;
  // Coordinator: KeepLast(keep) after each checkpoint when a request says 0
  // (--keep_checkpoints); 0 = keep everything.
  int keep = 0;
  // Coordinator: deadline of each daemon's WriteShard.
  absl::Duration daemon_call_timeout = absl::Minutes(30);
  // Coordinator, version -1: how often to retry with the new committed
  // version when a daemon has moved on meanwhile.
  int version_retries = 3;
  // Daemon: bytes per ExportRows message (default when the request says 0).
  int64_t export_chunk_bytes = 4 << 20;
  // The permissions of the checkpoint directories and files written
  // (0700 / 0600; 0750 / 0640 with --checkpoint_group_readable).
  FileModes modes;
  // Who may call the service (auth/security.h; null = no checks).
  std::shared_ptr<auth::Authenticator> authenticator;
  // Coordinator: how its channels to the daemons authenticate (TLS, the
  // cluster secret).
  auth::ChannelSecurity daemon_channel;
};

class CheckpointDaemonService {
 public:
  // `daemon` is not owned and must outlive the service.
  static absl::StatusOr<std::unique_ptr<CheckpointDaemonService>> Create(
      CheckpointServiceOptions options, CheckpointableDaemon* daemon);
  ~CheckpointDaemonService();

  grpc::Service* service();

  class Impl;

 private:
  explicit CheckpointDaemonService(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What the coordinator service needs to know about the cluster: the
// committed version, the tensors, the daemons (rank -> address) and the
// frozen buffers with their data (a checkpoint keeps them).
class ClusterView {
 public:
  virtual ~ClusterView() = default;
  virtual absl::StatusOr<rpc::Manifest> GetManifest() = 0;
};

// A ClusterView that asks the Coordinator service at `address` (the
// coordinator's own port, usually).
std::unique_ptr<ClusterView> NewGrpcClusterView(const std::string& address,
                                                absl::Duration timeout = absl::Seconds(30));

// The tensors of a paramd manifest as a checkpoint records them (spec =
// serialized paramd.rpc.HybridSpec).
std::vector<TensorInfo> CheckpointTensorsOf(const rpc::Manifest& manifest);

class CheckpointCoordinatorService {
 public:
  static absl::StatusOr<std::unique_ptr<CheckpointCoordinatorService>> Create(
      CheckpointServiceOptions options, std::unique_ptr<ClusterView> cluster);
  ~CheckpointCoordinatorService();

  grpc::Service* service();

  // The Checkpoint RPC, callable in-process (e.g. every N versions). Blocks.
  absl::StatusOr<CheckpointResponse> Checkpoint(const CheckpointRequest& request);

  class Impl;

 private:
  explicit CheckpointCoordinatorService(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace checkpoint
}  // namespace paramd

#endif  // PARAMD_CHECKPOINT_SERVICE_H_
