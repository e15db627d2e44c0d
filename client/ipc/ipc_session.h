// File: client/ipc/ipc_session.h
//
// A trainer's same-GPU session with one daemon (proto/ipc.proto,
// docs/ARCHITECTURE.md "Co-located trainers"): the gRPC calls of
// paramd.rpc.DaemonIpc, the lease kept alive by a thread of its own, and
// the daemon's file-descriptor socket. Host code only; the CUDA side
// (mapping the descriptors, device pointers) is client/gpu_fetch/ipc_import.h.
//
// Liveness: a keep-alive every lease/4 renews the lease; when the daemon
// stops answering (its process died, or the session expired) the session
// turns dead, stickily, and every call (and Healthy()) answers UNAVAILABLE
// saying why, so buffers mapped through it are never read on as if valid.
// Healthy() also checks that the daemon's process still exists (same
// machine, same PID namespace: the socket is an abstract Unix socket).
//
// Threading: thread-safe. Calls block for at most the call timeout.
#ifndef PARAMD_CLIENT_IPC_IPC_SESSION_H_
#define PARAMD_CLIENT_IPC_IPC_SESSION_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "ipc/fd_socket.h"
#include "ipc/pin_page.h"
#include "proto/ipc.grpc.pb.h"

namespace paramd {
namespace ipc {

struct IpcSessionOptions {
  // The lease: a session not renewed for this long expires on the daemon
  // (with its pins). Renewed every lease/4 while the session lives.
  absl::Duration lease = absl::Seconds(5);
  std::string name;  // for the daemon's logs; empty: "<hostname>:<pid>"
  absl::Duration call_timeout = absl::Seconds(10);
  // Tests only: no keep-alive thread (a trainer that stopped: its lease
  // lapses).
  bool keep_alive = true;
};

class IpcSession {
 public:
  // Opens a session on the daemon behind `channel` (a Client::DaemonChannel).
  // FAILED_PRECONDITION: the daemon has no exporter (a cpu daemon or a build
  // without --config=cuda).
  static absl::StatusOr<std::unique_ptr<IpcSession>> Open(std::shared_ptr<grpc::Channel> channel,
                                                          const IpcSessionOptions& options);
  ~IpcSession();  // closes the session (best effort; else its lease lapses)
  IpcSession(const IpcSession&) = delete;
  IpcSession& operator=(const IpcSession&) = delete;

  uint64_t id() const { return open_.session(); }
  const std::string& device_uuid() const { return open_.device_uuid(); }
  int daemon_pid() const { return open_.daemon_pid(); }
  absl::Duration lease() const { return absl::Milliseconds(open_.lease_ms()); }

  // OK while the daemon lives and the session is renewed; else UNAVAILABLE
  // (sticky) with the reason.
  absl::Status Healthy() const;

  // PinIpc (see proto/ipc.proto). `unpin_version` >= 0 is released in the
  // same call.
  absl::StatusOr<rpc::PinIpcResponse> Pin(int64_t version,
                                          const std::vector<rpc::TensorDirections>& tensors,
                                          int64_t unpin_version = -1);
  absl::Status Unpin(int64_t version);
  // The daemon's exported regions: new descriptors (owned by the caller),
  // sizes and epoch.
  absl::StatusOr<FdReply> GetRegions();
  // The session's shared-memory pin page (ipc/pin_page.h), mapped
  // here; NOT_FOUND from a daemon that made none.
  absl::StatusOr<std::unique_ptr<PinPage>> GetPinPage();
  // Hands the daemon the descriptor of a trainer buffer (not closed here).
  absl::Status RegisterBuffer(uint64_t id, int fd, uint64_t bytes);
  // PushGradientsIpc; the session field is filled in.
  absl::StatusOr<rpc::PushGradientsResponse> Push(rpc::PushGradientsIpcRequest request);

 private:
  IpcSession(std::shared_ptr<grpc::Channel> channel, const IpcSessionOptions& options);
  void KeepAlive();
  // A request without a descriptor to the daemon's socket; a reply that is
  // not OK closes its descriptors.
  absl::StatusOr<FdReply> SocketCall(FdOp op);
  // A failed call: kills the session when the daemon is gone.
  absl::Status Failed(const grpc::Status& s, const char* what);
  void SetDeadline(grpc::ClientContext& context) const;

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<rpc::DaemonIpc::Stub> stub_;
  const IpcSessionOptions options_;
  rpc::OpenIpcSessionResponse open_;
  mutable absl::Mutex mu_;
  mutable absl::Status dead_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread keep_alive_;
};

}  // namespace ipc
}  // namespace paramd

#endif  // PARAMD_CLIENT_IPC_IPC_SESSION_H_
