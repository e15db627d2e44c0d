#include "transport/socket_channel.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
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

  Pair() {
    std::vector<std::string> addresses;
    for (int r = 0; r < 2; ++r) {
      absl::StatusOr<std::unique_ptr<SocketChannel>> c = SocketChannel::Listen("");
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
  EXPECT_TRUE((*stranger)->Send(1, 0, 1, Bytes("x"), In(absl::Seconds(10))).ok());
  ASSERT_TRUE(pair.channels[0]->Send(1, 0, 1, Bytes("ok"), In(absl::Seconds(10))).ok());
  EXPECT_EQ(pair.Take(1, 0, 0, 1, absl::Seconds(10)), "ok");
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

// Rank 1 in another process, SIGKILLed while rank 0 waits for it: the
// kernel's hang-up fails the receive within a second, naming rank 1. Forks
// before any thread of this test exists (the child runs only its own
// channel).
TEST(SocketChannelTest, KilledPeerProcessFailsPendingReceive) {
  int to_child[2], to_parent[2];
  ASSERT_EQ(pipe(to_child), 0);
  ASSERT_EQ(pipe(to_parent), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(to_child[1]);
    close(to_parent[0]);
    absl::StatusOr<std::unique_ptr<SocketChannel>> c = SocketChannel::Listen("");
    if (!c.ok()) _exit(2);
    std::string mine = (*c)->address() + "\n";
    if (write(to_parent[1], mine.data(), mine.size()) != static_cast<ssize_t>(mine.size())) {
      _exit(3);
    }
    std::string theirs;
    char ch;
    while (read(to_child[0], &ch, 1) == 1 && ch != '\n') theirs += ch;
    std::vector<std::shared_ptr<Mailbox>> boxes = {std::make_shared<Mailbox>()};
    (*c)->Start(1, {theirs, (*c)->address()}, boxes);
    if (!(*c)->Send(0, 0, 1, Bytes("up"), In(absl::Seconds(10))).ok()) _exit(4);
    for (;;) pause();
  }
  close(to_child[0]);
  close(to_parent[1]);
  absl::StatusOr<std::unique_ptr<SocketChannel>> c = SocketChannel::Listen("");
  ASSERT_TRUE(c.ok()) << c.status();
  std::string theirs;
  char ch;
  while (read(to_parent[0], &ch, 1) == 1 && ch != '\n') theirs += ch;
  ASSERT_FALSE(theirs.empty());
  const std::string mine = (*c)->address() + "\n";
  ASSERT_EQ(write(to_child[1], mine.data(), mine.size()), static_cast<ssize_t>(mine.size()));
  auto box = std::make_shared<Mailbox>();
  (*c)->Start(0, {(*c)->address(), theirs}, {box});
  std::string up(8, '\0');
  absl::StatusOr<size_t> got =
      box->Receive(1, 1, absl::MakeSpan(reinterpret_cast<uint8_t*>(&up[0]), up.size()),
                   In(absl::Seconds(20)));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(up.substr(0, *got), "up");

  absl::Status waiting;
  absl::Duration waited;
  std::thread waiter([&] {
    const absl::Time start = absl::Now();
    waiting = box->Receive(1, 2, absl::MakeSpan(reinterpret_cast<uint8_t*>(&up[0]), up.size()),
                           In(absl::Seconds(60)))
                  .status();
    waited = absl::Now() - start;
  });
  absl::SleepFor(absl::Milliseconds(200));
  const absl::Time killed = absl::Now();
  kill(child, SIGKILL);
  waiter.join();
  const absl::Duration after_kill = absl::Now() - killed;
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_EQ(waiting.code(), absl::StatusCode::kUnavailable) << waiting;
  EXPECT_TRUE(absl::StrContains(waiting.message(), "rank 1")) << waiting;
  EXPECT_LT(after_kill, absl::Seconds(1));
  EXPECT_GT(waited, absl::Milliseconds(150));  // it really was waiting
  std::printf("receive failed %.1f ms after the SIGKILL: %s\n",
              absl::ToDoubleMilliseconds(after_kill), std::string(waiting.message()).c_str());
  EXPECT_TRUE((*c)->PeerGone(1));
  EXPECT_EQ((*c)->Send(1, 0, 1, Bytes("x"), In(absl::Seconds(10))).code(),
            absl::StatusCode::kUnavailable);
  close(to_child[1]);
  close(to_parent[0]);
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
