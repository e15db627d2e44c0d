// kill -9 during checkpoints of the REAL hybrid-paramd processes: a
// coordinator and two daemon processes (AdamW; FP8 delayed / blockwise FP8 /
// NVFP4 copies; a few MB of masters) take a complete checkpoint, then
// step and checkpoint again while the test SIGKILLs, after a random delay
// in [0, the duration of a checkpoint], a daemon (or, in the second test,
// the coordinator). Then the rest of the cluster is killed too, and:
//   - the previous checkpoint is still listed, complete, and verifies
//     (checkpoint/store.h on the directory itself); every listed one does;
//   - the interrupted one is never listed nor opened (if the RPC returned OK
//     it must be listed);
//   - fresh processes started with --restore_from restore the newest listed
//     version (the previous one, or the new one if it completed), serving
//     masters and every published copy byte-identical to what the killed
//     cluster served for that version;
//   - the restored cluster steps on to the next version byte-identically
//     with the run so far (moments, step count and delayed scaling were
//     restored), and its checkpoint of that version is the next trial.
//
// CKPT_KILL_TRIALS (default 20 per test) and CKPT_KILL_SEED (default
// 20261130) override; tools/checkpoint_soak.sh runs more.
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <future>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "checkpoint/store.h"
#include "gtest/gtest.h"
#include "tests/checkpoint_test_util.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

// Delayed scaling in both directions (history and cast scale restored per
// direction), blockwise FP8, and an NVFP4 columnwise copy quantized from the
// dequantized rowwise one.
constexpr char kRecipe[] = R"txt(
  rule {
    pattern: "w1"
    spec {
      rowwise { format: FP8_DELAYED amax_history_len: 4 }
      columnwise { format: FP8_DELAYED amax_history_len: 2 fp8_type: E5M2 }
    }
  }
  rule {
    pattern: "w2"
    spec {
      rowwise { format: FP8_BLOCK_128X128 }
      columnwise { format: NVFP4 }
      columnwise_source: ROWWISE_DEQUANTIZED
    }
  }
  default_spec { rowwise { format: IDENTITY_FP32 } })txt";

// 2.4 MB of masters, 7.1 MB per checkpoint with the AdamW moments.
const std::vector<TestTensor>& Model() {
  static const auto* model =
      new std::vector<TestTensor>{{"w1", {768, 512}, RandomValues(768 * 512, 11)},
                                  {"w2", {512, 384}, RandomValues(512 * 384, 12)},
                                  {"b", {1000}, RandomValues(1000, 13)}};
  return *model;
}

std::map<std::string, std::vector<float>> Gradient(int64_t version) {
  std::map<std::string, std::vector<float>> g;
  for (const TestTensor& t : Model()) {
    g[t.name] = RandomValues(static_cast<int64_t>(t.values.size()),
                             static_cast<uint32_t>(1000 + version), 0.01f);
  }
  return g;
}

int EnvInt(const char* name, int fallback) {
  const char* value = getenv(name);
  return value != nullptr ? atoi(value) : fallback;
}

enum class Victim { kDaemon, kCoordinator };

class KillTrials {
 public:
  explicit KillTrials(std::string root) : root_(std::move(root)) {}

  TestClusterOptions Options(bool restore) const {
    TestClusterOptions o;
    o.daemons = 2;
    o.expected_pushers = 1;
    o.optimizer = "adamw";
    o.lr = 0.01;
    o.coordinator_flags = {"--checkpoint_dir=" + root_, "--keep_checkpoints=2"};
    if (restore) o.coordinator_flags.push_back("--restore_from=" + root_);
    o.daemon_flags = {"--checkpoint_dir=" + root_};
    return o;
  }

  // The bytes of `version` served by `cluster` must equal what was served
  // for it before (by this or an earlier, killed cluster); the first time,
  // they are recorded.
  void CheckOrRecord(RawCluster& cluster, int64_t version, const std::string& what) {
    absl::StatusOr<Snapshot> got = TakeSnapshot(cluster, version);
    ASSERT_TRUE(got.ok()) << what << ": " << got.status() << cluster.cluster().Logs();
    auto it = seen_.find(version);
    if (it == seen_.end()) {
      seen_.emplace(version, *std::move(got));
      return;
    }
    const std::string diff = CompareSnapshots(it->second, *got);
    ASSERT_EQ(diff, "") << what << ": version " << version << " differs from the run so far";
  }

  std::vector<uint64_t> Listed() const {
    auto store = checkpoint::CheckpointStore::Open(root_, /*create=*/false);
    EXPECT_TRUE(store.ok()) << store.status();
    std::vector<uint64_t> versions;
    if (!store.ok()) return versions;
    auto list = store->List();
    EXPECT_TRUE(list.ok()) << list.status();
    if (list.ok()) {
      for (const checkpoint::CheckpointSummary& s : *list) versions.push_back(s.version);
    }
    return versions;
  }

  const std::string& root() const { return root_; }

 private:
  std::string root_;
  std::map<int64_t, Snapshot> seen_;
};

void RunKillTrials(Victim victim) {
  const int trials = EnvInt("CKPT_KILL_TRIALS", 20);
  const unsigned seed = static_cast<unsigned>(EnvInt("CKPT_KILL_SEED", 20261130));
  std::printf(
      "kill -9 %s of real hybrid-paramd processes during checkpoints: %d trials, seed %u "
      "(rerun with CKPT_KILL_SEED=%u)\n",
      victim == Victim::kDaemon ? "a daemon" : "the coordinator", trials, seed, seed);
  std::mt19937 rng(seed);
  absl::StatusOr<demo::TempDir> dir = demo::TempDir::Create("ckpt_server_kill");
  ASSERT_TRUE(dir.ok());
  KillTrials state(dir->path() + "/ckpt");

  // Load, and a first complete checkpoint of version 0; its duration
  // spreads the kills over a checkpoint.
  absl::StatusOr<std::unique_ptr<RawCluster>> started = RawCluster::Start(state.Options(false));
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<RawCluster> cluster = *std::move(started);
  const std::string model = dir->path() + "/model.safetensors";
  ASSERT_TRUE(WriteModel(model, Model()).ok());
  absl::StatusOr<int64_t> loaded = cluster->Load(model, kRecipe);
  ASSERT_TRUE(loaded.ok()) << loaded.status() << cluster->cluster().Logs();
  ASSERT_EQ(*loaded, 0);
  ASSERT_NO_FATAL_FAILURE(state.CheckOrRecord(*cluster, 0, "loaded"));
  checkpoint::CheckpointResponse first;
  const absl::Time start = absl::Now();
  const grpc::Status s =
      CheckpointVia(cluster->cluster().coordinator_address(), 0, absl::Seconds(60), &first);
  ASSERT_TRUE(s.ok()) << s.error_message() << cluster->cluster().Logs();
  // As the test sees it (RPC included), so that kills also land after the
  // manifest: during KeepLast or the reply.
  const double duration = absl::ToDoubleSeconds(absl::Now() - start);
  std::printf("checkpoint of v0: %.1f MB in %.3f s (%.3f s in the coordinator)\n",
              first.total_bytes() / 1e6, duration, first.seconds());

  int64_t version = 0;  // the cluster's committed version, checkpointed
  int interrupted = 0, restored_newer = 0;
  for (int trial = 0; trial < trials; ++trial) {
    // Step to version + 1 (from the same gradient as any earlier attempt).
    ASSERT_TRUE(cluster->PushAll(version, "trainer", Gradient(version)).ok())
        << cluster->cluster().Logs();
    ASSERT_TRUE(cluster->WaitForVersion(version + 1).ok()) << cluster->cluster().Logs();
    ASSERT_NO_FATAL_FAILURE(state.CheckOrRecord(*cluster, version + 1, "after a step"));

    const auto delay =
        std::chrono::duration<double>(std::uniform_real_distribution<double>(0.0, duration)(rng));
    const int daemon = static_cast<int>(rng() % 2);
    const std::string address = cluster->cluster().coordinator_address();
    const absl::Time call_start = absl::Now();
    auto call = std::async(std::launch::async, [address, v = version + 1] {
      return CheckpointVia(address, v, absl::Seconds(60));
    });
    std::this_thread::sleep_for(delay);
    if (victim == Victim::kDaemon) {
      cluster->cluster().KillDaemon(daemon);
    } else {
      ASSERT_TRUE(KillCoordinator(cluster->cluster()).ok());
    }
    const grpc::Status status = call.get();
    const double rpc_seconds = absl::ToDoubleSeconds(absl::Now() - call_start);
    // The rest goes too: nothing writes into the directory any more.
    if (victim == Victim::kCoordinator) {
      cluster->cluster().KillDaemon(0);
      cluster->cluster().KillDaemon(1);
    } else {
      cluster->cluster().KillDaemon(1 - daemon);
      ASSERT_TRUE(KillCoordinator(cluster->cluster()).ok());
    }
    cluster.reset();

    const std::vector<uint64_t> listed = state.Listed();
    const uint64_t previous = static_cast<uint64_t>(version);
    const uint64_t attempted = previous + 1;
    const bool complete = std::find(listed.begin(), listed.end(), attempted) != listed.end();
    std::printf(
        "trial %2d: v%llu, killed %s after %.3f s: rpc %s after %.3f s; listed [%s]\n", trial,
        static_cast<unsigned long long>(attempted),
        victim == Victim::kDaemon ? absl::StrCat("daemon ", daemon).c_str() : "the coordinator",
        delay.count(), status.ok() ? "OK" : status.error_message().substr(0, 60).c_str(),
        rpc_seconds, absl::StrJoin(listed, ", ").c_str());
    SCOPED_TRACE(absl::StrCat("trial ", trial, " (seed ", seed, "), v", attempted, " killed after ",
                              delay.count(), " s"));
    ASSERT_TRUE(std::find(listed.begin(), listed.end(), previous) != listed.end())
        << "the previous checkpoint v" << previous << " is no longer listed";
    auto store = checkpoint::CheckpointStore::Open(state.root(), false);
    ASSERT_TRUE(store.ok());
    for (uint64_t v : listed) {
      ASSERT_LE(v, attempted);
      const absl::Status verified = store->Verify(v);
      ASSERT_TRUE(verified.ok()) << verified;
    }
    if (status.ok()) {
      ASSERT_TRUE(complete) << "the RPC succeeded but v" << attempted << " is not listed";
    }
    if (!complete) {
      ++interrupted;
      EXPECT_FALSE(checkpoint::CheckpointReader::Open(*store, attempted).ok());
      EXPECT_FALSE(store->ReadManifest(attempted).ok());
    }

    // Fresh processes restore the newest complete checkpoint at startup.
    const int64_t expected = static_cast<int64_t>(complete ? attempted : previous);
    restored_newer += complete;
    started = RawCluster::Start(state.Options(true));
    ASSERT_TRUE(started.ok()) << started.status();
    cluster = *std::move(started);
    absl::StatusOr<int64_t> restored = cluster->WaitForVersion(expected, absl::Seconds(30));
    ASSERT_TRUE(restored.ok()) << restored.status() << cluster->cluster().Logs();
    ASSERT_EQ(*restored, expected) << cluster->cluster().Logs();
    ASSERT_TRUE(cluster->RefreshManifest().ok());
    ASSERT_NO_FATAL_FAILURE(state.CheckOrRecord(*cluster, expected, "restored"));
    version = expected;
  }
  // One more step after the last restore continues the run exactly.
  ASSERT_TRUE(cluster->PushAll(version, "trainer", Gradient(version)).ok());
  ASSERT_TRUE(cluster->WaitForVersion(version + 1).ok());
  ASSERT_NO_FATAL_FAILURE(state.CheckOrRecord(*cluster, version + 1, "after the last restore"));
  std::printf("%d of %d checkpoints interrupted by the kill, %d completed before it\n", interrupted,
              trials, restored_newer);
  EXPECT_GT(interrupted, 0) << "no kill landed inside a checkpoint";
}

TEST(CheckpointServerKillTest, KillNineADaemonDuringCheckpoints) { RunKillTrials(Victim::kDaemon); }

TEST(CheckpointServerKillTest, KillNineTheCoordinatorDuringCheckpoints) {
  RunKillTrials(Victim::kCoordinator);
}

}  // namespace
}  // namespace testing
}  // namespace paramd
