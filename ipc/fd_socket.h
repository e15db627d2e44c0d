// File: ipc/fd_socket.h
//
// File descriptors between processes of one machine (same-GPU sessions,
// proto/ipc.proto): CUDA virtual-memory shareable handles are POSIX file
// descriptors, which only a Unix socket (SCM_RIGHTS) can hand to another
// process. The daemon listens on an abstract-namespace Unix socket (no file
// to clean up; gone with the process); a request carries the daemon's
// socket secret (handed out only by an authenticated OpenIpcSession) and a
// session id, and at most one descriptor; a reply carries a status, a few
// numbers and up to kMaxFds descriptors. Peers of another uid are refused
// (SO_PEERCRED).
//
// Threading: the server answers on one thread of its own, one request at a
// time (each is short: no device work waits on a peer). FdSocketCall is
// blocking (bounded by its timeout) and thread-safe.
#ifndef PARAMD_IPC_FD_SOCKET_H_
#define PARAMD_IPC_FD_SOCKET_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace paramd {
namespace ipc {

constexpr int kMaxFds = 16;
constexpr int kSecretBytes = 32;

enum class FdOp : uint32_t {
  kGetRegions = 1,      // reply: the exported regions' fds, sizes and epoch
  kRegisterBuffer = 2,  // request fd: a trainer buffer (arg0 id, arg1 bytes)
  kGetPinPage = 3,      // reply: the session's pin page (ipc/pin_page.h)
};

struct FdRequest {
  FdOp op = FdOp::kGetRegions;
  std::string secret;  // kSecretBytes
  uint64_t session = 0;
  uint64_t arg0 = 0;
  uint64_t arg1 = 0;
};

struct FdReply {
  absl::Status status;
  uint64_t epoch = 0;
  std::vector<uint64_t> sizes;  // one per fd
  // Descriptors to send; the server closes them after sending (the handler
  // hands over ownership). On the client: received, owned by the caller.
  std::vector<int> fds;
};

// The handler: `fd` is the request's descriptor (-1 if none), owned by the
// handler (close it or keep it).
using FdHandler = std::function<FdReply(const FdRequest& request, int fd)>;

class FdSocketServer {
 public:
  // Listens on a new abstract socket "paramd-ipc-<pid>-<random>".
  static absl::StatusOr<std::unique_ptr<FdSocketServer>> Start(FdHandler handler);
  ~FdSocketServer();  // Stop()
  void Stop();

  const std::string& name() const { return name_; }
  // The secret requests must carry (kSecretBytes random bytes).
  const std::string& secret() const { return secret_; }

 private:
  FdSocketServer() = default;
  void Serve();
  void Answer(int conn);

  FdHandler handler_;
  std::string name_;
  std::string secret_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};  // Stop() writes to wake_[1]
  std::thread thread_;
};

// One request to the socket `name`. The reply's status is the server's (or
// UNAVAILABLE: no such socket / the daemon died; DEADLINE_EXCEEDED).
// `send_fd` (-1: none) is sent with the request (not closed here).
absl::StatusOr<FdReply> FdSocketCall(const std::string& name, const FdRequest& request,
                                     int send_fd = -1, absl::Duration timeout = absl::Seconds(10));

}  // namespace ipc
}  // namespace paramd

#endif  // PARAMD_IPC_FD_SOCKET_H_
