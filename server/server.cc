#include "server/server.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/async_util.h"

namespace paramd {

absl::StatusOr<std::unique_ptr<ParamdServer>> ParamdServer::Start(ServerOptions options) {
  if (!options.run_coordinator && !options.run_daemon) {
    return absl::InvalidArgumentError("nothing to run: neither coordinator nor daemon role");
  }
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
    RETURN_IF_ERROR(options.add_services(s->coordinator_.get(), s->daemon_.get(),
                                         &options.extra_services));
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &s->port_);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  if (s->coordinator_) builder.RegisterService(s->coordinator_->service());
  if (s->daemon_) builder.RegisterService(s->daemon_->service());
  for (grpc::Service* service : options.extra_services) builder.RegisterService(service);
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
  }
  s->address_ = options.advertise_address.empty() ? absl::StrCat("127.0.0.1:", s->port_)
                                                  : options.advertise_address;
  if (s->daemon_) {
    s->daemon_->Start(s->address_, options.coordinator_address.empty()
                                       ? s->address_
                                       : options.coordinator_address);
  }
  Log("server", absl::StrCat("serving ", s->coordinator_ ? "coordinator" : "",
                             s->coordinator_ && s->daemon_ ? "+" : "",
                             s->daemon_ ? "daemon" : "", " on ", options.listen, " (",
                             s->address_, ")"));
  return s;
}

ParamdServer::~ParamdServer() { Shutdown(); }

void ParamdServer::Wait() { server_->Wait(); }

void ParamdServer::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (coordinator_) coordinator_->Shutdown();
  if (daemon_) daemon_->Shutdown();
  // Null when Start failed before listening (e.g. a refused --backend).
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

}  // namespace paramd
