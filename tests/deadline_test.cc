// Every client call ends by its deadline even when the peer stops
// answering: a real daemon process is stopped with SIGSTOP
//   - before a 32 MB push from the C++ client (the stream is then stuck
//     mid-way in HTTP/2 flow control),
//   - during a fetch,
//   - before a fetch,
// and each call returns DEADLINE_EXCEEDED or UNAVAILABLE within its
// timeout plus a slack for a loaded machine, never later. After SIGCONT the daemon serves
// again and the next push commits a version (nothing was half-applied).
// Keepalive (auth::AddKeepalive on every channel and server) is what drops
// such a connection for the calls that come after; the deadlines are what
// bound each call.
#include <signal.h>

#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "tests/client_cluster.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

using client::Client;
using client::ClientOptions;
using client::Gradient;

constexpr int64_t kRows = 2048, kCols = 4096;  // 32 MB of FP32
constexpr absl::Duration kTimeout = absl::Seconds(2);
// A call may end somewhat after its deadline on a loaded 2-core test
// machine (a push to a stopped daemon was seen ending 3.3 s late while
// four compilations ran beside it; 0.1-0.5 s when idle), never the tens of
// seconds of an unbounded call.
constexpr absl::Duration kSlack = absl::Seconds(6);

bool StoppedCode(absl::StatusCode code) {
  return code == absl::StatusCode::kDeadlineExceeded || code == absl::StatusCode::kUnavailable;
}

class DeadlineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TestClusterOptions options;
    options.daemons = 1;
    options.expected_pushers = 1;
    auto cluster = TestCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    const std::string path = cluster_->dir() + "/model.safetensors";
    ASSERT_TRUE(WriteModel(path, {{"w", {kRows, kCols}, RandomValues(kRows * kCols, 3)}}).ok());
    ClientOptions o;
    o.coordinator_address = cluster_->coordinator_address();
    o.call_timeout = absl::Seconds(30);
    auto c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    absl::StatusOr<int64_t> v;
    do {
      v = client_->Load(path, "", absl::Seconds(30));
    } while (v.status().code() == absl::StatusCode::kUnavailable && absl::Now() < give_up &&
             (absl::SleepFor(absl::Milliseconds(50)), true));
    ASSERT_TRUE(v.ok()) << v.status() << cluster_->Logs();
    grads_ = RandomValues(kRows * kCols, 4, 0.01f);
    // Connect to the daemon before it is stopped (a fetch), so that the
    // calls below get stuck inside the stream, not in the connect.
    const absl::Status first = Fetch(absl::Seconds(20));
    ASSERT_TRUE(first.ok()) << first << cluster_->Logs();
  }

  void TearDown() override {
    if (cluster_ != nullptr) cluster_->SignalDaemon(0, SIGCONT);
  }

  absl::Status Fetch(absl::Duration timeout) {
    return client_
        ->Fetch(Client::kLatest, client::AllTargets(client_->manifest(), {Direction::kRowwise}),
                timeout)
        .status();
  }
  absl::Status Push(int64_t version, absl::Duration timeout) {
    const std::vector<Gradient> g = {Gradient::Fp32("w", grads_)};
    return client_->PushGradients(version, g, timeout).status();
  }

  // Runs `call` and checks that it failed as a stopped peer does, by its
  // deadline.
  template <class Call>
  void ExpectBoundedFailure(const char* what, Call call) {
    const absl::Time start = absl::Now();
    const absl::Status s = call();
    const absl::Duration took = absl::Now() - start;
    EXPECT_TRUE(StoppedCode(s.code())) << what << ": " << s;
    EXPECT_LE(took, kTimeout + kSlack) << what << " took " << took << ": " << s;
    EXPECT_GE(took, kTimeout - absl::Milliseconds(100)) << what << " ended early: " << s;
  }

  std::unique_ptr<TestCluster> cluster_;
  std::unique_ptr<Client> client_;
  std::vector<float> grads_;
};

TEST_F(DeadlineTest, PushToAStoppedDaemonEndsAtItsDeadline) {
  cluster_->SignalDaemon(0, SIGSTOP);
  ExpectBoundedFailure("push (32 MB) to a stopped daemon", [&] { return Push(0, kTimeout); });
  cluster_->SignalDaemon(0, SIGCONT);
  // The stuck stream changed nothing: a full push now commits v1.
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  absl::Status pushed;
  do {
    pushed = Push(0, absl::Seconds(10));
  } while (pushed.code() == absl::StatusCode::kUnavailable && absl::Now() < give_up &&
           (absl::SleepFor(absl::Milliseconds(100)), true));
  ASSERT_TRUE(pushed.ok()) << pushed << cluster_->Logs();
  auto v = client_->WaitForVersion(1, absl::Seconds(20));
  ASSERT_TRUE(v.ok()) << v.status() << cluster_->Logs();
}

TEST_F(DeadlineTest, FetchFromADaemonStoppedBeforeOrDuringItEndsAtItsDeadline) {
  cluster_->SignalDaemon(0, SIGSTOP);
  ExpectBoundedFailure("fetch from a stopped daemon", [&] { return Fetch(kTimeout); });
  cluster_->SignalDaemon(0, SIGCONT);
  ASSERT_TRUE(Fetch(absl::Seconds(20)).ok());
  // Stopped 2 ms into the fetch: it may have finished by then (OK), but it
  // never outlives its deadline.
  for (int i = 0; i < 3; ++i) {
    std::thread stopper([&] {
      absl::SleepFor(absl::Milliseconds(2));
      cluster_->SignalDaemon(0, SIGSTOP);
    });
    const absl::Time start = absl::Now();
    const absl::Status s = Fetch(kTimeout);
    const absl::Duration took = absl::Now() - start;
    stopper.join();
    EXPECT_TRUE(s.ok() || StoppedCode(s.code())) << s;
    EXPECT_LE(took, kTimeout + kSlack) << "fetch stopped mid-way took " << took << ": " << s;
    cluster_->SignalDaemon(0, SIGCONT);
  }
}

}  // namespace
}  // namespace testing
}  // namespace paramd
