// File: tests/load_join_wait_test.cc
//
// A Load sent before every daemon has joined waits for the joins
// (CoordinatorOptions::load_join_wait) instead of being refused: in one
// process, a coordinator-only server and daemon-only servers started later,
// all through their real RPCs. Without the wait a Load before the joins was
// refused at once with UNAVAILABLE ("waiting for daemons: 0 of N joined").

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/paramd.grpc.pb.h"
#include "server/server.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace {

using ::paramd::testing::RandomValues;
using ::paramd::testing::TestTensor;
using ::paramd::testing::WriteModel;

class LoadJoinWait : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = absl::StrCat(::testing::TempDir(), "/load_join_wait.safetensors");
    const std::vector<TestTensor> tensors = {{"w", {16, 8}, RandomValues(16 * 8, 7)}};
    ASSERT_TRUE(WriteModel(model_, tensors).ok());
  }
  void TearDown() override {
    for (auto& d : daemons_) d->Shutdown();
    if (coordinator_) coordinator_->Shutdown();
  }

  // A coordinator-only server expecting `daemons` daemons.
  void StartCoordinator(int daemons, absl::Duration load_join_wait = absl::Seconds(60)) {
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    options.run_daemon = false;
    options.coordinator.expected_daemons = daemons;
    options.coordinator.expected_pushers = 1;
    options.coordinator.load_join_wait = load_join_wait;
    absl::StatusOr<std::unique_ptr<ParamdServer>> s = ParamdServer::Start(options);
    ASSERT_TRUE(s.ok()) << s.status();
    coordinator_ = *std::move(s);
    address_ = absl::StrCat("127.0.0.1:", coordinator_->port());
    stub_ = rpc::Coordinator::NewStub(
        grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  }

  // A daemon-only server joining the coordinator.
  void StartDaemon() {
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    options.run_coordinator = false;
    options.coordinator_address = address_;
    absl::StatusOr<std::unique_ptr<ParamdServer>> s = ParamdServer::Start(options);
    ASSERT_TRUE(s.ok()) << s.status();
    daemons_.push_back(*std::move(s));
  }

  // Coordinator.Load of the test model with a deadline of `timeout`.
  grpc::Status Load(absl::Duration timeout, rpc::LoadResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    rpc::LoadRequest request;
    request.set_safetensors_path(model_);
    return stub_->Load(&context, request, response);
  }

  std::string model_;
  std::string address_;
  std::unique_ptr<ParamdServer> coordinator_;
  std::vector<std::unique_ptr<ParamdServer>> daemons_;
  std::unique_ptr<rpc::Coordinator::Stub> stub_;
};

TEST_F(LoadJoinWait, LoadBeforeTheJoinsSucceedsOnceTheDaemonsJoin) {
  StartCoordinator(/*daemons=*/2);
  ASSERT_EQ(coordinator_->coordinator()->joined_daemons(), 0);
  std::atomic<bool> answered{false};
  grpc::Status status;
  rpc::LoadResponse response;
  std::thread load([&] {
    status = Load(absl::Seconds(60), &response);
    answered = true;
  });
  // No daemon yet: the Load waits (it used to be refused at once).
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_FALSE(answered.load());
  StartDaemon();
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(answered.load());  // one of two joined: still waiting
  StartDaemon();
  load.join();
  ASSERT_TRUE(status.ok()) << status.error_code() << ": " << status.error_message();
  EXPECT_EQ(response.committed_version(), 0);
  EXPECT_EQ(response.manifest().tensors_size(), 1);
  EXPECT_EQ(coordinator_->coordinator()->committed_version(), 0);
  EXPECT_EQ(coordinator_->coordinator()->joined_daemons(), 2);
}

TEST_F(LoadJoinWait, DeadlineRunsOutWithUnavailableNamingTheMissingDaemons) {
  StartCoordinator(/*daemons=*/2);
  StartDaemon();
  const absl::Time start = absl::Now();
  rpc::LoadResponse response;
  const grpc::Status status = Load(absl::Seconds(5), &response);
  const absl::Duration took = absl::Now() - start;
  // Answered before the deadline (not DEADLINE_EXCEEDED), after waiting.
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "1 of 2 joined")) << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "missing rank 1"))
      << status.error_message();
  EXPECT_GE(took, absl::Seconds(4)) << took;
  EXPECT_EQ(coordinator_->coordinator()->committed_version(), -1);
  // The coordinator keeps serving: a Load waiting when the last daemon
  // joins succeeds, although rank 0 waited for the world longer than its
  // lease (its open Join holds the lease: DaemonWaitingInItsJoinIsNotDown).
  grpc::Status again;
  std::thread load([&] { again = Load(absl::Seconds(60), &response); });
  absl::SleepFor(absl::Milliseconds(300));
  StartDaemon();
  load.join();
  EXPECT_TRUE(again.ok()) << again.error_code() << ": " << again.error_message();
  EXPECT_EQ(response.committed_version(), 0);
}

// Rank 0 waits in its Join (wait_for_world) longer than its 1.5 s lease; it
// has no member id to heartbeat with until the Join answers. It used to be
// marked DOWN, and a Load in the ~250 ms after the last join (before rank 0's
// first heartbeat) was refused UNAVAILABLE "rank 0 ... is down".
TEST_F(LoadJoinWait, DaemonWaitingInItsJoinIsNotDown) {
  StartCoordinator(/*daemons=*/2, /*load_join_wait=*/absl::ZeroDuration());
  StartDaemon();
  absl::SleepFor(absl::Milliseconds(2500));
  const std::vector<rpc::Member> waiting = coordinator_->coordinator()->daemon_members();
  ASSERT_EQ(waiting.size(), 1u);
  EXPECT_EQ(waiting[0].state(), rpc::MEMBER_STATE_ALIVE) << waiting[0].down_reason();
  StartDaemon();
  for (int i = 0; i < 200 && coordinator_->coordinator()->joined_daemons() < 2; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(coordinator_->coordinator()->joined_daemons(), 2);
  rpc::LoadResponse response;
  const grpc::Status status = Load(absl::Seconds(30), &response);
  EXPECT_TRUE(status.ok()) << status.error_code() << ": " << status.error_message();
  EXPECT_EQ(response.committed_version(), 0);
  EXPECT_EQ(coordinator_->coordinator()->daemons_lost(), 0);
}

// A daemon that goes away while waiting in its Join cancels the call; its
// lease then runs, and it is DOWN within 2 s as any dead daemon.
TEST_F(LoadJoinWait, DaemonGoneWhileWaitingInItsJoinIsDownWithinTwoSeconds) {
  StartCoordinator(/*daemons=*/2, /*load_join_wait=*/absl::ZeroDuration());
  StartDaemon();
  absl::SleepFor(absl::Milliseconds(2500));
  ASSERT_EQ(coordinator_->coordinator()->daemons_lost(), 0);
  const absl::Time gone = absl::Now();
  daemons_[0]->Shutdown();  // cancels its open Join, as a killed process' closed connection does
  absl::Duration took = absl::InfiniteDuration();
  while (absl::Now() - gone < absl::Seconds(5)) {
    const std::vector<rpc::Member> m = coordinator_->coordinator()->daemon_members();
    if (!m.empty() && m[0].state() == rpc::MEMBER_STATE_DOWN) {
      took = absl::Now() - gone;
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_LE(took, absl::Seconds(2)) << took;
  EXPECT_GE(took, absl::Milliseconds(1400)) << took;  // one lease after the cancel
  EXPECT_EQ(coordinator_->coordinator()->daemons_lost(), 1);
}

TEST_F(LoadJoinWait, WaitIsBoundedWithoutADeadline) {
  StartCoordinator(/*daemons=*/1, /*load_join_wait=*/absl::Milliseconds(500));
  const absl::Time start = absl::Now();
  grpc::ClientContext context;  // no deadline
  rpc::LoadRequest request;
  request.set_safetensors_path(model_);
  rpc::LoadResponse response;
  const grpc::Status status = stub_->Load(&context, request, &response);
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "0 of 1 joined")) << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "missing rank 0"))
      << status.error_message();
  EXPECT_GE(took, absl::Milliseconds(500)) << took;
  EXPECT_LT(took, absl::Seconds(30)) << took;
}

TEST_F(LoadJoinWait, ShutdownAnswersAWaitingLoad) {
  StartCoordinator(/*daemons=*/1);
  grpc::Status status;
  rpc::LoadResponse response;
  std::thread load([&] { status = Load(absl::Seconds(60), &response); });
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time start = absl::Now();
  coordinator_->Shutdown();
  load.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "coordinator shutting down"))
      << status.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

}  // namespace
}  // namespace paramd
