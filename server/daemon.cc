#include "server/daemon.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <optional>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "common/telemetry.h"
#include "proto/paramd.grpc.pb.h"
#include "safetensors/convert.h"
#include "safetensors/safetensors.h"
#include "server/async_util.h"
#include "server/chunks.h"
#include "server/convert.h"
#include "server/data_plane.h"
#include "server/device_channel.h"
#include "server/ipc/ipc_service.h"
#include "server/lease_keeper.h"
#include "server/push_pipeline.h"
#include "server/step_pipeline.h"
#include "server/optimizer_config.h"
#include "server/restore.h"
#include "server/serial_worker.h"
#include "server/shard_backend.h"
#include "server/snapshot.h"

namespace paramd {
namespace {

constexpr char kTag[] = "daemon";
constexpr int64_t kMaxChunkBytes = int64_t{4} << 20;

using Worker = SerialWorker;

// Rows [row_begin, row_end) of a [rows][cols] tensor of a safetensors file,
// converted to FP32.
absl::Status ReadRows(const safetensors::SafetensorsFile& file, const TensorDef& def,
                      const ShardDef& shard, absl::Span<float> out) {
  const safetensors::TensorInfo* info = file.Find(def.name);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat(file.path(), ": no tensor ", def.name));
  }
  if (info->num_elements != def.rows * def.cols) {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensor ", def.name, " has ",
                                                   info->num_elements, " elements, manifest says ",
                                                   def.rows, " x ", def.cols));
  }
  switch (info->dtype) {
    case safetensors::Dtype::kF32:
    case safetensors::Dtype::kBF16:
    case safetensors::Dtype::kF16:
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(file.path(), ": tensor ", def.name, " has dtype ",
                       safetensors::DtypeName(info->dtype), "; want F32, BF16 or F16"));
  }
  const int64_t n = shard.rows() * def.cols;
  const int elem = safetensors::DtypeSize(info->dtype);
  std::vector<uint8_t> bytes(n * elem);
  RETURN_IF_ERROR(file.ReadTensorBytes(*info, shard.row_begin * def.cols * elem,
                                       absl::MakeSpan(bytes)));
  return safetensors::DecodeToFloat(info->dtype, bytes, out);
}

}  // namespace

class FetchReactor;
class DeviceChannelReactor;

class Daemon::Impl : public rpc::Daemon::CallbackService, public ipc::IpcHost {
 public:
  friend class Daemon;
  Impl(DaemonOptions options, gpu_backend::DaemonBackend backend)
      : options_(std::move(options)),
        backend_(backend),
        backend_auto_(options_.backend == "auto"),
        incarnation_(NewIncarnation()),
        ipc_(std::make_unique<ipc::IpcService>(this, IpcOptions(options_))) {
    coordinator_token_ = std::make_shared<auth::BearerToken>(options_.join_token);
    SnapshotOptions snapshot;
    snapshot.every_steps = options_.snapshot_every_steps;
    snapshot.tls = options_.tls;
    snapshot.token = coordinator_token_;
    snapshots_ = std::make_unique<SnapshotKeeper>(std::move(snapshot));
  }

  ~Impl() override { Shutdown(); }

  void Start(const std::string& address, const std::string& coordinator) {
    {
      absl::MutexLock lock(&mu_);
      address_ = address;
    }
    coordinator_address_ = coordinator;
    if (options_.member_secret.empty()) options_.member_secret = auth::RandomSecret();
    if (options_.authenticator) options_.authenticator->AddClusterSecret(options_.member_secret);
    // Reconnect within a second of a coordinator that starts late (gRPC's
    // default backoff grows to two minutes).
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    // The Join presents join_token; once joined, every call presents the
    // cluster secret from the reply.
    channel_ = auth::CreateChannel(coordinator, {options_.tls, coordinator_token_}, args);
    coordinator_ = rpc::Coordinator::NewStub(channel_);
    join_thread_ = std::thread([this] { JoinLoop(); });
    lease_ = std::make_unique<LeaseKeeper>(
        coordinator_.get(), options_.heartbeat_interval,
        [this]() -> std::optional<rpc::HeartbeatRequest> {
          absl::MutexLock lock(&mu_);
          if (rank_ < 0 || replaced_) return std::nullopt;
          rpc::HeartbeatRequest r;
          r.set_rank(rank_);
          r.set_member_id(member_id_);
          r.set_incarnation(incarnation_);
          r.set_published_version(latest_ ? latest_->version : -1);
          return r;
        },
        [this](const rpc::HeartbeatRequest& request, rpc::HeartbeatVerdict verdict) {
          OnHeartbeatVerdict(request, verdict);
        });
  }

  void Shutdown() {
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) return;
      shut_down_ = true;
      if (join_context_ != nullptr) join_context_->TryCancel();
    }
    ipc_->Shutdown();  // a step waiting for an IPC pin returns
    if (join_thread_.joinable()) join_thread_.join();
    lease_.reset();
    std::vector<uint64_t> channels;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [id, c] : channels_) channels.push_back(id);
    }
    for (uint64_t id : channels) CloseDeviceChannel(id, "daemon shutting down");
    reaper_.Stop();
    {
      absl::MutexLock lock(&plane_mu_);
      if (data_plane_) data_plane_->Shutdown();  // unblocks a step in the all-reduce
    }
    worker_.Stop();
    publish_waiters_.WakeAll();
  }

  int rank() const {
    absl::MutexLock lock(&mu_);
    return rank_;
  }

  int64_t published_version() const {
    absl::MutexLock lock(&mu_);
    return latest_ ? latest_->version : -1;
  }

  absl::Status startup_error() const {
    absl::MutexLock lock(&mu_);
    // A replacement has no data plane until the coordinator's recovery.
    if (!join_done_ || shut_down_ || (rank_ >= 0 && (all_reduce_ || recovering_))) {
      return absl::OkStatus();
    }
    return absl::FailedPreconditionError(
        absl::StrCat("daemon cannot join the cluster: ", join_error_));
  }

  // ---- Same-GPU sessions (ipc::IpcHost, server/ipc/ipc_service.h) ----

  ipc::IpcService* ipc_service() { return ipc_.get(); }

  absl::Status WithSnapshot(
      const std::function<absl::Status(const ipc::IpcSnapshot&)>& fn) override {
    absl::ReaderMutexLock device_lock(&device_mu_);  // keeps a load from freeing the backend
    absl::MutexLock lock(&mu_);
    if (shut_down_) return absl::UnavailableError("daemon shutting down");
    RETURN_IF_ERROR(CheckNotReplacedLocked());
    ipc::IpcSnapshot snap;
    if (view_ != nullptr && shards_ != nullptr) {
      snap.view = view_.get();
      snap.backend = shards_.get();
    }
    snap.latest = latest_ ? latest_->version : -1;
    snap.previous = previous_ ? previous_->version : -1;
    return fn(snap);
  }

  absl::Status CheckPush(int64_t version, const std::string& pusher) override {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return absl::UnavailableError("daemon shutting down");
    RETURN_IF_ERROR(CheckDevicePushAllowedLocked());
    return CheckPushLocked(version, pusher);
  }

  absl::Status CommitPush(int64_t version, const std::string& pusher, int64_t generation,
                          int64_t bytes, const std::function<absl::Status(ShardBackend&)>& apply,
                          rpc::PushGradientsResponse* response) override {
    absl::ReaderMutexLock device_lock(&device_mu_);
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckDevicePushAllowedLocked());
    RETURN_IF_ERROR(CheckPushLocked(version, pusher));
    if (view_ == nullptr || view_->generation != generation || shards_ == nullptr) {
      return absl::FailedPreconditionError("the model was reloaded during the push");
    }
    RETURN_IF_ERROR(apply(*shards_));
    CountPushLocked(version, pusher, bytes, response);
    return absl::OkStatus();
  }

  // ---- RPCs ----

  grpc::ServerReadReactor<rpc::PushGradientsRequest>* PushGradients(
      grpc::CallbackServerContext* context, rpc::PushGradientsResponse* response) override;
  grpc::ServerWriteReactor<rpc::FetchResponse>* Fetch(grpc::CallbackServerContext* context,
                                                      const rpc::FetchRequest* request) override;
  grpc::ServerReadReactor<rpc::PushWeightsRequest>* PushWeights(
      grpc::CallbackServerContext* context, rpc::PushWeightsResponse* response) override;
  grpc::ServerWriteReactor<rpc::DeviceChannelEvent>* OpenDeviceChannel(
      grpc::CallbackServerContext* context,
      const rpc::OpenDeviceChannelRequest* request) override;
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
                                       rpc::LoadShardsResponse* response) override {
    if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                         "/paramd.rpc.Daemon/LoadShards");
        !s.ok()) {
      return auth::RefusedUnary(context, s);
    }
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    // Refused before anything changes: the loaded model stays.
    if (absl::Status s = CheckLoadShardsRequest(*request, options_.limits); !s.ok()) {
      reactor->Finish(ToGrpcStatus(s));
      return reactor;
    }
    absl::StatusOr<ModelView> view;
    {
      absl::MutexLock lock(&mu_);
      view = MakeModelView(request->manifest(), request->daemon_rank(), ++generation_);
    }
    if (!view.ok()) {
      reactor->Finish(ToGrpcStatus(view.status()));
      return reactor;
    }
    auto shared_view = std::make_shared<const ModelView>(*std::move(view));
    LoadSource source;
    for (auto [in, out] : {std::pair{&request->safetensors_path(), &source.safetensors_path},
                           std::pair{&request->checkpoint_path(), &source.checkpoint_path}}) {
      if (in->empty()) continue;
      absl::StatusOr<std::string> resolved =
          ResolveBelow(options_.limits.file_roots, *in, "--model_root");
      if (!resolved.ok()) {
        reactor->Finish(ToGrpcStatus(resolved.status()));
        return reactor;
      }
      *out = *std::move(resolved);
    }
    source.checkpoint_version = request->checkpoint_version();
    worker_.Post([this, shared_view, source, pushers = request->expected_pushers(), reactor,
                  response] {
      // The coordinator may send this as soon as it has registered our Join,
      // before the join thread has seen the reply and opened the data plane.
      const absl::Status joined = AwaitJoined(shared_view->rank);
      if (joined.ok()) snapshots_->DropAll();  // of the model this load replaces
      absl::StatusOr<int64_t> v = joined.ok() ? LoadOnWorker(shared_view, source, pushers)
                                              : absl::StatusOr<int64_t>(joined);
      if (v.ok()) response->set_published_version(*v);
      reactor->Finish(ToGrpcStatus(v.status()));
    });
    return reactor;
  }

  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* context,
                                 const rpc::DaemonStepRequest* request,
                                 rpc::DaemonStepResponse* response) override {
    if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                         "/paramd.rpc.Daemon/Step");
        !s.ok()) {
      return auth::RefusedUnary(context, s);
    }
    const int64_t from = request->version();
    if (absl::Status s = CheckDaemonStepRequest(*request); !s.ok()) {
      grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
      reactor->Finish(ToGrpcStatus(s));
      return reactor;
    }
    {
      absl::MutexLock lock(&mu_);
      absl::Status s = StartAdminStepLocked(from);
      if (!s.ok()) {
        grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
        reactor->Finish(ToGrpcStatus(s));
        return reactor;
      }
    }
    return StartWaitingUnary(&publish_waiters_,
                             [this, from, response]() -> std::optional<grpc::Status> {
                               absl::MutexLock lock(&mu_);
                               if (latest_ && latest_->version > from) {
                                 response->set_published_version(latest_->version);
                                 return grpc::Status::OK;
                               }
                               if (shut_down_) {
                                 return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                                     "daemon shutting down");
                               }
                               if (!stepping_ && failed_step_from_ == from) {
                                 return ToGrpcStatus(last_step_error_);
                               }
                               return std::nullopt;
                             });
  }

  // ---- Recovery (server/recovery.h is the coordinator's side) ----

  grpc::ServerUnaryReactor* PrepareRecovery(grpc::CallbackServerContext* context,
                                            const rpc::PrepareRecoveryRequest* request,
                                            rpc::PrepareRecoveryResponse* response) override {
    if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                         "/paramd.rpc.Daemon/PrepareRecovery");
        !s.ok()) {
      return auth::RefusedUnary(context, s);
    }
    absl::StatusOr<std::string> address = OpenNextWorld(request->epoch());
    if (address.ok()) response->set_data_plane_address(*address);
    for (rpc::SnapshotHeld& h : snapshots_->HoldForRecovery()) {
      *response->add_snapshots() = std::move(h);
    }
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(ToGrpcStatus(address.status()));
    return reactor;
  }

  grpc::ServerUnaryReactor* Recover(grpc::CallbackServerContext* context,
                                    const rpc::RecoverRequest* request,
                                    rpc::RecoverResponse* response) override {
    if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                         "/paramd.rpc.Daemon/Recover");
        !s.ok()) {
      return auth::RefusedUnary(context, s);
    }
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    std::shared_ptr<const ModelView> view;
    if (request->load().manifest().tensors_size() > 0) {
      absl::StatusOr<ModelView> v;
      {
        absl::MutexLock lock(&mu_);
        v = MakeModelView(request->load().manifest(), request->load().daemon_rank(),
                          ++generation_);
      }
      if (!v.ok()) {
        reactor->Finish(ToGrpcStatus(v.status()));
        return reactor;
      }
      view = std::make_shared<const ModelView>(*std::move(v));
    }
    worker_.Post([this, request = *request, view, reactor, response] {
      absl::StatusOr<int64_t> v = RecoverOnWorker(request, view);
      if (v.ok()) response->set_published_version(*v);
      if (!v.ok()) Log(kTag, absl::StrCat("recovery failed: ", v.status().ToString()));
      reactor->Finish(ToGrpcStatus(v.status()));
    });
    return reactor;
  }

  // Buddy copies of snapshots (server/snapshot.h).
  grpc::ServerReadReactor<rpc::SnapshotChunk>* PutSnapshot(
      grpc::CallbackServerContext* context, rpc::PutSnapshotResponse* response) override {
    if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                         "/paramd.rpc.Daemon/PutSnapshot");
        !s.ok()) {
      return auth::RefusedReader<rpc::SnapshotChunk>(s);
    }
    return snapshots_->StartPut(context, response);
  }

  grpc::ServerWriteReactor<rpc::SnapshotChunk>* GetSnapshot(
      grpc::CallbackServerContext* context, const rpc::GetSnapshotRequest* request) override {
    if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                         "/paramd.rpc.Daemon/GetSnapshot");
        !s.ok()) {
      return auth::RefusedWriter<rpc::SnapshotChunk>(s);
    }
    return snapshots_->StartGet(*request);
  }

  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const rpc::GetStatsRequest* request,
                                     rpc::GetStatsResponse* response) override {
    if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                         "/paramd.rpc.Daemon/GetStats");
        !s.ok()) {
      return auth::RefusedUnary(context, s);
    }
    FillStats(request->include_shards(), response->mutable_stats());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  // The coordinator's SetOptimizerSchedule: applied on the worker, between
  // steps (a running step finishes with the old config).
  grpc::ServerUnaryReactor* SetOptimizer(grpc::CallbackServerContext* context,
                                         const rpc::SetOptimizerRequest* request,
                                         rpc::SetOptimizerResponse* /*response*/) override {
    if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                         "/paramd.rpc.Daemon/SetOptimizer");
        !s.ok()) {
      return auth::RefusedUnary(context, s);
    }
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    absl::StatusOr<OptimizerOptions> o = OptimizerFromProto(request->optimizer());
    if (!o.ok()) {
      reactor->Finish(ToGrpcStatus(o.status()));
      return reactor;
    }
    worker_.Post([this, o = *o, reactor] {
      absl::Status s;
      {
        // Under mu_: pushes read the config while they add (CommitPush).
        absl::MutexLock lock(&mu_);
        s = shards_ == nullptr ? absl::FailedPreconditionError("no model loaded on this daemon")
                               : shards_->SetOptimizer(o);
      }
      Log(kTag, s.ok() ? absl::StrCat("optimizer now ", DescribeOptimizer(o))
                       : absl::StrCat("SetOptimizer refused: ", s.ToString()));
      reactor->Finish(ToGrpcStatus(s));
    });
    return reactor;
  }

  absl::Status WithStableState(const Daemon::StableStateFn& fn, absl::Duration timeout) {
    struct Gate {
      absl::Notification entered;
      absl::Notification release;
    };
    auto gate = std::make_shared<Gate>();
    worker_.Post([gate] {
      gate->entered.Notify();
      gate->release.WaitForNotification();
    });
    // Release the worker on every path, also if it never got here.
    struct Releaser {
      Gate* g;
      ~Releaser() { g->release.Notify(); }
    } releaser{gate.get()};
    if (!gate->entered.WaitForNotificationWithTimeout(timeout)) {
      return absl::UnavailableError("the daemon's worker is busy (a step or load is running)");
    }
    snapshots_->BeforeChange();  // host_state() below may rewrite what a snapshot copies
    std::shared_ptr<const PublishedVersion> latest, previous;
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) return absl::UnavailableError("daemon shutting down");
      if (!latest_ || !shards_) {
        return absl::FailedPreconditionError("no model published on this daemon yet");
      }
      latest = latest_;
      previous = previous_;
    }
    const ShardSet* host = shards_->host_state();
    if (host == nullptr) {
      return absl::UnimplementedError(absl::StrCat(
          "checkpoints and exports are not supported by the ", shards_->name(),
          " daemon backend (run the daemons with --backend=cpu)"));
    }
    // gpu backend: the published bytes of both versions on the host.
    if (HostBytesFn bytes = shards_->host_bytes()) {
      ASSIGN_OR_RETURN(latest, bytes(latest));
      if (previous) {
        absl::StatusOr<std::shared_ptr<const PublishedVersion>> p = bytes(previous);
        previous = p.ok() ? *std::move(p) : nullptr;
      }
    }
    return fn(*host, *latest, previous.get());
  }

  // ---- Used by the reactors ----

  // What a fetch should do now.
  struct FetchTarget {
    std::shared_ptr<const PublishedVersion> version;  // null: wait
    std::shared_ptr<const ModelView> view;
    int rank = -1;
    HostBytesFn host_bytes;  // non-null: `version` has no bytes yet (gpu backend)
  };
  absl::StatusOr<FetchTarget> ResolveFetch(int64_t version) {
    absl::MutexLock lock(&mu_);
    FetchTarget t;
    if (shut_down_) return absl::UnavailableError("daemon shutting down");
    RETURN_IF_ERROR(CheckNotReplacedLocked());
    if (!latest_ || version > latest_->version) return t;  // wait
    t.view = view_;
    t.rank = rank_;
    if (shards_) t.host_bytes = shards_->host_bytes();
    if (version < 0 || version == latest_->version) {
      t.version = latest_;
    } else if (previous_ && version == previous_->version) {
      t.version = previous_;
    } else {
      return absl::NotFoundError(absl::StrCat(
          "version ", version, " was dropped; this daemon holds versions ",
          previous_ ? absl::StrCat(previous_->version, " and ") : "", latest_->version));
    }
    return t;
  }

  WaitList* publish_waiters() { return &publish_waiters_; }
  int64_t default_chunk_bytes() const { return options_.default_chunk_bytes; }
  const RequestLimits& limits() const { return options_.limits; }

  // Fetches parked (waiting for an unpublished version) per client host:
  // false when `client` already has the limit parked here.
  bool Park(const std::string& client) {
    absl::MutexLock lock(&parked_mu_);
    int64_t& n = parked_[client];
    if (n >= options_.limits.max_parked_fetches_per_client) return false;
    ++n;
    return true;
  }
  void Unpark(const std::string& client) {
    absl::MutexLock lock(&parked_mu_);
    auto it = parked_.find(client);
    if (it != parked_.end() && --it->second <= 0) parked_.erase(it);
  }
  void AddServed(Direction d, int64_t bytes) {
    bytes_served_[d == Direction::kRowwise ? 0 : 1].fetch_add(bytes);
  }

  // First message of a push stream: fails fast on a bad version or pusher.
  absl::StatusOr<std::shared_ptr<const ModelView>> BeginPush(int64_t version,
                                                             const std::string& pusher) {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckPushLocked(version, pusher));
    return view_;
  }

  // A push stream's registration with the pipelined step (both null when
  // the daemon does not pipeline).
  struct PipelinedPush {
    std::shared_ptr<PushPipeline> pipeline;
    std::shared_ptr<PushPipeline::Stream> stream;
  };
  // After BeginPush: registers the stream with the pipelined step and, if
  // none runs, starts one (it waits for the pushes bucket by bucket).
  absl::StatusOr<PipelinedPush> OpenPipelinedPush(int64_t version, const std::string& pusher) {
    absl::MutexLock lock(&mu_);
    PipelinedPush p;
    if (push_pipeline_ == nullptr) return p;
    ASSIGN_OR_RETURN(p.stream, push_pipeline_->Open(version, pusher));
    p.pipeline = push_pipeline_;
    if (!pipeline_attempt_ && !stepping_ && latest_ && latest_->version == version) {
      pipeline_attempt_ = true;
      worker_.Post([this, version] { RunStep(version, /*apply_optimizer=*/true); });
    }
    return p;
  }

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
  ReadyPart InFlightPart(int64_t version) {
    absl::MutexLock lock(&mu_);
    ReadyPart part;
    if (in_flight_host_.out == nullptr || in_flight_host_.out->version != version) return part;
    part.version = in_flight_host_.out;
    part.ready_tensor_end = in_flight_host_.ready_tensor_end;
    part.ready_pieces = in_flight_host_.ready_pieces;
    part.view = view_;
    part.rank = rank_;
    return part;
  }
  // What an as_ready fetch that streamed pieces of in-flight `v` answers:
  // nullopt while its step runs; OK once `v` is published; ABORTED if the
  // step failed or was started again (the bytes are not a published
  // version).
  std::optional<absl::Status> OutcomeOf(const PublishedVersion* v) {
    absl::MutexLock lock(&mu_);
    if (latest_.get() == v || previous_.get() == v) return absl::OkStatus();
    if (in_flight_host_.out.get() == v) return std::nullopt;
    return absl::AbortedError(absl::StrCat(
        "the step producing version ", v->version,
        " did not publish the bytes sent (they are not a published version; fetch again): ",
        failed_step_from_ == v->version - 1 && !last_step_error_.ok()
            ? last_step_error_.ToString()
            : "the pipelined step was started again"));
  }

  // Sums a complete push into the accumulators (pipelined: keeps it staged
  // for the step, `live`), exactly once per pusher and version; may start
  // the step.
  absl::Status CommitPush(int64_t version, const std::string& pusher, const ModelView& view,
                          std::vector<StagedPiece>& pieces, int64_t bytes,
                          rpc::PushGradientsResponse* response,
                          const PipelinedPush& live = PipelinedPush()) {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckPushLocked(version, pusher));
    if (view.generation != view_->generation) {
      return absl::FailedPreconditionError("the model was reloaded during the push");
    }
    if (live.stream != nullptr) {
      live.pipeline->Commit(*live.stream);
      CountPushLocked(version, pusher, bytes, response);
      return absl::OkStatus();
    }
    const bool last = LastPushLocked();
    for (StagedPiece& p : pieces) {
      // gpu backend: summed on the device (ShardBackend::AccumulateGradient).
      const ShardDef& shard = shards_->shards()[p.shard];
      const int64_t cols = view.tensors[p.tensor].cols;
      RETURN_IF_ERROR(shards_->AccumulateGradient(p.shard, (p.row_begin - shard.row_begin) * cols,
                                                  p.values, last));
    }
    CountPushLocked(version, pusher, bytes, response);
    return absl::OkStatus();
  }

  // Whether the push being committed completes the version: the backend
  // takes the gradient norm's row sums while it adds it.
  bool LastPushLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return expected_pushers_ > 0 && static_cast<int>(pushers_.size()) + 1 >= expected_pushers_;
  }

  // After a push's values were added: counts the pusher (once per version)
  // and may start the step. Host and device pushes alike.
  void CountPushLocked(int64_t version, const std::string& pusher, int64_t bytes,
                       rpc::PushGradientsResponse* response) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    pushers_.insert(pusher);
    bytes_pushed_.fetch_add(bytes);
    response->set_version(version);
    response->set_pushers_received(static_cast<int>(pushers_.size()));
    response->set_pushers_expected(expected_pushers_);
    response->set_bytes_received(bytes);
    MaybeStartStepLocked();
  }

  absl::StatusOr<std::shared_ptr<const ModelView>> BeginWeights() {
    absl::MutexLock lock(&mu_);
    if (!awaiting_weights_) {
      return absl::FailedPreconditionError(
          "this daemon is not waiting for pushed weights (load with declared tensors first)");
    }
    return view_;
  }

  absl::Status CommitWeights(const ModelView& view, std::vector<StagedPiece>& pieces,
                             rpc::PushWeightsResponse* response, int64_t bytes) {
    absl::MutexLock lock(&mu_);
    if (!awaiting_weights_ || view.generation != view_->generation) {
      return absl::FailedPreconditionError("the model was reloaded or published meanwhile");
    }
    for (StagedPiece& p : pieces) {
      absl::Span<float> m = shards_->load_master(p.shard);
      const ShardDef& shard = shards_->shards()[p.shard];
      const int64_t cols = view.tensors[p.tensor].cols;
      std::copy(p.values.begin(), p.values.end(),
                m.begin() + (p.row_begin - shard.row_begin) * cols);
      std::vector<bool>& loaded = rows_loaded_[p.shard];
      for (int64_t r = p.row_begin; r < p.row_end; ++r) {
        if (!loaded[r - shard.row_begin]) {
          loaded[r - shard.row_begin] = true;
          --rows_missing_;
        }
      }
    }
    response->set_bytes_received(bytes);
    response->set_complete(rows_missing_ == 0);
    if (rows_missing_ == 0) {
      awaiting_weights_ = false;
      stepping_ = true;
      stepping_from_ = -1;
      worker_.Post([this] { RunStep(-1, /*apply_optimizer=*/false); });
    }
    return absl::OkStatus();
  }

 private:
  static std::string NewIncarnation() {
    std::random_device device;
    std::mt19937_64 rng((static_cast<uint64_t>(device()) << 32) ^ device() ^
                        static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
    return absl::StrCat(absl::Hex(rng(), absl::kZeroPad16));
  }

  // A daemon whose rank another process took (it was stopped past its
  // lease, then continued) must not serve or take pushes: its state is
  // from before the recovery.
  absl::Status CheckNotReplacedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!replaced_) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "this daemon (rank ", rank_, ") was replaced by another process after its lease expired; "
        "ask the coordinator for the current daemons"));
  }

  // Lease keeper thread: a heartbeat's verdict other than OK.
  void OnHeartbeatVerdict(const rpc::HeartbeatRequest& request, rpc::HeartbeatVerdict verdict) {
    absl::MutexLock lock(&mu_);
    if (verdict == rpc::HEARTBEAT_REPLACED && !replaced_) {
      replaced_ = true;
      Log(kTag, absl::StrCat("rank ", request.rank(),
                             " was taken by another daemon (this one missed its lease); "
                             "refusing fetches and pushes from now on"));
    } else if (verdict == rpc::HEARTBEAT_UNKNOWN && !unknown_logged_) {
      unknown_logged_ = true;
      Log(kTag, absl::StrCat("the coordinator does not know rank ", request.rank(), " (",
                             request.member_id(), ")"));
    }
  }

  // The pipelined step takes its gradients from the host push streams
  // (server/push_pipeline.h), bucket by bucket: a push already in device
  // memory would not be seen.
  absl::Status CheckDevicePushAllowedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (push_pipeline_ == nullptr) return absl::OkStatus();
    return absl::FailedPreconditionError(
        "this daemon runs --pipelined_step, which takes host pushes (PushGradients) only; "
        "push over the host stream, or run the daemons without --pipelined_step");
  }

  absl::Status CheckPushLocked(int64_t version, const std::string& pusher)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (pusher.empty()) return absl::InvalidArgumentError("push without pusher_id");
    RETURN_IF_ERROR(CheckNotReplacedLocked());
    if (recovering_) {
      return absl::UnavailableError(
          "this daemon is recovering from the loss of a daemon; wait for the version the "
          "coordinator rewinds to (WaitForVersion) and push for it");
    }
    if (!latest_) {
      return absl::FailedPreconditionError("no model published on this daemon yet");
    }
    const int64_t current = latest_->version;
    if (version == current && pushers_.count(pusher) > 0) {
      return absl::AlreadyExistsError(absl::StrCat("pusher ", pusher,
                                                   " already pushed gradients for version ",
                                                   version, " to this daemon"));
    }
    if (version < current) {
      return absl::FailedPreconditionError(absl::StrCat(
          "stale push for version ", version, ": this daemon is at version ", current));
    }
    if (version > current) {
      return absl::OutOfRangeError(absl::StrCat("push for future version ", version,
                                                ": this daemon is at version ", current,
                                                "; wait for it first"));
    }
    if (stepping_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "version ", version, " is being stepped; push for version ", version + 1, " later"));
    }
    if (static_cast<int64_t>(pushers_.size()) >= options_.limits.max_pushers_per_version) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "version ", version, " already has ", pushers_.size(),
          " pushers on this daemon: the limit (--max_pushers_per_version)"));
    }
    if (expected_pushers_ > 0 && static_cast<int>(pushers_.size()) >= expected_pushers_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "all ", expected_pushers_, " expected pushers already pushed version ", version));
    }
    return absl::OkStatus();
  }

  void MaybeStartStepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!latest_ || stepping_ || expected_pushers_ <= 0 ||
        static_cast<int>(pushers_.size()) < expected_pushers_) {
      return;
    }
    stepping_ = true;
    stepping_from_ = latest_->version;
    const int64_t from = stepping_from_;
    if (pipeline_attempt_) {  // the running pipelined step commits now
      push_pipeline_->Wake();
      return;
    }
    worker_.Post([this, from] { RunStep(from, /*apply_optimizer=*/true); });
  }

  absl::Status StartAdminStepLocked(int64_t from) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!latest_) return absl::FailedPreconditionError("no model published on this daemon yet");
    if (stepping_ && stepping_from_ == from) return absl::OkStatus();  // already running
    if (from < latest_->version) return absl::OkStatus();  // already done: reported at once
    if (from > latest_->version) {
      return absl::OutOfRangeError(absl::StrCat("step from version ", from,
                                                ": this daemon is at version ",
                                                latest_->version));
    }
    if (stepping_) return absl::FailedPreconditionError("another step is running");
    stepping_ = true;
    stepping_from_ = from;
    worker_.Post([this, from] { RunStep(from, /*apply_optimizer=*/true); });
    return absl::OkStatus();
  }

  // Worker thread: publishes version from+1 (with one optimizer step if
  // `apply_optimizer`) and reports it. A load publishes 0 (from = -1), a
  // restore of checkpoint V republishes V (from = V-1, no optimizer, no
  // delayed-scaling update).
  void RunStep(int64_t from, bool apply_optimizer, bool update_delayed = true) {
    snapshots_->BeforeChange();  // the state a snapshot copies stays until then
    AllReduceMaxFn all_reduce;
    ShardBackend* shards;
    bool shutting_down;
    std::pair<int64_t, int64_t> retire{-1, -1};  // (generation, version) rewritten
    bool pipelined;
    {
      absl::MutexLock lock(&mu_);
      pipelined = apply_optimizer && push_pipeline_ != nullptr;
      // A pipelined step posted again after it gave the worker up, whose
      // version was stepped meanwhile (an admin step).
      if (pipelined && (!latest_ || latest_->version != from)) return;
      all_reduce = all_reduce_;
      shards = shards_.get();
      shards->set_data_plane(data_plane_transport_, options_.step_timeout);
      shards->set_step_enqueued([this](int64_t version) { OnStepEnqueued(version); });
      // The gpu backend rewrites the device slot of the version before
      // `from` (it keeps two): device sends of it that already started
      // finish first, later ones are refused (ServeDeviceFetch). Sends of
      // `from` itself run beside the step; there is no whole-step lock.
      overwriting_version_ = previous_ ? previous_->version : -1;
      auto unpinned = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return shut_down_ || fetch_pins_.count(overwriting_version_) == 0;
      };
      mu_.Await(absl::Condition(&unpinned));
      shutting_down = shut_down_;
      retire = {generation_, overwriting_version_};
    }
    // Same-GPU sessions (server/ipc/): the step waits while a live session
    // pins the version whose buffers it rewrites.
    if (!shutting_down && !ipc_->RetireForStep(retire.first, retire.second).ok()) {
      shutting_down = true;
    }
    const absl::Time start = absl::Now();
    absl::StatusOr<std::shared_ptr<const PublishedVersion>> result;
    if (shutting_down) {
      // Sends may still read the slot: never rewrite it under them.
      result = absl::UnavailableError("daemon shutting down");
    } else if (!all_reduce) {
      result = absl::FailedPreconditionError("data plane not open");
    } else if (pipelined) {
      result = StepPipelined(shards, from, all_reduce, update_delayed);
    } else {
      result = shards->Step(from + 1, apply_optimizer, all_reduce, update_delayed);
    }
    shards->set_step_enqueued(nullptr);
    if (pipelined && IsStepAbandoned(result.status())) {  // nothing happened
      {
        absl::MutexLock lock(&mu_);
        overwriting_version_ = -1;
      }
      ipc_->EndRetire(retire.first, retire.second);
      return;
    }
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    {
      absl::MutexLock lock(&mu_);
      stepping_ = false;
      overwriting_version_ = -1;
      in_flight_version_ = -1;
      in_flight_host_ = InFlightHost();
      if (pipelined) pipeline_attempt_ = false;
      if (result.ok()) {
        previous_ = apply_optimizer ? latest_ : nullptr;
        latest_ = *result;
        pushers_.clear();
        if (push_pipeline_ != nullptr && apply_optimizer) push_pipeline_->Published(from);
        last_step_seconds_ = seconds;
        if (apply_optimizer) {
          ++steps_;
          telemetry::ObserveStep(seconds);
        }
      } else {
        failed_step_from_ = from;
        last_step_error_ = result.status();
      }
    }
    ipc_->EndRetire(retire.first, retire.second);
    publish_waiters_.WakeAll();
    if (!result.ok()) {
      LogError(kTag, absl::StrCat("step from version ", from, " failed: ", result.status().ToString()));
      return;
    }
    ReportVersion(from + 1, seconds);
    if (apply_optimizer && update_delayed) snapshots_->AfterPublish(*shards, **result);
  }

  // Worker thread: the pipelined step from `from` (server/step_pipeline.h):
  // buckets are stepped as the pushes deliver them, each announced to
  // as_ready fetches. An abandoned attempt is run again at once while it
  // can progress, or posted behind the worker's other work (then this
  // returns the abandon, and RunStep leaves everything as it was).
  absl::StatusOr<std::shared_ptr<const PublishedVersion>> StepPipelined(
      ShardBackend* shards, int64_t from, const AllReduceMaxFn& all_reduce, bool update_delayed) {
    std::shared_ptr<PushPipeline> pipeline;
    {
      absl::MutexLock lock(&mu_);
      pipeline = push_pipeline_;
    }
    const std::vector<StepBucket> buckets =
        PlanStepBuckets(shards->tensors(), shards->shards(), options_.step_bucket_elements);
    const std::function<bool()> yield = [this] { return worker_.HasPending(); };
    for (;;) {
      // Sized before fetches can see it (InFlightPart).
      std::shared_ptr<PublishedVersion> out =
          NewPipelinedVersion(from + 1, buckets, static_cast<int>(shards->tensors().size()));
      {
        absl::MutexLock lock(&mu_);
        // Once every push is counted (stepping_), only committed ones count.
        pipeline->BeginAttempt(from, stepping_);
        in_flight_host_ = InFlightHost();
        in_flight_host_.out = out;
      }
      PipelinedStepHooks hooks;
      hooks.await_bucket = [&](const StepBucket& b, BucketGradients* g) {
        return pipeline->AwaitBucket(b, g, absl::InfiniteFuture(), yield);
      };
      hooks.check_bucket = [&] { return pipeline->CheckUsed(); };
      hooks.on_bucket_ready = [&](int b) {
        {
          absl::MutexLock lock(&mu_);
          in_flight_host_.ready_tensor_end = buckets[b].tensor_end;
          in_flight_host_.ready_pieces = buckets[b].piece_end;
        }
        publish_waiters_.WakeAll();
      };
      hooks.before_commit = [&] { return pipeline->AwaitCommit(absl::InfiniteFuture(), yield); };
      absl::StatusOr<std::shared_ptr<const PublishedVersion>> result =
          shards->StepPipelined(from + 1, all_reduce, update_delayed, buckets, hooks, out);
      pipeline->EndAttempt();
      if (!IsStepAbandoned(result.status())) return result;
      bool again = false;
      const char* next = "waits for the next push";
      {
        absl::MutexLock lock(&mu_);
        in_flight_host_ = InFlightHost();  // as_ready fetches of it: ABORTED
        if (shut_down_) {
          pipeline_attempt_ = false;
        } else if (worker_.HasPending()) {
          worker_.Post([this, from] { RunStep(from, /*apply_optimizer=*/true); });
          next = "runs again after the worker's other work";
        } else if (stepping_ || pipeline->CanProgress(from)) {
          again = true;
          next = "runs again";
        } else {
          pipeline_attempt_ = false;  // the next push to begin starts one
        }
      }
      // Waiting for a pusher that has not begun is the usual case; anything
      // else (a failed push, queued work) is worth a line.
      const std::string line = absl::StrCat("step from version ", from, ": ",
                                            result.status().message(), "; ", next);
      if (!absl::StrContains(line, "not begun")) {
        LogInfo(kTag, line);
      } else {
        LogDebug(kTag, line);
      }
      publish_waiters_.WakeAll();
      if (!again) return result;
    }
  }

  // Step thread (ShardBackend::set_step_enqueued): `version`'s device work
  // is enqueued, so FetchDevice calls with reply_after_send waiting for it
  // may start their sends now (behind the per-tensor ready events).
  void OnStepEnqueued(int64_t version) {
    {
      absl::MutexLock lock(&mu_);
      in_flight_version_ = version;
    }
    publish_waiters_.WakeAll();
  }

  // Worker thread: waits until the join thread is done (bounded), then
  // checks that this daemon is rank `rank`.
  absl::Status AwaitJoined(int rank) {
    absl::MutexLock lock(&mu_);
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return shut_down_ || join_done_;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&done), options_.step_timeout)) {
      return absl::UnavailableError("daemon has not finished joining");
    }
    if (shut_down_) return absl::UnavailableError("daemon shutting down");
    if (!all_reduce_) {
      return absl::FailedPreconditionError(absl::StrCat("daemon not joined: ", join_error_));
    }
    if (rank != rank_) {
      return absl::FailedPreconditionError(
          absl::StrCat("LoadShards for daemon rank ", rank, " sent to rank ", rank_));
    }
    return absl::OkStatus();
  }

  struct LoadSource {
    std::string safetensors_path;  // else pushed weights, unless a checkpoint
    std::string checkpoint_path;
    int64_t checkpoint_version = -1;
    std::shared_ptr<const DaemonSnapshot> snapshot;  // a recovery from a snapshot
  };

  // Worker thread: installs a new model and publishes its first version (0
  // from a file, V from checkpoint V); with neither, waits for PushWeights.
  absl::StatusOr<int64_t> LoadOnWorker(std::shared_ptr<const ModelView> view,
                                       const LoadSource& source, int expected_pushers) {
    ShardBackendOptions backend_options;
    // The coordinator's config (every manifest it sends has one).
    backend_options.optimizer = view->optimizer.value_or(options_.optimizer);
    backend_options.step_timeout = options_.step_timeout;
    snapshots_->BeforeChange();
    const bool restore = !source.checkpoint_path.empty() || source.snapshot != nullptr;
    absl::StatusOr<std::unique_ptr<ShardBackend>> created =
        CreateShardBackend(backend_, view->tensors, view->shards, backend_options);
    // --backend=auto: the gpu where it supports the model, else the cpu
    // (logged: the operator sees why). A model that does not fit the GPU is
    // an error, not a silent move to the host.
    if (backend_auto_ && backend_ == gpu_backend::DaemonBackend::kGpu &&
        absl::IsUnimplemented(created.status())) {
      Log(kTag, absl::StrCat("--backend=auto: cpu backend for this model (gpu: ",
                             created.status().ToString(), ")"));
      created = CreateShardBackend(gpu_backend::DaemonBackend::kCpu, view->tensors, view->shards,
                                   backend_options);
    }
    RETURN_IF_ERROR(created.status());
    std::unique_ptr<ShardBackend> shards = *std::move(created);
    const bool from_file = restore || !source.safetensors_path.empty();
    std::vector<SavedDelayedState> next_delayed;
    if (restore) {
      if (shards->host_state() == nullptr) {
        return absl::UnimplementedError(
            absl::StrCat("restoring a checkpoint is not supported by the ", shards->name(),
                         " daemon backend (run the daemons with --backend=cpu)"));
      }
      if (source.snapshot != nullptr) {
        ASSIGN_OR_RETURN(next_delayed, RestoreSnapshot(*source.snapshot, *shards->host_state()));
      } else {
        ASSIGN_OR_RETURN(next_delayed, RestoreShardSet(source.checkpoint_path,
                                                       source.checkpoint_version,
                                                       *shards->host_state()));
      }
    } else if (from_file) {
      ASSIGN_OR_RETURN(safetensors::SafetensorsFile file,
                       safetensors::SafetensorsFile::Open(
                           source.safetensors_path, options_.limits.max_tensor_name_bytes));
      absl::Time next_progress = absl::Now() + absl::Seconds(5);
      for (size_t i = 0; i < shards->shards().size(); ++i) {
        const ShardDef& d = shards->shards()[i];
        RETURN_IF_ERROR(ReadRows(file, view->tensors[d.tensor], d, shards->load_master(i)));
        if (absl::Now() >= next_progress) {  // a large model: say how far it is
          LogInfo(kTag, absl::StrCat("rank ", view->rank, ": read ", i + 1, " of ",
                                     shards->shards().size(), " shards of ",
                                     source.safetensors_path));
          next_progress = absl::Now() + absl::Seconds(5);
        }
      }
    }
    const int64_t first_version =
        source.snapshot != nullptr ? source.snapshot->header.version()
                                   : (restore ? source.checkpoint_version : 0);
    {
      absl::WriterMutexLock device_lock(&device_mu_);  // frees the old backend
      absl::MutexLock lock(&mu_);
      shards_ = std::move(shards);
      view_ = view;
      expected_pushers_ = expected_pushers;
      push_pipeline_ = options_.pipelined_step ? std::make_shared<PushPipeline>(
                                                     view->tensors, view->shards, expected_pushers)
                                               : nullptr;
      pipeline_attempt_ = false;
      in_flight_host_ = InFlightHost();
      latest_ = nullptr;
      previous_ = nullptr;
      pushers_.clear();
      failed_step_from_ = -2;
      rows_loaded_.clear();
      rows_missing_ = 0;
      for (const ShardDef& d : view->shards) {
        rows_loaded_.emplace_back(d.rows(), from_file);
        if (!from_file) rows_missing_ += d.rows();
      }
      awaiting_weights_ = !from_file && rows_missing_ > 0;
      if (awaiting_weights_) return -1;
      stepping_ = true;
      stepping_from_ = first_version - 1;
    }
    Log(kTag, absl::StrCat("rank ", view->rank, " (", shards_->name(), " backend): ",
                           restore ? "restored " : "loaded ",
                           view->shards.size(), " shards of ", view->tensors.size(),
                           " tensors", restore ? absl::StrCat(" at version ", first_version) : ""));
    snapshots_->SetModel(view->rank, DaemonAddresses(view->manifest),
                         ShardLayoutHash(view->tensors, view->shards));
    RunStep(first_version - 1, /*apply_optimizer=*/false, /*update_delayed=*/!restore);
    absl::MutexLock lock(&mu_);
    if (!latest_) return last_step_error_;
    // Back to the saved post-update scales (the worker is still ours: no
    // step can run in between).
    if (restore) ApplyDelayedStates(next_delayed, *shards_->host_state());
    return latest_->version;
  }

  // gRPC thread: leaves the current data-plane world (a step blocked in its
  // all-reduce fails now) and opens the endpoint of the next one. The same
  // epoch again (a retried call) gives the same endpoint.
  absl::StatusOr<std::string> OpenNextWorld(int64_t epoch) {
    {
      absl::MutexLock lock(&mu_);
      recovering_ = true;
    }
    absl::MutexLock lock(&plane_mu_);
    if (pending_plane_ != nullptr && pending_epoch_ == epoch) return pending_plane_->address();
    if (data_plane_) data_plane_->Shutdown();
    ASSIGN_OR_RETURN(pending_plane_,
                     DaemonDataPlane::Open(options_.data_plane, options_.data_plane_listen,
                                           options_.step_timeout));
    pending_epoch_ = epoch;
    Log(kTag, absl::StrCat("recovery ", epoch, ": left the data-plane world; next endpoint ",
                           pending_plane_->address()));
    return pending_plane_->address();
  }

  // Worker thread: connects the world PrepareRecovery opened and, with a
  // model, restores this rank's shards of the checkpoint and republishes
  // its version (LoadOnWorker); returns that version (-1: no model).
  absl::StatusOr<int64_t> RecoverOnWorker(const rpc::RecoverRequest& request,
                                          std::shared_ptr<const ModelView> view) {
    const int rank = request.load().daemon_rank();
    std::unique_ptr<DaemonDataPlane> old;
    {
      absl::MutexLock lock(&plane_mu_);
      if (pending_plane_ == nullptr || pending_epoch_ != request.epoch()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "Recover for epoch ", request.epoch(), " without its PrepareRecovery"));
      }
      old = std::move(data_plane_);
      data_plane_ = std::move(pending_plane_);
    }
    ASSIGN_OR_RETURN(AllReduceMaxFn all_reduce, data_plane_->Connect(request.data_plane(), rank));
    {
      absl::MutexLock lock(&mu_);
      if (rank != rank_) {
        return absl::FailedPreconditionError(
            absl::StrCat("Recover for daemon rank ", rank, " sent to rank ", rank_));
      }
      all_reduce_ = std::move(all_reduce);
      data_plane_transport_ = data_plane_->transport();
      recovery_epoch_ = request.epoch();
      join_error_.clear();
      join_done_ = true;
    }
    old.reset();  // its transport served only this worker's steps
    int64_t version = -1;
    if (view != nullptr) {
      LoadSource source;
      if (request.has_snapshot_version()) {
        // This rank's own copy, or the buddy's copy of a replaced rank.
        if (request.snapshot_source().empty()) {
          source.snapshot = snapshots_->Find(rank, request.snapshot_version());
          if (source.snapshot == nullptr) {
            return absl::NotFoundError(absl::StrCat("no snapshot v", request.snapshot_version(),
                                                    " of rank ", rank, " held here"));
          }
        } else {
          ASSIGN_OR_RETURN(source.snapshot,
                           snapshots_->Fetch(request.snapshot_source(), rank,
                                             request.snapshot_version()));
        }
      } else {
        source.checkpoint_path = request.load().checkpoint_path();
        source.checkpoint_version = request.load().checkpoint_version();
      }
      ASSIGN_OR_RETURN(version, LoadOnWorker(view, source, request.load().expected_pushers()));
      snapshots_->AfterRecovery(version, source.snapshot);
    }
    absl::MutexLock lock(&mu_);
    recovering_ = false;
    Log(kTag, absl::StrCat("recovery ", request.epoch(), ": rank ", rank, " in the new world",
                           version >= 0 ? absl::StrCat(", at version ", version) : ""));
    return version;
  }

  void ReportVersion(int64_t version, double seconds) {
    rpc::ReportVersionRequest request;
    {
      absl::MutexLock lock(&mu_);
      request.set_member_id(member_id_);
      request.set_daemon_rank(rank_);
      request.set_recovery_epoch(recovery_epoch_);
    }
    request.set_published_version(version);
    request.set_step_seconds(seconds);
    for (int attempt = 0; attempt < 5; ++attempt) {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + options_.coordinator_call_timeout));
      rpc::ReportVersionResponse response;
      grpc::Status s = coordinator_->ReportVersion(&context, request, &response);
      if (s.ok()) return;
      LogWarning(kTag, absl::StrCat("ReportVersion(", version, ") failed: ", s.error_message()));
      {
        absl::MutexLock lock(&mu_);
        if (shut_down_) return;
      }
      absl::SleepFor(absl::Milliseconds(200 << attempt));
    }
  }

  void JoinLoop() {
    JoinLoopBody();
    absl::MutexLock lock(&mu_);
    join_done_ = true;
  }

  void JoinLoopBody() {
    const absl::Time give_up = absl::Now() + options_.join_timeout;
    absl::StatusOr<std::unique_ptr<DaemonDataPlane>> data_plane =
        DaemonDataPlane::Open(options_.data_plane, options_.data_plane_listen,
                              options_.step_timeout, options_.authenticator,
                              std::make_shared<const auth::ChannelSecurity>(
                                  auth::ChannelSecurity{options_.tls, coordinator_token_}));
    if (!data_plane.ok()) {
      absl::MutexLock lock(&mu_);
      join_error_ = absl::StrCat("data plane: ", data_plane.status().ToString());
      LogError(kTag, join_error_);
      return;
    }
    {
      absl::MutexLock lock(&plane_mu_);
      data_plane_ = *std::move(data_plane);
    }
    rpc::JoinRequest request;
    request.set_role(rpc::ROLE_DAEMON);
    {
      absl::MutexLock lock(&mu_);
      request.set_address(address_);
    }
    request.set_data_plane_address(data_plane_->address());
    request.set_name(absl::StrCat("daemon@", request.address()));
    request.set_wait_for_world(true);
    absl::Time next_waiting_log = absl::InfinitePast();
    request.set_incarnation(incarnation_);
    if (options_.rank >= 0) request.set_rank(options_.rank);
    bool unavailable_logged = false;
    *request.mutable_optimizer_flags() = options_.optimizer_flags;
    request.set_pipelined_step(options_.pipelined_step);
    request.set_step_bucket_elements(options_.step_bucket_elements);
    request.set_member_secret(options_.member_secret);
    while (absl::Now() < give_up) {
      // Until the coordinator answers, say so every few seconds (a daemon
      // started before its coordinator is not silent).
      if (!channel_->WaitForConnected(
              absl::ToChronoTime(std::min(give_up, absl::Now() + absl::Seconds(1))))) {
        {
          absl::MutexLock lock(&mu_);
          if (shut_down_) return;
        }
        if (absl::Now() >= next_waiting_log) {
          Log(kTag, absl::StrCat("waiting for the coordinator at ", coordinator_address_,
                                 " (not reachable yet; retrying, giving up in ",
                                 absl::FormatDuration(absl::Trunc(give_up - absl::Now(),
                                                                  absl::Seconds(1))),
                                 ")"));
          next_waiting_log = absl::Now() + absl::Seconds(5);
        }
        continue;
      }
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(std::min(give_up, absl::Now() + absl::Seconds(30))));
      context.set_wait_for_ready(true);
      {
        absl::MutexLock lock(&mu_);
        if (shut_down_) return;
        join_context_ = &context;
      }
      rpc::JoinResponse response;
      grpc::Status s = coordinator_->Join(&context, request, &response);
      {
        absl::MutexLock lock(&mu_);
        join_context_ = nullptr;
        if (shut_down_) return;
      }
      if (s.ok() && !response.cluster_secret().empty()) {
        if (options_.authenticator) {
          options_.authenticator->AddClusterSecret(response.cluster_secret());
        }
        coordinator_token_->Set(response.cluster_secret());
      }
      if (s.ok() && response.replacement()) {
        // The world's data plane is rebuilt by the coordinator's recovery,
        // which also gives this daemon the rank's state.
        absl::MutexLock lock(&mu_);
        rank_ = response.rank();
        member_id_ = response.member_id();
        recovering_ = true;
        Log(kTag, absl::StrCat("joined as daemon rank ", rank_, " of ",
                               response.data_plane().num_daemons(),
                               ", replacing a daemon that went down; waiting for the "
                               "coordinator's recovery"));
        return;
      }
      if (s.ok()) {
        absl::StatusOr<AllReduceMaxFn> all_reduce =
            data_plane_->Connect(response.data_plane(), response.rank());
        absl::MutexLock lock(&mu_);
        rank_ = response.rank();
        SetLogRank(rank_);
        member_id_ = response.member_id();
        if (all_reduce.ok()) {
          all_reduce_ = *std::move(all_reduce);
          data_plane_transport_ = data_plane_->transport();
        } else {
          join_error_ = all_reduce.status().ToString();
        }
        if (response.has_optimizer()) {
          absl::StatusOr<OptimizerOptions> o = OptimizerFromProto(response.optimizer());
          Log(kTag, o.ok() ? absl::StrCat("coordinator's optimizer: ", DescribeOptimizer(*o))
                           : absl::StrCat("coordinator's optimizer config: ", o.status().ToString()));
        }
        Log(kTag, absl::StrCat("joined as daemon rank ", rank_, " of ",
                               response.data_plane().num_daemons(), "; backend ",
                               backend_ == gpu_backend::DaemonBackend::kGpu ? "gpu" : "cpu",
                               backend_auto_ ? " (--backend=auto)" : "",
                               all_reduce.ok() ? "" : absl::StrCat("; data plane: ", join_error_)));
        return;
      }
      const grpc::StatusCode code = s.error_code();
      if (code == grpc::StatusCode::UNAVAILABLE && !s.error_message().empty() &&
          !unavailable_logged) {
        // E.g. --rank=N while the previous holder's lease has not expired.
        unavailable_logged = true;
        Log(kTag, absl::StrCat("join: ", s.error_message(), " (retrying)"));
      }
      if (code != grpc::StatusCode::UNAVAILABLE && code != grpc::StatusCode::DEADLINE_EXCEEDED) {
        absl::MutexLock lock(&mu_);
        join_error_ = absl::StrCat("join refused: ", s.error_message());
        LogError(kTag, join_error_);
        return;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    absl::MutexLock lock(&mu_);
    join_error_ = absl::StrCat("could not join the coordinator at ", coordinator_address_,
                               " within ", absl::FormatDuration(options_.join_timeout));
    LogError(kTag, join_error_);
  }

  std::vector<PieceHealth> PublishedHealth(int64_t max_samples) const {
    std::shared_ptr<const PublishedVersion> latest;
    std::shared_ptr<const ModelView> view;
    {
      absl::MutexLock lock(&mu_);
      latest = latest_;
      view = view_;
    }
    std::vector<PieceHealth> out;
    if (!latest || !view) return out;
    for (const PublishedPiece& p : latest->pieces) {
      if (p.tensor < 0 || p.tensor >= static_cast<int>(view->tensors.size())) continue;
      const TensorDef& t = view->tensors[p.tensor];
      const QuantSpec& spec =
          p.direction == Direction::kRowwise ? t.spec.rowwise : t.spec.columnwise;
      PieceHealth h;
      h.tensor = t.name;
      h.direction = p.direction;
      h.format = p.q.format;
      h.row_begin = p.row_begin;
      h.row_end = p.row_end;
      h.amax = p.q.amax;
      h.scale = p.scale;
      h.codes = CountCodes(p.q, spec.fp8_type, max_samples);
      out.push_back(std::move(h));
    }
    return out;
  }

  void FillStats(bool include_shards, rpc::DaemonStats* stats) const {
    absl::MutexLock lock(&mu_);
    stats->set_rank(rank_);
    stats->set_address(address_);
    stats->set_published_version(latest_ ? latest_->version : -1);
    if (previous_) stats->add_held_versions(previous_->version);
    if (latest_) stats->add_held_versions(latest_->version);
    stats->set_pushers_received(static_cast<int>(pushers_.size()));
    stats->set_pushers_expected(expected_pushers_);
    stats->set_bytes_served_rowwise(bytes_served_[0].load());
    stats->set_bytes_served_columnwise(bytes_served_[1].load());
    stats->set_device_fetches_streamed(device_fetches_streamed_.load());
    stats->set_device_fetches_beside_step(device_fetches_beside_step_.load());
    stats->set_bytes_pushed(bytes_pushed_.load());
    stats->set_steps(steps_);
    stats->set_last_step_seconds(last_step_seconds_);
    if (latest_) {
      const StepReport& r = latest_->report;
      stats->set_optimizer_steps(r.optimizer_steps);
      stats->set_skipped_steps(r.skipped_steps);
      stats->set_lr(r.lr);
      stats->set_grad_norm(r.grad_norm);
      stats->set_clip_factor(r.clip_factor);
    }
    if (shards_ != nullptr) {  // replaced only under mu_ (LoadOnWorker)
      const BackendMemory memory = shards_->memory();
      stats->set_backend(std::string(shards_->name()));
      stats->set_parameters(memory.parameters);
      stats->set_device_bytes(memory.device_bytes);
      stats->set_device_bytes_per_parameter(memory.device_bytes_per_parameter());
    }
    std::string error = join_error_;
    if (failed_step_from_ > -2 && !last_step_error_.ok()) {
      absl::StrAppend(&error, error.empty() ? "" : "; ", "step from ", failed_step_from_,
                      " failed: ", last_step_error_.ToString());
    }
    stats->set_error(error);
    snapshots_->FillStats(stats);
    if (!include_shards || !latest_ || !view_) return;
    for (const PublishedPiece& p : latest_->pieces) {
      if (stats->shards_size() == 0 || stats->shards().rbegin()->tensor() !=
                                           view_->tensors[p.tensor].name ||
          stats->shards().rbegin()->row_begin() != p.row_begin) {
        rpc::ShardStats* s = stats->add_shards();
        s->set_tensor(view_->tensors[p.tensor].name);
        s->set_row_begin(p.row_begin);
        s->set_row_end(p.row_end);
      }
      rpc::DirectionStats* d = stats->mutable_shards()->rbegin()->add_directions();
      d->set_direction(DirectionToProto(p.direction));
      d->set_format(FormatToProto(p.q.format));
      d->set_scale(p.scale);
      d->set_scale_inv(p.q.scale_inv);
      d->set_amax(p.q.amax);
      // Delayed scaling records the reduced amax of the cast as its newest
      // history entry.
      if (p.q.format == Format::kFp8Delayed) d->set_amax_history_head(p.q.amax);
    }
  }

  DaemonOptions options_;
  std::string coordinator_address_;  // set by Start()
  // The cluster secret once joined: presented to the coordinator and to
  // other daemons (snapshot copies).
  std::shared_ptr<auth::BearerToken> coordinator_token_;
  std::unique_ptr<SnapshotKeeper> snapshots_;  // thread-safe; outlives worker_
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<rpc::Coordinator::Stub> coordinator_;
  std::thread join_thread_;
  std::unique_ptr<LeaseKeeper> lease_;
  // The data plane of the current world, and the endpoint of the next one
  // (PrepareRecovery) until Recover connects it. Replaced only by the join
  // thread (before the first Connect) and by Recover on the worker, so the
  // worker may use data_plane_ without plane_mu_.
  absl::Mutex plane_mu_;
  std::unique_ptr<DaemonDataPlane> data_plane_;
  std::unique_ptr<DaemonDataPlane> pending_plane_ ABSL_GUARDED_BY(plane_mu_);
  int64_t pending_epoch_ ABSL_GUARDED_BY(plane_mu_) = -1;
  Worker worker_;
  WaitList publish_waiters_;
  std::atomic<int64_t> bytes_served_[2] = {0, 0};
  // DaemonStats.device_fetches_streamed / device_fetches_beside_step.
  std::atomic<int64_t> device_fetches_streamed_{0};
  std::atomic<int64_t> device_fetches_beside_step_{0};
  std::atomic<int64_t> bytes_pushed_{0};

  mutable absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* join_context_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::string address_ ABSL_GUARDED_BY(mu_);
  int rank_ ABSL_GUARDED_BY(mu_) = -1;
  std::string member_id_ ABSL_GUARDED_BY(mu_);
  const std::string incarnation_;  // JoinRequest.incarnation
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
  gpu_backend::DaemonBackend backend_ = gpu_backend::DaemonBackend::kCpu;
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
  void ServeDevicePush(ChannelState* c, const DevicePush& push, rpc::PushGradientsResponse* response,
                       grpc::ServerUnaryReactor* reactor);
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
                                               std::shared_ptr<DeviceFetchCall> call);

  // Readers: device sends and device-push commits (they use the backend's
  // device memory); writer: a load (it frees the old backend). Steps do not
  // take it: they wait for pins instead (fetch_pins_). Taken before mu_.
  absl::Mutex device_mu_;
  uint64_t next_channel_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::shared_ptr<ChannelState>> channels_ ABSL_GUARDED_BY(mu_);
  Worker reaper_;  // destroys closed channels

  absl::Mutex parked_mu_;
  std::map<std::string, int64_t> parked_ ABSL_GUARDED_BY(parked_mu_);

  static ipc::IpcServiceOptions IpcOptions(const DaemonOptions& options) {
    ipc::IpcServiceOptions o;
    o.authenticator = options.authenticator;
    return o;
  }
  // Declared last: destroyed first (its socket thread calls WithSnapshot).
  std::unique_ptr<ipc::IpcService> ipc_;
};

namespace {

// ---- Client-streaming uploads of GradientChunks ----
//
// Every message is validated as it arrives; the stream's content is applied
// only on its explicit end marker (OnMessage sets finished_), for gradient
// pushes and pushed weights alike. A failed read
// is never taken for a clean end: gRPC reports a message over the size
// limit, a cancel or a broken connection the same way (ok = false) and the
// context need not say cancelled yet.
// The end marker's total against the chunk bytes the stream carried.
absl::Status CheckStreamEnd(int64_t total_bytes, int64_t carried, absl::string_view what) {
  if (total_bytes == carried) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, " end marker says ", total_bytes,
                                                 " bytes but the stream carried ", carried,
                                                 "; nothing applied"));
}

template <class Request, class Response>
class ChunkStreamReactor : public grpc::ServerReadReactor<Request> {
 public:
  ChunkStreamReactor(Daemon::Impl* daemon, grpc::CallbackServerContext* context,
                     Response* response)
      : daemon_(daemon), context_(context), response_(response) {}

  void OnReadDone(bool ok) override {
    absl::Status s;
    if (!ok) {
      s = context_->IsCancelled() ? absl::CancelledError("upload cancelled; nothing applied")
                                  : OnStreamEnd();
      this->Finish(ToGrpcStatus(s));
      return;
    }
    s = OnMessage(request_);
    if (!s.ok() || finished_) {
      this->Finish(ToGrpcStatus(s));
      return;
    }
    this->StartRead(&request_);
  }

  void OnDone() override { delete this; }

 protected:
  virtual absl::Status OnMessage(const Request& request) = 0;
  // The read side ended without the context cancelled: a half-close, or a
  // read that failed for another reason.
  virtual absl::Status OnStreamEnd() = 0;

  Daemon::Impl* const daemon_;
  grpc::CallbackServerContext* const context_;
  Response* const response_;
  Request request_;
  std::shared_ptr<const ModelView> view_;
  std::optional<ChunkAssembler> assembler_;
  bool finished_ = false;  // OnMessage applied the stream: answer now
};

// PushGradients: one atomic contribution of one pusher for one version,
// applied only on its end marker.
class PushReactor
    : public ChunkStreamReactor<rpc::PushGradientsRequest, rpc::PushGradientsResponse> {
 public:
  using ChunkStreamReactor::ChunkStreamReactor;
  void Begin() { StartRead(&request_); }

 private:
  absl::Status OnMessage(const rpc::PushGradientsRequest& request) override {
    absl::Status s = ReadMessage(request);
    if (!s.ok() && live_.stream != nullptr) live_.pipeline->Fail(*live_.stream);
    return s;
  }

  absl::Status ReadMessage(const rpc::PushGradientsRequest& request) {
    if (view_ == nullptr) {
      version_ = request.version();
      pusher_ = request.pusher_id();
      ASSIGN_OR_RETURN(view_, daemon_->BeginPush(version_, pusher_));
      // non_finite: SKIP_STEP takes NaN/Inf; the step then skips.
      assembler_.emplace(view_.get(), view_->optimizer.has_value() &&
                                          view_->optimizer->non_finite ==
                                              NonFinitePolicy::kSkipStep);
      ASSIGN_OR_RETURN(live_, daemon_->OpenPipelinedPush(version_, pusher_));
    } else if ((request.version() != 0 && request.version() != version_) ||
               (!request.pusher_id().empty() && request.pusher_id() != pusher_)) {
      return absl::InvalidArgumentError("version/pusher_id changed inside a push stream");
    }
    if (request.has_chunk()) {
      carried_ += static_cast<int64_t>(request.chunk().data().size());
      RETURN_IF_ERROR(assembler_->Add(request.chunk()));
      if (live_.stream != nullptr) {
        RETURN_IF_ERROR(live_.pipeline->Progress(*live_.stream, assembler_->pieces(),
                                                 assembler_->piece_open()));
      }
    }
    if (!request.has_end()) return absl::OkStatus();
    RETURN_IF_ERROR(CheckStreamEnd(request.end().total_bytes(), carried_, "push"));
    RETURN_IF_ERROR(assembler_->Close());
    RETURN_IF_ERROR(daemon_->CommitPush(version_, pusher_, *view_, assembler_->pieces(),
                                        assembler_->bytes(), response_, live_));
    finished_ = true;
    return absl::OkStatus();
  }

  absl::Status OnStreamEnd() override {
    if (view_ == nullptr) return absl::InvalidArgumentError("empty push stream (no version)");
    if (live_.stream != nullptr) live_.pipeline->Fail(*live_.stream);
    return absl::InvalidArgumentError(
        "push stream ended without its end marker (PushGradientsRequest.end); nothing applied "
        "and the pusher is not counted: push again");
  }

  int64_t version_ = 0;
  std::string pusher_;
  int64_t carried_ = 0;  // chunk bytes received so far
  // Pipelined step: the stream's registration; its staged pieces go to the
  // pipeline when the stream ends (a step may still read them).
  Daemon::Impl::PipelinedPush live_;

 public:
  ~PushReactor() override {
    if (live_.stream != nullptr) live_.pipeline->Close(live_.stream, std::move(assembler_->pieces()));
  }
};

// PushWeights: rows of a model loaded with declared tensors.
class WeightsReactor
    : public ChunkStreamReactor<rpc::PushWeightsRequest, rpc::PushWeightsResponse> {
 public:
  using ChunkStreamReactor::ChunkStreamReactor;
  void Begin() {
    absl::StatusOr<std::shared_ptr<const ModelView>> view = daemon_->BeginWeights();
    if (!view.ok()) {
      Finish(ToGrpcStatus(view.status()));
      return;
    }
    view_ = *std::move(view);
    assembler_.emplace(view_.get(), /*allow_non_finite=*/true);
    StartRead(&request_);
  }

 private:
  absl::Status OnMessage(const rpc::PushWeightsRequest& request) override {
    if (request.has_chunk()) {
      carried_ += static_cast<int64_t>(request.chunk().data().size());
      RETURN_IF_ERROR(assembler_->Add(request.chunk()));
    }
    if (!request.has_end()) return absl::OkStatus();
    RETURN_IF_ERROR(CheckStreamEnd(request.end().total_bytes(), carried_, "weights"));
    RETURN_IF_ERROR(assembler_->Close());
    RETURN_IF_ERROR(
        daemon_->CommitWeights(*view_, assembler_->pieces(), response_, assembler_->bytes()));
    finished_ = true;
    return absl::OkStatus();
  }
  // Not even the complete pieces of a stream cut short are copied: a
  // failed upload changes nothing (the client's retry sends it again).
  absl::Status OnStreamEnd() override {
    return absl::InvalidArgumentError(
        "weights stream ended without its end marker (PushWeightsRequest.end); nothing "
        "applied: push again");
  }

  int64_t carried_ = 0;  // chunk bytes received so far
};

}  // namespace

// ---- Fetch: plan, then chunks; waits for unpublished versions ----
//
// The published version is held by shared_ptr: a step publishing newer
// versions never changes the bytes being streamed.
class FetchReactor : public WaitingWriter<rpc::FetchResponse> {
 public:
  FetchReactor(Daemon::Impl* daemon, const rpc::FetchRequest& request, std::string client)
      : WaitingWriter(daemon->publish_waiters()),
        daemon_(daemon),
        request_(request),
        client_(std::move(client)) {}
  ~FetchReactor() override {
    if (parked_) daemon_->Unpark(client_);
  }

 private:
  struct Segment {
    int piece;
    rpc::BufferKind kind;
    const std::vector<uint8_t>* bytes;
    Direction direction;
  };

  void PumpLocked() override {
    if (started_) {
      if (awaiting_outcome_) {
        PollOutcomeLocked();
        return;
      }
      WriteNextLocked();
      return;
    }
    if (absl::Status s = CheckFetchRequest(request_, daemon_->limits()); !s.ok()) {
      started_ = true;
      FinishLocked(ToGrpcStatus(s));
      return;
    }
    // Registers before resolving so that a publish in between still wakes us.
    RegisterLocked();
    absl::StatusOr<Daemon::Impl::FetchTarget> target = daemon_->ResolveFetch(request_.version());
    if (target.ok() && target->version == nullptr) {  // wait for a publish
      if (request_.as_ready() && StartInFlightLocked()) return;
      if (!parked_ && !daemon_->Park(client_)) {
        UnregisterLocked();
        started_ = true;
        FinishLocked(ToGrpcStatus(absl::ResourceExhaustedError(absl::StrCat(
            "too many fetches of unpublished versions waiting from ", client_,
            " (--max_parked_fetches_per_client)"))));
        return;
      }
      parked_ = true;
      return;
    }
    UnregisterLocked();
    if (parked_) {
      daemon_->Unpark(client_);
      parked_ = false;
    }
    started_ = true;
    absl::Status s = target.ok() ? BuildPlan(*target) : target.status();
    if (!s.ok()) {
      FinishLocked(ToGrpcStatus(s));
      return;
    }
    WriteNextLocked();
  }

  void OnWrittenLocked() override {
    if (last_chunk_bytes_ > 0) daemon_->AddServed(last_direction_, last_chunk_bytes_);
  }

  // FetchRequest.as_ready of a version a pipelined step is filling: once the
  // requested tensors are ready, streams them at once and answers when the
  // step ended (OutcomeOf). False: not (yet) possible, wait.
  bool StartInFlightLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Daemon::Impl::ReadyPart part = daemon_->InFlightPart(request_.version());
    if (part.version == nullptr) return false;
    bool ready = request_.tensors_size() > 0 ||
                 part.ready_tensor_end == static_cast<int>(part.view->tensors.size());
    for (const rpc::TensorDirections& td : request_.tensors()) {
      ready &= part.view->Find(td.tensor()) < part.ready_tensor_end;  // unknown: BuildPlan says
    }
    if (!ready) return false;
    UnregisterLocked();
    if (parked_) {
      daemon_->Unpark(client_);
      parked_ = false;
    }
    started_ = true;
    in_flight_ = true;
    piece_limit_ = part.ready_pieces;
    Daemon::Impl::FetchTarget target;
    target.version = part.version;
    target.view = part.view;
    target.rank = part.rank;
    absl::Status s = BuildPlan(target);
    if (!s.ok()) {
      FinishLocked(ToGrpcStatus(s));
      return true;
    }
    WriteNextLocked();
    return true;
  }

  void PollOutcomeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    RegisterLocked();  // before asking: a step ending in between still wakes us
    std::optional<absl::Status> outcome = daemon_->OutcomeOf(version_.get());
    if (!outcome.has_value()) return;
    UnregisterLocked();
    FinishLocked(ToGrpcStatus(*outcome));
  }

  absl::Status BuildPlan(const Daemon::Impl::FetchTarget& target)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (target.host_bytes) {
      ASSIGN_OR_RETURN(version_, target.host_bytes(target.version));
    } else {
      version_ = target.version;
    }
    const ModelView& view = *target.view;
    chunk_bytes_ = request_.max_chunk_bytes() > 0 ? request_.max_chunk_bytes()
                                                  : daemon_->default_chunk_bytes();
    chunk_bytes_ = std::min(chunk_bytes_, kMaxChunkBytes);
    // Selected (tensor, direction) pairs; empty = all.
    std::vector<std::pair<int, std::vector<Direction>>> wanted;
    for (const rpc::TensorDirections& td : request_.tensors()) {
      const int t = view.Find(td.tensor());
      if (t < 0) return absl::NotFoundError(absl::StrCat("unknown tensor \"", td.tensor(), "\""));
      std::vector<Direction> dirs;
      for (int d : td.directions()) {
        ASSIGN_OR_RETURN(Direction dir, DirectionFromProto(static_cast<rpc::Direction>(d)));
        const HybridSpec& spec = view.tensors[t].spec;
        if (!(dir == Direction::kRowwise ? spec.rowwise_usage : spec.columnwise_usage)) {
          return absl::FailedPreconditionError(absl::StrCat(
              "tensor ", td.tensor(), " does not publish a ", DirectionName(dir), " copy"));
        }
        dirs.push_back(dir);
      }
      wanted.emplace_back(t, std::move(dirs));
    }
    rpc::FetchPlan* plan = plan_message_.mutable_plan();
    plan->set_version(version_->version);
    plan->set_daemon_rank(target.rank);
    auto add = [&](const PublishedPiece& p) {
      const int index = plan->pieces_size();
      rpc::FetchPiece* fp = plan->add_pieces();
      fp->set_tensor(view.tensors[p.tensor].name);
      fp->set_tensor_index(p.tensor);
      fp->set_direction(DirectionToProto(p.direction));
      fp->set_row_begin(p.row_begin);
      fp->set_row_end(p.row_end);
      fp->set_cols(view.tensors[p.tensor].cols);
      fp->set_format(FormatToProto(p.q.format));
      *fp->mutable_layout() = LayoutToProto(p.layout);
      fp->set_data_bytes(p.q.data.size());
      fp->set_scale_bytes(p.q.scales.size());
      fp->set_scale_inv(p.q.scale_inv);
      fp->set_amax(p.q.amax);
      if (!request_.plan_only()) {
        segments_.push_back({index, rpc::BUFFER_DATA, &p.q.data, p.direction});
        segments_.push_back({index, rpc::BUFFER_SCALES, &p.q.scales, p.direction});
      }
    };
    // An in-flight version: only its ready pieces.
    const absl::Span<const PublishedPiece> pieces =
        absl::MakeConstSpan(version_->pieces)
            .subspan(0, piece_limit_ >= 0 ? piece_limit_ : version_->pieces.size());
    if (wanted.empty()) {
      for (const PublishedPiece& p : pieces) add(p);
    } else {
      for (const auto& [t, dirs] : wanted) {
        for (const PublishedPiece& p : pieces) {
          if (p.tensor != t) continue;
          if (!dirs.empty() && std::find(dirs.begin(), dirs.end(), p.direction) == dirs.end()) {
            continue;
          }
          add(p);
        }
      }
    }
    plan_pending_ = true;
    return absl::OkStatus();
  }

  void WriteNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    last_chunk_bytes_ = 0;
    if (plan_pending_) {
      plan_pending_ = false;
      WriteLocked(&plan_message_);
      return;
    }
    while (segment_ < segments_.size() &&
           offset_ >= static_cast<int64_t>(segments_[segment_].bytes->size())) {
      ++segment_;
      offset_ = 0;
    }
    if (segment_ >= segments_.size()) {
      if (in_flight_) {
        awaiting_outcome_ = true;
        PollOutcomeLocked();
        return;
      }
      FinishLocked(grpc::Status::OK);
      return;
    }
    const Segment& seg = segments_[segment_];
    const int64_t n =
        std::min<int64_t>(chunk_bytes_, static_cast<int64_t>(seg.bytes->size()) - offset_);
    rpc::FetchChunk* chunk = chunk_message_.mutable_chunk();
    chunk->set_piece(seg.piece);
    chunk->set_buffer(seg.kind);
    chunk->set_offset(offset_);
    chunk->set_data(reinterpret_cast<const char*>(seg.bytes->data()) + offset_, n);
    offset_ += n;
    last_chunk_bytes_ = n;
    last_direction_ = seg.direction;
    WriteLocked(&chunk_message_);
  }

  Daemon::Impl* const daemon_;
  const rpc::FetchRequest request_;
  const std::string client_;  // the client's host, for the parked-fetch limit
  bool parked_ ABSL_GUARDED_BY(mu_) = false;  // counted by Daemon::Impl::Park
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  std::shared_ptr<const PublishedVersion> version_ ABSL_GUARDED_BY(mu_);
  rpc::FetchResponse plan_message_ ABSL_GUARDED_BY(mu_);
  rpc::FetchResponse chunk_message_ ABSL_GUARDED_BY(mu_);
  bool plan_pending_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Segment> segments_ ABSL_GUARDED_BY(mu_);
  size_t segment_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t offset_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t chunk_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_chunk_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  Direction last_direction_ ABSL_GUARDED_BY(mu_) = Direction::kRowwise;
  // as_ready of an in-flight version: pieces of version_ beyond piece_limit_
  // are not final (-1: all are); after the bytes, the answer waits for the
  // step's outcome.
  bool in_flight_ ABSL_GUARDED_BY(mu_) = false;
  int64_t piece_limit_ ABSL_GUARDED_BY(mu_) = -1;
  bool awaiting_outcome_ ABSL_GUARDED_BY(mu_) = false;
};

grpc::ServerReadReactor<rpc::PushGradientsRequest>* Daemon::Impl::PushGradients(
    grpc::CallbackServerContext* context, rpc::PushGradientsResponse* response) {
  if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                       "/paramd.rpc.Daemon/PushGradients");
      !s.ok()) {
    return auth::RefusedReader<rpc::PushGradientsRequest>(s);
  }
  auto* reactor = new PushReactor(this, context, response);
  reactor->Begin();
  return reactor;
}

// "ipv4:127.0.0.1:5000" -> "ipv4:127.0.0.1": limits are per client host.
std::string ClientHost(const std::string& peer) {
  const size_t colon = peer.rfind(':');
  return colon == std::string::npos || colon < 5 ? peer : peer.substr(0, colon);
}

grpc::ServerWriteReactor<rpc::FetchResponse>* Daemon::Impl::Fetch(
    grpc::CallbackServerContext* context, const rpc::FetchRequest* request) {
  if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                       "/paramd.rpc.Daemon/Fetch");
      !s.ok()) {
    return auth::RefusedWriter<rpc::FetchResponse>(s);
  }
  auto* reactor = new FetchReactor(this, *request, ClientHost(context->peer()));
  reactor->Begin();
  return reactor;
}

grpc::ServerReadReactor<rpc::PushWeightsRequest>* Daemon::Impl::PushWeights(
    grpc::CallbackServerContext* context, rpc::PushWeightsResponse* response) {
  if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                       "/paramd.rpc.Daemon/PushWeights");
      !s.ok()) {
    return auth::RefusedReader<rpc::PushWeightsRequest>(s);
  }
  auto* reactor = new WeightsReactor(this, context, response);
  reactor->Begin();
  return reactor;
}

// ---- Device channels: OpenDeviceChannel (a stream as long as the channel)
// and FetchDevice (plan over gRPC, bytes over the channel's NCCL world) ----

// The OpenDeviceChannel stream. References: one held by gRPC (dropped in
// OnDone) and one by the channel (dropped when it closes); every entry point
// that may Finish() holds one more, so an OnDone run inline never deletes
// the reactor under its own lock.
class DeviceChannelReactor : public grpc::ServerWriteReactor<rpc::DeviceChannelEvent> {
 public:
  explicit DeviceChannelReactor(Daemon::Impl* daemon) : daemon_(daemon) {}

  void Ref() { refs_.fetch_add(1); }
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  // Writes the first event (channel id and the daemon's address).
  void Begin(uint64_t id, const rpc::DeviceChannelEvent& event) {
    Ref();
    {
      std::lock_guard<std::mutex> lock(mu_);
      id_ = id;
      if (!finished_ && !finish_pending_) {
        event_ = event;
        writing_ = true;
        started_ = true;
        StartWrite(&event_);
      }
    }
    Unref();
  }

  // Finishes the call (after a write in flight). Idempotent. With a
  // non-empty `reason` (the trainer is still there) a last event names it,
  // so the trainer's receive in progress fails at once.
  void Close(const grpc::Status& status, const std::string& reason = "") {
    Ref();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!finished_ && !finish_pending_) {
        if (writing_) {
          finish_pending_ = true;
          pending_status_ = status;
        } else if (!reason.empty() && started_ && !cancelled_) {
          event_.Clear();
          event_.set_channel(id_);
          event_.set_closed(reason);
          finish_pending_ = true;
          pending_status_ = status;
          writing_ = true;
          StartWrite(&event_);
        } else {
          finished_ = true;
          Finish(status);
        }
      }
    }
    Unref();
  }

  void OnWriteDone(bool ok) override {
    Ref();
    uint64_t id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      id = id_;
      writing_ = false;
      if (finish_pending_ && !finished_) {
        finished_ = true;
        Finish(pending_status_);
      }
    }
    if (!ok) daemon_->CloseDeviceChannel(id, "the channel's stream broke");
    Unref();
  }

  void OnCancel() override {
    Ref();
    uint64_t id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      id = id_;
      cancelled_ = true;
    }
    daemon_->CloseDeviceChannel(id, "the trainer closed the channel or disconnected");
    Close(grpc::Status(grpc::StatusCode::CANCELLED, "channel cancelled"));
    Unref();
  }

  void OnDone() override { Unref(); }

 private:
  Daemon::Impl* const daemon_;
  std::atomic<int> refs_{1};
  std::mutex mu_;
  uint64_t id_ = 0;
  rpc::DeviceChannelEvent event_;
  bool writing_ = false;
  bool started_ = false;  // the first event was written
  bool cancelled_ = false;
  bool finished_ = false;
  bool finish_pending_ = false;
  grpc::Status pending_status_;
};

grpc::ServerWriteReactor<rpc::DeviceChannelEvent>* Daemon::Impl::OpenDeviceChannel(
    grpc::CallbackServerContext* context, const rpc::OpenDeviceChannelRequest* request) {
  if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                       "/paramd.rpc.Daemon/OpenDeviceChannel");
      !s.ok()) {
    return auth::RefusedWriter<rpc::DeviceChannelEvent>(s);
  }
  auto* reactor = new DeviceChannelReactor(this);
  const std::string trainer =
      request->name().empty() ? request->trainer_address() : request->name();
  absl::StatusOr<std::shared_ptr<ChannelState>> opened =
      [&]() -> absl::StatusOr<std::shared_ptr<ChannelState>> {
    if (backend_ != gpu_backend::DaemonBackend::kGpu) {
      return absl::FailedPreconditionError(
          "device fetch needs a daemon with --backend=gpu (this one runs the cpu backend); "
          "fetch over the host stream (Fetch) instead");
    }
    if (request->trainer_address().empty()) {
      return absl::InvalidArgumentError("OpenDeviceChannel without trainer_address");
    }
    const std::string secret = auth::RandomSecret();
    ASSIGN_OR_RETURN(std::unique_ptr<DeviceChannel> channel,
                     ::paramd::OpenDeviceChannel(options_.device_channel_listen, secret));
    auto c = std::make_shared<ChannelState>();
    c->trainer = trainer;
    c->secret = secret;
    c->channel = std::move(channel);
    c->reactor = reactor;
    reactor->Ref();  // the channel's reference
    absl::MutexLock lock(&mu_);
    if (shut_down_) {
      reactor->Unref();
      return absl::UnavailableError("daemon shutting down");
    }
    c->id = ++next_channel_;
    channels_[c->id] = c;
    return c;
  }();
  if (!opened.ok()) {
    reactor->Close(ToGrpcStatus(opened.status()));
    return reactor;
  }
  std::shared_ptr<ChannelState> c = *std::move(opened);
  rpc::DeviceChannelEvent event;
  event.set_channel(c->id);
  event.set_daemon_address(c->channel->address());
  event.set_device(c->channel->device());
  event.set_channel_secret(c->secret);
  ChannelState* raw = c.get();
  const std::string trainer_address = request->trainer_address();
  c->worker.Post([this, raw, trainer_address] {
    if (raw->closed) return;
    absl::Status s = raw->channel->Connect(trainer_address);
    if (!s.ok()) CloseDeviceChannel(raw->id, absl::StrCat("connect: ", s.ToString()));
  });
  Log(kTag, absl::StrCat("device channel ", c->id, " opened for ", trainer));
  reactor->Begin(c->id, event);
  return reactor;
}

void Daemon::Impl::CloseDeviceChannel(uint64_t id, const std::string& reason) {
  std::shared_ptr<ChannelState> c;
  {
    absl::MutexLock lock(&mu_);
    auto it = channels_.find(id);
    if (it == channels_.end()) return;
    c = it->second;
    channels_.erase(it);
  }
  c->closed = true;
  c->channel->Shutdown();
  Log(kTag, absl::StrCat("device channel ", id, " (", c->trainer, ") closed: ", reason));
  c->reactor->Close(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                 absl::StrCat("device channel closed: ", reason)),
                    reason);
  c->reactor->Unref();
  c->reactor = nullptr;
  // The last reference may be dropped here on the channel's own worker:
  // destroy (join) it on the reaper. Moved, not copied: with a copy, the
  // reaper could run first and leave this frame the last reference, which
  // then joined the worker from itself ("Resource deadlock avoided"). After
  // Shutdown (reaper stopped), only Shutdown itself closes channels, never
  // on a channel's worker.
  reaper_.Post([c = std::move(c)] {});
}

std::optional<absl::Status> Daemon::Impl::StartDeviceFetch(
    const rpc::FetchDeviceRequest& request, absl::Time deadline,
    rpc::FetchDeviceResponse* response, std::shared_ptr<DeviceFetchCall> call) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("daemon shutting down");
  auto it = channels_.find(request.channel());
  if (it == channels_.end()) {
    return absl::NotFoundError(absl::StrCat("device channel ", request.channel(),
                                            " is unknown or closed; open a new one"));
  }
  RETURN_IF_ERROR(CheckDeviceChannelSecret(request.channel_secret(), it->second->secret,
                                           request.channel()));
  if (request.tensors().empty()) {
    return absl::InvalidArgumentError("FetchDevice without tensors");
  }
  if (request.tag() > kMaxUserTag) return absl::InvalidArgumentError("FetchDevice tag too large");
  const int64_t version = request.version();
  // The step producing `version` has enqueued its work: a trainer that
  // receives beside the call gets it tensor by tensor as it is quantized.
  const bool in_flight = call != nullptr && version >= 0 && version == in_flight_version_ &&
                         (!latest_ || version > latest_->version);
  if (!in_flight && (!latest_ || version > latest_->version)) {
    return std::nullopt;  // wait for a publish (or the step's enqueue)
  }
  int64_t resolved;
  if (in_flight) {
    resolved = version;
  } else if (version < 0 || version == latest_->version) {
    resolved = latest_->version;
  } else if (previous_ && version == previous_->version) {
    resolved = previous_->version;
  } else {
    return absl::NotFoundError(absl::StrCat(
        "version ", version, " was dropped; this daemon holds versions ",
        previous_ ? absl::StrCat(previous_->version, " and ") : "", latest_->version));
  }
  if (shards_ == nullptr || shards_->name() != "gpu") {
    return absl::FailedPreconditionError(absl::StrCat(
        "device fetch needs the gpu backend; this model runs on the ",
        shards_ ? std::string(shards_->name()) : "no", " backend (fetch over the host stream)"));
  }
  const ModelView& view = *view_;
  rpc::FetchPlan* plan = response->mutable_plan();
  plan->set_version(resolved);
  plan->set_daemon_rank(rank_);
  std::vector<DeviceFetchItem> items;
  int64_t bytes[2] = {0, 0};
  for (const rpc::TensorDirections& td : request.tensors()) {
    const int t = view.Find(td.tensor());
    if (t < 0) return absl::NotFoundError(absl::StrCat("unknown tensor \"", td.tensor(), "\""));
    if (td.directions().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("FetchDevice of ", td.tensor(), " names no direction"));
    }
    const TensorDef& tensor = view.tensors[t];
    std::vector<Direction> dirs;
    for (int d : td.directions()) {
      absl::StatusOr<Direction> dir = DirectionFromProto(static_cast<rpc::Direction>(d));
      if (!dir.ok()) return dir.status();
      if (!(*dir == Direction::kRowwise ? tensor.spec.rowwise_usage
                                        : tensor.spec.columnwise_usage)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "tensor ", td.tensor(), " does not publish a ", DirectionName(*dir), " copy"));
      }
      dirs.push_back(*dir);
    }
    for (size_t s = 0; s < view.shards.size(); ++s) {
      const ShardDef& shard = view.shards[s];
      if (shard.tensor != t) continue;
      for (Direction dir : dirs) {
        const QuantSpec& spec =
            dir == Direction::kRowwise ? tensor.spec.rowwise : tensor.spec.columnwise;
        absl::StatusOr<Layout> layout = ComputeLayout(spec, dir, shard.rows(), tensor.cols);
        if (!layout.ok()) return layout.status();
        items.push_back({static_cast<int>(s), dir});
        rpc::FetchPiece* fp = plan->add_pieces();
        fp->set_tensor(tensor.name);
        fp->set_tensor_index(t);
        fp->set_direction(DirectionToProto(dir));
        fp->set_row_begin(shard.row_begin);
        fp->set_row_end(shard.row_end);
        fp->set_cols(tensor.cols);
        fp->set_format(FormatToProto(spec.format));
        *fp->mutable_layout() = LayoutToProto(*layout);
        fp->set_data_bytes(layout->data_bytes());
        fp->set_scale_bytes(layout->scale_bytes());
        bytes[dir == Direction::kRowwise ? 0 : 1] += layout->data_bytes() + layout->scale_bytes();
      }
    }
  }
  ChannelState* c = it->second.get();
  const int64_t generation = view.generation;
  const uint64_t tag = request.tag();
  c->worker.Post([this, c, resolved, generation, items = std::move(items), tag, deadline,
                  b0 = bytes[0], b1 = bytes[1], in_flight, call] {
    int64_t b[2] = {b0, b1};
    ServeDeviceFetch(c, resolved, generation, items, tag, deadline, b, in_flight, call);
  });
  return absl::OkStatus();
}

void Daemon::Impl::ServeDeviceFetch(ChannelState* c, int64_t version, int64_t generation,
                                    const std::vector<DeviceFetchItem>& items, uint64_t tag,
                                    absl::Time deadline, int64_t bytes[2], bool in_flight,
                                    const std::shared_ptr<DeviceFetchCall>& call) {
  absl::Status s;
  bool streamed = false;     // sent while its version was stepped
  bool beside_step = false;  // a held version sent while a step ran
  if (c->closed) {
    s = absl::UnavailableError("device channel closed before the send");
  } else {
    // Keeps a load from freeing the backend under the send.
    absl::ReaderMutexLock device_lock(&device_mu_);
    ShardBackend* backend = nullptr;
    {
      absl::MutexLock lock(&mu_);
      beside_step = stepping_;
      if (view_ != nullptr && view_->generation == generation) {
        // A running step rewrites overwriting_version_'s slot: refused even
        // though previous_ still names it until the step publishes.
        const bool held = (latest_ && latest_->version == version) ||
                          (previous_ && previous_->version == version &&
                           version != overwriting_version_);
        streamed = !held && in_flight && in_flight_version_ == version;
        if (held || streamed) {
          backend = shards_.get();
          ++fetch_pins_[version];  // the step after next waits for it
        }
      }
    }
    if (backend == nullptr) {
      s = absl::NotFoundError(
          absl::StrCat("version ", version, " was dropped or reloaded before its send"));
      // Asked for while it was being stepped, sent only after the step
      // ended (e.g. behind the channel's connect), and never published.
      if (in_flight) s = AwaitStepOf(version, generation, /*sent=*/false, deadline);
    } else {
      s = c->channel->Send(*backend, version, items, tag, deadline, streamed);
      absl::MutexLock lock(&mu_);
      auto it = fetch_pins_.find(version);
      if (--it->second == 0) fetch_pins_.erase(it);
    }
    // The bytes left during the step: they are `version` only if it
    // publishes.
    if (s.ok() && streamed) s = AwaitStepOf(version, generation, /*sent=*/true, deadline);
  }
  if (call != nullptr) {
    {
      absl::MutexLock lock(&call->mu);
      call->result = s;
    }
    publish_waiters_.WakeAll();  // the call's poll answers with it
  }
  if (s.ok()) {
    bytes_served_[0].fetch_add(bytes[0]);
    bytes_served_[1].fetch_add(bytes[1]);
    if (streamed) {
      device_fetches_streamed_.fetch_add(1);
    } else if (beside_step) {
      device_fetches_beside_step_.fetch_add(1);
    }
    return;
  }
  LogWarning(kTag, absl::StrCat("device fetch of version ", version, " on channel ", c->id, " (",
                         c->trainer, ") failed: ", s.ToString()));
  CloseDeviceChannel(c->id, absl::StrCat("device fetch failed: ", s.ToString()));
}

absl::Status Daemon::Impl::AwaitStepOf(int64_t version, int64_t generation, bool sent,
                                       absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto settled = [this, version, generation]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return shut_down_ || view_ == nullptr || view_->generation != generation ||
           in_flight_version_ != version;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&settled), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "the step producing version ", version, " did not finish before the deadline"));
  }
  if (shut_down_) return absl::UnavailableError("daemon shutting down");
  if (view_ == nullptr || view_->generation != generation) {
    return absl::AbortedError(absl::StrCat("the model was reloaded while version ", version,
                                           " was being stepped"));
  }
  if (latest_ && latest_->version >= version) {
    // Published: what was sent is that version. Not sent: it is held no
    // more (ServeDeviceFetch found it neither held nor in flight).
    return sent ? absl::OkStatus()
                : absl::NotFoundError(
                      absl::StrCat("version ", version, " was dropped before its send"));
  }
  return absl::AbortedError(absl::StrCat(
      "the step producing version ", version, " failed (", last_step_error_.ToString(), ")",
      sent ? ": the bytes sent are not a published version" : ""));
}

namespace {

// A device transfer's bound: the call's deadline, or `fallback` from now
// when the call has none.
absl::Time DeviceCallDeadline(const grpc::CallbackServerContext* context,
                              absl::Duration fallback) {
  const auto grpc_deadline = context->deadline();
  if (grpc_deadline < std::chrono::system_clock::now() + std::chrono::hours(24 * 365)) {
    return absl::FromChrono(grpc_deadline);
  }
  return absl::Now() + fallback;
}

}  // namespace

grpc::ServerUnaryReactor* Daemon::Impl::FetchDevice(grpc::CallbackServerContext* context,
                                                    const rpc::FetchDeviceRequest* request,
                                                    rpc::FetchDeviceResponse* response) {
  if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                       "/paramd.rpc.Daemon/FetchDevice");
      !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  // The send is bounded by the call's deadline (no deadline: step_timeout).
  const absl::Time deadline = DeviceCallDeadline(context, options_.step_timeout);
  // reply_after_send: the answer waits for the send (and the publish of a
  // version streamed while stepped), reported through `call`.
  std::shared_ptr<DeviceFetchCall> call =
      request->reply_after_send() ? std::make_shared<DeviceFetchCall>() : nullptr;
  return StartWaitingUnary(
      &publish_waiters_,
      [this, request, response, deadline, call,
       queued = false]() mutable -> std::optional<grpc::Status> {
        if (!queued) {
          std::optional<absl::Status> s = StartDeviceFetch(*request, deadline, response, call);
          if (!s.has_value()) return std::nullopt;
          if (!s->ok() || call == nullptr) return ToGrpcStatus(*s);
          queued = true;
        }
        absl::MutexLock lock(&call->mu);
        if (!call->result.has_value()) return std::nullopt;
        return ToGrpcStatus(*call->result);
      });
}

// ---- Device push (PushGradientsDevice; daemon_push_test) ----

absl::Status Daemon::Impl::CheckDevicePush(const rpc::PushGradientsDeviceRequest& request,
                                           DevicePush* push,
                                           std::shared_ptr<ChannelState>* channel) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("daemon shutting down");
  // The host stream's rules first, with its codes.
  RETURN_IF_ERROR(CheckPushLocked(request.version(), request.pusher_id()));
  RETURN_IF_ERROR(CheckDevicePushAllowedLocked());
  if (request.tag() > kMaxUserTag) {
    return absl::InvalidArgumentError("PushGradientsDevice tag too large");
  }
  const ModelView& view = *view_;
  push->version = request.version();
  push->pusher = request.pusher_id();
  push->generation = view.generation;
  push->tag = request.tag();
  // As the host stream: SKIP_STEP takes NaN/Inf (the step then skips).
  push->accept_non_finite =
      view.optimizer.has_value() && view.optimizer->non_finite == NonFinitePolicy::kSkipStep;
  struct Rows {
    int tensor;
    int64_t begin, end;
  };
  std::vector<Rows> seen;
  for (const rpc::DevicePushTensor& dt : request.tensors()) {
    const int t = view.Find(dt.tensor());
    if (t < 0) return absl::NotFoundError(absl::StrCat("unknown tensor \"", dt.tensor(), "\""));
    const TensorDef& def = view.tensors[t];
    if (dt.dtype() != rpc::DTYPE_FP32 && dt.dtype() != rpc::DTYPE_BF16) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", def.name, ": device push dtype must be DTYPE_FP32 or DTYPE_BF16"));
    }
    const bool bf16 = dt.dtype() == rpc::DTYPE_BF16;
    const int64_t b = dt.row_begin(), e = dt.row_end();
    if (b < 0 || e <= b || e > def.rows) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", def.name, ": rows [", b, ", ", e,
                                                     ") outside [0, ", def.rows, ")"));
    }
    const std::string where = absl::StrCat("tensor ", def.name, " rows [", b, ", ", e, ")");
    const int shard = view.FindShard(t, b, e);
    if (shard < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, " are not held by daemon rank ", view.rank,
          " (wrong daemon or a row range spanning shards; re-read the manifest)"));
    }
    for (const Rows& r : seen) {
      if (r.tensor == t && r.begin < e && b < r.end) {
        return absl::InvalidArgumentError(absl::StrCat(where, " overlap rows already in this push"));
      }
    }
    seen.push_back({t, b, e});
    DevicePushPiece piece;
    piece.shard = shard;
    piece.offset = (b - view.shards[shard].row_begin) * def.cols;
    piece.count = (e - b) * def.cols;
    piece.bf16 = bf16;
    push->pieces.push_back(piece);
    push->bytes += piece.count * (bf16 ? 2 : 4);
  }
  if (shards_ == nullptr || shards_->name() != "gpu") {
    return absl::FailedPreconditionError(absl::StrCat(
        "device push needs a daemon with --backend=gpu (this model runs on the ",
        shards_ ? std::string(shards_->name()) : "no",
        " backend); push over the host stream (PushGradients) instead"));
  }
  channel->reset();
  if (push->pieces.empty()) return absl::OkStatus();
  auto it = channels_.find(request.channel());
  if (it == channels_.end()) {
    return absl::NotFoundError(absl::StrCat("device channel ", request.channel(),
                                            " is unknown or closed; open a new one"));
  }
  RETURN_IF_ERROR(CheckDeviceChannelSecret(request.channel_secret(), it->second->secret,
                                           request.channel()));
  *channel = it->second;
  return absl::OkStatus();
}

absl::Status Daemon::Impl::CommitDevicePush(ChannelState* c, const DevicePush& push,
                                            std::unique_ptr<StagedDevicePush> staged,
                                            rpc::PushGradientsResponse* response) {
  // A staged push reads the backend's device memory: keep a load from
  // freeing it (device_mu_ before mu_). Without pieces nothing is read.
  std::optional<absl::ReaderMutexLock> device_lock;
  if (staged != nullptr) device_lock.emplace(&device_mu_);
  absl::MutexLock lock(&mu_);
  // Checked again: another push of this pusher or a step may have
  // committed while the bytes travelled.
  absl::Status s = CheckPushLocked(push.version, push.pusher);
  if (s.ok() && (view_ == nullptr || view_->generation != push.generation)) {
    s = absl::FailedPreconditionError("the model was reloaded during the push");
  }
  if (s.ok() && staged != nullptr) s = c->channel->ApplyPush(*shards_, *staged, LastPushLocked());
  // Freed (stream-ordered after the adds) while the backend is alive.
  staged.reset();
  if (!s.ok()) return s;
  CountPushLocked(push.version, push.pusher, push.bytes, response);
  return absl::OkStatus();
}

void Daemon::Impl::ServeDevicePush(ChannelState* c, const DevicePush& push,
                                   rpc::PushGradientsResponse* response,
                                   grpc::ServerUnaryReactor* reactor) {
  absl::Status s;
  if (c->closed) {
    s = absl::UnavailableError("device channel closed before the push arrived; nothing applied");
  } else {
    absl::StatusOr<std::unique_ptr<StagedDevicePush>> staged =
        c->channel->ReceivePush(push.pieces, push.tag, push.deadline, push.accept_non_finite);
    if (staged.ok()) {
      s = CommitDevicePush(c, push, *std::move(staged), response);
    } else {
      s = absl::Status(staged.status().code(),
                       absl::StrCat("device push of version ", push.version, " by ", push.pusher,
                                    " failed, nothing applied: ",
                                    staged.status().message()));
      LogWarning(kTag, absl::StrCat(s.message(), " on channel ", c->id, " (", c->trainer, ")"));
      // A transfer failure may leave the channel's NCCL world broken: the
      // trainer opens a new one. INVALID_ARGUMENT (non-finite values) came
      // after the whole message: the channel is fine.
      if (!absl::IsInvalidArgument(staged.status())) {
        CloseDeviceChannel(c->id, absl::StrCat("device push failed: ", s.ToString()));
      }
    }
  }
  reactor->Finish(ToGrpcStatus(s));
}

grpc::ServerUnaryReactor* Daemon::Impl::PushGradientsDevice(
    grpc::CallbackServerContext* context, const rpc::PushGradientsDeviceRequest* request,
    rpc::PushGradientsResponse* response) {
  if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                       "/paramd.rpc.Daemon/PushGradientsDevice");
      !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  DevicePush push;
  push.deadline = DeviceCallDeadline(context, options_.step_timeout);
  std::shared_ptr<ChannelState> c;
  absl::Status s = CheckDevicePush(*request, &push, &c);
  if (s.ok() && c == nullptr) s = CommitDevicePush(nullptr, push, nullptr, response);
  if (!s.ok() || c == nullptr) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  ChannelState* raw = c.get();
  raw->worker.Post([this, raw, push = std::move(push), response, reactor] {
    ServeDevicePush(raw, push, response, reactor);
  });
  return reactor;
}

// ---- Daemon ----

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Create(DaemonOptions options) {
  RETURN_IF_ERROR(ValidateOptimizerOptions(options.optimizer));
  if (options.data_plane.empty()) return absl::InvalidArgumentError("daemon: no data plane");
  if (options.default_chunk_bytes < 1) {
    return absl::InvalidArgumentError("daemon: default_chunk_bytes must be >= 1");
  }
  ASSIGN_OR_RETURN(gpu_backend::DaemonBackend backend,
                   gpu_backend::ChooseDaemonBackend(options.backend));
  if (backend == gpu_backend::DaemonBackend::kGpu && !GpuShardBackendLinked()) {
    if (options.backend == "auto") {
      backend = gpu_backend::DaemonBackend::kCpu;
    } else {
      return absl::FailedPreconditionError(
          "--backend=gpu but the gpu daemon backend is not linked into this binary "
          "(build with --config=cuda)");
    }
  }
  return std::unique_ptr<Daemon>(new Daemon(std::make_unique<Impl>(std::move(options), backend)));
}

Daemon::Daemon(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Daemon::~Daemon() { Shutdown(); }
grpc::Service* Daemon::service() { return impl_.get(); }
grpc::Service* Daemon::ipc_service() { return impl_->ipc_service(); }
void Daemon::Start(const std::string& address, const std::string& coordinator) {
  impl_->Start(address, coordinator);
}
void Daemon::Shutdown() { impl_->Shutdown(); }
int Daemon::rank() const { return impl_->rank(); }
int64_t Daemon::published_version() const { return impl_->published_version(); }
absl::Status Daemon::startup_error() const { return impl_->startup_error(); }
absl::Status Daemon::WithStableState(const StableStateFn& fn, absl::Duration timeout) {
  return impl_->WithStableState(fn, timeout);
}
std::vector<PieceHealth> Daemon::PublishedHealth(int64_t max_samples) const {
  return impl_->PublishedHealth(max_samples);
}

rpc::DaemonStats Daemon::Stats(bool include_shards) const {
  rpc::DaemonStats stats;
  impl_->FillStats(include_shards, &stats);
  return stats;
}

}  // namespace paramd
