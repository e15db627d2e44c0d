#include "transport/conformance_test_lib.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"

namespace paramd {
namespace {

using ::testing::AnyOf;

constexpr absl::Duration kLong = absl::Seconds(30);
// "Quickly": far below kLong, generous for a loaded 2-core machine.
constexpr absl::Duration kQuick = absl::Seconds(5);

absl::Time In(absl::Duration d) { return absl::Now() + d; }

std::vector<uint8_t> Pattern(size_t size, uint32_t seed) {
  std::vector<uint8_t> v(size);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < size; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = static_cast<uint8_t>(x >> 24);
  }
  return v;
}

std::vector<uint8_t> Bytes(absl::string_view s) { return std::vector<uint8_t>(s.begin(), s.end()); }

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// Runs fn(r) for r in [0, n) on n threads and joins them.
template <typename Fn>
void OnRanks(int n, Fn fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&fn, r] { fn(r); });
  for (std::thread& t : threads) t.join();
}

// Sends on a thread while the caller receives: works for buffered and
// rendezvous backends alike.
void Exchange(Transport& from, Transport& to, uint64_t tag, const std::vector<uint8_t>& message,
              size_t buffer_size) {
  absl::Status sent;
  std::thread sender([&] { sent = from.Send(to.rank(), tag, message, In(kLong)); });
  std::vector<uint8_t> buffer(buffer_size, 0xEE);
  absl::StatusOr<size_t> got = to.Recv(from.rank(), tag, absl::MakeSpan(buffer), In(kLong));
  sender.join();
  ASSERT_TRUE(sent.ok()) << sent;
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(*got, message.size());
  buffer.resize(*got);
  EXPECT_TRUE(buffer == message) << "payload of " << message.size() << " bytes differs";
}

TEST_P(TransportConformanceTest, RankAndWorldSize) {
  auto world = MakeWorld(3);
  ASSERT_EQ(world.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(world[r]->rank(), r);
    EXPECT_EQ(world[r]->world_size(), 3);
    EXPECT_FALSE(world[r]->backend().empty());
  }
}

TEST_P(TransportConformanceTest, PointToPointSizes) {
  auto world = MakeWorld(2);
  ASSERT_EQ(world.size(), 2u);
  std::vector<int64_t> sizes = {
      0, 1, 7, 4096, (int64_t{1} << 20) + 3, (int64_t{3} << 20) - 1, GetParam().max_message_bytes};
  uint64_t tag = 0;
  for (int64_t size : sizes) {
    SCOPED_TRACE(absl::StrCat(size, " bytes"));
    const std::vector<uint8_t> message = Pattern(size, static_cast<uint32_t>(size));
    Exchange(*world[0], *world[1], tag++, message, size);
    if (size < (int64_t{8} << 20)) Exchange(*world[1], *world[0], tag++, message, size);
  }
}

TEST_P(TransportConformanceTest, SendToSelf) {
  auto world = MakeWorld(2);
  ASSERT_EQ(world.size(), 2u);
  Exchange(*world[1], *world[1], 3, Pattern(1000, 5), 1000);
}

TEST_P(TransportConformanceTest, RecvPostedBeforeSend) {
  auto world = MakeWorld(2);
  ASSERT_EQ(world.size(), 2u);
  std::vector<uint8_t> buffer(64);
  absl::StatusOr<size_t> got = absl::UnknownError("not run");
  std::thread receiver([&] { got = world[1]->Recv(0, 8, absl::MakeSpan(buffer), In(kLong)); });
  absl::SleepFor(absl::Milliseconds(100));
  const std::vector<uint8_t> message = Pattern(64, 8);
  EXPECT_TRUE(world[0]->Send(1, 8, message, In(kLong)).ok());
  receiver.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, 64u);
  EXPECT_TRUE(buffer == message);
}

TEST_P(TransportConformanceTest, TagsMatchOutOfOrderAndFifoPerTag) {
  auto world = MakeWorld(2);
  ASSERT_EQ(world.size(), 2u);
  std::vector<std::thread> senders;
  std::vector<absl::Status> sent(4);
  for (uint64_t tag : {1, 2, 3}) {
    senders.emplace_back([&, tag] {
      sent[tag] = world[0]->Send(1, tag, Bytes(absl::StrCat("tag-", tag)), In(kLong));
    });
  }
  // Same tag, one thread: arrival order is send order.
  senders.emplace_back([&] {
    sent[0] = world[0]->Send(1, 9, Bytes("first"), In(kLong));
    if (sent[0].ok()) sent[0] = world[0]->Send(1, 9, Bytes("second"), In(kLong));
  });
  auto recv = [&](uint64_t tag, size_t size) -> std::string {
    std::vector<uint8_t> buffer(size);
    absl::StatusOr<size_t> got = world[1]->Recv(0, tag, absl::MakeSpan(buffer), In(kLong));
    EXPECT_TRUE(got.ok()) << got.status();
    return got.ok() ? std::string(buffer.begin(), buffer.begin() + *got) : "";
  };
  EXPECT_EQ(recv(3, 5), "tag-3");
  EXPECT_EQ(recv(1, 5), "tag-1");
  EXPECT_EQ(recv(9, 5), "first");
  EXPECT_EQ(recv(2, 5), "tag-2");
  EXPECT_EQ(recv(9, 6), "second");
  for (std::thread& t : senders) t.join();
  for (const absl::Status& s : sent) EXPECT_TRUE(s.ok()) << s;
}

TEST_P(TransportConformanceTest, ManyConcurrentSenders) {
  constexpr int kRanks = 5, kThreads = 2, kMessages = 10;
  auto world = MakeWorld(kRanks);
  ASSERT_EQ(world.size(), static_cast<size_t>(kRanks));
  auto size_of = [](int r, int k, int i) {
    return static_cast<size_t>((r * 37 + k * 5 + i * 11) % 3000);
  };
  auto seed_of = [](int r, int k, int i) { return static_cast<uint32_t>(r * 10000 + k * 100 + i); };
  std::vector<std::thread> threads;
  std::vector<absl::Status> send_status(kRanks * kThreads);
  for (int r = 1; r < kRanks; ++r) {
    for (int k = 0; k < kThreads; ++k) {
      threads.emplace_back([&, r, k] {
        for (int i = 0; i < kMessages; ++i) {
          absl::Status s = world[r]->Send(0, k * 100 + i,
                                          Pattern(size_of(r, k, i), seed_of(r, k, i)), In(kLong));
          if (!s.ok()) send_status[r * kThreads + k] = s;
        }
      });
      threads.emplace_back([&, r, k] {
        for (int i = 0; i < kMessages; ++i) {
          std::vector<uint8_t> buffer(size_of(r, k, i));
          absl::StatusOr<size_t> got =
              world[0]->Recv(r, k * 100 + i, absl::MakeSpan(buffer), In(kLong));
          ASSERT_TRUE(got.ok()) << got.status();
          EXPECT_EQ(*got, buffer.size());
          EXPECT_TRUE(buffer == Pattern(size_of(r, k, i), seed_of(r, k, i)))
              << "from rank " << r << " thread " << k << " message " << i;
        }
      });
    }
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : send_status) EXPECT_TRUE(s.ok()) << s;
}

TEST_P(TransportConformanceTest, SizeMismatch) {
  if (!GetParam().detects_size_mismatch) GTEST_SKIP() << "backend needs exact sizes";
  auto world = MakeWorld(2);
  ASSERT_EQ(world.size(), 2u);
  absl::Status sent;
  std::thread sender([&] {
    sent = world[0]->Send(1, 1, Pattern(100, 1), In(kLong));
    if (sent.ok()) sent = world[0]->Send(1, 1, Pattern(10, 2), In(kLong));
  });
  std::vector<uint8_t> buffer(50);
  // Larger than the buffer: an error, and the message is gone.
  EXPECT_EQ(world[1]->Recv(0, 1, absl::MakeSpan(buffer), In(kLong)).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Smaller: received, with its size.
  absl::StatusOr<size_t> got = world[1]->Recv(0, 1, absl::MakeSpan(buffer), In(kLong));
  sender.join();
  EXPECT_TRUE(sent.ok()) << sent;
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, 10u);
  buffer.resize(10);
  EXPECT_TRUE(buffer == Pattern(10, 2));
}

TEST_P(TransportConformanceTest, DeadlineExceededWithoutSender) {
  auto world = MakeWorld(2);
  ASSERT_EQ(world.size(), 2u);
  std::vector<uint8_t> buffer(8);
  const absl::Time start = absl::Now();
  EXPECT_EQ(
      world[0]->Recv(1, 5, absl::MakeSpan(buffer), start + absl::Milliseconds(200)).status().code(),
      absl::StatusCode::kDeadlineExceeded);
  const absl::Duration waited = absl::Now() - start;
  EXPECT_GE(waited, absl::Milliseconds(190));
  EXPECT_LT(waited, kQuick);
  // A deadline already past: Send fails without sending.
  EXPECT_EQ(world[0]->Send(1, 5, Pattern(8, 1), absl::Now() - absl::Seconds(1)).code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST_P(TransportConformanceTest, AllReduceWithMissingMemberTimesOut) {
  auto world = MakeWorld(3);
  ASSERT_EQ(world.size(), 3u);
  // Rank 2 never joins: the root (0) and a non-root (1) both give up.
  std::vector<absl::Status> status(2);
  OnRanks(2, [&](int r) {
    std::vector<float> v = {1.0f, 2.0f};
    status[r] = world[r]->AllReduceMax({0, 1, 2}, absl::MakeSpan(v), In(absl::Milliseconds(300)));
  });
  for (const absl::Status& s : status) {
    EXPECT_THAT(s.code(),
                AnyOf(absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kUnavailable))
        << s;
  }
}

TEST_P(TransportConformanceTest, RejectsBadArguments) {
  auto world = MakeWorld(2);
  ASSERT_EQ(world.size(), 2u);
  Transport& t = *world[0];
  std::vector<uint8_t> buffer(4);
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(t.Send(-1, 0, buffer, In(kLong)).code(), kInvalid);
  EXPECT_EQ(t.Send(2, 0, buffer, In(kLong)).code(), kInvalid);
  EXPECT_EQ(t.Send(1, kMaxUserTag + 1, buffer, In(kLong)).code(), kInvalid);
  EXPECT_EQ(t.Recv(-1, 0, absl::MakeSpan(buffer), In(kLong)).status().code(), kInvalid);
  EXPECT_EQ(t.Recv(2, 0, absl::MakeSpan(buffer), In(kLong)).status().code(), kInvalid);
  EXPECT_EQ(t.Recv(1, ~uint64_t{0}, absl::MakeSpan(buffer), In(kLong)).status().code(), kInvalid);
  std::vector<float> v(3, 1.0f);
  for (std::vector<int> group : std::vector<std::vector<int>>{{}, {1, 0}, {0, 0, 1}, {1}, {0, 2}}) {
    EXPECT_EQ(t.AllReduceMax(group, absl::MakeSpan(v), In(kLong)).code(), kInvalid)
        << "group of " << group.size();
  }
  EXPECT_EQ(t.CanConnect(5, In(kLong)).code(), kInvalid);
  // Validation consumed no collective sequence number: a real one works.
  OnRanks(2, [&](int r) {
    std::vector<float> x = {static_cast<float>(r)};
    EXPECT_TRUE(world[r]->AllReduceMax({0, 1}, absl::MakeSpan(x), In(kLong)).ok());
    EXPECT_EQ(x[0], 1.0f);
  });
}

TEST_P(TransportConformanceTest, AllReduceMaxSemantics) {
  constexpr int kRanks = 4;
  auto world = MakeWorld(kRanks);
  ASSERT_EQ(world.size(), static_cast<size_t>(kRanks));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const float denorm = std::numeric_limits<float>::denorm_min();
  // inputs[element][rank], expected[element]
  const std::vector<std::vector<float>> inputs = {
      {nan, nan, 1.5f, nan},        {nan, -nan, nan, nan},      {-0.0f, 0.0f, -0.0f, -0.0f},
      {-0.0f, -0.0f, -0.0f, -0.0f}, {-inf, -5.0f, -inf, -inf},  {1.0f, inf, 3.0f, nan},
      {denorm, 0.0f, -1.0f, nan},   {-3.0f, -2.0f, nan, -7.0f}, {448.0f, 57344.0f, 3.4e38f, 2.0f},
      {0.1f, 0.2f, 0.3f, 0.25f},
  };
  const std::vector<float> expected = {1.5f, nan,    0.0f,  -0.0f,   -5.0f,
                                       inf,  denorm, -2.0f, 3.4e38f, 0.3f};
  std::vector<std::vector<float>> results(kRanks);
  std::vector<absl::Status> status(kRanks);
  OnRanks(kRanks, [&](int r) {
    for (const auto& element : inputs) results[r].push_back(element[r]);
    status[r] = world[r]->AllReduceMax({0, 1, 2, 3}, absl::MakeSpan(results[r]), In(kLong));
  });
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    for (size_t e = 0; e < expected.size(); ++e) {
      if (std::isnan(expected[e])) {
        EXPECT_TRUE(std::isnan(results[r][e])) << "rank " << r << " element " << e;
      } else {
        EXPECT_EQ(Bits(results[r][e]), Bits(expected[e]))
            << "rank " << r << " element " << e << ": " << results[r][e];
      }
    }
  }
}

TEST_P(TransportConformanceTest, RepeatedAndConcurrentGroups) {
  constexpr int kRanks = 4, kRounds = 15, kSize = 33;
  auto world = MakeWorld(kRanks);
  ASSERT_EQ(world.size(), static_cast<size_t>(kRanks));
  auto value = [](int r, int round, int i) {
    return static_cast<float>(((r * 7919 + round * 104729 + i * 31) % 1000) - 500) / 8.0f;
  };
  OnRanks(kRanks, [&](int r) {
    const std::vector<int> pair = r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
    for (int round = 0; round < kRounds; ++round) {
      std::vector<float> all(kSize), mine(kSize);
      for (int i = 0; i < kSize; ++i) all[i] = mine[i] = value(r, round, i);
      absl::Status s = world[r]->AllReduceMax({0, 1, 2, 3}, absl::MakeSpan(all), In(kLong));
      ASSERT_TRUE(s.ok()) << "rank " << r << " round " << round << ": " << s;
      s = world[r]->AllReduceMax(pair, absl::MakeSpan(mine), In(kLong));
      ASSERT_TRUE(s.ok()) << "rank " << r << " round " << round << ": " << s;
      for (int i = 0; i < kSize; ++i) {
        float want_all = value(0, round, i), want_pair = value(pair[0], round, i);
        for (int q = 1; q < kRanks; ++q) want_all = std::max(want_all, value(q, round, i));
        want_pair = std::max(want_pair, value(pair[1], round, i));
        ASSERT_EQ(all[i], want_all) << "rank " << r << " round " << round << " i " << i;
        ASSERT_EQ(mine[i], want_pair) << "rank " << r << " round " << round << " i " << i;
      }
      // Barrier and a one-member group need nothing from anyone else.
      std::vector<float> solo = {-0.0f};
      ASSERT_TRUE(world[r]->AllReduceMax({r}, absl::MakeSpan(solo), In(kLong)).ok());
      EXPECT_EQ(Bits(solo[0]), Bits(-0.0f));
      ASSERT_TRUE(world[r]->Barrier({0, 1, 2, 3}, In(kLong)).ok());
    }
  });
}

TEST_P(TransportConformanceTest, AllReduceSizeDisagreementIsReportedToAll) {
  // Once with a longer vector at a non-root member, once at the root.
  for (int odd_rank : {2, 0}) {
    SCOPED_TRACE(absl::StrCat("rank ", odd_rank, " has one value more"));
    auto world = MakeWorld(3);
    ASSERT_EQ(world.size(), 3u);
    std::vector<absl::Status> status(3);
    const absl::Time start = absl::Now();
    OnRanks(3, [&](int r) {
      std::vector<float> v(r == odd_rank ? 5 : 4, 1.0f);
      status[r] = world[r]->AllReduceMax({0, 1, 2}, absl::MakeSpan(v), In(kLong));
    });
    EXPECT_LT(absl::Now() - start, kQuick);
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(status[r].code(), absl::StatusCode::kInvalidArgument) << "rank " << r;
    }
  }
}

TEST_P(TransportConformanceTest, CanConnectToEveryPeer) {
  auto world = MakeWorld(3);
  ASSERT_EQ(world.size(), 3u);
  for (int a = 0; a < 3; ++a) {
    for (int b = 0; b < 3; ++b) {
      EXPECT_TRUE(world[a]->CanConnect(b, In(kLong)).ok()) << a << " -> " << b;
    }
  }
}

TEST_P(TransportConformanceTest, PeerShutdown) {
  auto world = MakeWorld(3);
  ASSERT_EQ(world.size(), 3u);
  // A message sent before the shutdown is still received.
  Exchange(*world[1], *world[0], 4, Bytes("last words"), 16);
  // Buffered backends: even one nobody was waiting for.
  const bool buffered = GetParam().buffered_sends;
  if (buffered) {
    ASSERT_TRUE(world[1]->Send(0, 4, Bytes("queued"), In(kLong)).ok());
  }
  std::vector<uint8_t> buffer(16);
  // Rank 2 waits on rank 1 with a long deadline while rank 1 leaves.
  absl::Status waiting;
  absl::Duration waited;
  std::thread waiter([&] {
    const absl::Time start = absl::Now();
    waiting = world[2]->Recv(1, 6, absl::MakeSpan(buffer), In(kLong)).status();
    waited = absl::Now() - start;
  });
  absl::SleepFor(absl::Milliseconds(100));
  world[1]->Shutdown();
  waiter.join();
  EXPECT_THAT(waiting.code(),
              AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded))
      << waiting;
  EXPECT_LT(waited, kQuick);

  if (buffered) {
    absl::StatusOr<size_t> queued = world[0]->Recv(1, 4, absl::MakeSpan(buffer), In(kLong));
    ASSERT_TRUE(queued.ok()) << queued.status();
    EXPECT_EQ(std::string(buffer.begin(), buffer.begin() + *queued), "queued");
  }
  // Then: nothing more from rank 1, quickly.
  absl::Time start = absl::Now();
  absl::Status s = world[0]->Recv(1, 4, absl::MakeSpan(buffer), In(kLong)).status();
  EXPECT_THAT(s.code(), AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded))
      << s;
  EXPECT_LT(absl::Now() - start, kQuick);
  start = absl::Now();
  s = world[0]->Send(1, 4, Bytes("anyone?"), In(kLong));
  EXPECT_THAT(s.code(), AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded))
      << s;
  EXPECT_LT(absl::Now() - start, kQuick);
  EXPECT_FALSE(world[0]->CanConnect(1, In(absl::Seconds(2))).ok());
  EXPECT_TRUE(world[0]->CanConnect(2, In(kLong)).ok());

  // The one that left refuses everything.
  std::vector<float> v = {1.0f};
  EXPECT_EQ(world[1]->Send(0, 1, Bytes("x"), In(kLong)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(world[1]->Recv(0, 1, absl::MakeSpan(buffer), In(kLong)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(world[1]->AllReduceMax({0, 1}, absl::MakeSpan(v), In(kLong)).code(),
            absl::StatusCode::kFailedPrecondition);
  world[1]->Shutdown();  // idempotent
}

TEST_P(TransportConformanceTest, OwnShutdownCancelsBlockedCalls) {
  auto world = MakeWorld(2);
  ASSERT_EQ(world.size(), 2u);
  std::vector<uint8_t> buffer(8);
  absl::Status blocked;
  absl::Duration waited;
  std::thread waiter([&] {
    const absl::Time start = absl::Now();
    blocked = world[0]->Recv(1, 2, absl::MakeSpan(buffer), In(kLong)).status();
    waited = absl::Now() - start;
  });
  absl::SleepFor(absl::Milliseconds(100));
  world[0]->Shutdown();
  waiter.join();
  EXPECT_EQ(blocked.code(), absl::StatusCode::kCancelled) << blocked;
  EXPECT_LT(waited, kQuick);
}

}  // namespace

TransportConformanceParam RegistryConformanceParam(const std::string& backend,
                                                   const TransportOptions& options) {
  TransportConformanceParam param;
  param.name = backend;
  param.make_world = [backend, options](int world_size) {
    return ConnectInProcessWorld(backend, world_size, options);
  };
  return param;
}

std::string ConformanceParamName(const ::testing::TestParamInfo<TransportConformanceParam>& info) {
  return info.param.name;
}

std::vector<std::unique_ptr<Transport>> TransportConformanceTest::MakeWorld(int world_size) {
  absl::StatusOr<std::vector<std::unique_ptr<Transport>>> world = GetParam().make_world(world_size);
  if (!world.ok()) {
    ADD_FAILURE() << "cannot make a world of " << world_size << ": " << world.status();
    return {};
  }
  return *std::move(world);
}

}  // namespace paramd
