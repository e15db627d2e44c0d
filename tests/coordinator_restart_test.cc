// A coordinator killed and started again with the same --state_file
// (tests/client_cluster.h: real processes on loopback): it takes the daemons
// back and loses no committed version while they go on serving and stepping,
// and one restarted before any model was loaded loads its startup model.
#include <atomic>
#include <cstdio>
#include <ctime>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "grpcpp/grpcpp.h"
#include "proto/paramd.grpc.pb.h"
#include "server/coordinator/coordinator_state.h"
#include "tests/client_cluster.h"
#include "tests/recovery_test_util.h"

namespace paramd {
namespace {

using client::Client;
using client::ClientOptions;
using testing::EnvInt;
using testing::PushGradientsFor;
using testing::SocketsOnPort;
using testing::TestCluster;
using testing::TestClusterFlags;
using testing::TestClusterOptions;
using testing::WriteAndLoadModel;
using testing::WriteModel;

// A cluster with --state_file on its coordinator and one pusher (this test).
std::unique_ptr<TestCluster> StateFileCluster() {
  TestClusterOptions options;
  options.daemons = 2;
  options.expected_pushers = 1;
  options.optimizer = "adamw";
  options.lr = 0.01;
  auto cluster = TestCluster::Start(options, [](const std::string& dir) {
    TestClusterFlags flags;
    flags.coordinator = {"--state_file=" + dir + "/coordinator.state"};
    return flags;
  });
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  return cluster.ok() ? *std::move(cluster) : nullptr;
}

// COORDINATOR_KILL_TRIALS (default 2; 10 for the full run) trials: while a
// pusher pushes and waits continuously, the coordinator is SIGKILLed after
// a random 0-400 ms and started again with the same --state_file. The
// daemons keep serving meanwhile; the restarted coordinator takes them back,
// its committed version is never below the last one the pusher saw, and
// the pusher goes on (its waits retried while the coordinator is down).
TEST(CoordinatorRestartTest, KilledCoordinatorComesBackWithNoVersionLost) {
  const int trials = EnvInt("COORDINATOR_KILL_TRIALS", 2);
  std::mt19937 rng(static_cast<uint32_t>(EnvInt("RECOVERY_KILL_SEED", time(nullptr))));
  for (int trial = 0; trial < trials; ++trial) {
    SCOPED_TRACE(absl::StrCat("trial ", trial));
    std::unique_ptr<TestCluster> owned = StateFileCluster();
    ASSERT_NE(owned, nullptr);
    std::unique_ptr<TestCluster>* cluster = &owned;
    ClientOptions co;
    co.coordinator_address = (*cluster)->coordinator_address();
    co.expected_pushers = 1;
    auto client = Client::Connect(co);
    ASSERT_TRUE(client.ok()) << client.status();
    absl::StatusOr<int64_t> loaded =
        WriteAndLoadModel(**client, (*cluster)->dir() + "/model.safetensors");
    ASSERT_TRUE(loaded.ok()) << loaded.status() << (*cluster)->Logs();

    // One pushed step from `v`, its wait retried while the coordinator is away.
    auto push = [&](int64_t v) -> absl::Status {
      absl::Status pushed = PushGradientsFor(**client, v);
      // A retry of a push that arrived: the daemon already has it.
      if (!pushed.ok() && !absl::IsAlreadyExists(pushed) && !absl::IsFailedPrecondition(pushed)) {
        return pushed;
      }
      const absl::Time give_up = absl::Now() + absl::Seconds(30);
      for (;;) {
        absl::StatusOr<int64_t> w = (*client)->WaitForVersion(v + 1, absl::Seconds(5));
        if (w.ok()) return absl::OkStatus();
        if (!absl::IsUnavailable(w.status())) return w.status();
        if (absl::Now() > give_up) {
          const std::string& address = (*cluster)->coordinator_address();
          return absl::Status(
              w.status().code(),
              absl::StrCat(w.status().message(), "\nsockets on the coordinator's port:\n",
                           SocketsOnPort(std::stoi(address.substr(address.rfind(':') + 1)))));
        }
        absl::SleepFor(absl::Milliseconds(50));
      }
    };
    std::atomic<int64_t> seen{0};
    std::atomic<bool> stop{false};
    absl::Status pusher_status;
    std::thread pusher([&] {
      for (int64_t v = 0; !stop.load(); ++v) {
        pusher_status = push(v);
        if (!pusher_status.ok()) return;
        seen = v + 1;
      }
    });
    absl::SleepFor(absl::Milliseconds(std::uniform_int_distribution<int>(0, 400)(rng)));
    const int64_t before = seen.load();
    ASSERT_TRUE((*cluster)->RestartCoordinator().ok()) << (*cluster)->Logs();
    const int64_t target = before + 5;
    while (seen.load() < target && pusher_status.ok()) absl::SleepFor(absl::Milliseconds(20));
    stop = true;
    pusher.join();
    ASSERT_TRUE(pusher_status.ok()) << pusher_status << (*cluster)->Logs();
    auto status = (*client)->Status(false, absl::Seconds(5));
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_GE(status->committed_version(), target);
    EXPECT_GE(status->committed_version(), before);
    ASSERT_EQ(status->daemons_size(), 2);
    for (const rpc::DaemonStats& d : status->daemons()) {
      EXPECT_EQ(d.published_version(), status->committed_version()) << d.error();
    }
    EXPECT_EQ(status->manifest().tensors_size(), 2);
    EXPECT_EQ(status->recovery().epoch(), 0);
    EXPECT_NE((*cluster)->Logs().find("restarted from"), std::string::npos) << (*cluster)->Logs();
  }
}

// The version daemon process `d` publishes, asked of it directly (-1 if it
// does not answer).
int64_t PublishedBy(TestCluster& cluster, int d) {
  auto stub = rpc::Daemon::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", cluster.daemon_port(d)), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  rpc::GetStatsRequest request;
  rpc::GetStatsResponse response;
  if (!stub->GetStats(&context, request, &response).ok()) return -1;
  return response.stats().published_version();
}

// While the coordinator is down, the daemons take pushes and step on: their
// reports of each version to the coordinator fail and are retried on a
// thread of their own, never on the worker that runs the next step (a
// worker sleeping through 0.2 + 0.4 + ... + 3.2 s of retries held every
// step after the first for over 6 s). The restarted coordinator then
// commits what they published.
TEST(CoordinatorRestartTest, DaemonsStepOnWhileTheCoordinatorIsDown) {
  std::unique_ptr<TestCluster> cluster = StateFileCluster();
  ASSERT_NE(cluster, nullptr);
  ClientOptions co;
  co.coordinator_address = cluster->coordinator_address();
  co.expected_pushers = 1;
  auto client = Client::Connect(co);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<int64_t> loaded =
      WriteAndLoadModel(**client, cluster->dir() + "/model.safetensors");
  ASSERT_TRUE(loaded.ok()) << loaded.status() << cluster->Logs();
  auto push = [&](int64_t v) { return PushGradientsFor(**client, v); };
  ASSERT_TRUE(push(0).ok());
  ASSERT_TRUE((*client)->WaitForVersion(1, absl::Seconds(30)).ok()) << cluster->Logs();
  // The state file holds the model (written by the coordinator's own thread).
  const absl::Time written_by = absl::Now() + absl::Seconds(20);
  for (;;) {
    auto state = ReadStateFile(cluster->dir() + "/coordinator.state");
    if (state.ok() && state->has_value() && (*state)->manifest().tensors_size() == 2) break;
    ASSERT_LT(absl::Now(), written_by) << "no model in the state file";
    absl::SleepFor(absl::Milliseconds(20));
  }

  cluster->KillCoordinator();
  const absl::Time start = absl::Now();
  constexpr int64_t kSteps = 4;
  for (int64_t v = 1; v <= kSteps; ++v) {
    ASSERT_TRUE(push(v).ok()) << cluster->Logs();
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    while ((PublishedBy(*cluster, 0) < v + 1 || PublishedBy(*cluster, 1) < v + 1) &&
           absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    ASSERT_EQ(PublishedBy(*cluster, 0), v + 1) << cluster->Logs();
    ASSERT_EQ(PublishedBy(*cluster, 1), v + 1) << cluster->Logs();
  }
  const absl::Duration took = absl::Now() - start;
  std::printf("%lld pushed steps with the coordinator down: %.3f s\n",
              static_cast<long long>(kSteps), absl::ToDoubleSeconds(took));
  // A worker held by report retries needs over 6 s for the second step.
  EXPECT_LT(took, absl::Seconds(5)) << cluster->Logs();

  ASSERT_TRUE(cluster->RestartCoordinator().ok()) << cluster->Logs();
  absl::StatusOr<int64_t> w;
  const absl::Time committed_by = absl::Now() + absl::Seconds(30);
  while (absl::Now() < committed_by) {
    w = (*client)->WaitForVersion(kSteps + 1, absl::Seconds(2));
    if (!absl::IsUnavailable(w.status())) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(w.ok()) << w.status() << cluster->Logs();
  EXPECT_EQ(*w, kSteps + 1);
}

// A coordinator restarted with --model after its earlier run died before a
// model was loaded (its state file holds the daemons and no manifest): the
// daemons are not joining again, so nothing completes the world; it loads
// the startup model once they are back.
TEST(CoordinatorRestartTest, RestartedBeforeAModelWasLoadedItLoadsItsStartupModel) {
  std::unique_ptr<TestCluster> cluster = StateFileCluster();
  ASSERT_NE(cluster, nullptr);
  ClientOptions co;
  co.coordinator_address = cluster->coordinator_address();
  co.role = ClientOptions::Role::kObserver;
  auto client = Client::Connect(co);
  ASSERT_TRUE(client.ok()) << client.status();
  // Both daemons joined (and so are in the state file, written on every change).
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  for (;;) {
    auto s = (*client)->Status(false, absl::Seconds(5));
    int alive = 0;
    if (s.ok()) {
      for (const rpc::Member& m : s->members()) {
        alive += m.role() == rpc::ROLE_DAEMON && m.state() == rpc::MEMBER_STATE_ALIVE;
      }
    }
    if (alive == 2) break;
    ASSERT_LT(absl::Now(), give_up) << cluster->Logs();
    absl::SleepFor(absl::Milliseconds(50));
  }
  absl::SleepFor(absl::Milliseconds(300));  // the state writer's coalescing
  const std::string model = cluster->dir() + "/model.safetensors";
  WriteModel(model);
  ASSERT_TRUE(cluster->RestartCoordinator({"--model=" + model}).ok()) << cluster->Logs();
  // Before, nothing ever loaded the model: this gave up after 30 s.
  absl::StatusOr<int64_t> v;
  const absl::Time loaded_by = absl::Now() + absl::Seconds(30);
  while (absl::Now() < loaded_by) {
    v = (*client)->WaitForVersion(0, absl::Seconds(2));
    if (v.ok()) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(v.ok()) << v.status() << cluster->Logs();
  EXPECT_EQ(*v, 0);
  auto status = (*client)->Status(false, absl::Seconds(5));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->manifest().tensors_size(), 2);
  EXPECT_NE(cluster->Logs().find("restarted from"), std::string::npos) << cluster->Logs();
}

}  // namespace
}  // namespace paramd
