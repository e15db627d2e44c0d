#include "common/address.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace paramd {
namespace {

bool HasScheme(absl::string_view address) {
  return absl::StrContains(address, "://") || absl::StartsWith(address, "unix:") ||
         absl::StartsWith(address, "unix-abstract:") || absl::StartsWith(address, "ipv4:") ||
         absl::StartsWith(address, "ipv6:") || absl::StartsWith(address, "vsock:");
}

// One connection attempt: 0 = connected (*out = the socket, blocking
// again), ETIMEDOUT = no answer within the time given, else the errno of a
// definite failure.
int TryConnect(const addrinfo& ai, absl::Duration timeout, int* out) {
  const int fd =
      ::socket(ai.ai_family, ai.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai.ai_protocol);
  if (fd < 0) return errno;
  int err = 0;
  if (::connect(fd, ai.ai_addr, ai.ai_addrlen) != 0) {
    err = errno;
    if (err == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      const int ms = static_cast<int>(absl::ToInt64Milliseconds(timeout));
      const int n = ::poll(&p, 1, ms > 0 ? ms : 1);
      if (n <= 0) {
        err = ETIMEDOUT;
      } else {
        socklen_t len = sizeof err;
        if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      }
    }
  }
  if (err == 0 && ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0) err = errno;
  if (err != 0) {
    ::close(fd);
    return err;
  }
  *out = fd;
  return 0;
}

std::string Describe(const addrinfo& ai) {
  char host[NI_MAXHOST] = "?";
  char port[NI_MAXSERV] = "?";
  ::getnameinfo(ai.ai_addr, ai.ai_addrlen, host, sizeof host, port, sizeof port,
                NI_NUMERICHOST | NI_NUMERICSERV);
  return ai.ai_family == AF_INET6 ? absl::StrCat("[", host, "]:", port)
                                  : absl::StrCat(host, ":", port);
}

}  // namespace

absl::StatusOr<HostPort> ParseHostPort(absl::string_view address) {
  if (HasScheme(address)) return absl::NotFoundError("address with a gRPC scheme");
  HostPort hp;
  absl::string_view port;
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("address '", address, "': unclosed '['"));
    }
    hp.host = std::string(address.substr(1, close - 1));
    if (close + 1 >= address.size() || address[close + 1] != ':') {
      return absl::InvalidArgumentError(
          absl::StrCat("address '", address, "' has no port (expected [HOST]:PORT)"));
    }
    port = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("address '", address, "' has no port (expected HOST:PORT)"));
    }
    if (address.find(':') != colon) {
      return absl::InvalidArgumentError(
          absl::StrCat("address '", address, "': write an IPv6 address as [ADDRESS]:PORT"));
    }
    hp.host = std::string(address.substr(0, colon));
    port = address.substr(colon + 1);
  }
  if (hp.host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("address '", address, "' has no host"));
  }
  if (!absl::SimpleAtoi(port, &hp.port) || hp.port < 1 || hp.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("address '", address, "': port '", port, "' is not a number in 1..65535"));
  }
  return hp;
}

absl::Status CheckAddress(absl::string_view address) {
  absl::StatusOr<HostPort> parsed = ParseHostPort(address);
  return parsed.ok() || absl::IsNotFound(parsed.status()) ? absl::OkStatus() : parsed.status();
}

absl::StatusOr<int> ConnectTcp(absl::string_view address, absl::Duration timeout) {
  absl::StatusOr<HostPort> hp = ParseHostPort(address);
  if (!hp.ok()) return hp.status();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  const std::string port = absl::StrCat(hp->port);
  const int rc = ::getaddrinfo(hp->host.c_str(), port.c_str(), &hints, &list);
  if (rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve host '", hp->host, "' of ", address,
                                               ": ", ::gai_strerror(rc)));
  }
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<std::string> failures;
  bool silent = false;  // some address neither connected nor refused
  for (const addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
    int fd = -1;
    const int err = TryConnect(*ai, std::max(deadline - absl::Now(), absl::Milliseconds(1)), &fd);
    if (err == 0) {
      ::freeaddrinfo(list);
      return fd;
    }
    if (err == ETIMEDOUT) {
      silent = true;
      continue;
    }
    failures.push_back(absl::StrCat(Describe(*ai), ": ", std::strerror(err)));
  }
  ::freeaddrinfo(list);
  if (silent) {
    return absl::DeadlineExceededError(
        absl::StrCat(address, " did not answer within ", absl::FormatDuration(timeout)));
  }
  return absl::UnavailableError(absl::StrCat("cannot reach the coordinator at ", address, " (",
                                             absl::StrJoin(failures, "; "),
                                             "); is hybrid-paramd running there?"));
}

absl::Status ProbeAddress(absl::string_view address, absl::Duration timeout) {
  if (HasScheme(address)) return absl::OkStatus();
  absl::StatusOr<int> fd = ConnectTcp(address, timeout);
  if (fd.ok()) {
    ::close(*fd);
    return absl::OkStatus();
  }
  return absl::IsDeadlineExceeded(fd.status()) ? absl::OkStatus() : fd.status();
}

}  // namespace paramd
