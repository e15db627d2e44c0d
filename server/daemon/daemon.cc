// File: server/daemon/daemon.cc
//
// The daemon's life (server/daemon/daemon.h): construction, joining the coordinator,
// the lease, reporting versions, shutdown, the same-GPU session host (IpcHost
// snapshot), and the public Daemon facade. The RPC handlers live beside it:
// daemon_load.cc, daemon_push.cc, daemon_step.cc, daemon_fetch.cc,
// daemon_device.cc, daemon_recovery.cc, daemon_stats.cc (the shared class
// declaration is server/daemon/daemon_internal.h).

#include "server/daemon/daemon_internal.h"

#include <algorithm>
#include <random>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "auth/endpoint_probe.h"
#include "common/status_macros.h"
#include "common/telemetry.h"
#include "server/step/optimizer_config.h"

namespace paramd {

using daemon_internal::kTag;

TransportOptions Daemon::Impl::DataPlaneOptions() const {
  TransportOptions options;
  options.listen_address = options_.data_plane_listen;
  options.advertise_host = options_.advertise_host;
  options.authenticator = options_.authenticator;
  options.security = std::make_shared<const auth::ChannelSecurity>(
      auth::ChannelSecurity{options_.tls, coordinator_token_});
  return options;
}

void Daemon::Impl::Start(const std::string& address, const std::string& coordinator) {
  {
    absl::MutexLock lock(&mu_);
    address_ = address;
    coordinator_address_ = coordinator;  // GetStats may already read it
  }
  if (options_.member_secret.empty()) options_.member_secret = auth::RandomSecret();
  if (options_.authenticator) options_.authenticator->AddClusterSecret(options_.member_secret);
  // Reconnect within a second of a coordinator that starts late (gRPC's
  // default backoff grows to two minutes).
  grpc::ChannelArguments args;
  auth::AddFastReconnect(&args);
  // The Join presents join_token; once joined, every call presents the
  // cluster secret from the reply.
  channel_ = auth::CreateChannel(coordinator, {options_.tls, coordinator_token_}, args);
  coordinator_ = rpc::Coordinator::NewStub(channel_);
  reporter_ = std::make_unique<VersionReporter>(
      [this](const rpc::ReportVersionRequest& request) {
        grpc::ClientContext context;
        context.set_deadline(absl::ToChronoTime(absl::Now() + options_.coordinator_call_timeout));
        rpc::ReportVersionResponse response;
        return coordinator_->ReportVersion(&context, request, &response);
      },
      [](const rpc::ReportVersionRequest& request, const grpc::Status& s) {
        LogWarning(kTag, absl::StrCat("ReportVersion(", request.published_version(),
                                      ") failed: ", s.error_message()));
      });
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

void Daemon::Impl::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    if (join_context_ != nullptr) join_context_->TryCancel();
  }
  ipc_->Shutdown();  // a step waiting for an IPC pin returns
  if (join_thread_.joinable()) join_thread_.join();
  lease_.reset();
  if (reporter_) reporter_->Stop();
  std::vector<uint64_t> channels;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, c] : channels_) channels.push_back(id);
  }
  for (uint64_t id : channels) CloseDeviceChannel(id, "daemon shutting down");
  reaper_.Stop();
  worlds_.ShutdownCurrent();  // unblocks a step in the all-reduce
  worker_.Stop();
  publish_waiters_.WakeAll();
}

int Daemon::Impl::rank() const {
  absl::MutexLock lock(&mu_);
  return rank_;
}

int64_t Daemon::Impl::published_version() const {
  absl::MutexLock lock(&mu_);
  return latest_ ? latest_->version : -1;
}

absl::Status Daemon::Impl::startup_error() const {
  absl::MutexLock lock(&mu_);
  // A replacement has no data plane until the coordinator's recovery.
  if (!join_done_ || shut_down_ || (rank_ >= 0 && (all_reduce_ || recovering_))) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      absl::StrCat("daemon cannot join the cluster: ", join_error_));
}

absl::Status Daemon::Impl::WithSnapshot(
    const std::function<absl::Status(const ipc::IpcSnapshot&)>& fn) {
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

std::string Daemon::Impl::NewIncarnation() {
  std::random_device device;
  std::mt19937_64 rng((static_cast<uint64_t>(device()) << 32) ^ device() ^
                      static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
  return absl::StrCat(absl::Hex(rng(), absl::kZeroPad16));
}

ipc::IpcServiceOptions Daemon::Impl::IpcOptions(const DaemonOptions& options) {
  ipc::IpcServiceOptions o;
  o.authenticator = options.authenticator;
  return o;
}

absl::Status Daemon::Impl::CheckNotReplacedLocked() const {
  if (!replaced_) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("this daemon (rank ", rank_,
                   ") was replaced by another process after its lease expired; "
                   "ask the coordinator for the current daemons"));
}

void Daemon::Impl::OnHeartbeatVerdict(const rpc::HeartbeatRequest& request,
                                      rpc::HeartbeatVerdict verdict) {
  absl::MutexLock lock(&mu_);
  if (verdict == rpc::HEARTBEAT_REPLACED && !replaced_) {
    replaced_ = true;
    LogWarning(kTag, absl::StrCat("rank ", request.rank(),
                                  " was taken by another daemon (this one missed its lease); "
                                  "refusing fetches and pushes from now on"));
  } else if (verdict == rpc::HEARTBEAT_UNKNOWN && !unknown_logged_) {
    unknown_logged_ = true;
    LogWarning(kTag, absl::StrCat("the coordinator does not know rank ", request.rank(), " (",
                                  request.member_id(), ")"));
  }
}

// Queued for reporter_ (server/daemon/version_reporter.h): never blocks the worker.
void Daemon::Impl::ReportVersion(int64_t version, double seconds) {
  rpc::ReportVersionRequest request;
  {
    absl::MutexLock lock(&mu_);
    request.set_member_id(member_id_);
    request.set_daemon_rank(rank_);
    request.set_recovery_epoch(recovery_epoch_);
  }
  request.set_published_version(version);
  request.set_step_seconds(seconds);
  if (reporter_) reporter_->Report(std::move(request));
}

void Daemon::Impl::JoinLoop() {
  JoinLoopBody();
  absl::MutexLock lock(&mu_);
  join_done_ = true;
}

namespace {

// How the endpoint probe's messages name this daemon's TLS flags.
auth::ProbeNames CoordinatorProbeNames() {
  auth::ProbeNames names;
  names.ca = "this daemon's --tls_ca";
  names.give_ca =
      "start the daemon with --tls_cert, --tls_key and the --tls_ca that signed "
      "the coordinator's certificate";
  names.server_name = "this daemon's --tls_server_name";
  return names;
}

}  // namespace

rpc::JoinRequest Daemon::Impl::MakeJoinRequest() {
  rpc::JoinRequest request;
  request.set_role(rpc::ROLE_DAEMON);
  {
    absl::MutexLock lock(&mu_);
    request.set_address(address_);
  }
  request.set_data_plane_address(worlds_.current()->address());
  request.set_name(absl::StrCat("daemon@", request.address()));
  request.set_wait_for_world(true);
  request.set_incarnation(incarnation_);
  if (options_.rank >= 0) request.set_rank(options_.rank);
  *request.mutable_optimizer_flags() = options_.optimizer_flags;
  request.set_pipelined_step(options_.pipelined_step);
  request.set_step_bucket_elements(options_.step_bucket_elements);
  request.set_member_secret(options_.member_secret);
  return request;
}

bool Daemon::Impl::CoordinatorUnreachable(absl::Time give_up, absl::Time* next_waiting_log) {
  if (absl::Now() < *next_waiting_log) return false;
  // What waiting will not mend (TLS against plaintext, a certificate the CA
  // did not sign, ...) ends the join at once, in words; a refused or silent
  // address is waited for (the coordinator may start later), and the log
  // says why it is not reachable.
  const absl::Status probe = auth::ProbeEndpoint(coordinator_address_, options_.tls,
                                                 absl::Seconds(2), CoordinatorProbeNames());
  if (!probe.ok() && !absl::IsUnavailable(probe)) {
    absl::MutexLock lock(&mu_);
    join_error_ = absl::StrCat("the coordinator at ", coordinator_address_, ": ", probe.message());
    LogError(kTag, join_error_);
    return true;
  }
  Log(kTag, absl::StrCat(
                "waiting for the coordinator at ", coordinator_address_, " (not reachable yet",
                probe.ok() ? "" : absl::StrCat(": ", probe.message()), "; retrying, giving up in ",
                absl::FormatDuration(absl::Trunc(give_up - absl::Now(), absl::Seconds(1))), ")"));
  *next_waiting_log = absl::Now() + absl::Seconds(5);
  return false;
}

void Daemon::Impl::AdoptJoin(const rpc::JoinResponse& response) {
  if (!response.cluster_secret().empty()) {
    if (options_.authenticator) options_.authenticator->AddClusterSecret(response.cluster_secret());
    coordinator_token_->Set(response.cluster_secret());
  }
  if (response.replacement()) {
    // The world's data plane is rebuilt by the coordinator's recovery,
    // which also gives this daemon the rank's state.
    absl::MutexLock lock(&mu_);
    rank_ = response.rank();
    member_id_ = response.member_id();
    recovering_ = true;
    Log(kTag,
        absl::StrCat("joined as daemon rank ", rank_, " of ", response.data_plane().num_daemons(),
                     ", replacing a daemon that went down; waiting for the "
                     "coordinator's recovery"));
    return;
  }
  absl::StatusOr<AllReduceMaxFn> all_reduce =
      worlds_.current()->Connect(response.data_plane(), response.rank());
  absl::MutexLock lock(&mu_);
  rank_ = response.rank();
  SetLogRank(rank_);
  member_id_ = response.member_id();
  const bool connected = all_reduce.ok();
  if (connected) {
    all_reduce_ = *std::move(all_reduce);
    data_plane_transport_ = worlds_.current()->transport();
  } else {
    join_error_ = all_reduce.status().ToString();
  }
  if (response.has_optimizer()) {
    absl::StatusOr<OptimizerOptions> o = OptimizerFromProto(response.optimizer());
    Log(kTag, o.ok() ? absl::StrCat("coordinator's optimizer: ", DescribeOptimizer(*o))
                     : absl::StrCat("coordinator's optimizer config: ", o.status().ToString()));
  }
  Log(kTag,
      absl::StrCat("joined as daemon rank ", rank_, " of ", response.data_plane().num_daemons(),
                   "; backend ", backend_ == DaemonBackend::kGpu ? "gpu" : "cpu",
                   backend_auto_ ? " (--backend=auto)" : "",
                   connected ? "" : absl::StrCat("; data plane: ", join_error_)));
}

void Daemon::Impl::JoinLoopBody() {
  const absl::Time give_up = absl::Now() + options_.join_timeout;
  if (absl::Status opened = worlds_.OpenFirst(); !opened.ok()) {
    absl::MutexLock lock(&mu_);
    join_error_ = absl::StrCat("data plane: ", opened.ToString());
    LogError(kTag, join_error_);
    return;
  }
  const rpc::JoinRequest request = MakeJoinRequest();
  absl::Time next_waiting_log = absl::InfinitePast();
  bool unavailable_logged = false;
  while (absl::Now() < give_up) {
    // Until the coordinator answers, say so every few seconds (a daemon
    // started before its coordinator is not silent).
    if (!channel_->WaitForConnected(
            absl::ToChronoTime(std::min(give_up, absl::Now() + absl::Seconds(1))))) {
      {
        absl::MutexLock lock(&mu_);
        if (shut_down_) return;
      }
      if (CoordinatorUnreachable(give_up, &next_waiting_log)) return;
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
    if (s.ok()) {
      AdoptJoin(response);
      return;
    }
    const grpc::StatusCode code = s.error_code();
    if (code == grpc::StatusCode::UNAVAILABLE && !s.error_message().empty() &&
        !unavailable_logged) {
      // E.g. --rank=N while the previous holder's lease has not expired.
      unavailable_logged = true;
      LogWarning(kTag, absl::StrCat("join: ", s.error_message(), " (retrying)"));
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
  join_error_ = absl::StrCat("could not join the coordinator at ", coordinator_address_, " within ",
                             absl::FormatDuration(options_.join_timeout));
  LogError(kTag, join_error_);
}

// ---- Daemon ----

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Create(DaemonOptions options) {
  RETURN_IF_ERROR(ValidateOptimizerOptions(options.optimizer));
  if (options.data_plane.empty()) return absl::InvalidArgumentError("daemon: no data plane");
  if (options.default_chunk_bytes < 1) {
    return absl::InvalidArgumentError("daemon: default_chunk_bytes must be >= 1");
  }
  ASSIGN_OR_RETURN(DaemonBackend backend, ChooseDaemonBackend(options.backend));
  if (backend == DaemonBackend::kGpu && !GpuShardBackendLinked()) {
    if (options.backend == "auto") {
      backend = DaemonBackend::kCpu;
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
