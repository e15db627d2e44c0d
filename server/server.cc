#include "server/server.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/rpc/async_util.h"
#include "server/rpc/rpc_metrics.h"

namespace paramd {

absl::StatusOr<std::unique_ptr<ParamdServer>> ParamdServer::Start(ServerOptions options) {
  if (!options.run_coordinator && !options.run_daemon) {
    return absl::InvalidArgumentError("nothing to run: neither coordinator nor daemon role");
  }
  RETURN_IF_ERROR(auth::CheckListenAddress(options.listen, options.tls.enabled(),
                                           options.insecure_listen_anywhere));
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                   auth::ServerCredentials(options.tls));
  if (options.authenticator == nullptr) {
    options.authenticator = std::make_shared<auth::Authenticator>(std::vector<auth::TokenEntry>());
  }
  options.coordinator.authenticator = options.authenticator;
  options.coordinator.tls = options.tls;
  options.coordinator.cluster_secret = options.cluster_secret;
  options.daemon.authenticator = options.authenticator;
  options.daemon.tls = options.tls;
  options.daemon.join_token = options.cluster_secret;
  std::unique_ptr<ParamdServer> s(new ParamdServer());
  if (options.run_coordinator) {
    ASSIGN_OR_RETURN(s->coordinator_, Coordinator::Create(options.coordinator));
  }
  if (options.run_daemon) {
    if (options.coordinator_address.empty() && !options.run_coordinator) {
      return absl::InvalidArgumentError("a daemon needs the coordinator's address");
    }
    ASSIGN_OR_RETURN(s->daemon_, Daemon::Create(options.daemon));
  }

  if (options.add_services) {
    RETURN_IF_ERROR(
        options.add_services(s->coordinator_.get(), s->daemon_.get(), &options.extra_services));
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, credentials, &s->port_);
  auth::AddKeepalive(&builder);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  // gRPC sets SO_REUSEPORT by default: a second process on this port would
  // start and take half of the connections. Refuse it instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(NewRpcMetricsFactory());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  if (s->coordinator_) builder.RegisterService(s->coordinator_->service());
  if (s->daemon_) {
    builder.RegisterService(s->daemon_->service());
    builder.RegisterService(s->daemon_->ipc_service());
  }
  for (grpc::Service* service : options.extra_services) builder.RegisterService(service);
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen,
                     " (address in use by another process, or not an address of this machine)"));
  }
  // Not ready until the roles say so (the default service starts SERVING).
  s->UpdateHealth();
  s->address_ = options.advertise_address.empty() ? absl::StrCat("127.0.0.1:", s->port_)
                                                  : options.advertise_address;
  if (s->daemon_) {
    s->daemon_->Start(s->address_, options.coordinator_address.empty()
                                       ? s->address_
                                       : options.coordinator_address);
  }
  Log("server",
      absl::StrCat(
          "serving ", s->coordinator_ ? "coordinator" : "",
          s->coordinator_ && s->daemon_ ? "+" : "", s->daemon_ ? "daemon" : "", " on ",
          options.listen, " (", s->address_, "; ", options.tls.enabled() ? "TLS" : "plaintext",
          options.tls.require_client_cert ? ", client certificates required" : "",
          options.authenticator->tokens_required() ? ", bearer tokens required" : ", no token file",
          ")"));
  s->monitor_ = std::thread([p = s.get()] { p->Monitor(); });
  return s;
}

ParamdServer::~ParamdServer() { Shutdown(); }

void ParamdServer::Wait() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](ParamdServer* s)
           ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) { return s->shut_down_ || !s->fatal_.ok(); },
      this));
}

absl::Status ParamdServer::fatal_error() const {
  absl::MutexLock lock(&mu_);
  return fatal_;
}

void ParamdServer::Monitor() {
  for (;;) {
    absl::Status fatal;
    if (coordinator_) fatal = coordinator_->startup_error();
    if (fatal.ok() && daemon_) fatal = daemon_->startup_error();
    if (!fatal.ok()) {
      absl::MutexLock lock(&mu_);
      if (fatal_.ok()) fatal_ = fatal;
      return;  // Wait() returns; the owner shuts down
    }
    UpdateHealth();
    absl::MutexLock lock(&mu_);
    if (mu_.AwaitWithTimeout(absl::Condition(&shut_down_), absl::Milliseconds(50))) return;
  }
}

void ParamdServer::UpdateHealth() {
  std::map<std::string, bool> health;
  bool ready = true;
  if (coordinator_) {
    const bool joined = coordinator_->joined_daemons() >= coordinator_->expected_daemons();
    // A recovery that found nothing to recover from leaves the cluster
    // unable to step or load until an operator loads again: the
    // coordinator's service is not serving, whatever else is up.
    const bool recoverable = !coordinator_->recovery().needs_load();
    health["paramd.rpc.Coordinator"] = joined && recoverable;
    // A DOWN daemon (lease expired) holds shards nobody serves until it is
    // replaced, and a replacement serves none until its state is back
    // (RECOVERING): the process is not ready meanwhile.
    bool all_up = true;
    for (const rpc::Member& m : coordinator_->daemon_members()) {
      if (m.state() != rpc::MEMBER_STATE_ALIVE) all_up = false;
    }
    ready = ready && joined && recoverable && all_up && coordinator_->committed_version() >= 0;
  }
  if (daemon_) {
    const bool serving = daemon_->rank() >= 0 && daemon_->published_version() >= 0;
    health["paramd.rpc.Daemon"] = serving;
    ready = ready && serving;
  }
  health[""] = ready;
  absl::MutexLock lock(&mu_);
  if (shut_down_ || server_ == nullptr) return;
  grpc::HealthCheckServiceInterface* service = server_->GetHealthCheckService();
  if (service == nullptr) return;
  for (const auto& [name, serving] : health) {
    auto it = health_.find(name);
    if (it != health_.end() && it->second == serving) continue;
    const bool first = it == health_.end();
    health_[name] = serving;
    service->SetServingStatus(name, serving);
    if (first) continue;  // the initial NOT_SERVING goes without saying
    Log("server", absl::StrCat("health ", name.empty() ? "(process)" : name, ": ",
                               serving ? "SERVING" : "NOT_SERVING"));
  }
}

void ParamdServer::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (monitor_.joinable()) monitor_.join();
  if (coordinator_) coordinator_->Shutdown();
  if (daemon_) daemon_->Shutdown();
  // Null when Start failed before listening (e.g. a refused --backend).
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

}  // namespace paramd
