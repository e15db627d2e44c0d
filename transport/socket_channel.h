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
// (the NCCL transport) closes the world and opens a new one.
//
// A silent peer is dead too. A peer host that vanishes without a FIN/RST
// (power loss, a network partition) sends no hang-up; TCP keepalive and
// TCP_USER_TIMEOUT on every connection (both ends, see
// SocketChannelOptions) turn its silence into a timed-out connection
// within ~15 s by default, and that takes the same path as a hang-up: the
// peer is marked dead, with a reason that says it stopped answering ("no
// keepalive answer ..." from a reader, "sent data unacknowledged ..." from
// a Send). A peer process that is alive but stopped (SIGSTOP, wedged) is
// only caught once this side has data it will not take (its kernel still
// answers the keepalives): a Send whose bytes stay unacknowledged for the
// user timeout fails UNAVAILABLE and marks it dead. Not detected: a peer
// whose connection could not be opened (refused: Sends give UNAVAILABLE,
// nothing is marked).
//
// Authentication: every connection proves the world's secret
// (SocketChannelOptions::secret) before the acceptor takes any frame from
// it: the acceptor sends a random nonce, the connector answers with its rank
// and HMAC-SHA256(secret, nonce || rank). A connection that does not prove
// it within kSocketHelloTimeout (a stranger, a wrong secret, garbage) is
// closed and marks nobody dead: the channel's own connections are not
// disturbed. The frames themselves are not encrypted.
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
#include <functional>
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
// How long an accepted connection has to prove the secret.
inline constexpr absl::Duration kSocketHelloTimeout = absl::Seconds(5);

// How a channel notices a peer host that went silent, set on every
// connection it opens or accepts (SO_KEEPALIVE with TCP_KEEPIDLE /
// TCP_KEEPINTVL / TCP_KEEPCNT, and TCP_USER_TIMEOUT).
//
// Why these defaults (~15 s to a dead host): the world's peers sit in one
// cluster, where a round trip is well under a millisecond and nothing idles
// a connection out, so a peer that answers no probe for 15 s is gone, not
// slow; 5 probes 2 s apart ride out a few lost packets or a short switch
// hiccup without a false death (which costs a new world). Much shorter
// risks those false deaths under congestion; much longer and the callers'
// deadlines always fire first, so the detection would be worth nothing.
// The cost is one empty segment per idle connection every 2-5 s.
//
// This does not replace deadlines: each gRPC call, Send and Receive is
// still bounded by its own deadline, which may be shorter than the
// detection time (the call then fails DEADLINE_EXCEEDED, and the peer is
// marked dead later, when its connection times out).
//
// The kernel takes whole seconds for the keepalive times (rounded up here)
// and milliseconds for the user timeout. With a user timeout set, Linux
// declares a keepalive failure at the first probe after nothing was heard
// for the user timeout (so at about max(user_timeout, keepalive_idle +
// keepalive_interval)), not after keepalive_count probes: keep user_timeout
// ~= keepalive_idle + keepalive_count * keepalive_interval so both agree.
struct SocketChannelOptions {
  // Off: no keepalive probes (an idle connection to a vanished host is then
  // never seen to die).
  bool keepalive = true;
  // Silence before the first probe, the gap between probes, and how many
  // unanswered probes make the host dead. Times >= 1 s, count in [1, 127].
  absl::Duration keepalive_idle = absl::Seconds(5);
  absl::Duration keepalive_interval = absl::Seconds(2);
  int keepalive_count = 5;
  // Sent data unacknowledged this long (a receiver that keeps its window
  // shut included) fails the connection. Zero: the kernel's default (~15
  // min of retransmissions). In [0, 24h].
  absl::Duration user_timeout = absl::Seconds(15);
  // The secret every rank of the world shares (see the file comment),
  // read when a connection is opened or accepted, so it may be set after
  // Listen (a daemon learns its cluster secret when it joins). Null or
  // returning "": connections prove nothing and any is accepted.
  std::function<std::string()> secret;
  // The host address() names when Listen's host is a wildcard (see
  // TransportOptions::advertise_host); "" = this machine's hostname.
  std::string advertise_host;
};

class SocketChannel {
 public:
  // Listens on `host`:0 ("" = 127.0.0.1; a wildcard host is advertised as
  // options.advertise_host, else this machine's hostname). Connections are accepted only after
  // Start; until then they wait in the kernel's backlog. UNAVAILABLE if the host cannot be bound,
  // INVALID_ARGUMENT for options out of range.
  static absl::StatusOr<std::unique_ptr<SocketChannel>> Listen(
      const std::string& host, const SocketChannelOptions& options = {});

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
  // finish in time (the connection is dropped and the peer is dead), or
  // UNAVAILABLE if it stayed unacknowledged for the user timeout (the peer
  // is then dead; see SocketChannelOptions).
  absl::Status Send(int peer, uint32_t mailbox, uint64_t tag, absl::Span<const uint8_t> bytes,
                    absl::Time deadline);

  // Whether `peer` is dead: it hung up or stopped answering (see above).
  // Lock-free: for polling loops.
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

  SocketChannel(int listen_fd, int wake_fd[2], std::string address, SocketChannelOptions options);
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
  const SocketChannelOptions options_;
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
