// Multi-process checkpoint crash tests: a coordinator process and two daemon
// processes (//checkpoint:fake_cluster: the real checkpoint services over
// fake state) checkpoint version after version while this test kills, with
// SIGKILL at a random moment, either a daemon or the coordinator. After
// every kill: the previous checkpoint is still listed, complete and
// byte-exact; a checkpoint that did not finish is never listed nor opened;
// every listed checkpoint verifies. The killed process is restarted and
// the next trial goes on.
//
// CKPT_KILL_TRIALS (default 20 per scenario) and CKPT_KILL_SEED (default:
// time) as for //checkpoint:crash_test; tools/checkpoint_soak.sh runs more.
#include <signal.h>
#include <stdlib.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/store.h"
#include "checkpoint/test_util.h"
#include "deploy/process.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/checkpoint_service.grpc.pb.h"

namespace paramd {
namespace checkpoint {
namespace {

constexpr int kWorld = 2;
const char kBinary[] = "checkpoint/fake_cluster";  // runfiles-relative

std::vector<TensorInfo> Model() {  // as in checkpoint/fake_cluster_main.cc
  return testing::FakeTensors({{512, 512}, {130, 97}, {1, 1000}, {3, 7}});
}

int EnvInt(const char* name, int fallback) {
  const char* value = getenv(name);
  return value != nullptr ? atoi(value) : fallback;
}

class Cluster {
 public:
  explicit Cluster(std::string dir) : dir_(std::move(dir)), root_(dir_ + "/ckpt") {}

  void StartDaemon(int rank) {
    const std::string port_file = absl::StrCat(dir_, "/daemon", rank, ".", ++starts_, ".port");
    std::vector<std::string> argv = {kBinary,
                                     "--role=daemon",
                                     absl::StrCat("--rank=", rank),
                                     absl::StrCat("--world=", kWorld),
                                     "--root=" + root_,
                                     "--port_file=" + port_file};
    // Restart on the same port: the coordinator knows daemons by address.
    argv.push_back(ports_[rank] > 0 ? absl::StrCat("--listen=127.0.0.1:", ports_[rank])
                                    : "--listen=127.0.0.1:0");
    auto index =
        children_.Start({absl::StrCat("daemon ", rank), argv, dir_ + "/log", dir_ + "/log"});
    ASSERT_TRUE(index.ok()) << index.status();
    daemon_index_[rank] = *index;
    auto port = demo::WaitForPortFile(port_file, absl::Seconds(20), &children_, *index);
    ASSERT_TRUE(port.ok()) << port.status();
    ports_[rank] = *port;
  }

  void StartCoordinator() {
    const std::string port_file = absl::StrCat(dir_, "/coordinator.", ++starts_, ".port");
    std::vector<std::string> addresses;
    for (int rank = 0; rank < kWorld; ++rank) {
      addresses.push_back(absl::StrCat("127.0.0.1:", ports_[rank]));
    }
    auto index = children_.Start(
        {"coordinator",
         {kBinary, "--role=coordinator", absl::StrCat("--world=", kWorld), "--root=" + root_,
          "--port_file=" + port_file, "--daemons=" + absl::StrJoin(addresses, ",")},
         dir_ + "/log",
         dir_ + "/log"});
    ASSERT_TRUE(index.ok()) << index.status();
    coordinator_index_ = *index;
    auto port = demo::WaitForPortFile(port_file, absl::Seconds(20), &children_, *index);
    ASSERT_TRUE(port.ok()) << port.status();
    stub_ = CheckpointCoordinator::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", *port), grpc::InsecureChannelCredentials()));
  }

  void Kill(int index) {
    children_.Signal(index, SIGKILL);
    ASSERT_TRUE(children_.Wait(index, absl::Seconds(10)).ok());
  }

  // Checkpoint RPC of `version` (runs on the calling thread).
  grpc::Status Checkpoint(uint64_t version) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    CheckpointRequest request;
    request.set_version(static_cast<int64_t>(version));
    request.set_keep(3);
    CheckpointResponse response;
    return stub_->Checkpoint(&context, request, &response);
  }

  const std::string& root() const { return root_; }
  int daemon_index(int rank) const { return daemon_index_[rank]; }
  int coordinator_index() const { return coordinator_index_; }

 private:
  std::string dir_, root_;
  demo::ChildProcesses children_;
  int starts_ = 0;
  int ports_[kWorld] = {0, 0};
  int daemon_index_[kWorld] = {-1, -1};
  int coordinator_index_ = -1;
  std::unique_ptr<CheckpointCoordinator::Stub> stub_;
};

std::vector<uint64_t> Listed(const CheckpointStore& store) {
  std::vector<uint64_t> versions;
  auto list = store.List();
  EXPECT_TRUE(list.ok()) << list.status();
  if (list.ok()) {
    for (const CheckpointSummary& summary : *list) versions.push_back(summary.version);
  }
  return versions;
}

enum class Victim { kDaemon, kCoordinator };

void RunKillTrials(Victim victim) {
  auto dir = demo::TempDir::Create(victim == Victim::kDaemon ? "kill_daemon" : "kill_coord");
  ASSERT_TRUE(dir.ok());
  Cluster cluster(dir->path());
  for (int rank = 0; rank < kWorld; ++rank) ASSERT_NO_FATAL_FAILURE(cluster.StartDaemon(rank));
  ASSERT_NO_FATAL_FAILURE(cluster.StartCoordinator());

  const int trials = EnvInt("CKPT_KILL_TRIALS", 20);
  const unsigned seed =
      static_cast<unsigned>(EnvInt("CKPT_KILL_SEED", static_cast<int>(time(nullptr))));
  std::printf("%s: %d trials, seed %u (rerun with CKPT_KILL_SEED=%u)\n",
              victim == Victim::kDaemon ? "kill a daemon" : "kill the coordinator", trials, seed,
              seed);
  std::mt19937 rng(seed);

  // Version 1 completes; its duration spreads the kills over a checkpoint.
  auto start = std::chrono::steady_clock::now();
  grpc::Status first = cluster.Checkpoint(1);
  ASSERT_TRUE(first.ok()) << first.error_message();
  const double cycle =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  auto store = CheckpointStore::Open(cluster.root(), false);
  ASSERT_TRUE(store.ok());
  uint64_t newest = 1;
  int interrupted = 0;
  for (int trial = 0; trial < trials; ++trial) {
    const uint64_t version = newest + 1;
    std::uniform_real_distribution<double> when(0.0, 1.3 * cycle);
    const auto delay = std::chrono::duration<double>(when(rng));
    const int rank = static_cast<int>(rng() % kWorld);
    auto call = std::async(std::launch::async, [&] { return cluster.Checkpoint(version); });
    std::this_thread::sleep_for(delay);
    if (victim == Victim::kDaemon) {
      ASSERT_NO_FATAL_FAILURE(cluster.Kill(cluster.daemon_index(rank)));
    } else {
      ASSERT_NO_FATAL_FAILURE(cluster.Kill(cluster.coordinator_index()));
    }
    const grpc::Status status = call.get();
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " v" << version << " killed after "
                                      << delay.count() << " s: rpc " << status.error_code());
    std::vector<uint64_t> listed = Listed(*store);
    ASSERT_TRUE(std::find(listed.begin(), listed.end(), newest) != listed.end())
        << "the previous checkpoint v" << newest << " disappeared";
    for (uint64_t v : listed) {
      ASSERT_TRUE(store->Verify(v).ok()) << store->Verify(v);
      absl::Status exact = testing::CheckFakeCheckpoint(*store, v, v, Model(), 1);
      ASSERT_TRUE(exact.ok()) << exact;
    }
    const bool complete = std::find(listed.begin(), listed.end(), version) != listed.end();
    if (status.ok()) {
      ASSERT_TRUE(complete) << "the RPC succeeded but v" << version << " is not listed";
    }
    if (!complete) {
      ++interrupted;
      ASSERT_FALSE(CheckpointReader::Open(*store, version).ok());
    }
    // Restart the victim; the same version must then checkpoint fine.
    if (victim == Victim::kDaemon) {
      ASSERT_NO_FATAL_FAILURE(cluster.StartDaemon(rank));
    } else {
      ASSERT_NO_FATAL_FAILURE(cluster.StartCoordinator());
    }
    if (!complete) {
      grpc::Status retry = cluster.Checkpoint(version);
      ASSERT_TRUE(retry.ok()) << "retry after the kill: " << retry.error_message();
      ASSERT_TRUE(testing::CheckFakeCheckpoint(*store, version, version, Model(), 3).ok());
    }
    newest = version;
  }
  std::printf("%d of %d checkpoints interrupted by the kill\n", interrupted, trials);
  EXPECT_GT(interrupted, 0) << "no kill landed inside a checkpoint";
}

TEST(CheckpointKillTest, KillNineADaemonDuringCheckpoints) { RunKillTrials(Victim::kDaemon); }

TEST(CheckpointKillTest, KillNineTheCoordinatorDuringCheckpoints) {
  RunKillTrials(Victim::kCoordinator);
}

}  // namespace
}  // namespace checkpoint
}  // namespace paramd
