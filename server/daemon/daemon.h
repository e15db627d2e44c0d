// File: server/daemon/daemon.h
//
// The daemon role of `hybrid-paramd`: a gRPC server (service
// paramd.rpc.Daemon of proto/paramd.proto) that owns the shards the
// coordinator's plan gives it. Per shard it keeps the FP32 master, the
// optimizer state and the FP32 gradient accumulator (server/backend/shard_backend.h:
// on the host, server/step/shard_set.h, or on the GPU, server/gpu_backend/);
// it publishes the quantized copies of the last two versions, immutable
// once published (a fetch of version v is never torn by the step writing
// v+1; a fetch of an older version gets NOT_FOUND).
//
// Life of a daemon:
//   1. Start() returns at once; a background thread joins the
//      coordinator (retrying while it is unreachable) and waits for the
//      world (every expected daemon), then opens the data plane used for
//      the amax all-reduce.
//   2. The coordinator sends LoadShards (manifest + shard plan + weights
//      source); the daemon loads its rows and publishes version 0.
//   3. Trainers push gradients for the current version; when every expected
//      pusher's push has been summed (or on an admin Step) the daemon runs
//      the step (server/step/shard_set.h) on its worker thread, publishes v+1 and
//      reports it to the coordinator.
//
// Threading: all public methods are thread-safe. gRPC callbacks never
// block; loads and steps run on one worker thread per daemon, device sends
// (FetchDevice) on one worker per device channel. A device send pins its
// version: a step waits only for sends of the version whose device slot it
// rewrites (never for sends of the latest one), and a FetchDevice with
// reply_after_send of the version being stepped is sent as the step
// quantizes it and answered once it is published (see
// docs/ARCHITECTURE.md "Fetch beside the step").
#ifndef PARAMD_SERVER_DAEMON_DAEMON_H_
#define PARAMD_SERVER_DAEMON_DAEMON_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "auth/security.h"
#include "grpcpp/grpcpp.h"
#include "proto/optimizer.pb.h"
#include "proto/paramd.pb.h"
#include "server/rpc/request_checks.h"
#include "server/step/fp8_health.h"
#include "server/step/optimizer.h"
#include "server/step/shard_set.h"

namespace paramd {

struct DaemonOptions {
  // Used only for a manifest without an optimizer config (every coordinator
  // sends one; the config is the coordinator's).
  OptimizerOptions optimizer;
  // The optimizer settings given on this daemon's command line (only those
  // fields set): sent at join, where the coordinator refuses any that
  // disagree with its config (JoinRequest.optimizer_flags).
  recipe::OptimizerConfig optimizer_flags;
  // Upper bound of a fetch chunk when the request gives none.
  int64_t default_chunk_bytes = int64_t{1} << 20;
  // How long to keep trying to join the coordinator before giving up
  // (startup_error() then says why; hybrid-paramd exits with it).
  absl::Duration join_timeout = absl::Minutes(5);
  // Deadline of each call to the coordinator (ReportVersion).
  absl::Duration coordinator_call_timeout = absl::Seconds(10);
  // Data-plane backend for the amax all-reduce (server/daemon/data_plane.h): "host"
  // or "local"; must match the coordinator's.
  std::string data_plane = "host";
  // Where the data-plane endpoint listens (host: "ip:port"; "" =
  // "127.0.0.1:0", one machine; use "0.0.0.0:0" across machines).
  std::string data_plane_listen;
  // A step (its all-reduce) that takes longer fails with ABORTED.
  absl::Duration step_timeout = absl::Seconds(60);
  // Which ShardBackend holds the shards (server/backend/shard_backend.h): "cpu",
  // "gpu" (Create fails with FAILED_PRECONDITION unless built with
  // --config=cuda and a GPU is usable) or "auto" (gpu when it could run,
  // else cpu; with the gpu, a model the gpu backend refuses as
  // UNIMPLEMENTED, e.g. rowwise_dequantized or sgd, or a checkpoint
  // restore, loads on the cpu backend instead). Every daemon of a world
  // must run the same backend.
  std::string backend = "cpu";
  // Where the NCCL endpoints of device-fetch channels (OpenDeviceChannel)
  // listen for their control messages: "" = 127.0.0.1:0 (trainers on this
  // machine); "0.0.0.0:0" for trainers on other machines.
  std::string device_channel_listen;
  // The host the data-plane and device-channel endpoints advertise when
  // their listen host is a wildcard (0.0.0.0): hybrid-paramd passes the
  // host of --advertise_address, the name other machines reach this one
  // by. "" = this machine's hostname.
  std::string advertise_host;
  // The rank to take (hybrid-paramd --rank); -1: the coordinator picks one
  // (the lowest not taken, else the lowest DOWN). A process started with
  // the rank of a daemon that went down replaces it
  // (docs/ARCHITECTURE.md "Membership").
  int rank = -1;
  // How often the daemon renews its lease with the coordinator (the
  // coordinator's lease, default 1.5 s, should be several of these).
  absl::Duration heartbeat_interval = absl::Milliseconds(250);
  // In-memory snapshots (server/snapshot/snapshot.h): every N optimizer steps the
  // daemon copies its state to host memory and sends the copy to its buddy
  // (rank+1 mod n); a recovery goes back to the newest one every rank
  // still has. 0: none (buddy copies of others are still kept).
  int snapshot_every_steps = 0;
  // Limits on what requests may ask (server/rpc/request_checks.h).
  RequestLimits limits;
  // Pipelined step (docs/ARCHITECTURE.md "Pipelined step"):
  // the optimizer of a bucket of tensors starts once every expected
  // pusher's share of it has arrived, and FetchRequest.as_ready serves each
  // tensor as soon as it is quantized. Every daemon of a world must agree
  // (their all-reduce calls differ; the coordinator refuses a join that
  // differs). Both backends; device pushes are refused while it is on.
  bool pipelined_step = false;
  // Parameters per bucket of the pipelined step (server/step/step_pipeline.h).
  int64_t step_bucket_elements = int64_t{1} << 22;

  // Security (auth/security.h, docs/SECURITY.md). Who may call this
  // service (null: no checks; ParamdServer always sets one). The daemon
  // adds its member secret and, once joined, the cluster secret to it.
  std::shared_ptr<auth::Authenticator> authenticator;
  // TLS of this daemon's channel to the coordinator (client side).
  auth::TlsConfig tls;
  // What the Join presents as its bearer token: the cluster secret
  // (--cluster_secret_file) or a `cluster` token; "" = none (accepted only
  // without a token file and a configured cluster secret, for a new rank).
  std::string join_token;
  // The secret the coordinator must present on its calls to this daemon
  // (sent in the JoinRequest). "" = random, generated by Start.
  std::string member_secret;
};

// One published piece's FP8 health (Daemon::PublishedHealth).
struct PieceHealth {
  std::string tensor;
  Direction direction = Direction::kRowwise;
  Format format = Format::kIdentityBf16;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  float amax = 0.0f;                // the amax the cast used (per-tensor FP8, NVFP4 global)
  float scale = 1.0f;               // per-tensor FP8 multiplier (1 for other formats)
  std::optional<CodeCounts> codes;  // server/step/fp8_health.h
};

// The daemon: its gRPC service and its worker. Served by ParamdServer
// (server/server.h), which binds the port and then calls Start().
class Daemon {
 public:
  // InvalidArgument for bad options.
  static absl::StatusOr<std::unique_ptr<Daemon>> Create(DaemonOptions options);

  ~Daemon();  // Shutdown()
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // The paramd.rpc.Daemon service to register. Owned by this object.
  grpc::Service* service();
  // The paramd.rpc.DaemonIpc service (same-GPU sessions, proto/ipc.proto;
  // server/ipc/ipc_service.h) to register beside it. Owned by this object.
  grpc::Service* ipc_service();
  // Starts joining the coordinator at `coordinator` ("host:port") in the
  // background, advertising `address` (this daemon's reachable
  // "host:port"). Call once, after the server serving service() started.
  void Start(const std::string& address, const std::string& coordinator);
  // Stops the join thread and the worker; fails waiting calls. Call after
  // the gRPC server has shut down. Idempotent.
  void Shutdown();

  // Rank once joined, else -1.
  int rank() const;
  // Latest published version, -1 if none.
  int64_t published_version() const;
  // Not OK once joining has failed for good (refused, join_timeout passed,
  // data plane not opened or connected): the process cannot become a
  // member (server/server.h exits with it).
  absl::Status startup_error() const;
  // What GetStats returns.
  rpc::DaemonStats Stats(bool include_shards) const;
  // Every piece of the latest published version with its amax, scale and
  // code counts (at most `max_samples` elements read per piece). Reads the
  // immutable published buffers outside the daemon's locks: no step or
  // fetch waits for it. Empty before the first publish.
  std::vector<PieceHealth> PublishedHealth(int64_t max_samples) const;

  // Runs `fn` on the calling thread while no step can commit (the worker is
  // parked), with the shard state that produced the latest published
  // version, that version, the previous one (null if not kept) and the
  // model generation of the loaded model (its manifest's; 0 if none was
  // recorded). For checkpoints and exports (server/checkpointing.h). Blocks
  // until the worker is free (queued steps run first); UNAVAILABLE if that
  // takes longer than `timeout` or the daemon shuts down;
  // FAILED_PRECONDITION if nothing is published yet. `fn` must not call
  // back into this daemon.
  using StableStateFn =
      std::function<absl::Status(const ShardSet& shards, const PublishedVersion& latest,
                                 const PublishedVersion* previous, int64_t model_generation)>;
  absl::Status WithStableState(const StableStateFn& fn, absl::Duration timeout = absl::Minutes(10));

  class Impl;

 private:
  explicit Daemon(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace paramd

#endif  // PARAMD_SERVER_DAEMON_DAEMON_H_
