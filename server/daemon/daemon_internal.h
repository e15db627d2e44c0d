// File: server/daemon/daemon_internal.h
//
// Private to the daemon's implementation (server/daemon/daemon*.cc); nothing
// outside //server/daemon:daemon includes it. The declaration of Daemon::Impl, the
// object behind the public Daemon of server/daemon/daemon.h, shared by the files
// its methods are defined in:
//   daemon.cc           life: construction, join, lease, ReportVersion,
//                       Shutdown, the IpcHost snapshot, the Daemon facade
//   daemon_load.cc      LoadShards, AwaitJoined, LoadOnWorker
//   daemon_push.cc      the push rules, host and IPC pushes, PushWeights
//   daemon_step.cc      Step, SetOptimizer, RunStep, the pipelined step
//   daemon_fetch.cc     Fetch and what a fetch reads (ResolveFetch, ...)
//   daemon_device.cc    OpenDeviceChannel, FetchDevice, PushGradientsDevice
//   daemon_recovery.cc  PrepareRecovery, Recover, snapshots, WithStableState
//   daemon_stats.cc     GetStats, FillStats, PublishedHealth
//
// Ownership and threading are those of server/daemon/daemon.h: one Impl per
// Daemon, which owns it; mu_ guards the model and its versions (published,
// in flight, pushers, pins, the step's state: one atomic decision per push
// commit and step start), device_mu_ is taken before mu_. The independent
// parts (pusher owners, parked fetches, traffic counters, data-plane
// worlds, snapshots, the IPC service) own their state and leaf locks. gRPC
// callbacks never block; loads and steps run on worker_, device sends on
// each channel's own worker.
#ifndef PARAMD_SERVER_DAEMON_DAEMON_INTERNAL_H_
#define PARAMD_SERVER_DAEMON_DAEMON_INTERNAL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "auth/security.h"
#include "common/telemetry.h"
#include "format/convert.h"
#include "proto/paramd.grpc.pb.h"
#include "server/backend/device_channel.h"
#include "server/backend/shard_backend.h"
#include "server/daemon/daemon.h"
#include "server/daemon/data_plane.h"
#include "server/daemon/data_plane_worlds.h"
#include "server/daemon/lease_keeper.h"
#include "server/daemon/parked_fetches.h"
#include "server/daemon/pusher_owners.h"
#include "server/daemon/traffic_counters.h"
#include "server/daemon/version_reporter.h"
#include "server/ipc/ipc_service.h"
#include "server/rpc/async_util.h"
#include "server/rpc/serial_worker.h"
#include "server/snapshot/snapshot.h"
#include "server/step/chunks.h"
#include "server/step/push_pipeline.h"
#include "server/step/step_pipeline.h"

namespace paramd {
namespace daemon_internal {

// The daemon's log tag.
inline constexpr char kTag[] = "daemon";

}  // namespace daemon_internal

class DeviceChannelReactor;  // daemon_device.cc

class Daemon::Impl : public rpc::Daemon::CallbackService, public ipc::IpcHost {
 public:
  friend class Daemon;
  using Worker = SerialWorker;

  Impl(DaemonOptions options, DaemonBackend backend)
      : options_(std::move(options)),
        pusher_owners_(kMaxPusherOwners),
        parked_(options_.limits.max_parked_fetches_per_client),
        worlds_([this] {
          return DaemonDataPlane::Open(options_.data_plane, DataPlaneOptions(),
                                       options_.step_timeout);
        }),
        incarnation_(NewIncarnation()),
        backend_(backend),
        backend_auto_(options_.backend == "auto"),
        ipc_(std::make_unique<ipc::IpcService>(this, IpcOptions(options_))) {
    coordinator_token_ = std::make_shared<auth::BearerToken>(options_.join_token);
    SnapshotOptions snapshot;
    snapshot.every_steps = options_.snapshot_every_steps;
    snapshot.tls = options_.tls;
    snapshot.token = coordinator_token_;
    snapshots_ = std::make_unique<SnapshotKeeper>(std::move(snapshot));
  }

  ~Impl() override { Shutdown(); }

  void Start(const std::string& address, const std::string& coordinator);

  // What every data-plane endpoint of this daemon is opened with, the
  // first and each recovery's: its listen address and advertised host, who
  // may call it (the cluster secret), TLS and the token of its channels.
  TransportOptions DataPlaneOptions() const;

  void Shutdown();

  int rank() const;

  int64_t published_version() const;

  absl::Status startup_error() const;

  // ---- Same-GPU sessions (ipc::IpcHost, server/ipc/ipc_service.h) ----

  ipc::IpcService* ipc_service() { return ipc_.get(); }
  // The step's thread, once a step's outcome is recorded: the versions the
  // sessions' pin pages offer (pinning them needs no RPC; daemon_step.cc).
  void OfferIpcVersions(int64_t generation, ShardBackend* backend);

  absl::Status WithSnapshot(
      const std::function<absl::Status(const ipc::IpcSnapshot&)>& fn) override;

  absl::Status CheckPush(int64_t version, const std::string& pusher) override;

  absl::Status CommitPush(int64_t version, const std::string& pusher, int64_t generation,
                          int64_t bytes, const std::function<absl::Status(ShardBackend&)>& apply,
                          rpc::PushGradientsResponse* response) override;

  // ---- RPCs ----

  grpc::ServerReadReactor<rpc::PushGradientsRequest>* PushGradients(
      grpc::CallbackServerContext* context, rpc::PushGradientsResponse* response) override;
  grpc::ServerWriteReactor<rpc::FetchResponse>* Fetch(grpc::CallbackServerContext* context,
                                                      const rpc::FetchRequest* request) override;
  grpc::ServerReadReactor<rpc::PushWeightsRequest>* PushWeights(
      grpc::CallbackServerContext* context, rpc::PushWeightsResponse* response) override;
  grpc::ServerWriteReactor<rpc::DeviceChannelEvent>* OpenDeviceChannel(
      grpc::CallbackServerContext* context, const rpc::OpenDeviceChannelRequest* request) override;
  grpc::ServerUnaryReactor* FetchDevice(grpc::CallbackServerContext* context,
                                        const rpc::FetchDeviceRequest* request,
                                        rpc::FetchDeviceResponse* response) override;
  grpc::ServerUnaryReactor* PushGradientsDevice(grpc::CallbackServerContext* context,
                                                const rpc::PushGradientsDeviceRequest* request,
                                                rpc::PushGradientsResponse* response) override;
  // Closes device channel `id` (no-op if already closed): its transport is
  // shut down (a send in progress returns, the trainer's receive fails),
  // its stream finishes with `reason`. Any thread but the channel's own
  // worker may destroy it, so destruction happens on reaper_.
  void CloseDeviceChannel(uint64_t id, const std::string& reason);

  grpc::ServerUnaryReactor* LoadShards(grpc::CallbackServerContext* context,
                                       const rpc::LoadShardsRequest* request,
                                       rpc::LoadShardsResponse* response) override;

  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* context,
                                 const rpc::DaemonStepRequest* request,
                                 rpc::DaemonStepResponse* response) override;

  // ---- Recovery (server/coordinator/recovery.h is the coordinator's side) ----

  grpc::ServerUnaryReactor* PrepareRecovery(grpc::CallbackServerContext* context,
                                            const rpc::PrepareRecoveryRequest* request,
                                            rpc::PrepareRecoveryResponse* response) override;

  grpc::ServerUnaryReactor* Recover(grpc::CallbackServerContext* context,
                                    const rpc::RecoverRequest* request,
                                    rpc::RecoverResponse* response) override;

  // Buddy copies of snapshots (server/snapshot/snapshot.h).
  grpc::ServerReadReactor<rpc::SnapshotChunk>* PutSnapshot(
      grpc::CallbackServerContext* context, rpc::PutSnapshotResponse* response) override;

  grpc::ServerWriteReactor<rpc::SnapshotChunk>* GetSnapshot(
      grpc::CallbackServerContext* context, const rpc::GetSnapshotRequest* request) override;

  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const rpc::GetStatsRequest* request,
                                     rpc::GetStatsResponse* response) override;

  // The coordinator's SetOptimizerSchedule: applied on the worker, between
  // steps (a running step finishes with the old config).
  grpc::ServerUnaryReactor* SetOptimizer(grpc::CallbackServerContext* context,
                                         const rpc::SetOptimizerRequest* request,
                                         rpc::SetOptimizerResponse* /*response*/) override;

  absl::Status WithStableState(const Daemon::StableStateFn& fn, absl::Duration timeout);

  // ---- Used by the reactors ----

  // What a fetch should do now.
  struct FetchTarget {
    std::shared_ptr<const PublishedVersion> version;  // null: wait
    std::shared_ptr<const ModelView> view;
    int rank = -1;
    HostBytesFn host_bytes;  // non-null: `version` has no bytes yet (gpu backend)
  };
  absl::StatusOr<FetchTarget> ResolveFetch(int64_t version);

  WaitList* publish_waiters() { return &publish_waiters_; }
  int64_t default_chunk_bytes() const { return options_.default_chunk_bytes; }
  const RequestLimits& limits() const { return options_.limits; }

  // Fetches parked (waiting for an unpublished version) per client host.
  ParkedFetches* parked() { return &parked_; }
  TrafficCounters* traffic() { return &traffic_; }

  // First message of a push stream: fails fast on a bad version or pusher.
  absl::StatusOr<std::shared_ptr<const ModelView>> BeginPush(int64_t version,
                                                             const std::string& pusher);

  // A push stream's registration with the pipelined step (both null when
  // the daemon does not pipeline).
  struct PipelinedPush {
    std::shared_ptr<PushPipeline> pipeline;
    std::shared_ptr<PushPipeline::Stream> stream;
  };
  // After BeginPush: registers the stream with the pipelined step and, if
  // none runs, starts one (it waits for the pushes bucket by bucket).
  absl::StatusOr<PipelinedPush> OpenPipelinedPush(int64_t version, const std::string& pusher);

  // The in-flight version of a pipelined step, for FetchRequest.as_ready:
  // pieces [0, ready_pieces) (the tensors [0, ready_tensor_end)) are final
  // for this attempt; null version when `version` is not being stepped.
  struct ReadyPart {
    std::shared_ptr<const PublishedVersion> version;
    int ready_tensor_end = 0;
    int ready_pieces = 0;
    std::shared_ptr<const ModelView> view;
    int rank = -1;
  };
  ReadyPart InFlightPart(int64_t version);
  // What an as_ready fetch that streamed pieces of in-flight `v` answers:
  // nullopt while its step runs; OK once `v` is published; ABORTED if the
  // step failed or was started again (the bytes are not a published
  // version).
  std::optional<absl::Status> OutcomeOf(const PublishedVersion* v);

  // With a token file, a pusher id belongs to the token whose push under
  // it first committed (PusherOwners::Claim with the caller's token
  // identity). No-op without a token file. Thread-safe.
  absl::Status ClaimPusher(const std::string& pusher, const grpc::ServerContextBase& context,
                           bool bind);

  // Sums a complete push into the accumulators (pipelined: keeps it staged
  // for the step, `live`), exactly once per pusher and version; may start
  // the step.
  absl::Status CommitPush(int64_t version, const std::string& pusher, const ModelView& view,
                          std::vector<StagedPiece>& pieces, int64_t bytes,
                          rpc::PushGradientsResponse* response,
                          const PipelinedPush& live = PipelinedPush());

  // Whether the push being committed completes the version: the backend
  // takes the gradient norm's row sums while it adds it.
  bool LastPushLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // After a push's values were added: counts the pusher (once per version)
  // and may start the step. Host and device pushes alike.
  void CountPushLocked(int64_t version, const std::string& pusher, int64_t bytes,
                       rpc::PushGradientsResponse* response) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::StatusOr<std::shared_ptr<const ModelView>> BeginWeights();

  absl::Status CommitWeights(const ModelView& view, std::vector<StagedPiece>& pieces,
                             rpc::PushWeightsResponse* response, int64_t bytes);

 private:
  static std::string NewIncarnation();

  // A daemon whose rank another process took (it was stopped past its
  // lease, then continued) must not serve or take pushes: its state is
  // from before the recovery.
  absl::Status CheckNotReplacedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Lease keeper thread: a heartbeat's verdict other than OK.
  void OnHeartbeatVerdict(const rpc::HeartbeatRequest& request, rpc::HeartbeatVerdict verdict);

  // The pipelined step takes its gradients from the host push streams
  // (server/step/push_pipeline.h), bucket by bucket: a push already in device
  // memory would not be seen.
  absl::Status CheckDevicePushAllowedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Status CheckPushLocked(int64_t version, const std::string& pusher)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void MaybeStartStepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Status StartAdminStepLocked(int64_t from) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Worker thread: publishes version from+1 (with one optimizer step if
  // `apply_optimizer`) and reports it. A load publishes 0 (from = -1), a
  // restore of checkpoint V republishes V (from = V-1, no optimizer, no
  // delayed-scaling update).
  void RunStep(int64_t from, bool apply_optimizer, bool update_delayed = true);

  // Worker thread: the pipelined step from `from` (server/step/step_pipeline.h):
  // buckets are stepped as the pushes deliver them, each announced to
  // as_ready fetches. An abandoned attempt is run again at once while it
  // can progress, or posted behind the worker's other work (then this
  // returns the abandon, and RunStep leaves everything as it was).
  absl::StatusOr<std::shared_ptr<const PublishedVersion>> StepPipelined(
      ShardBackend* shards, int64_t from, const AllReduceMaxFn& all_reduce, bool update_delayed);

  // Step thread (ShardBackend::set_step_enqueued): `version`'s device work
  // is enqueued, so FetchDevice calls with reply_after_send waiting for it
  // may start their sends now (behind the per-tensor ready events).
  void OnStepEnqueued(int64_t version);

  // Worker thread: waits until the join thread is done (bounded), then
  // checks that this daemon is rank `rank`.
  absl::Status AwaitJoined(int rank);

  struct LoadSource {
    std::string safetensors_path;  // else pushed weights, unless a checkpoint
    std::string checkpoint_path;
    int64_t checkpoint_version = -1;
    std::shared_ptr<const DaemonSnapshot> snapshot;  // a recovery from a snapshot
  };

  // Worker thread: installs a new model and publishes its first version (0
  // from a file, V from checkpoint V); with neither, waits for PushWeights.
  // `phases` (may be null): backend_create, restore and republish seconds.
  absl::StatusOr<int64_t> LoadOnWorker(const std::shared_ptr<const ModelView>& view,
                                       const LoadSource& source, int expected_pushers,
                                       rpc::RecoveryPhases* phases = nullptr);

  // gRPC thread: leaves the current data-plane world (a step blocked in its
  // all-reduce fails now) and opens the endpoint of the next one. The same
  // epoch again (a retried call) gives the same endpoint, unless a Recover
  // has claimed it (then this is a new attempt: a new endpoint).
  absl::StatusOr<std::string> OpenNextWorld(int64_t epoch);

  // Worker thread: connects the world PrepareRecovery opened, waits until
  // every peer's endpoint answers (DaemonDataPlane::AwaitPeers, bounded by
  // the step timeout) and, with a model, restores this rank's shards of the
  // checkpoint and republishes its version (LoadOnWorker); returns that
  // version (-1: no model). On failure it leaves the world it connected, so
  // that peers waiting in the republish for it fail now.
  // `phases`: where its time went (connect, snapshot fetch, LoadOnWorker's).
  absl::StatusOr<int64_t> RecoverOnWorker(const rpc::RecoverRequest& request,
                                          const std::shared_ptr<const ModelView>& view,
                                          rpc::RecoveryPhases* phases);

  void ReportVersion(int64_t version, double seconds);

  void JoinLoop();

  void JoinLoopBody();
  // JoinLoopBody's steps: the request it sends; while the coordinator is
  // not connected, a log line every 5 s and true when a probe shows that
  // waiting will not help (join_error_ set); the accepted join's answer
  // taken (cluster secret, rank, data-plane world).
  rpc::JoinRequest MakeJoinRequest();
  bool CoordinatorUnreachable(absl::Time give_up, absl::Time* next_waiting_log);
  void AdoptJoin(const rpc::JoinResponse& response);

  std::vector<PieceHealth> PublishedHealth(int64_t max_samples) const;

  void FillStats(bool include_shards, rpc::DaemonStats* stats) const;

  DaemonOptions options_;
  // Set by Start() under mu_ (GetStats reads it under mu_; the join
  // threads Start begins read it freely).
  std::string coordinator_address_;
  // The cluster secret once joined: presented to the coordinator and to
  // other daemons (snapshot copies).
  std::shared_ptr<auth::BearerToken> coordinator_token_;
  std::unique_ptr<SnapshotKeeper> snapshots_;  // thread-safe; outlives worker_
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<rpc::Coordinator::Stub> coordinator_;
  std::unique_ptr<VersionReporter> reporter_;  // ReportVersion calls, off the worker
  std::thread join_thread_;
  std::unique_ptr<LeaseKeeper> lease_;
  // Who owns which pusher id (with tokens), the fetches parked per
  // client, what was served and pushed: each its own small object.
  static constexpr size_t kMaxPusherOwners = size_t{1} << 16;
  PusherOwners pusher_owners_;
  ParkedFetches parked_;
  TrafficCounters traffic_;
  // The data-plane world this daemon steps in and the next one a recovery
  // opens (the worker uses worlds_.current() without a lock).
  DataPlaneWorlds worlds_;
  Worker worker_;
  WaitList publish_waiters_;

  mutable absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* join_context_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::string address_ ABSL_GUARDED_BY(mu_);
  int rank_ ABSL_GUARDED_BY(mu_) = -1;
  std::string member_id_ ABSL_GUARDED_BY(mu_);
  const std::string incarnation_;               // JoinRequest.incarnation
  bool replaced_ ABSL_GUARDED_BY(mu_) = false;  // another process holds our rank
  bool unknown_logged_ ABSL_GUARDED_BY(mu_) = false;
  std::string join_error_ ABSL_GUARDED_BY(mu_);
  bool join_done_ ABSL_GUARDED_BY(mu_) = false;  // the join thread has finished
  AllReduceMaxFn all_reduce_ ABSL_GUARDED_BY(mu_);
  // data_plane_->transport() once joined (null: one daemon); for the
  // backend's device all-reduce (ShardBackend::set_data_plane).
  Transport* data_plane_transport_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::shared_ptr<const ModelView> view_ ABSL_GUARDED_BY(mu_);
  // Written under mu_ between steps; the worker uses it without mu_ while
  // stepping_ (no push can commit then).
  std::unique_ptr<ShardBackend> shards_;
  // Which ShardBackend LoadShards creates (fixed by DaemonOptions::backend).
  DaemonBackend backend_ = DaemonBackend::kCpu;
  const bool backend_auto_ = false;  // --backend=auto: fall back to cpu per model
  int expected_pushers_ ABSL_GUARDED_BY(mu_) = 0;
  bool awaiting_weights_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::vector<bool>> rows_loaded_ ABSL_GUARDED_BY(mu_);
  int64_t rows_missing_ ABSL_GUARDED_BY(mu_) = 0;
  std::shared_ptr<const PublishedVersion> latest_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const PublishedVersion> previous_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> pushers_ ABSL_GUARDED_BY(mu_);
  bool stepping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t stepping_from_ ABSL_GUARDED_BY(mu_) = -2;
  // Device sends in progress per version (pinned by ServeDeviceFetch): a
  // step waits until none reads the version whose slot it rewrites.
  std::map<int64_t, int> fetch_pins_ ABSL_GUARDED_BY(mu_);
  // While a step runs: the version whose device slot it rewrites (-1:
  // none); sends of it are refused (NOT_FOUND, dropped) from then on.
  int64_t overwriting_version_ ABSL_GUARDED_BY(mu_) = -1;
  // The version being stepped once its device work is enqueued (-1: none):
  // FetchDevice with reply_after_send streams it (OnStepEnqueued).
  int64_t in_flight_version_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t failed_step_from_ ABSL_GUARDED_BY(mu_) = -2;
  absl::Status last_step_error_ ABSL_GUARDED_BY(mu_);
  // Pipelined step (DaemonOptions::pipelined_step, cpu backend): the pushes
  // of the current version as they stream (null: steps run whole), whether
  // a pipelined step is posted or running, and the version it is filling
  // (its pieces [0, ready_pieces) are final for this attempt).
  std::shared_ptr<PushPipeline> push_pipeline_ ABSL_GUARDED_BY(mu_);
  bool pipeline_attempt_ ABSL_GUARDED_BY(mu_) = false;
  struct InFlightHost {
    std::shared_ptr<PublishedVersion> out;
    int ready_tensor_end = 0;
    int ready_pieces = 0;
  };
  InFlightHost in_flight_host_ ABSL_GUARDED_BY(mu_);
  int64_t steps_ ABSL_GUARDED_BY(mu_) = 0;
  double last_step_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  // Recovery: between PrepareRecovery and a successful Recover pushes are
  // refused (UNAVAILABLE); recovery_epoch_ tags ReportVersion.
  bool recovering_ ABSL_GUARDED_BY(mu_) = false;
  int64_t recovery_epoch_ ABSL_GUARDED_BY(mu_) = 0;

  // ---- Device channels (OpenDeviceChannel / FetchDevice) ----
  struct ChannelState {
    uint64_t id = 0;
    std::string trainer;  // for logs
    std::string secret;   // the channel's one-time secret (never logged)
    std::unique_ptr<DeviceChannel> channel;
    DeviceChannelReactor* reactor = nullptr;  // holds one reference
    std::atomic<bool> closed{false};
    Worker worker;  // serial: Connect, then the sends in request order. Last
                    // member: joined before the channel is destroyed.
  };
  // The outcome of a FetchDevice with reply_after_send, set by its send on
  // the channel's worker (then publish_waiters_ is woken) and read by the
  // call's poll, which answers with it.
  struct DeviceFetchCall {
    absl::Mutex mu;
    std::optional<absl::Status> result ABSL_GUARDED_BY(mu);
  };
  // The device send of one FetchDevice, on the channel's worker: pins
  // `version` for the send; `in_flight`: it may be the step in flight
  // (reply_after_send), sent behind the step's per-tensor events, and then
  // OK only once published. Reports to `call` when not null.
  void ServeDeviceFetch(ChannelState* c, int64_t version, int64_t generation,
                        const std::vector<DeviceFetchItem>& items, uint64_t tag,
                        absl::Time deadline, int64_t bytes[2], bool in_flight,
                        const std::shared_ptr<DeviceFetchCall>& call);
  // A FetchDevice of `version` asked for while it was being stepped: waits
  // until that step ended. `sent`: its bytes left during the step; OK if
  // the step published `version` (same model generation). Not `sent` (the
  // send came after the step, and found the version not held): why not
  // (NOT_FOUND dropped, ABORTED the step failed). Else why not.
  absl::Status AwaitStepOf(int64_t version, int64_t generation, bool sent, absl::Time deadline);
  // A validated device push (PushGradientsDevice), queued on its channel.
  struct DevicePush {
    int64_t version = 0;
    std::string pusher;
    int64_t generation = 0;
    std::vector<DevicePushPiece> pieces;
    int64_t bytes = 0;
    uint64_t tag = 0;
    absl::Time deadline;
    bool accept_non_finite = false;  // non_finite: SKIP_STEP
  };
  // Checks a PushGradientsDevice against the push rules and the model
  // (nothing changes on refusal); fills `push` and the channel to receive
  // on (null: no pieces, commit at once).
  absl::Status CheckDevicePush(const rpc::PushGradientsDeviceRequest& request, DevicePush* push,
                               std::shared_ptr<ChannelState>* channel);
  // On the channel's worker: receive into staging, then add and count under
  // the push rules; finishes `reactor`.
  void ServeDevicePush(ChannelState* c, const DevicePush& push,
                       rpc::PushGradientsResponse* response, grpc::ServerUnaryReactor* reactor);
  // Adds staged (may be null: no pieces) and counts the pusher, if the push
  // rules still allow it (another push or a step may have come between).
  absl::Status CommitDevicePush(ChannelState* c, const DevicePush& push,
                                std::unique_ptr<StagedDevicePush> staged,
                                rpc::PushGradientsResponse* response);

  // Validates a FetchDevice and, once its version is published (with
  // `call`, reply_after_send: or its step's work enqueued), fills the plan
  // and queues the send. nullopt: wait for a publish.
  std::optional<absl::Status> StartDeviceFetch(const rpc::FetchDeviceRequest& request,
                                               absl::Time deadline,
                                               rpc::FetchDeviceResponse* response,
                                               const std::shared_ptr<DeviceFetchCall>& call);

  // Readers: device sends and device-push commits (they use the backend's
  // device memory); writer: a load (it frees the old backend). Steps do not
  // take it: they wait for pins instead (fetch_pins_). Taken before mu_.
  absl::Mutex device_mu_;
  uint64_t next_channel_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::shared_ptr<ChannelState>> channels_ ABSL_GUARDED_BY(mu_);
  Worker reaper_;  // destroys closed channels

  static ipc::IpcServiceOptions IpcOptions(const DaemonOptions& options);
  // Declared last: destroyed first (its socket thread calls WithSnapshot).
  std::unique_ptr<ipc::IpcService> ipc_;
};

}  // namespace paramd

#endif  // PARAMD_SERVER_DAEMON_DAEMON_INTERNAL_H_
