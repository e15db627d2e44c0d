// File: transport/socket_channel.h
//
// Internal to transport/: a low-latency control channel for small messages
// (the NCCL backend's message headers and clear-to-sends). One TCP
// connection per (sender, receiver), TCP_NODELAY, opened lazily by the
// sender; a reader thread per accepted connection delivers each frame into
// one of the receiver's Mailboxes as if it had come through the backend's
// own channel. A send is one write() (no per-message RPC, no reply), so a
// message reaches the peer's mailbox in tens of microseconds instead of the
// few hundred of a gRPC Deliver call.
//
// What it does NOT do (its user keeps a gRPC channel for these): tell
// receivers that a peer left (a closed connection marks nothing gone),
// acknowledge delivery (Send returns once the frame is in the kernel's
// socket buffer), or carry large messages efficiently.
//
// Threading: every method may be called from any thread, concurrently with
// any other, except the destructor. Frames from one sender to one peer
// arrive in the order their Sends returned.
#ifndef PARAMD_TRANSPORT_SOCKET_CHANNEL_H_
#define PARAMD_TRANSPORT_SOCKET_CHANNEL_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "transport/message_transport.h"

namespace paramd {
namespace transport_internal {

// Frames larger than this are refused by Send (INVALID_ARGUMENT) and by the
// reader (which drops the connection).
inline constexpr size_t kSocketMaxFrameBytes = size_t{1} << 20;

class SocketChannel {
 public:
  // Listens on `host`:0 ("" = 127.0.0.1; a wildcard host is advertised as
  // this machine's hostname). Connections are accepted only after Start;
  // until then they wait in the kernel's backlog. UNAVAILABLE if the host
  // cannot be bound.
  static absl::StatusOr<std::unique_ptr<SocketChannel>> Listen(const std::string& host);

  // Closes (see Close).
  ~SocketChannel();

  // "host:port" for peers' Start.
  const std::string& address() const { return address_; }

  // Joins as `rank`: frames from rank r for mailbox b go into mailboxes[b]
  // as coming from r; Send(peer, ...) connects to addresses[peer] (an empty
  // address: Send gives UNAVAILABLE). Call once.
  void Start(int rank, std::vector<std::string> addresses,
             std::vector<std::shared_ptr<Mailbox>> mailboxes);

  // Writes one frame to `peer`'s mailbox `mailbox` with `tag`. Connects
  // first if needed (bounded by the deadline and ~2 s). OK once the frame is
  // in the socket buffer. UNAVAILABLE if the peer cannot be reached or has
  // closed its end (the caller may fall back to another channel; a frame may
  // then have been half-written, which the reader drops), DEADLINE_EXCEEDED
  // if the write could not finish in time (the connection is then dropped).
  absl::Status Send(int peer, uint32_t mailbox, uint64_t tag, absl::Span<const uint8_t> bytes,
                    absl::Time deadline);

  // Stops accepting, closes every connection and joins the threads.
  // Idempotent; later Sends give FAILED_PRECONDITION.
  void Close();

 private:
  struct Peer {
    absl::Mutex mu;
    int fd ABSL_GUARDED_BY(mu) = -1;
    bool failed ABSL_GUARDED_BY(mu) = false;  // do not retry a refused peer
  };

  SocketChannel(int listen_fd, int wake_fd[2], std::string address);
  absl::Status ConnectLocked(int peer, Peer& p, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  void AcceptLoop();
  void ReadLoop(int fd);

  int listen_fd_;
  int wake_fd_[2];
  const std::string address_;
  std::atomic<bool> closed_{false};
  int rank_ = -1;
  std::vector<std::string> addresses_;
  std::vector<std::shared_ptr<Mailbox>> mailboxes_;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::thread acceptor_;
  absl::Mutex readers_mu_;
  std::vector<int> reader_fds_ ABSL_GUARDED_BY(readers_mu_);
  std::vector<std::thread> readers_ ABSL_GUARDED_BY(readers_mu_);
};

}  // namespace transport_internal
}  // namespace paramd

#endif  // PARAMD_TRANSPORT_SOCKET_CHANNEL_H_
