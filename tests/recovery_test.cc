// Membership and recovery against real processes (tests/client_cluster.h):
// a coordinator and two hybrid-paramd daemons on loopback.
//
//   Membership: a SIGKILLed or SIGSTOPped daemon is DOWN in GetStatus within
//   2 s; steps are refused with UNAVAILABLE naming it while the survivor
//   keeps serving fetches; a stopped daemon that continues is alive again;
//   a process started with --rank=N takes rank N.
#include <signal.h>

#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "grpcpp/grpcpp.h"
#include "proto/paramd.grpc.pb.h"
#include "safetensors/safetensors.h"
#include "tests/client_cluster.h"

namespace paramd {
namespace {

using client::Client;
using client::ClientOptions;
using testing::TestCluster;
using testing::TestClusterOptions;

void WriteModel(const std::string& path) {
  std::vector<safetensors::TensorSpec> specs = {{"a.weight", safetensors::Dtype::kF32, {256, 64}},
                                                {"b.weight", safetensors::Dtype::kF32, {128, 96}}};
  auto writer = safetensors::SafetensorsWriter::Create(path, specs);
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (const auto& spec : specs) {
    std::vector<float> v(spec.shape[0] * spec.shape[1]);
    for (size_t i = 0; i < v.size(); ++i) v[i] = 0.01f * static_cast<float>((i * 37) % 101) - 0.5f;
    ASSERT_TRUE((*writer)
                    ->WriteTensor(spec.name, absl::MakeConstSpan(
                                                 reinterpret_cast<const uint8_t*>(v.data()),
                                                 v.size() * 4))
                    .ok());
  }
  ASSERT_TRUE((*writer)->Finish().ok());
}

class MembershipTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TestClusterOptions options;
    options.daemons = 2;
    options.expected_pushers = 0;  // admin steps only
    auto cluster = TestCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    ClientOptions co;
    co.coordinator_address = cluster_->coordinator_address();
    co.role = ClientOptions::Role::kObserver;
    auto c = Client::Connect(co);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
    const std::string model = cluster_->dir() + "/model.safetensors";
    WriteModel(model);
    // UNAVAILABLE until both daemons have joined.
    absl::StatusOr<int64_t> v;
    for (int attempt = 0; attempt < 200; ++attempt) {
      v = client_->Load(model, "", absl::Seconds(30));
      if (!absl::IsUnavailable(v.status())) break;
      absl::SleepFor(absl::Milliseconds(50));
    }
    ASSERT_TRUE(v.ok()) << v.status() << cluster_->Logs();
    auto stepped = client_->Step(0, /*wait=*/true, absl::Seconds(30));
    ASSERT_TRUE(stepped.ok()) << stepped.status() << cluster_->Logs();
  }

  // The daemon process (index for KillDaemon) that holds `rank`.
  int ProcessOfRank(int rank) {
    auto s = client_->Status(false, absl::Seconds(5));
    EXPECT_TRUE(s.ok()) << s.status();
    for (const rpc::Member& m : s->members()) {
      if (m.role() != rpc::ROLE_DAEMON || m.rank() != rank) continue;
      for (int d = 0; d < 8; ++d) {
        if (m.address() == absl::StrCat("127.0.0.1:", cluster_->daemon_port(d))) return d;
      }
    }
    ADD_FAILURE() << "no process for rank " << rank;
    return 0;
  }

  rpc::Member MemberOfRank(int rank) {
    auto s = client_->Status(false, absl::Seconds(5));
    EXPECT_TRUE(s.ok()) << s.status();
    for (const rpc::Member& m : s->members()) {
      if (m.role() == rpc::ROLE_DAEMON && m.rank() == rank) return m;
    }
    return rpc::Member();
  }

  // Seconds until rank `rank`'s state is `state` (polled every 20 ms), or
  // -1 after `limit`.
  double SecondsUntil(int rank, rpc::MemberState state, absl::Duration limit) {
    const absl::Time start = absl::Now();
    while (absl::Now() - start < limit) {
      if (MemberOfRank(rank).state() == state) return absl::ToDoubleSeconds(absl::Now() - start);
      absl::SleepFor(absl::Milliseconds(20));
    }
    return -1;
  }

  // A fetch of every tensor piece rank `rank` holds, straight from it.
  grpc::Status FetchFromDaemon(int rank) {
    auto channel = grpc::CreateChannel(MemberOfRank(rank).address(),
                                       grpc::InsecureChannelCredentials());
    auto stub = rpc::Daemon::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    rpc::FetchRequest request;
    request.set_version(-1);
    auto reader = stub->Fetch(&context, request);
    rpc::FetchResponse response;
    int messages = 0;
    while (reader->Read(&response)) ++messages;
    grpc::Status s = reader->Finish();
    if (s.ok() && messages < 2) return grpc::Status(grpc::StatusCode::INTERNAL, "no chunks");
    return s;
  }

  std::unique_ptr<TestCluster> cluster_;
  std::unique_ptr<Client> client_;
};

TEST_F(MembershipTest, KilledDaemonIsDownWithinTwoSecondsAndStepsNameIt) {
  const int victim = ProcessOfRank(1);
  cluster_->KillDaemon(victim);
  const double seconds = SecondsUntil(1, rpc::MEMBER_STATE_DOWN, absl::Seconds(5));
  ASSERT_GE(seconds, 0) << cluster_->Logs();
  EXPECT_LT(seconds, 2.0);
  EXPECT_NE(MemberOfRank(1).down_reason().find("no heartbeat"), std::string::npos);

  absl::StatusOr<int64_t> step = client_->Step(1, true, absl::Seconds(10));
  ASSERT_FALSE(step.ok());
  EXPECT_TRUE(absl::IsUnavailable(step.status())) << step.status();
  EXPECT_NE(step.status().message().find("rank 1"), std::string::npos) << step.status();
  EXPECT_NE(step.status().message().find("--rank=1"), std::string::npos) << step.status();

  // Everything else is served: status (without waiting on the dead one) and
  // the survivor's fetches.
  const absl::Time start = absl::Now();
  auto status = client_->Status(false, absl::Seconds(5));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  ASSERT_EQ(status->daemons_size(), 2);
  EXPECT_NE(status->daemons(1).error().find("down"), std::string::npos);
  EXPECT_TRUE(FetchFromDaemon(0).ok());
  EXPECT_NE(cluster_->Logs().find("is DOWN"), std::string::npos);
}

TEST_F(MembershipTest, StoppedDaemonIsDownThenAliveWhenContinued) {
  const int victim = ProcessOfRank(1);
  cluster_->SignalDaemon(victim, SIGSTOP);
  const double seconds = SecondsUntil(1, rpc::MEMBER_STATE_DOWN, absl::Seconds(5));
  cluster_->SignalDaemon(victim, SIGCONT);
  ASSERT_GE(seconds, 0) << cluster_->Logs();
  EXPECT_LT(seconds, 2.0);
  EXPECT_GE(SecondsUntil(1, rpc::MEMBER_STATE_ALIVE, absl::Seconds(3)), 0) << cluster_->Logs();
  absl::StatusOr<int64_t> step = client_->Step(1, true, absl::Seconds(20));
  EXPECT_TRUE(step.ok()) << step.status() << cluster_->Logs();
}

TEST_F(MembershipTest, StepHeldByAStoppedDaemonFailsWhenItsLeaseEnds) {
  const int victim = ProcessOfRank(1);
  cluster_->SignalDaemon(victim, SIGSTOP);
  const absl::Time start = absl::Now();
  absl::StatusOr<int64_t> step = client_->Step(1, true, absl::Seconds(20));
  const absl::Duration took = absl::Now() - start;
  cluster_->SignalDaemon(victim, SIGCONT);
  ASSERT_FALSE(step.ok());
  EXPECT_TRUE(absl::IsUnavailable(step.status())) << step.status();
  EXPECT_NE(step.status().message().find("rank 1"), std::string::npos) << step.status();
  EXPECT_LT(took, absl::Seconds(3));
}

TEST_F(MembershipTest, ReplacementWithTheRankTakesItsPlace) {
  const int victim = ProcessOfRank(1);
  const std::string old_address = MemberOfRank(1).address();
  cluster_->KillDaemon(victim);
  // Started at once: it retries until the dead one's lease expires.
  auto replacement = cluster_->StartDaemon({"--rank=1"});
  ASSERT_TRUE(replacement.ok()) << replacement.status();
  const absl::Time start = absl::Now();
  rpc::Member m;
  while (absl::Now() - start < absl::Seconds(5)) {
    m = MemberOfRank(1);
    if (m.address() != old_address) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(m.address(), absl::StrCat("127.0.0.1:", cluster_->daemon_port(*replacement)))
      << cluster_->Logs();
  EXPECT_NE(m.state(), rpc::MEMBER_STATE_DOWN);
  EXPECT_NE(cluster_->Logs().find("replaced by"), std::string::npos);
}

}  // namespace
}  // namespace paramd
