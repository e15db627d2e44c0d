#include "transport/socket_channel.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

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
