#include "common/address.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace paramd {
namespace {

TEST(ParseHostPort, AcceptsHostPortAndBracketedIpv6) {
  auto a = ParseHostPort("node-1.example:7070");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "node-1.example");
  EXPECT_EQ(a->port, 7070);
  auto b = ParseHostPort("[::1]:65535");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->host, "::1");
  EXPECT_EQ(b->port, 65535);
}

TEST(ParseHostPort, NamesWhatIsWrong) {
  for (const char* bad : {"localhost", "127.0.0.1:", ":7070", "h:0", "h:65536", "h:70x", "::1:7070",
                          "[::1]", "[::1"}) {
    auto r = ParseHostPort(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(r.status().message(), bad)) << r.status();
  }
  EXPECT_TRUE(absl::StrContains(ParseHostPort("localhost").status().message(), "no port"));
  // gRPC target URIs are left to gRPC.
  EXPECT_EQ(ParseHostPort("dns:///h:1").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(ProbeAddress("unix:/tmp/x", absl::Seconds(1)).ok());
  // CheckAddress: HOST:PORT and gRPC targets pass, the rest is refused.
  EXPECT_TRUE(CheckAddress("node0:7070").ok());
  EXPECT_TRUE(CheckAddress("dns:///node0:7070").ok());
  EXPECT_EQ(CheckAddress("node0").code(), absl::StatusCode::kInvalidArgument);
}

// A port nothing listens on: bind a socket, read its port, close it; -1
// when the machine gives none.
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                     ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  return bound ? ntohs(a.sin_port) : -1;
}

TEST(ProbeAddress, RefusedIsUnavailableAtOnce) {
  const absl::Time start = absl::Now();
  const int port = FreePort();
  ASSERT_GT(port, 0);
  absl::Status s = ProbeAddress(absl::StrCat("127.0.0.1:", port), absl::Seconds(2));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "Connection refused")) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

TEST(ProbeAddress, UnresolvableNameIsUnavailable) {
  absl::Status s = ProbeAddress("no-such-host.invalid:7070", absl::Seconds(2));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "cannot resolve host 'no-such-host.invalid'")) << s;
}

TEST(ProbeAddress, ListeningPortIsOk) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  EXPECT_TRUE(ProbeAddress(absl::StrCat("127.0.0.1:", ntohs(a.sin_port)), absl::Seconds(2)).ok());
  EXPECT_TRUE(ProbeAddress(absl::StrCat("localhost:", ntohs(a.sin_port)), absl::Seconds(2)).ok());
  ::close(fd);
}

}  // namespace
}  // namespace paramd
