// File: server/daemon/lease_keeper.h
//
// A daemon's side of membership (docs/ARCHITECTURE.md "Membership"): a
// thread that renews the daemon's lease with a Heartbeat to the coordinator
// every `interval` once the daemon has joined, and hands each verdict that
// is not OK (the coordinator forgot the daemon, or another process took its
// rank) to the daemon.
//
// Threading: the callbacks run on the keeper's thread; they must not block
// for long (a heartbeat late by more than the lease makes the daemon DOWN).
// The destructor stops the thread (waits at most one heartbeat's deadline).
#ifndef PARAMD_SERVER_DAEMON_LEASE_KEEPER_H_
#define PARAMD_SERVER_DAEMON_LEASE_KEEPER_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/paramd.grpc.pb.h"

namespace paramd {

class LeaseKeeper {
 public:
  // What the next heartbeat says; nullopt: not joined (nothing is sent).
  using RequestFn = std::function<std::optional<rpc::HeartbeatRequest>()>;
  using VerdictFn = std::function<void(const rpc::HeartbeatRequest&, rpc::HeartbeatVerdict)>;

  // `coordinator` must outlive this object.
  LeaseKeeper(rpc::Coordinator::Stub* coordinator, absl::Duration interval, RequestFn request,
              VerdictFn on_verdict);
  ~LeaseKeeper();
  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;

 private:
  void Run();

  rpc::Coordinator::Stub* const coordinator_;
  const absl::Duration interval_;
  const RequestFn request_;
  const VerdictFn on_verdict_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace paramd

#endif  // PARAMD_SERVER_DAEMON_LEASE_KEEPER_H_
