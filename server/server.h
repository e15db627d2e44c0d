// File: server/server.h
//
// One `hybrid-paramd` process: a gRPC server on one port serving the
// coordinator role, the daemon role or both (server/coordinator/coordinator.h,
// server/daemon/daemon.h), plus gRPC health checking and reflection. With both
// roles the daemon joins its own coordinator through that port, so one
// process is a complete single-node setup.
//
// Health (grpc.health.v1, as systemd/Kubernetes probes read it), checked
// every 50 ms:
//   "paramd.rpc.Coordinator"  SERVING once every expected daemon has joined
//                             (Load, checkpoint and hpctl calls can work);
//   "paramd.rpc.Daemon"       SERVING once this daemon has joined and
//                             publishes a version;
//   "" (the process)          SERVING once every role here is ready and a
//                             version is loaded: the coordinator has
//                             committed one and no daemon is DOWN, the
//                             daemon publishes one.
// NOT_SERVING before that and after Shutdown().
//
// Fatal startup errors (a refused or timed-out join, a failed startup
// --model/--restore_from load) end Wait() and are returned by
// fatal_error(): the process is not healthy and will not become so.
//
// No SO_REUSEPORT: a second server on a bound port fails to start.
//
// Threading: thread-safe. Shutdown() may be called from any thread (not
// from a signal handler).
#ifndef PARAMD_SERVER_SERVER_H_
#define PARAMD_SERVER_SERVER_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "auth/security.h"
#include "grpcpp/grpcpp.h"
#include "server/coordinator/coordinator.h"
#include "server/daemon/daemon.h"

namespace paramd {

struct ServerOptions {
  // "host:port"; port 0 picks a free port (see ParamdServer::port()).
  // Without TLS only a loopback address is accepted unless
  // insecure_listen_anywhere (auth::CheckListenAddress).
  std::string listen = "127.0.0.1:7070";
  // The address other processes use to reach this one. Empty:
  // "127.0.0.1:<bound port>" (single machine).
  std::string advertise_address;
  bool run_coordinator = true;
  bool run_daemon = true;
  CoordinatorOptions coordinator;
  DaemonOptions daemon;
  // Coordinator address for the daemon role. Empty with run_coordinator:
  // this process. Required otherwise.
  std::string coordinator_address;
  // Served on the same port (e.g. checkpoint/). Not owned; must outlive the
  // server.
  std::vector<grpc::Service*> extra_services;
  // Called once the roles exist and before the port is bound, to create
  // services over them (null arguments for roles not run here); appends to
  // `services`, which the callee keeps alive until the server is gone.
  std::function<absl::Status(Coordinator* coordinator, Daemon* daemon,
                             std::vector<grpc::Service*>* services)>
      add_services;
  // Largest gRPC message accepted or sent.
  int max_message_bytes = 64 << 20;

  // Security (auth/security.h, docs/SECURITY.md). TLS of the server (its
  // certificate; with a CA, client certificates are checked) and of this
  // process's own channels (the same CA checks the peers' certificates,
  // the same certificate is presented to them).
  auth::TlsConfig tls;
  bool insecure_listen_anywhere = false;
  // Who may call what; null = no token file (auth::Authenticator({})).
  std::shared_ptr<auth::Authenticator> authenticator;
  // The cluster secret shared by the coordinator and its daemons
  // (--cluster_secret_file, else a `cluster` token of the token file);
  // "" = the coordinator generates one (CoordinatorOptions::cluster_secret)
  // and daemons join without credentials.
  std::string cluster_secret;
};

class ParamdServer {
 public:
  // InvalidArgument for bad options (no role, bad role options);
  // Unavailable if `listen` cannot be bound.
  static absl::StatusOr<std::unique_ptr<ParamdServer>> Start(ServerOptions options);

  ~ParamdServer();  // Shutdown()
  ParamdServer(const ParamdServer&) = delete;
  ParamdServer& operator=(const ParamdServer&) = delete;

  int port() const { return port_; }
  const std::string& address() const { return address_; }
  // Null when the role does not run here.
  Coordinator* coordinator() { return coordinator_.get(); }
  Daemon* daemon() { return daemon_.get(); }

  // Blocks until Shutdown() or a fatal error (fatal_error()).
  void Wait();
  // Fails waiting calls, stops the roles and the server. Idempotent.
  void Shutdown();
  // OK unless a role hit a fatal startup error (then Wait() has returned).
  absl::Status fatal_error() const;

 private:
  ParamdServer() = default;
  // Health and fatal-error checks, every 50 ms until Shutdown().
  void Monitor();
  void UpdateHealth();

  int port_ = 0;
  std::string address_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<grpc::Server> server_;
  std::thread monitor_;
  mutable absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status fatal_ ABSL_GUARDED_BY(mu_);
  // Last health set per service name ("" = the process).
  std::map<std::string, bool> health_ ABSL_GUARDED_BY(mu_);
};

}  // namespace paramd

#endif  // PARAMD_SERVER_SERVER_H_
