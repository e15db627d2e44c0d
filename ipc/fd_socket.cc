#include "ipc/fd_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"

namespace paramd {
namespace ipc {
namespace {

constexpr uint32_t kMagic = 0x70697063;  // "pipc"
constexpr int kMessageChars = 400;

// Wire format (one message each way; both ends are this code, one machine).
struct WireRequest {
  uint32_t magic;
  uint32_t op;
  char secret[kSecretBytes];
  uint64_t session;
  uint64_t arg0;
  uint64_t arg1;
};
struct WireReply {
  uint32_t magic;
  int32_t code;  // absl::StatusCode
  uint32_t n_fds;
  uint32_t pad;
  uint64_t epoch;
  uint64_t sizes[kMaxFds];
  char message[kMessageChars];
};

absl::Status Errno(const std::string& what) {
  const int e = errno;
  const std::string m = absl::StrCat(what, ": ", std::strerror(e));
  if (e == ECONNREFUSED || e == ENOENT || e == EPIPE || e == ECONNRESET) {
    return absl::UnavailableError(m);
  }
  return absl::InternalError(m);
}

sockaddr_un AbstractAddress(const std::string& name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof(a.sun_path) - 1);
  std::memcpy(a.sun_path + 1, name.data(), n);  // sun_path[0] = 0: abstract
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return a;
}

// Waits until `fd` is readable (POLLIN) or writable, bounded by `deadline`.
absl::Status WaitFd(int fd, short events, absl::Time deadline) {
  for (;;) {
    const int64_t ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
    pollfd p{fd, events, 0};
    const int r = poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30)));
    if (r > 0) return absl::OkStatus();
    if (r == 0) return absl::DeadlineExceededError("IPC socket: timed out");
    if (errno != EINTR) return Errno("IPC socket poll");
  }
}

// Sends `bytes` and `fds` in one sendmsg (SOCK_SEQPACKET: one record).
absl::Status SendWithFds(int sock, const void* bytes, size_t n, const std::vector<int>& fds) {
  iovec iov{const_cast<void*>(bytes), n};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
  if (!fds.empty()) {
    m.msg_control = control;
    m.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t r;
  do {
    r = sendmsg(sock, &m, MSG_NOSIGNAL);
  } while (r < 0 && errno == EINTR);
  if (r < 0) return Errno("IPC socket send");
  if (static_cast<size_t>(r) != n) return absl::InternalError("IPC socket: short send");
  return absl::OkStatus();
}

// Receives one record of exactly `n` bytes and its descriptors (owned by
// the caller; closed here on error).
absl::Status RecvWithFds(int sock, void* bytes, size_t n, std::vector<int>* fds,
                         absl::Time deadline) {
  if (absl::Status s = WaitFd(sock, POLLIN, deadline); !s.ok()) return s;
  iovec iov{bytes, n};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
  m.msg_control = control;
  m.msg_controllen = sizeof(control);
  ssize_t r;
  do {
    r = recvmsg(sock, &m, MSG_CMSG_CLOEXEC);
  } while (r < 0 && errno == EINTR);
  if (r < 0) return Errno("IPC socket receive");
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds->push_back(fd);
      }
    }
  }
  auto fail = [fds](absl::Status s) {
    for (int fd : *fds) close(fd);
    fds->clear();
    return s;
  };
  if (r == 0) return fail(absl::UnavailableError("IPC socket: the peer closed the connection"));
  if (static_cast<size_t>(r) != n || (m.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
    return fail(absl::InvalidArgumentError("IPC socket: malformed message"));
  }
  return absl::OkStatus();
}

std::string RandomBytes(size_t n) {
  std::random_device device;
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(device() & 0xff);
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<FdSocketServer>> FdSocketServer::Start(FdHandler handler) {
  std::unique_ptr<FdSocketServer> s(new FdSocketServer());
  s->handler_ = std::move(handler);
  s->secret_ = RandomBytes(kSecretBytes);
  std::mt19937_64 rng(std::random_device{}());
  s->name_ = absl::StrCat("paramd-ipc-", getpid(), "-", absl::Hex(rng(), absl::kZeroPad16));
  s->listen_fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (s->listen_fd_ < 0) return Errno("IPC socket");
  socklen_t len;
  sockaddr_un a = AbstractAddress(s->name_, &len);
  if (bind(s->listen_fd_, reinterpret_cast<sockaddr*>(&a), len) != 0) return Errno("IPC bind");
  if (listen(s->listen_fd_, 64) != 0) return Errno("IPC listen");
  if (pipe2(s->wake_, O_CLOEXEC) != 0) return Errno("IPC pipe");
  FdSocketServer* raw = s.get();
  s->thread_ = std::thread([raw] { raw->Serve(); });
  return s;
}

FdSocketServer::~FdSocketServer() {
  Stop();
  for (int fd : {listen_fd_, wake_[0], wake_[1]}) {
    if (fd >= 0) close(fd);
  }
}

void FdSocketServer::Stop() {
  if (!thread_.joinable()) return;
  const char c = 0;
  ssize_t ignored = write(wake_[1], &c, 1);
  (void)ignored;
  thread_.join();
}

void FdSocketServer::Serve() {
  for (;;) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    const int r = poll(p, 2, -1);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 || (p[1].revents != 0)) return;
    if ((p[0].revents & POLLIN) == 0) continue;
    const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    Answer(conn);
    close(conn);
  }
}

void FdSocketServer::Answer(int conn) {
  ucred peer{};
  socklen_t peer_len = sizeof(peer);
  if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &peer, &peer_len) != 0 || peer.uid != getuid()) {
    return;  // another user: no answer
  }
  WireRequest req{};
  std::vector<int> in_fds;
  if (!RecvWithFds(conn, &req, sizeof(req), &in_fds, absl::Now() + absl::Seconds(5)).ok()) return;
  FdReply reply;
  const int fd = in_fds.empty() ? -1 : in_fds[0];
  for (size_t i = 1; i < in_fds.size(); ++i) close(in_fds[i]);
  if (req.magic != kMagic || std::memcmp(req.secret, secret_.data(), kSecretBytes) != 0) {
    if (fd >= 0) close(fd);
    reply.status = absl::PermissionDeniedError("IPC socket: wrong secret");
  } else {
    FdRequest r;
    r.op = static_cast<FdOp>(req.op);
    r.secret.assign(req.secret, kSecretBytes);
    r.session = req.session;
    r.arg0 = req.arg0;
    r.arg1 = req.arg1;
    reply = handler_(r, fd);
  }
  WireReply w{};
  w.magic = kMagic;
  w.code = static_cast<int32_t>(reply.status.code());
  if (reply.fds.size() > static_cast<size_t>(kMaxFds) || reply.sizes.size() != reply.fds.size()) {
    for (int f : reply.fds) close(f);
    reply.fds.clear();
    w.code = static_cast<int32_t>(absl::StatusCode::kInternal);
    std::snprintf(w.message, kMessageChars, "IPC socket: bad reply (%zu fds)", reply.fds.size());
  } else {
    std::snprintf(w.message, kMessageChars, "%s", std::string(reply.status.message()).c_str());
  }
  w.n_fds = static_cast<uint32_t>(reply.fds.size());
  w.epoch = reply.epoch;
  for (size_t i = 0; i < reply.fds.size(); ++i) w.sizes[i] = reply.sizes[i];
  (void)SendWithFds(conn, &w, sizeof(w), reply.fds);
  for (int f : reply.fds) close(f);
}

absl::StatusOr<FdReply> FdSocketCall(const std::string& name, const FdRequest& request, int send_fd,
                                     absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  if (request.secret.size() != static_cast<size_t>(kSecretBytes)) {
    return absl::InvalidArgumentError("IPC socket: the secret has the wrong length");
  }
  const int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (sock < 0) return Errno("IPC socket");
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{sock};
  socklen_t len;
  sockaddr_un a = AbstractAddress(name, &len);
  if (connect(sock, reinterpret_cast<sockaddr*>(&a), len) != 0) {
    absl::Status s = Errno(absl::StrCat("IPC socket connect to @", name));
    return absl::UnavailableError(
        absl::StrCat(s.message(), " (the daemon's process is gone or has no IPC socket)"));
  }
  WireRequest w{};
  w.magic = kMagic;
  w.op = static_cast<uint32_t>(request.op);
  std::memcpy(w.secret, request.secret.data(), kSecretBytes);
  w.session = request.session;
  w.arg0 = request.arg0;
  w.arg1 = request.arg1;
  std::vector<int> out;
  if (send_fd >= 0) out.push_back(send_fd);
  if (absl::Status s = SendWithFds(sock, &w, sizeof(w), out); !s.ok()) return s;
  WireReply r{};
  FdReply reply;
  if (absl::Status s = RecvWithFds(sock, &r, sizeof(r), &reply.fds, deadline); !s.ok()) return s;
  if (r.magic != kMagic || r.n_fds != reply.fds.size()) {
    for (int fd : reply.fds) close(fd);
    return absl::InternalError("IPC socket: malformed reply");
  }
  r.message[kMessageChars - 1] = '\0';
  reply.status = absl::Status(static_cast<absl::StatusCode>(r.code), r.message);
  reply.epoch = r.epoch;
  reply.sizes.assign(r.sizes, r.sizes + r.n_fds);
  return reply;
}

}  // namespace ipc
}  // namespace paramd
