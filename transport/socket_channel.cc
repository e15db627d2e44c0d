#include "transport/socket_channel.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "transport/transport.h"

namespace paramd {
namespace transport_internal {
namespace {

constexpr uint32_t kHelloMagic = 0x324C4548;  // "HEL2": nonce + proof
constexpr uint32_t kFrameMagic = 0x4D415246;  // "FRAM"
constexpr absl::Duration kConnectTimeout = absl::Seconds(2);

using Nonce = std::array<uint8_t, 32>;

// The connector's answer to the acceptor's nonce.
struct Hello {
  uint32_t magic = kHelloMagic;
  int32_t rank = -1;
  uint8_t proof[32] = {};  // HMAC-SHA256(secret, nonce || rank)
};

void Prove(const std::string& secret, const Nonce& nonce, int32_t rank, uint8_t out[32]) {
  uint8_t message[sizeof(Nonce) + sizeof(rank)];
  std::memcpy(message, nonce.data(), nonce.size());
  std::memcpy(message + nonce.size(), &rank, sizeof(rank));
  unsigned int len = 32;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), message, sizeof(message), out,
       &len);
}

std::string SecretOf(const SocketChannelOptions& o) { return o.secret ? o.secret() : ""; }

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint32_t mailbox = 0;
  uint64_t tag = 0;
  uint64_t size = 0;
};

// Milliseconds until `deadline` for poll(), at least 0, at most `cap`.
int PollTimeoutMs(absl::Time deadline, absl::Duration cap = absl::InfiniteDuration()) {
  const absl::Duration left = std::min(deadline - absl::Now(), cap);
  if (left <= absl::ZeroDuration()) return 0;
  if (left >= absl::Hours(1)) return 3600 * 1000;
  return static_cast<int>(absl::ToInt64Milliseconds(left)) + 1;
}

// 1: read all of `size`; 0: EOF first; -errno: a read error (a reset).
int ReadFull(int fd, void* data, size_t size) {
  uint8_t* p = static_cast<uint8_t*>(data);
  while (size > 0) {
    const ssize_t n = read(fd, p, size);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      return n == 0 ? 0 : -errno;
    }
  }
  return 1;
}

// ReadFull bounded by `deadline` (blocking or non-blocking `fd`): 1 when
// all was read, 0 for EOF, -errno for an error, -ETIMEDOUT at the deadline.
int ReadFullBy(int fd, void* data, size_t size, absl::Time deadline) {
  uint8_t* p = static_cast<uint8_t*>(data);
  while (size > 0) {
    pollfd pf = {fd, POLLIN, 0};
    const int timeout = PollTimeoutMs(deadline);
    const int ready = timeout == 0 ? 0 : poll(&pf, 1, timeout);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return -ETIMEDOUT;
    const ssize_t n = read(fd, p, size);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
    } else if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) {
      continue;
    } else {
      return n == 0 ? 0 : -errno;
    }
  }
  return 1;
}

// Whole seconds, rounded up, for the kernel's keepalive options.
int CeilSeconds(absl::Duration d) {
  return static_cast<int>(absl::ToInt64Seconds(absl::Ceil(d, absl::Seconds(1))));
}

// About how long a silent peer takes to be declared dead (see
// SocketChannelOptions on how the kernel combines the two).
absl::Duration DetectionTime(const SocketChannelOptions& o) {
  const absl::Duration keepalive =
      absl::Seconds(CeilSeconds(o.keepalive_idle) +
                    int64_t{o.keepalive_count} * CeilSeconds(o.keepalive_interval));
  if (o.user_timeout <= absl::ZeroDuration()) return keepalive;
  return std::max(o.user_timeout,
                  absl::Seconds(CeilSeconds(o.keepalive_idle) + CeilSeconds(o.keepalive_interval)));
}

// Why a connection timed out (ETIMEDOUT: keepalive or user timeout), from
// the reader's side (it sends nothing, so only keepalive probes went
// unanswered) or the writer's.
std::string TimedOutReason(bool reader, const SocketChannelOptions& o) {
  if (reader) {
    return absl::StrCat("stopped answering (no keepalive answer for ~",
                        absl::FormatDuration(DetectionTime(o)), ": host down or unreachable)");
  }
  return absl::StrCat(
      "stopped answering (sent data unacknowledged or no keepalive answer for ~",
      absl::FormatDuration(o.user_timeout > absl::ZeroDuration() ? o.user_timeout
                                                                 : DetectionTime(o)),
      ": host down, unreachable or not reading)");
}

// Why a reader's connection ended, from ReadFull's result.
std::string HangUpReason(int read_result, const SocketChannelOptions& o) {
  if (read_result == 0) return "hung up (EOF)";
  if (read_result == -ETIMEDOUT) return TimedOutReason(/*reader=*/true, o);
  return absl::StrCat("hung up (", std::strerror(-read_result), ")");
}

// Sets TCP_NODELAY and the silent-peer detection of `o` on a connection.
absl::Status TuneConnection(int fd, const SocketChannelOptions& o) {
  auto set = [fd](int level, int name, int value, const char* what) {
    if (setsockopt(fd, level, name, &value, sizeof(value)) == 0) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("setsockopt(", what, "): ", std::strerror(errno)));
  };
  RETURN_IF_ERROR(set(IPPROTO_TCP, TCP_NODELAY, 1, "TCP_NODELAY"));
  RETURN_IF_ERROR(set(SOL_SOCKET, SO_KEEPALIVE, o.keepalive ? 1 : 0, "SO_KEEPALIVE"));
  if (o.keepalive) {
    RETURN_IF_ERROR(set(IPPROTO_TCP, TCP_KEEPIDLE, CeilSeconds(o.keepalive_idle), "TCP_KEEPIDLE"));
    RETURN_IF_ERROR(
        set(IPPROTO_TCP, TCP_KEEPINTVL, CeilSeconds(o.keepalive_interval), "TCP_KEEPINTVL"));
    RETURN_IF_ERROR(set(IPPROTO_TCP, TCP_KEEPCNT, o.keepalive_count, "TCP_KEEPCNT"));
  }
  return set(IPPROTO_TCP, TCP_USER_TIMEOUT,
             static_cast<int>(absl::ToInt64Milliseconds(o.user_timeout)), "TCP_USER_TIMEOUT");
}

absl::Status ValidateOptions(const SocketChannelOptions& o) {
  const auto bad = [](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("control channel options: ", what));
  };
  if (o.keepalive) {
    // TCP_KEEPIDLE / TCP_KEEPINTVL: 1..32767 s; TCP_KEEPCNT: 1..127.
    for (absl::Duration d : {o.keepalive_idle, o.keepalive_interval}) {
      if (d < absl::Seconds(1) || d > absl::Seconds(32767)) {
        return bad(
            absl::StrCat("keepalive time ", absl::FormatDuration(d), " not in [1s, 32767s]"));
      }
    }
    if (o.keepalive_count < 1 || o.keepalive_count > 127) {
      return bad(absl::StrCat("keepalive_count ", o.keepalive_count, " not in [1, 127]"));
    }
  }
  if (o.user_timeout < absl::ZeroDuration() || o.user_timeout > absl::Hours(24)) {
    return bad(
        absl::StrCat("user_timeout ", absl::FormatDuration(o.user_timeout), " not in [0, 24h]"));
  }
  return absl::OkStatus();
}

// Writes all of `bytes` to the non-blocking `fd`, waiting for room until
// the deadline.
absl::Status WriteFull(int fd, absl::Span<const uint8_t> bytes, absl::Time deadline,
                       const SocketChannelOptions& o) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pf = {fd, POLLOUT, 0};
      const int timeout = PollTimeoutMs(deadline);
      if (timeout == 0 || poll(&pf, 1, timeout) == 0) {
        return absl::DeadlineExceededError("write did not finish in time");
      }
      continue;
    }
    if (errno == ETIMEDOUT) return absl::UnavailableError(TimedOutReason(/*reader=*/false, o));
    return absl::UnavailableError(absl::StrCat("write failed: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

// "host:port" or "[v6]:port" -> (host, port).
bool SplitAddress(const std::string& address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 >= address.size()) return false;
  *host = address.substr(0, colon);
  *port = address.substr(colon + 1);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SocketChannel>> SocketChannel::Listen(
    const std::string& host_in, const SocketChannelOptions& options) {
  RETURN_IF_ERROR(ValidateOptions(options));
  const std::string host = host_in.empty() ? "127.0.0.1" : host_in;
  std::string bind_host = host;
  if (bind_host.size() >= 2 && bind_host.front() == '[') {
    bind_host = bind_host.substr(1, bind_host.size() - 2);
  }
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (getaddrinfo(bind_host.c_str(), "0", &hints, &found) != 0 || found == nullptr) {
    return absl::UnavailableError(absl::StrCat("control channel: cannot resolve '", host, "'"));
  }
  int fd = -1;
  int port = 0;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    sockaddr_storage bound = {};
    socklen_t len = sizeof(bound);
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 128) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
      close(fd);
      fd = -1;
      continue;
    }
    port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                       : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  }
  freeaddrinfo(found);
  if (fd < 0)
    return absl::UnavailableError(absl::StrCat("control channel: cannot listen on ", host));
  int wake[2];
  if (pipe2(wake, O_CLOEXEC) != 0) {
    close(fd);
    return absl::UnavailableError("control channel: pipe2 failed");
  }
  std::string address = AdvertisedAddress(host, port, options.advertise_host);
  return std::unique_ptr<SocketChannel>(new SocketChannel(fd, wake, std::move(address), options));
}

SocketChannel::SocketChannel(int listen_fd, int wake_fd[2], std::string address,
                             SocketChannelOptions options)
    : listen_fd_(listen_fd),
      wake_fd_{wake_fd[0], wake_fd[1]},
      address_(std::move(address)),
      options_(std::move(options)) {}

SocketChannel::~SocketChannel() {
  Close();
  close(wake_fd_[0]);
  close(wake_fd_[1]);
}

void SocketChannel::Start(int rank, std::vector<std::string> addresses,
                          std::vector<std::shared_ptr<Mailbox>> mailboxes) {
  rank_ = rank;
  addresses_ = std::move(addresses);
  mailboxes_ = std::move(mailboxes);
  for (size_t i = 0; i < addresses_.size(); ++i) peers_.push_back(std::make_unique<Peer>());
  acceptor_ = std::thread([this] { AcceptLoop(); });
  connector_ = std::thread([this] { ConnectAll(); });
}

// Opens the connection to every other peer up front, so that each peer
// holds a reader on it (and sees this rank hang up) before any traffic.
// A peer that cannot be reached now is left to Send's lazy connect.
void SocketChannel::ConnectAll() {
  for (int peer = 0; peer < static_cast<int>(peers_.size()); ++peer) {
    if (closed_.load()) return;
    if (peer == rank_ || addresses_[peer].empty()) continue;
    Peer& p = *peers_[peer];
    absl::MutexLock lock(&p.mu);
    if (p.fd < 0 && !p.failed && !p.gone.load()) {
      (void)ConnectLocked(peer, p, absl::Now() + kConnectTimeout);
    }
  }
}

bool SocketChannel::PeerGone(int peer) const {
  return peer >= 0 && peer < static_cast<int>(peers_.size()) && peers_[peer]->gone.load();
}

absl::Status SocketChannel::PeerStatus(int peer) {
  if (!PeerGone(peer)) return absl::OkStatus();
  Peer& p = *peers_[peer];
  absl::MutexLock lock(&p.why_mu);
  return absl::UnavailableError(p.why);
}

void SocketChannel::MarkDead(int peer, const std::string& why) {
  Peer& p = *peers_[peer];
  {
    absl::MutexLock lock(&p.why_mu);
    if (p.gone.load()) return;
    p.why = why;
    p.gone.store(true);
  }
  for (const std::shared_ptr<Mailbox>& box : mailboxes_) box->MarkGone(peer, why);
  // Hang up our side too, so the peer agrees. A Send holding the lock is
  // writing to that connection: it sees the flag once its write ends.
  if (p.mu.TryLock()) {
    if (p.fd >= 0) {
      shutdown(p.fd, SHUT_RDWR);
      close(p.fd);
      p.fd = -1;
    }
    p.mu.Unlock();
  }
}

void SocketChannel::AcceptLoop() {
  while (!closed_.load()) {
    pollfd pf[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_[0], POLLIN, 0}};
    if (poll(pf, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (pf[1].revents != 0 || closed_.load()) return;
    if ((pf[0].revents & POLLIN) == 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    // Untuned, a silent peer would go unseen: refuse the connection (the
    // peer's Sends then fail UNAVAILABLE).
    if (!TuneConnection(fd, options_).ok()) {
      close(fd);
      continue;
    }
    absl::MutexLock lock(&readers_mu_);
    if (closed_.load()) {
      close(fd);
      return;
    }
    reader_fds_.push_back(fd);
    readers_.emplace_back([this, fd] { ReadLoop(fd); });
  }
}

void SocketChannel::ReadLoop(int fd) {
  // The challenge: a fresh nonce (32 bytes always fit the new socket's
  // buffer), answered by the connector's rank and proof of the secret.
  Nonce nonce;
  if (RAND_bytes(nonce.data(), static_cast<int>(nonce.size())) != 1 ||
      send(fd, nonce.data(), nonce.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(nonce.size())) {
    return;
  }
  Hello hello;
  if (ReadFullBy(fd, &hello, sizeof(hello), absl::Now() + kSocketHelloTimeout) != 1 ||
      hello.magic != kHelloMagic || hello.rank < 0 ||
      hello.rank >= static_cast<int>(addresses_.size())) {
    shutdown(fd, SHUT_RDWR);
    return;  // a stranger: nobody to mark
  }
  if (const std::string secret = SecretOf(options_); !secret.empty()) {
    uint8_t want[32];
    Prove(secret, nonce, hello.rank, want);
    if (CRYPTO_memcmp(want, hello.proof, sizeof(want)) != 0) {
      shutdown(fd, SHUT_RDWR);
      return;  // no proof of the secret: a stranger claiming a rank
    }
  }
  std::string why;
  for (;;) {
    FrameHeader h;
    int r = ReadFull(fd, &h, sizeof(h));
    if (r != 1) {
      why = HangUpReason(r, options_);
      break;
    }
    if (h.magic != kFrameMagic || h.size > kSocketMaxFrameBytes || h.mailbox >= mailboxes_.size()) {
      why = "sent a malformed frame (connection dropped)";
      break;
    }
    std::string bytes(h.size, '\0');
    if (h.size > 0 && (r = ReadFull(fd, &bytes[0], h.size)) != 1) {
      why = HangUpReason(r, options_);
      break;
    }
    // A closed mailbox (its transport shut down) refuses: nothing to do.
    (void)mailboxes_[h.mailbox]->Deliver(hello.rank, h.tag, std::move(bytes));
  }
  // Our own Close ends every reader: that is no news about the peer.
  if (closed_.load()) return;
  shutdown(fd, SHUT_RDWR);  // closed by Close, with the other readers' fds
  MarkDead(hello.rank, absl::StrCat("control channel: rank ", hello.rank, " (",
                                    addresses_[hello.rank], ") ", why));
}

absl::Status SocketChannel::ConnectLocked(int peer, Peer& p, absl::Time deadline) {
  if (p.failed) return absl::UnavailableError("control channel: peer refused before");
  std::string host, port;
  if (!SplitAddress(addresses_[peer], &host, &port)) {
    p.failed = true;
    return absl::UnavailableError(absl::StrCat("control channel: no address for rank ", peer));
  }
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0 || found == nullptr) {
    p.failed = true;
    return absl::UnavailableError(absl::StrCat("control channel: cannot resolve ", host));
  }
  absl::Status status =
      absl::UnavailableError(absl::StrCat("control channel: cannot connect to ", addresses_[peer]));
  for (addrinfo* a = found; a != nullptr && p.fd < 0; a = a->ai_next) {
    const int fd =
        socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    int r = connect(fd, a->ai_addr, a->ai_addrlen);
    if (r != 0 && errno == EINPROGRESS) {
      pollfd pf = {fd, POLLOUT, 0};
      if (poll(&pf, 1, PollTimeoutMs(deadline, kConnectTimeout)) == 1) {
        int err = 0;
        socklen_t len = sizeof(err);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        r = err == 0 ? 0 : -1;
        if (err == ECONNREFUSED) p.failed = true;
      } else {
        status = absl::DeadlineExceededError(
            absl::StrCat("control channel: connecting to ", addresses_[peer], " timed out"));
      }
    } else if (r != 0 && errno == ECONNREFUSED) {
      p.failed = true;
    }
    if (r != 0) {
      close(fd);
      continue;
    }
    status = TuneConnection(fd, options_);
    Hello hello;
    hello.rank = rank_;
    Nonce nonce;
    if (status.ok()) {
      const int r = ReadFullBy(fd, nonce.data(), nonce.size(), deadline);
      if (r != 1) {
        status = r == -ETIMEDOUT ? absl::DeadlineExceededError("no challenge from the peer in time")
                                 : absl::UnavailableError("the peer closed before its challenge");
      }
    }
    if (status.ok()) {
      Prove(SecretOf(options_), nonce, rank_, hello.proof);
      status = WriteFull(
          fd, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(&hello), sizeof(hello)),
          deadline, options_);
    }
    if (!status.ok()) {
      status = absl::Status(status.code(), absl::StrCat("control channel: connection to ",
                                                        addresses_[peer], ": ", status.message()));
      close(fd);
      continue;
    }
    p.fd = fd;
    p.failed = false;
  }
  freeaddrinfo(found);
  return p.fd >= 0 ? absl::OkStatus() : status;
}

absl::Status SocketChannel::Send(int peer, uint32_t mailbox, uint64_t tag,
                                 absl::Span<const uint8_t> bytes, absl::Time deadline) {
  if (closed_.load()) return absl::FailedPreconditionError("control channel closed");
  if (peer < 0 || peer >= static_cast<int>(peers_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("control channel: no rank ", peer));
  }
  if (bytes.size() > kSocketMaxFrameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("control channel: frame of ", bytes.size(), " bytes"));
  }
  Peer& p = *peers_[peer];
  RETURN_IF_ERROR(PeerStatus(peer));
  absl::MutexLock lock(&p.mu);
  RETURN_IF_ERROR(PeerStatus(peer));
  if (p.fd < 0) RETURN_IF_ERROR(ConnectLocked(peer, p, deadline));
  // A connection dropped mid-frame cannot be resumed (the peer's reader is
  // out of step): the peer is dead for this channel from here on.
  auto drop = [&](const absl::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu) {
    shutdown(p.fd, SHUT_RDWR);
    close(p.fd);
    p.fd = -1;
    const std::string why =
        absl::StrCat("control channel: rank ", peer, " (", addresses_[peer], ") ", s.message());
    MarkDead(peer, why);
    return absl::Status(s.code(), why);
  };
  // The peer writes nothing on this connection: readable means it closed,
  // an error that it reset or stopped answering (keepalive, user timeout).
  pollfd pf = {p.fd, POLLIN | POLLRDHUP, 0};
  if (poll(&pf, 1, 0) == 1 && pf.revents != 0) {
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(p.fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err == ETIMEDOUT) {
      return drop(absl::UnavailableError(TimedOutReason(/*reader=*/false, options_)));
    }
    return drop(absl::UnavailableError(
        err == 0 ? "closed the connection"
                 : absl::StrCat("closed the connection (", std::strerror(err), ")")));
  }
  FrameHeader h;
  h.mailbox = mailbox;
  h.tag = tag;
  h.size = bytes.size();
  std::string frame(sizeof(h) + bytes.size(), '\0');
  std::memcpy(&frame[0], &h, sizeof(h));
  if (!bytes.empty()) std::memcpy(&frame[sizeof(h)], bytes.data(), bytes.size());
  absl::Status s = WriteFull(
      p.fd, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(frame.data()), frame.size()),
      deadline, options_);
  if (!s.ok()) return drop(s);
  return absl::OkStatus();
}

void SocketChannel::Close() {
  if (closed_.exchange(true)) return;
  const char byte = 1;
  (void)!write(wake_fd_[1], &byte, 1);
  if (acceptor_.joinable()) acceptor_.join();
  if (connector_.joinable()) connector_.join();
  // New connections are refused from here on.
  close(listen_fd_);
  for (auto& p : peers_) {
    absl::MutexLock lock(&p->mu);
    if (p->fd >= 0) {
      shutdown(p->fd, SHUT_RDWR);
      close(p->fd);
      p->fd = -1;
    }
  }
  std::vector<int> fds;
  std::vector<std::thread> readers;
  {
    absl::MutexLock lock(&readers_mu_);
    fds.swap(reader_fds_);
    readers.swap(readers_);
  }
  for (int fd : fds) shutdown(fd, SHUT_RDWR);
  for (std::thread& t : readers) t.join();
  for (int fd : fds) close(fd);
}

}  // namespace transport_internal
}  // namespace paramd
