// client::Client: connection, manifest, versions and administration
// (client/client.h). The data streams (Fetch, PushGradients) are in
// client_data.cc, the manifest helpers in manifest.cc.
#include "client/client.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "auth/endpoint_probe.h"
#include "client/client_internal.h"
#include "client/fetch_stream.h"
#include "client/host_allocator.h"
#include "common/address.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "proto/paramd.grpc.pb.h"

namespace paramd {
namespace client {
namespace {

using internal::ManifestFromProto;
using internal::ToChrono;

std::string DefaultName() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "localhost");
  return absl::StrCat(host, ":", getpid());
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const auth::ChannelSecurity& security) {
  grpc::ChannelArguments args;
  // Reconnect quickly after a daemon restarts; fail fast while it is down.
  auth::AddFastReconnect(&args);
  args.SetMaxReceiveMessageSize(64 << 20);
  return auth::CreateChannel(address, security, args);
}

// The defaults ClientOptions takes from the environment (client.h).
// Returns whether the CA came from HPCTL_TLS_CA.
bool ApplyEnvironment(ClientOptions* options) {
  if (options->coordinator_address.empty()) {
    const char* env = std::getenv("PARAMD_COORDINATOR");
    options->coordinator_address = env != nullptr && *env != 0 ? env : "127.0.0.1:7070";
  }
  if (options->tls.ca.empty() && options->tls.cert.empty()) {
    const char* env = std::getenv("HPCTL_TLS_CA");
    if (env != nullptr && *env != 0) {
      options->tls.ca = env;
      return true;
    }
  }
  return false;
}

// Join answered UNIMPLEMENTED: no coordinator serves at `address`. A
// daemon says which coordinator it joins (Daemon.GetStats).
absl::Status NotACoordinator(const std::shared_ptr<grpc::Channel>& channel,
                             const std::string& address, absl::Time deadline,
                             const absl::Status& join) {
  grpc::ClientContext context;
  context.set_deadline(ToChrono(std::min(deadline, absl::Now() + absl::Seconds(2))));
  rpc::GetStatsResponse stats;
  const grpc::Status s =
      rpc::Daemon::NewStub(channel)->GetStats(&context, rpc::GetStatsRequest(), &stats);
  if (s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        address, " is a hybrid-paramd daemon",
        stats.stats().rank() >= 0 ? absl::StrCat(" (rank ", stats.stats().rank(), ")") : "",
        ", not the coordinator; its coordinator is at ", stats.coordinator_address(),
        ": connect to that address"));
  }
  if (s.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
      s.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
    return absl::FailedPreconditionError(
        absl::StrCat(address,
                     " is a hybrid-paramd daemon, not the coordinator: connect to the address of "
                     "the coordinator it joins (its --coordinator flag)"));
  }
  return absl::FailedPreconditionError(
      absl::StrCat(address, " serves no hybrid-paramd coordinator (", join.message(), ")"));
}

}  // namespace

absl::Status Client::Impl::Connect() {
  const bool ca_from_environment = ApplyEnvironment(&options_);
  // A malformed address is refused now, not after connect_timeout; one
  // with a gRPC scheme ("dns:///...", "unix:...") is left to gRPC.
  if (absl::Status s = CheckAddress(options_.coordinator_address); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("coordinator address: ", s.message()));
  }
  if (options_.name.empty()) options_.name = DefaultName();
  ASSIGN_OR_RETURN(security_.tls, auth::LoadTls(options_.tls));
  security_.token = std::make_shared<auth::BearerToken>(options_.token);
  // What waiting will not mend (TLS against plaintext, an untrusted
  // certificate, ...) is said at once; a refused or silent address is
  // waited for below (a coordinator may start after its trainers).
  auth::ProbeNames names;
  names.ca = ca_from_environment ? "HPCTL_TLS_CA=" + options_.tls.ca : "the CA " + options_.tls.ca;
  names.give_ca =
      "give the CA that signed its certificate (the client's TLS CA, or "
      "$HPCTL_TLS_CA)";
  names.server_name = "the client's TLS server name";
  auto probe = [&](absl::Duration timeout) {
    return auth::ProbeEndpoint(options_.coordinator_address, security_.tls, timeout, names);
  };
  if (absl::Status s = probe(std::min(options_.connect_timeout, absl::Seconds(2)));
      !s.ok() && !absl::IsUnavailable(s)) {
    return s;
  }
  coordinator_channel_ = MakeChannel(options_.coordinator_address, security_);
  coordinator_ = rpc::Coordinator::NewStub(coordinator_channel_);
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  if (!coordinator_channel_->WaitForConnected(ToChrono(deadline))) {
    // Waited the whole timeout (a coordinator may start after its
    // trainers); say what a connection meets now, if it fails.
    if (const absl::Status s = probe(absl::Seconds(1)); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat(s.message(), " (waited ",
                                       absl::FormatDuration(options_.connect_timeout), ")"));
    }
    return absl::UnavailableError(absl::StrCat(
        "cannot reach the coordinator at ", options_.coordinator_address, " within ",
        absl::FormatDuration(options_.connect_timeout),
        security_.tls.enabled() ? " over TLS (is its certificate signed by the given CA and "
                                  "issued for that address?)"
                                : " over plaintext (a TLS server refuses plaintext clients)"));
  }
  rpc::JoinRequest request;
  request.set_role(options_.role == ClientOptions::Role::kTrainer ? rpc::ROLE_TRAINER
                                                                  : rpc::ROLE_OBSERVER);
  request.set_name(options_.name);
  request.set_pusher(options_.role == ClientOptions::Role::kTrainer && options_.pusher);
  request.set_expected_pushers(options_.expected_pushers);
  rpc::JoinResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToChrono(deadline));
  if (absl::Status join =
          FromGrpcStatus(coordinator_->Join(&context, request, &response), "join the coordinator");
      !join.ok()) {
    if (!absl::IsUnimplemented(join)) return join;
    return NotACoordinator(coordinator_channel_, options_.coordinator_address, deadline, join);
  }
  member_id_ = response.member_id();
  rank_ = response.rank();
  return RefreshManifest(deadline).status();
}

void Client::Impl::Leave() {
  if (coordinator_ == nullptr || member_id_.empty()) return;
  rpc::LeaveRequest request;
  request.set_member_id(member_id_);
  rpc::LeaveResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToChrono(absl::Now() + std::min(options_.call_timeout, absl::Seconds(2))));
  (void)coordinator_->Leave(&context, request, &response);
}

absl::StatusOr<Manifest> Client::Impl::RefreshManifest(absl::Time deadline, bool with_frozen_data) {
  rpc::GetManifestRequest request;
  request.set_with_frozen_data(with_frozen_data);
  rpc::GetManifestResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToChrono(deadline));
  RETURN_IF_ERROR(
      FromGrpcStatus(coordinator_->GetManifest(&context, request, &response), "GetManifest"));
  ASSIGN_OR_RETURN(Manifest m, ManifestFromProto(response.manifest()));
  SetManifest(m);
  return m;
}

absl::StatusOr<Layout> Client::Impl::LayoutOf(const std::string& tensor,
                                              Direction direction) const {
  absl::MutexLock lock(&mu_);
  const TensorMeta* meta = manifest_.Find(tensor);
  if (meta == nullptr) return absl::NotFoundError(absl::StrCat("no tensor '", tensor, "'"));
  if (!meta->Publishes(direction)) {
    return absl::FailedPreconditionError(absl::StrCat("tensor '", tensor, "' does not publish a ",
                                                      DirectionName(direction), " copy"));
  }
  return ComputeLayout(meta->SpecOf(direction), direction, meta->rows, meta->cols);
}

std::shared_ptr<rpc::Daemon::Stub> Client::Impl::DaemonStub(const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto& stub = daemons_[address];
  if (stub == nullptr) stub = rpc::Daemon::NewStub(DaemonChannelLocked(address));
  return stub;
}

std::shared_ptr<const internal::FetchMethod> Client::Impl::DaemonFetchMethod(
    const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto& method = fetch_methods_[address];
  if (method == nullptr) {
    method = std::make_shared<internal::FetchMethod>(DaemonChannelLocked(address));
  }
  return method;
}

std::shared_ptr<grpc::Channel> Client::Impl::DaemonChannelLocked(const std::string& address) {
  auto& channel = daemon_channels_[address];
  if (channel == nullptr) channel = MakeChannel(address, security_);
  return channel;
}

absl::StatusOr<VersionInfo> Client::Impl::WaitForVersionInfo(int64_t min_version,
                                                             absl::Time deadline) {
  rpc::WaitForVersionRequest request;
  request.set_min_version(min_version);
  {
    absl::MutexLock lock(&mu_);
    if (recovery_epoch_ >= 0) request.set_recovery_epoch(recovery_epoch_);
  }
  rpc::WaitForVersionResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToChrono(deadline));
  RETURN_IF_ERROR(FromGrpcStatus(coordinator_->WaitForVersion(&context, request, &response),
                                 absl::StrCat("wait for version ", min_version)));
  {
    absl::MutexLock lock(&mu_);
    recovery_epoch_ = std::max(recovery_epoch_, response.recovery_epoch());
  }
  VersionInfo info;
  info.committed_version = response.committed_version();
  info.recovery_epoch = response.recovery_epoch();
  if (response.has_rewound_to_version()) {
    info.rewound_to = response.rewound_to_version();
    // A replacement daemon serves the lost rank at another address.
    RETURN_IF_ERROR(RefreshManifest(deadline).status());
  }
  return info;
}

absl::Status Client::Impl::WatchVersion(int64_t min_version,
                                        const std::function<bool(const VersionInfo&)>& on_event,
                                        absl::Time deadline) {
  rpc::WatchVersionRequest request;
  request.set_min_version(min_version);
  {
    absl::MutexLock lock(&mu_);
    if (recovery_epoch_ >= 0) request.set_recovery_epoch(recovery_epoch_);
  }
  grpc::ClientContext context;
  context.set_deadline(ToChrono(deadline));
  std::unique_ptr<grpc::ClientReader<rpc::VersionEvent>> reader =
      coordinator_->WatchVersion(&context, request);
  rpc::VersionEvent event;
  absl::Status result;
  bool stopped = false;  // by us: the stream is cancelled, not failed
  while (reader->Read(&event)) {
    {
      absl::MutexLock lock(&mu_);
      recovery_epoch_ = std::max(recovery_epoch_, event.recovery_epoch());
    }
    VersionInfo info;
    info.committed_version = event.committed_version();
    info.recovery_epoch = event.recovery_epoch();
    if (event.has_rewound_to_version()) {
      info.rewound_to = event.rewound_to_version();
      result = RefreshManifest(deadline).status();  // the replacement's address
      if (!result.ok()) break;
    }
    if (!on_event(info)) {
      stopped = true;
      break;
    }
  }
  // Cancelled only when we left early: a stream that ended by itself (its
  // deadline, a failure) keeps its own status, which a cancel before
  // Finish() could turn into CANCELLED.
  if (stopped || !result.ok()) context.TryCancel();
  const grpc::Status s = reader->Finish();
  if (!result.ok()) return result;
  if (stopped) return absl::OkStatus();
  return FromGrpcStatus(s, absl::StrCat("watch version ", min_version));
}

constexpr char kRewoundPayload[] = "type.paramd/rewound_to_version";

absl::StatusOr<int64_t> Client::Impl::WaitForVersion(int64_t min_version, absl::Time deadline) {
  ASSIGN_OR_RETURN(VersionInfo info, WaitForVersionInfo(min_version, deadline));
  if (info.rewound_to.has_value()) {
    absl::Status s = absl::AbortedError(
        absl::StrCat("wait for version ", min_version, ": the cluster rewound to version ",
                     *info.rewound_to, " (recovery ", info.recovery_epoch,
                     ": a daemon was lost and replaced); go back to that version and push for it"));
    s.SetPayload(kRewoundPayload, absl::Cord(absl::StrCat(*info.rewound_to)));
    return s;
  }
  return info.committed_version;
}

absl::StatusOr<rpc::GetStatusResponse> Client::Impl::Status(bool include_shards,
                                                            absl::Time deadline) {
  rpc::GetStatusRequest request;
  request.set_include_shards(include_shards);
  rpc::GetStatusResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToChrono(deadline));
  RETURN_IF_ERROR(
      FromGrpcStatus(coordinator_->GetStatus(&context, request, &response), "GetStatus"));
  return response;
}

absl::StatusOr<int64_t> Client::Impl::Load(const std::string& path, const std::string& recipe,
                                           absl::Time deadline, bool replace_model) {
  rpc::LoadRequest request;
  request.set_safetensors_path(path);
  request.set_recipe_text(recipe);
  request.set_force(replace_model);
  rpc::LoadResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToChrono(deadline));
  RETURN_IF_ERROR(FromGrpcStatus(coordinator_->Load(&context, request, &response),
                                 absl::StrCat("load ", path)));
  ASSIGN_OR_RETURN(Manifest m, ManifestFromProto(response.manifest()));
  SetManifest(std::move(m));
  return response.committed_version();
}

absl::StatusOr<int64_t> Client::Impl::LoadDeclared(
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& tensors,
    const std::string& recipe, absl::Time deadline, bool replace_model,
    const std::vector<FrozenTensor>& frozen) {
  rpc::LoadRequest request;
  for (const auto& [name, shape] : tensors) {
    rpc::TensorDecl* d = request.add_tensors();
    d->set_name(name);
    for (int64_t s : shape) d->add_shape(s);
  }
  for (const FrozenTensor& f : frozen) *request.add_frozen() = f;
  request.set_recipe_text(recipe);
  request.set_force(replace_model);
  rpc::LoadResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToChrono(deadline));
  RETURN_IF_ERROR(FromGrpcStatus(coordinator_->Load(&context, request, &response),
                                 absl::StrCat("load of ", tensors.size(), " declared tensors")));
  ASSIGN_OR_RETURN(Manifest m, ManifestFromProto(response.manifest()));
  SetManifest(std::move(m));
  return response.committed_version();
}

absl::StatusOr<int64_t> Client::Impl::Step(int64_t version, bool wait, absl::Time deadline) {
  rpc::StepRequest request;
  request.set_version(version);
  request.set_wait(wait);
  rpc::StepResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToChrono(deadline));
  RETURN_IF_ERROR(FromGrpcStatus(coordinator_->Step(&context, request, &response),
                                 absl::StrCat("step from version ", version)));
  return response.committed_version();
}

absl::StatusOr<recipe::OptimizerConfig> Client::Impl::SetOptimizerSchedule(
    const recipe::LrSchedule& schedule, std::optional<float> lr, absl::Time deadline) {
  rpc::SetOptimizerScheduleRequest request;
  *request.mutable_schedule() = schedule;
  if (lr.has_value()) request.set_lr(*lr);
  rpc::SetOptimizerScheduleResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToChrono(deadline));
  RETURN_IF_ERROR(FromGrpcStatus(coordinator_->SetOptimizerSchedule(&context, request, &response),
                                 "SetOptimizerSchedule"));
  return response.optimizer();
}

// ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  if (options.tune_host_allocator) internal::TuneHostAllocator();
  auto impl = std::make_unique<Impl>(options);
  RETURN_IF_ERROR(impl->Connect());
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() { impl_->Leave(); }

const std::string& Client::member_id() const { return impl_->member_id_; }
int Client::rank() const { return impl_->rank_; }
Manifest Client::manifest() const { return impl_->manifest(); }

absl::StatusOr<Manifest> Client::RefreshManifest(absl::Duration timeout, bool with_frozen_data) {
  return impl_->RefreshManifest(impl_->DeadlineFor(timeout), with_frozen_data);
}

absl::StatusOr<Layout> Client::LayoutOf(const std::string& tensor, Direction direction) const {
  return impl_->LayoutOf(tensor, direction);
}

absl::StatusOr<FetchResult> Client::Fetch(int64_t version, const std::vector<FetchTarget>& targets,
                                          absl::Duration timeout) {
  return impl_->Fetch(version, targets, impl_->DeadlineFor(timeout));
}

absl::StatusOr<PushResult> Client::PushGradients(int64_t version,
                                                 absl::Span<const Gradient> gradients,
                                                 absl::Duration timeout, PushCoverage coverage) {
  return impl_->PushGradients(version, gradients, impl_->DeadlineFor(timeout), coverage);
}

absl::StatusOr<int64_t> Client::WaitForVersion(int64_t min_version, absl::Duration timeout) {
  return impl_->WaitForVersion(min_version, absl::Now() + timeout);
}

absl::StatusOr<VersionInfo> Client::WaitForVersionInfo(int64_t min_version,
                                                       absl::Duration timeout) {
  return impl_->WaitForVersionInfo(min_version, absl::Now() + timeout);
}

absl::Status Client::WatchVersion(int64_t min_version,
                                  const std::function<bool(const VersionInfo&)>& on_event,
                                  absl::Duration timeout) {
  return impl_->WatchVersion(min_version, on_event, absl::Now() + timeout);
}

std::optional<int64_t> RewoundTo(const absl::Status& status) {
  if (!absl::IsAborted(status)) return std::nullopt;
  auto payload = status.GetPayload(kRewoundPayload);
  int64_t v = 0;
  if (!payload || !absl::SimpleAtoi(std::string(*payload), &v)) return std::nullopt;
  return v;
}

absl::StatusOr<rpc::GetStatusResponse> Client::Status(bool include_shards, absl::Duration timeout) {
  return impl_->Status(include_shards, impl_->DeadlineFor(timeout));
}

absl::StatusOr<int64_t> Client::Load(const std::string& safetensors_path,
                                     const std::string& recipe_text, absl::Duration timeout,
                                     bool replace_model) {
  return impl_->Load(safetensors_path, recipe_text, impl_->DeadlineFor(timeout), replace_model);
}

absl::StatusOr<int64_t> Client::Step(int64_t version, bool wait, absl::Duration timeout) {
  return impl_->Step(version, wait, impl_->DeadlineFor(timeout));
}

absl::StatusOr<int64_t> Client::LoadDeclared(
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& tensors,
    const std::string& recipe_text, absl::Duration timeout, bool replace_model,
    const std::vector<FrozenTensor>& frozen) {
  return impl_->LoadDeclared(tensors, recipe_text, impl_->DeadlineFor(timeout), replace_model,
                             frozen);
}

absl::StatusOr<recipe::OptimizerConfig> Client::SetOptimizerSchedule(
    const recipe::LrSchedule& schedule, std::optional<float> lr, absl::Duration timeout) {
  return impl_->SetOptimizerSchedule(schedule, lr, impl_->DeadlineFor(timeout));
}

std::shared_ptr<grpc::Channel> Client::DaemonChannel(const std::string& address) {
  return impl_->DaemonChannel(address);
}

std::shared_ptr<grpc::Channel> Client::CoordinatorChannel() const {
  return impl_->coordinator_channel();
}

const auth::ChannelSecurity& Client::security() const { return impl_->security(); }

FetchStats Client::fetch_stats() const { return impl_->fetch_stats(); }

}  // namespace client
}  // namespace paramd
