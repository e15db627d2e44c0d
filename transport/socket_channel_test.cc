#include "transport/socket_channel.h"

#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace paramd {
namespace transport_internal {
namespace {

absl::Time In(absl::Duration d) { return absl::Now() + d; }

absl::Span<const uint8_t> Bytes(const std::string& s) {
  return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

// Two ranks, two mailboxes each.
struct Pair {
  std::vector<std::unique_ptr<SocketChannel>> channels;
  std::vector<std::vector<std::shared_ptr<Mailbox>>> boxes;

  explicit Pair(const SocketChannelOptions& options = {}) {
    std::vector<std::string> addresses;
    for (int r = 0; r < 2; ++r) {
      absl::StatusOr<std::unique_ptr<SocketChannel>> c = SocketChannel::Listen("", options);
      EXPECT_TRUE(c.ok()) << c.status();
      addresses.push_back((*c)->address());
      channels.push_back(*std::move(c));
      boxes.push_back({std::make_shared<Mailbox>(), std::make_shared<Mailbox>()});
    }
    for (int r = 0; r < 2; ++r) channels[r]->Start(r, addresses, boxes[r]);
  }

  std::string Take(int rank, int box, int src, uint64_t tag, absl::Duration wait) {
    std::string out(64, '\0');
    absl::StatusOr<size_t> got = boxes[rank][box]->Receive(
        src, tag, absl::MakeSpan(reinterpret_cast<uint8_t*>(&out[0]), out.size()), In(wait));
    if (!got.ok()) return got.status().ToString();
    out.resize(*got);
    return out;
  }
};

TEST(SocketChannelTest, DeliversIntoTheNamedMailboxInOrder) {
  Pair pair;
  EXPECT_TRUE(pair.channels[0]->Send(1, 0, 7, Bytes("a"), In(absl::Seconds(10))).ok());
  EXPECT_TRUE(pair.channels[0]->Send(1, 1, 7, Bytes("to box 1"), In(absl::Seconds(10))).ok());
  EXPECT_TRUE(pair.channels[0]->Send(1, 0, 7, Bytes("b"), In(absl::Seconds(10))).ok());
  EXPECT_TRUE(pair.channels[0]->Send(1, 0, 8, Bytes(""), In(absl::Seconds(10))).ok());
  EXPECT_TRUE(pair.channels[1]->Send(1, 0, 9, Bytes("self"), In(absl::Seconds(10))).ok());
  EXPECT_EQ(pair.Take(1, 0, 0, 7, absl::Seconds(10)), "a");
  EXPECT_EQ(pair.Take(1, 0, 0, 7, absl::Seconds(10)), "b");
  EXPECT_EQ(pair.Take(1, 1, 0, 7, absl::Seconds(10)), "to box 1");
  EXPECT_EQ(pair.Take(1, 0, 0, 8, absl::Seconds(10)), "");
  EXPECT_EQ(pair.Take(1, 0, 1, 9, absl::Seconds(10)), "self");
  // Nothing else arrived.
  EXPECT_EQ(pair.Take(1, 0, 0, 7, absl::Milliseconds(50)).substr(0, 17), "DEADLINE_EXCEEDED");
}

TEST(SocketChannelTest, ConcurrentSendersKeepFramesWhole) {
  Pair pair;
  constexpr int kThreads = 4, kMessages = 200;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kMessages; ++i) {
        const std::string m = std::to_string(t * 1000 + i);
        ASSERT_TRUE(pair.channels[0]->Send(1, 0, t, Bytes(m), In(absl::Seconds(10))).ok());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kMessages; ++i) {
      ASSERT_EQ(pair.Take(1, 0, 0, t, absl::Seconds(10)), std::to_string(t * 1000 + i));
    }
  }
}

TEST(SocketChannelTest, AWildcardListenAdvertisesTheGivenHost) {
  SocketChannelOptions options;
  options.advertise_host = "node-7.cluster.example";
  absl::StatusOr<std::unique_ptr<SocketChannel>> c = SocketChannel::Listen("0.0.0.0", options);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(absl::StartsWith((*c)->address(), "node-7.cluster.example:")) << (*c)->address();
  c = SocketChannel::Listen("127.0.0.1", options);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(absl::StartsWith((*c)->address(), "127.0.0.1:")) << (*c)->address();
}

TEST(SocketChannelTest, ClosedPeerAndBadArguments) {
  Pair pair;
  ASSERT_TRUE(pair.channels[0]->Send(1, 0, 1, Bytes("x"), In(absl::Seconds(10))).ok());
  EXPECT_EQ(pair.Take(1, 0, 0, 1, absl::Seconds(10)), "x");
  pair.channels[1]->Close();
  // The hang-up is seen before the next write, or the write fails.
  absl::Status s;
  const absl::Time start = absl::Now();
  for (int i = 0; i < 100 && s.ok(); ++i) {
    s = pair.channels[0]->Send(1, 0, 1, Bytes("y"), In(absl::Seconds(10)));
    if (s.ok()) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  // Reconnecting is refused at once.
  EXPECT_EQ(pair.channels[0]->Send(1, 0, 1, Bytes("z"), In(absl::Seconds(10))).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(pair.channels[0]->Send(2, 0, 1, Bytes("z"), In(absl::Seconds(10))).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pair.channels[1]->Send(0, 0, 1, Bytes("z"), In(absl::Seconds(10))).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(SocketChannelTest, GarbageFromAStrangerIsDropped) {
  Pair pair;
  // A second connection that sends no valid hello does not disturb the others.
  std::vector<std::string> addresses = {pair.channels[0]->address(), pair.channels[1]->address()};
  absl::StatusOr<std::unique_ptr<SocketChannel>> stranger = SocketChannel::Listen("");
  ASSERT_TRUE(stranger.ok());
  std::vector<std::shared_ptr<Mailbox>> none = {std::make_shared<Mailbox>()};
  (*stranger)->Start(7, {addresses[0], addresses[1]}, none);  // rank 7 of a 2-rank book
  // Rank 1 drops the connection as soon as it reads the bad hello, which
  // can happen before the stranger's write: the write then lands in the
  // kernel's buffer (OK) or finds the hang-up already seen (UNAVAILABLE).
  const absl::Status sent = (*stranger)->Send(1, 0, 1, Bytes("x"), In(absl::Seconds(10)));
  EXPECT_TRUE(sent.ok() || sent.code() == absl::StatusCode::kUnavailable) << sent;
  ASSERT_TRUE(pair.channels[0]->Send(1, 0, 1, Bytes("ok"), In(absl::Seconds(10))).ok());
  EXPECT_EQ(pair.Take(1, 0, 0, 1, absl::Seconds(10)), "ok");
}

SocketChannelOptions WithSecret(const std::string& secret) {
  SocketChannelOptions o;
  o.secret = [secret] { return secret; };
  return o;
}

// With a secret, a connection that does not prove it is dropped before
// any frame is taken and marks nobody dead: a stranger with the wrong
// secret claiming rank 0 (who then hangs up), a raw TCP connection that
// sends a well-formed hello for rank 0 with a made-up proof, and one that
// never answers the challenge. The ranks' own traffic flows throughout.
TEST(SocketChannelTest, ConnectionsWithoutTheSecretAreDroppedWithoutMarkingAnyone) {
  Pair pair(WithSecret("the-world-secret-0123456789"));
  const std::vector<std::string> addresses = {pair.channels[0]->address(),
                                              pair.channels[1]->address()};
  {
    auto stranger = SocketChannel::Listen("", WithSecret("a-guessed-secret-0123456789"));
    ASSERT_TRUE(stranger.ok());
    std::vector<std::shared_ptr<Mailbox>> none = {std::make_shared<Mailbox>()};
    (*stranger)->Start(0, addresses, none);  // claims rank 0
    // Its frame may sit in the kernel's buffer (OK) or find the
    // connection dropped; either way it never reaches rank 1's mailbox.
    (void)(*stranger)->Send(1, 0, 3, Bytes("forged"), In(absl::Seconds(10)));
    absl::SleepFor(absl::Milliseconds(200));
  }  // the stranger hangs up
  // A hand-made hello: right magic and rank, wrong proof.
  const int raw = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in to = {};
  to.sin_family = AF_INET;
  to.sin_port = htons(std::stoi(addresses[1].substr(addresses[1].rfind(':') + 1)));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(raw, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0);
  uint8_t nonce[32];
  ASSERT_EQ(recv(raw, nonce, sizeof(nonce), MSG_WAITALL), 32);  // the challenge
  struct {
    uint32_t magic = 0x324C4548;
    int32_t rank = 0;
    uint8_t proof[32] = {};
  } hello;
  ASSERT_EQ(send(raw, &hello, sizeof(hello), 0), static_cast<ssize_t>(sizeof(hello)));
  char byte;
  EXPECT_EQ(recv(raw, &byte, 1, 0), 0);  // dropped at once
  close(raw);
  // One that connects and never answers holds nothing for long.
  const int silent = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(connect(silent, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0);

  EXPECT_FALSE(pair.channels[1]->PeerGone(0));
  EXPECT_FALSE(pair.channels[0]->PeerGone(1));
  EXPECT_EQ(pair.Take(1, 0, 0, 3, absl::Milliseconds(100)).substr(0, 17), "DEADLINE_EXCEEDED");
  ASSERT_TRUE(pair.channels[0]->Send(1, 0, 1, Bytes("ok"), In(absl::Seconds(10))).ok());
  EXPECT_EQ(pair.Take(1, 0, 0, 1, absl::Seconds(10)), "ok");
  ASSERT_TRUE(pair.channels[1]->Send(0, 0, 2, Bytes("back"), In(absl::Seconds(10))).ok());
  EXPECT_EQ(pair.Take(0, 0, 1, 2, absl::Seconds(10)), "back");
  const absl::Time start = absl::Now();
  EXPECT_EQ(recv(silent, nonce, sizeof(nonce), MSG_WAITALL), 32);
  EXPECT_EQ(recv(silent, &byte, 1, 0), 0);  // closed after the hello timeout
  EXPECT_LE(absl::Now() - start, kSocketHelloTimeout + absl::Seconds(2));
  close(silent);
  EXPECT_FALSE(pair.channels[1]->PeerGone(0));
}

// A receive waiting on a peer fails at once when that peer's channel closes,
// not at its deadline; what the peer sent before is still received; sends
// to it fail at once; both sides agree.
TEST(SocketChannelTest, PeerHangUpFailsPendingAndLaterCalls) {
  Pair pair;
  ASSERT_TRUE(pair.channels[1]->Send(0, 1, 5, Bytes("before"), In(absl::Seconds(10))).ok());
  std::string waited_for;
  absl::Duration waited;
  std::thread waiter([&] {
    const absl::Time start = absl::Now();
    waited_for = pair.Take(0, 0, 1, 9, absl::Seconds(30));
    waited = absl::Now() - start;
  });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(pair.channels[0]->PeerGone(1));
  pair.channels[1]->Close();
  waiter.join();
  EXPECT_TRUE(absl::StartsWith(waited_for, "UNAVAILABLE")) << waited_for;
  EXPECT_TRUE(absl::StrContains(waited_for, "rank 1")) << waited_for;
  EXPECT_LT(waited, absl::Seconds(5));
  EXPECT_TRUE(pair.channels[0]->PeerGone(1));
  // Queued before the hang-up: still there.
  EXPECT_EQ(pair.Take(0, 1, 1, 5, absl::Seconds(10)), "before");
  // Later receives (either mailbox) and sends: at once.
  const absl::Time start = absl::Now();
  EXPECT_TRUE(absl::StartsWith(pair.Take(0, 1, 1, 5, absl::Seconds(30)), "UNAVAILABLE"));
  absl::Status s = pair.channels[0]->Send(1, 0, 1, Bytes("x"), In(absl::Seconds(30)));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "rank 1")) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  // The closed side marks nobody dead.
  EXPECT_FALSE(pair.channels[1]->PeerGone(0));
}

// Rank 1 of a two-rank world in a forked child process (which runs only its
// own channel and sends "up", tag 1, to rank 0); rank 0 here, once "up" has
// arrived. Fork before any thread of the calling test exists. The child is
// SIGKILLed and reaped on destruction.
class ForkedPeer {
 public:
  explicit ForkedPeer(const SocketChannelOptions& options) {
    if (pipe(to_child_) != 0 || pipe(to_parent_) != 0) {
      ADD_FAILURE() << "pipe";
      return;
    }
    child_ = fork();
    if (child_ == 0) RunChild(options);
    if (child_ < 0) {
      ADD_FAILURE() << "fork";
      return;
    }
    close(to_child_[0]);
    close(to_parent_[1]);
    absl::StatusOr<std::unique_ptr<SocketChannel>> c = SocketChannel::Listen("", options);
    if (!c.ok()) {
      ADD_FAILURE() << c.status();
      return;
    }
    channel_ = *std::move(c);
    const std::string theirs = ReadLine(to_parent_[0]);
    const std::string mine = channel_->address() + "\n";
    if (theirs.empty() ||
        write(to_child_[1], mine.data(), mine.size()) != static_cast<ssize_t>(mine.size())) {
      ADD_FAILURE() << "address exchange with the child";
      return;
    }
    channel_->Start(0, {channel_->address(), theirs}, {box_});
    absl::StatusOr<std::string> up = Receive(1, absl::Seconds(20));
    if (!up.ok() || *up != "up") ADD_FAILURE() << "no 'up' from the child: " << up.status();
    // "up" travelled on the child's connection; this rank's own connection
    // to the child is opened by Start's connector thread and may still be
    // mid-handshake. A Send returns only once it is up, so a test that then
    // stops or kills the child tests a live connection, not a connect to a
    // process that can no longer answer the challenge.
    const absl::Status hi = channel_->Send(1, 0, 9, Bytes("hi"), In(absl::Seconds(20)));
    if (!hi.ok()) ADD_FAILURE() << "no connection to the child: " << hi;
  }

  ~ForkedPeer() {
    channel_.reset();
    if (child_ > 0) {
      kill(child_, SIGKILL);
      int status = 0;
      waitpid(child_, &status, 0);
    }
    close(to_child_[1]);
    close(to_parent_[0]);
  }

  pid_t child() const { return child_; }
  SocketChannel& channel() { return *channel_; }
  bool ok() const { return channel_ != nullptr && child_ > 0; }

  // A frame from rank 1 with `tag` (up to 64 bytes).
  absl::StatusOr<std::string> Receive(uint64_t tag, absl::Duration wait) {
    std::string out(64, '\0');
    absl::StatusOr<size_t> got = box_->Receive(
        1, tag, absl::MakeSpan(reinterpret_cast<uint8_t*>(&out[0]), out.size()), In(wait));
    if (!got.ok()) return got.status();
    out.resize(*got);
    return out;
  }

 private:
  static std::string ReadLine(int fd) {
    std::string line;
    char ch;
    while (read(fd, &ch, 1) == 1 && ch != '\n') line += ch;
    return line;
  }

  [[noreturn]] void RunChild(const SocketChannelOptions& options) {
    close(to_child_[1]);
    close(to_parent_[0]);
    absl::StatusOr<std::unique_ptr<SocketChannel>> c = SocketChannel::Listen("", options);
    if (!c.ok()) _exit(2);
    const std::string mine = (*c)->address() + "\n";
    if (write(to_parent_[1], mine.data(), mine.size()) != static_cast<ssize_t>(mine.size())) {
      _exit(3);
    }
    const std::string theirs = ReadLine(to_child_[0]);
    std::vector<std::shared_ptr<Mailbox>> boxes = {std::make_shared<Mailbox>()};
    (*c)->Start(1, {theirs, (*c)->address()}, boxes);
    if (!(*c)->Send(0, 0, 1, Bytes("up"), In(absl::Seconds(10))).ok()) _exit(4);
    for (;;) pause();
  }

  int to_child_[2] = {-1, -1};
  int to_parent_[2] = {-1, -1};
  pid_t child_ = -1;
  std::unique_ptr<SocketChannel> channel_;
  std::shared_ptr<Mailbox> box_ = std::make_shared<Mailbox>();
};

// Rank 1 in another process, SIGKILLed while rank 0 waits for it: the
// kernel's hang-up fails the receive within a second, naming rank 1.
TEST(SocketChannelTest, KilledPeerProcessFailsPendingReceive) {
  ForkedPeer peer{SocketChannelOptions()};
  ASSERT_TRUE(peer.ok());
  absl::Status waiting;
  absl::Duration waited;
  std::thread waiter([&] {
    const absl::Time start = absl::Now();
    waiting = peer.Receive(2, absl::Seconds(60)).status();
    waited = absl::Now() - start;
  });
  absl::SleepFor(absl::Milliseconds(200));
  const absl::Time killed = absl::Now();
  kill(peer.child(), SIGKILL);
  waiter.join();
  const absl::Duration after_kill = absl::Now() - killed;
  EXPECT_EQ(waiting.code(), absl::StatusCode::kUnavailable) << waiting;
  EXPECT_TRUE(absl::StrContains(waiting.message(), "rank 1")) << waiting;
  EXPECT_LT(after_kill, absl::Seconds(1));
  EXPECT_GT(waited, absl::Milliseconds(150));  // it really was waiting
  std::printf("receive failed %.1f ms after the SIGKILL: %s\n",
              absl::ToDoubleMilliseconds(after_kill), std::string(waiting.message()).c_str());
  EXPECT_TRUE(peer.channel().PeerGone(1));
  EXPECT_EQ(peer.channel().Send(1, 0, 1, Bytes("x"), In(absl::Seconds(10))).code(),
            absl::StatusCode::kUnavailable);
}

// Rank 1's process stopped (SIGSTOP: its kernel still answers keepalives and
// acknowledges data until its receive buffer is full, as a wedged process or
// one whose host answers nothing else would look after the window shuts).
// Rank 0 keeps sending: once the bytes stay unacknowledged for the user
// timeout (1 s here), the blocked Send fails UNAVAILABLE naming rank 1 and
// saying it stopped answering, long before its 20 s deadline, and a receive
// pending on rank 1 fails the same way: the dead-peer path of a hang-up.
TEST(SocketChannelTest, StoppedPeerFailsSendAndReceiveAfterUserTimeout) {
  SocketChannelOptions options;
  options.keepalive_idle = absl::Seconds(1);
  options.keepalive_interval = absl::Seconds(1);
  options.keepalive_count = 1;
  options.user_timeout = absl::Seconds(1);
  ForkedPeer peer(options);
  ASSERT_TRUE(peer.ok());
  absl::Status waiting;
  std::thread waiter([&] { waiting = peer.Receive(2, absl::Seconds(30)).status(); });

  ASSERT_EQ(kill(peer.child(), SIGSTOP), 0);
  const absl::Time stopped = absl::Now();
  const std::string chunk(256 << 10, 'x');
  absl::Status s;
  int sent = 0;
  // 100 MB at most: far more than the two socket buffers hold.
  for (; sent < 400 && s.ok(); ++sent) {
    s = peer.channel().Send(1, 0, 3, Bytes(chunk), In(absl::Seconds(20)));
  }
  const absl::Duration after_stop = absl::Now() - stopped;
  waiter.join();
  std::printf("send %d failed %.0f ms after the SIGSTOP: %s\n", sent,
              absl::ToDoubleMilliseconds(after_stop), std::string(s.message()).c_str());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "rank 1")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "stopped answering")) << s;
  EXPECT_GE(after_stop, absl::Milliseconds(900));  // not before the user timeout
  EXPECT_LT(after_stop, absl::Seconds(6));
  EXPECT_EQ(waiting.code(), absl::StatusCode::kUnavailable) << waiting;
  EXPECT_EQ(waiting.message(), s.message());
  EXPECT_TRUE(peer.channel().PeerGone(1));
  EXPECT_EQ(peer.channel().Send(1, 0, 1, Bytes("x"), In(absl::Seconds(10))).code(),
            absl::StatusCode::kUnavailable);
}

// The port of "host:port".
int PortOf(const std::string& address) {
  return std::atoi(address.substr(address.rfind(':') + 1).c_str());
}

// This process's connected TCP sockets with a port of `ports` at either end
// (so both ends of every connection to those listeners, when both ends
// live here), found through /proc/self/fd.
std::vector<int> ConnectionFds(const std::set<int>& ports) {
  std::vector<int> fds;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return fds;
  while (dirent* e = readdir(dir)) {
    const int fd = std::atoi(e->d_name);
    int type = 0, listening = 0;
    socklen_t len = sizeof(int);
    if (e->d_name[0] == '.' || getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 ||
        type != SOCK_STREAM || getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 ||
        listening != 0) {
      continue;
    }
    sockaddr_in local = {}, remote = {};
    socklen_t local_len = sizeof(local), remote_len = sizeof(remote);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
        getpeername(fd, reinterpret_cast<sockaddr*>(&remote), &remote_len) != 0 ||
        local.sin_family != AF_INET) {
      continue;
    }
    if (ports.count(ntohs(local.sin_port)) > 0 || ports.count(ntohs(remote.sin_port)) > 0) {
      fds.push_back(fd);
    }
  }
  closedir(dir);
  return fds;
}

int IntOption(int fd, int level, int name) {
  int value = -1;
  socklen_t len = sizeof(value);
  EXPECT_EQ(getsockopt(fd, level, name, &value, &len), 0) << name;
  return value;
}

// Both ends of both connections (the sender's and the accepted one) carry
// keepalive and the user timeout: the defaults, and custom values (keepalive
// times rounded up to whole seconds).
TEST(SocketChannelTest, EveryConnectionEndHasKeepaliveAndUserTimeout) {
  struct Case {
    SocketChannelOptions options;
    int idle_s, interval_s, count, user_timeout_ms;
  };
  SocketChannelOptions custom;
  custom.keepalive_idle = absl::Milliseconds(6500);
  custom.keepalive_interval = absl::Seconds(3);
  custom.keepalive_count = 4;
  custom.user_timeout = absl::Milliseconds(12345);
  for (const Case& c :
       {Case{SocketChannelOptions(), 5, 2, 5, 15000}, Case{custom, 7, 3, 4, 12345}}) {
    Pair pair(c.options);
    // Both connections opened and accepted: a frame each way has arrived.
    ASSERT_TRUE(pair.channels[0]->Send(1, 0, 1, Bytes("a"), In(absl::Seconds(10))).ok());
    ASSERT_TRUE(pair.channels[1]->Send(0, 0, 1, Bytes("b"), In(absl::Seconds(10))).ok());
    ASSERT_EQ(pair.Take(1, 0, 0, 1, absl::Seconds(10)), "a");
    ASSERT_EQ(pair.Take(0, 0, 1, 1, absl::Seconds(10)), "b");
    const std::vector<int> fds =
        ConnectionFds({PortOf(pair.channels[0]->address()), PortOf(pair.channels[1]->address())});
    ASSERT_EQ(fds.size(), 4u);
    for (int fd : fds) {
      SCOPED_TRACE(fd);
      EXPECT_EQ(IntOption(fd, IPPROTO_TCP, TCP_NODELAY), 1);
      EXPECT_EQ(IntOption(fd, SOL_SOCKET, SO_KEEPALIVE), 1);
      EXPECT_EQ(IntOption(fd, IPPROTO_TCP, TCP_KEEPIDLE), c.idle_s);
      EXPECT_EQ(IntOption(fd, IPPROTO_TCP, TCP_KEEPINTVL), c.interval_s);
      EXPECT_EQ(IntOption(fd, IPPROTO_TCP, TCP_KEEPCNT), c.count);
      EXPECT_EQ(IntOption(fd, IPPROTO_TCP, TCP_USER_TIMEOUT), c.user_timeout_ms);
    }
  }
}

TEST(SocketChannelTest, OptionsOutOfRangeAreRefused) {
  const auto listen = [](void (*change)(SocketChannelOptions&)) {
    SocketChannelOptions o;
    change(o);
    return SocketChannel::Listen("", o).status().code();
  };
  EXPECT_EQ(listen([](SocketChannelOptions& o) { o.keepalive_idle = absl::Milliseconds(500); }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(listen([](SocketChannelOptions& o) { o.keepalive_interval = absl::ZeroDuration(); }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(listen([](SocketChannelOptions& o) { o.keepalive_count = 0; }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(listen([](SocketChannelOptions& o) { o.keepalive_count = 128; }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(listen([](SocketChannelOptions& o) { o.user_timeout = absl::Seconds(-1); }),
            absl::StatusCode::kInvalidArgument);
  // Keepalive off: its times are not looked at.
  EXPECT_EQ(listen([](SocketChannelOptions& o) {
              o.keepalive = false;
              o.keepalive_count = 0;
            }),
            absl::StatusCode::kOk);
}

// Not an assertion on speed (CI machines vary): prints the one-way latency
// that the nccl backend's control path pays per message.
TEST(SocketChannelTest, PingPongLatency) {
  Pair pair;
  constexpr int kIters = 2000;
  std::thread echo([&] {
    for (int i = 0; i < kIters; ++i) {
      const std::string m = pair.Take(1, 0, 0, 1, absl::Seconds(10));
      ASSERT_TRUE(pair.channels[1]->Send(0, 0, 2, Bytes(m), In(absl::Seconds(10))).ok());
    }
  });
  std::vector<double> rtt;
  for (int i = 0; i < kIters; ++i) {
    const absl::Time t0 = absl::Now();
    ASSERT_TRUE(pair.channels[0]->Send(1, 0, 1, Bytes("ping"), In(absl::Seconds(10))).ok());
    ASSERT_EQ(pair.Take(0, 0, 1, 2, absl::Seconds(10)), "ping");
    rtt.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
  }
  echo.join();
  std::sort(rtt.begin(), rtt.end());
  std::printf("socket control ping-pong (2 sends): p10 %.1f p50 %.1f p90 %.1f us\n",
              rtt[kIters / 10], rtt[kIters / 2], rtt[kIters * 9 / 10]);
}

}  // namespace
}  // namespace transport_internal
}  // namespace paramd
