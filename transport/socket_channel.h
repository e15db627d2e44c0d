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
// A hang-up marks the peer dead. Start connects to every other peer at
// once (in the background), so each rank holds a reader on every peer's
// connection from the start; when a peer's connection ends with EOF or a
// reset (its process died, or its channel closed), that peer is DEAD for
// this channel: every mailbox given to Start marks it gone (pending and
// later Receives of that peer with nothing queued fail at once with
// UNAVAILABLE naming the peer and why; what was queued is still received),
// PeerGone() turns true, and Sends to it fail at once with UNAVAILABLE. The
// same holds when this side drops the connection itself (a write that
// could not finish in time leaves a half-written frame; the peer then sees
// the hang-up too, so both sides agree). A peer is never revived: its user
// (the NCCL transport) closes the world and opens a new one. Not detected:
// a peer's host that vanishes without a FIN/RST (no TCP keepalive here;
// the caller's deadline covers it), and a peer whose connection could not
// be opened (refused: Sends give UNAVAILABLE, nothing is marked).
//
// What it does NOT do (its user keeps a gRPC channel for these):
// acknowledge delivery (Send returns once the frame is in the kernel's
// socket buffer), or carry large messages efficiently.
//
// Threading: every method may be called from any thread, concurrently with
// any other, except the destructor. Frames from one sender to one peer
// arrive in the order their Sends returned. One reader thread per accepted
// connection and one connector thread (joined by Close).
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
  // address: Send gives UNAVAILABLE). Starts connecting to every other peer
  // with an address in the background (so that their hang-ups are seen
  // before any traffic); returns without waiting. Call once.
  void Start(int rank, std::vector<std::string> addresses,
             std::vector<std::shared_ptr<Mailbox>> mailboxes);

  // Writes one frame to `peer`'s mailbox `mailbox` with `tag`. Connects
  // first if needed (bounded by the deadline and ~2 s). OK once the frame is
  // in the socket buffer. UNAVAILABLE at once for a dead peer (see above;
  // the message names the peer), UNAVAILABLE if the peer cannot be reached
  // (the caller may fall back to another channel) or hangs up during the
  // write (the peer is then dead), DEADLINE_EXCEEDED if the write could not
  // finish in time (the connection is dropped and the peer is dead).
  absl::Status Send(int peer, uint32_t mailbox, uint64_t tag, absl::Span<const uint8_t> bytes,
                    absl::Time deadline);

  // Whether `peer` hung up (see above). Lock-free: for polling loops.
  bool PeerGone(int peer) const;

  // OK while `peer` is not known dead, else UNAVAILABLE naming it and why.
  absl::Status PeerStatus(int peer);

  // Stops accepting, closes every connection and joins the threads (the
  // peers then see this rank hang up). Idempotent; later Sends give
  // FAILED_PRECONDITION. Marks nobody dead.
  void Close();

 private:
  struct Peer {
    absl::Mutex mu;
    int fd ABSL_GUARDED_BY(mu) = -1;
    bool failed ABSL_GUARDED_BY(mu) = false;  // do not retry a refused peer
    std::atomic<bool> gone{false};            // hung up: see the file comment
    absl::Mutex why_mu;
    std::string why ABSL_GUARDED_BY(why_mu);  // set before `gone`
  };

  SocketChannel(int listen_fd, int wake_fd[2], std::string address);
  absl::Status ConnectLocked(int peer, Peer& p, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  void AcceptLoop();
  void ConnectAll();
  void ReadLoop(int fd);
  // Marks `peer` dead with `why` (the first reason is kept): its mailboxes'
  // Receives and its Sends fail UNAVAILABLE from here on.
  void MarkDead(int peer, const std::string& why);

  int listen_fd_;
  int wake_fd_[2];
  const std::string address_;
  std::atomic<bool> closed_{false};
  int rank_ = -1;
  std::vector<std::string> addresses_;
  std::vector<std::shared_ptr<Mailbox>> mailboxes_;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::thread acceptor_;
  std::thread connector_;
  absl::Mutex readers_mu_;
  std::vector<int> reader_fds_ ABSL_GUARDED_BY(readers_mu_);
  std::vector<std::thread> readers_ ABSL_GUARDED_BY(readers_mu_);
};

}  // namespace transport_internal
}  // namespace paramd

#endif  // PARAMD_TRANSPORT_SOCKET_CHANNEL_H_
