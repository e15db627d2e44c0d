// Crash consistency of the checkpoint store: a child process writes a
// checkpoint (every daemon's shard file, the manifest, then KeepLast) and is
// killed with SIGKILL at a random moment. After every kill the previous
// checkpoint must still be listed and byte-exact, every listed checkpoint
// must verify, and a half-written one must never be listed nor opened.
//
// CKPT_CRASH_TRIALS (default 24) sets the number of kills; CKPT_CRASH_SEED
// the random seed (default: time); tools/checkpoint_soak.sh runs many more.
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/store.h"
#include "checkpoint/test_util.h"
#include "gtest/gtest.h"

namespace paramd {
namespace checkpoint {
namespace {

using testing::CheckFakeCheckpoint;
using testing::FakeTensors;
using testing::WriteFakeCheckpoint;

constexpr int kWorld = 2;
constexpr int kKeep = 2;
static_assert(kWorld == 2, "the report below prints three buckets");

std::vector<TensorInfo> Model() {
  // About 3 MB of masters + 2 moments per checkpoint.
  return FakeTensors({{512, 384}, {130, 97}, {1, 4096}, {300, 200}});
}

int EnvInt(const char* name, int fallback) {
  const char* value = getenv(name);
  return value != nullptr ? atoi(value) : fallback;
}

// What the child does: the whole checkpoint of `version`, then GC.
[[noreturn]] void ChildCheckpoint(const CheckpointStore& store, uint64_t version) {
  absl::Status status = WriteFakeCheckpoint(store, version, version, Model(), kWorld);
  if (status.ok()) status = store.KeepLast(kKeep).status();
  _exit(status.ok() ? 0 : 3);
}

double CheckpointSeconds(const CheckpointStore& store, uint64_t version) {
  auto start = std::chrono::steady_clock::now();
  pid_t pid = fork();
  if (pid == 0) ChildCheckpoint(store, version);
  int wstatus = 0;
  waitpid(pid, &wstatus, 0);
  EXPECT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::vector<uint64_t> Listed(const CheckpointStore& store) {
  auto list = store.List();
  EXPECT_TRUE(list.ok()) << list.status();
  std::vector<uint64_t> versions;
  if (list.ok()) {
    for (const CheckpointSummary& summary : *list) versions.push_back(summary.version);
  }
  return versions;
}

TEST(CrashTest, KillNineDuringCheckpointNeverLosesTheLastOne) {
  const std::string dir = testing::MakeTestDir("crash");
  ASSERT_FALSE(dir.empty());
  auto store = CheckpointStore::Open(dir, true);
  ASSERT_TRUE(store.ok());

  const int trials = EnvInt("CKPT_CRASH_TRIALS", 24);
  const unsigned seed =
      static_cast<unsigned>(EnvInt("CKPT_CRASH_SEED", static_cast<int>(time(nullptr))));
  std::printf("trials %d, seed %u (rerun with CKPT_CRASH_SEED=%u)\n", trials, seed, seed);
  std::mt19937 rng(seed);

  // Versions 1 and 2 complete; time a whole cycle to spread the kills over it.
  ASSERT_TRUE(WriteFakeCheckpoint(*store, 1, 1, Model(), kWorld).ok());
  double cycle = CheckpointSeconds(*store, 2);
  uint64_t newest = 2;

  int killed_midway = 0;
  int partial_by_files[kWorld + 1] = {};  // kills before the manifest, by shard files renamed
  int completed = 0;
  uint64_t version = 3;
  for (int trial = 0; trial < trials || (killed_midway == 0 && trial < 4 * trials); ++trial) {
    // Mostly uniform over the cycle; some kills later (during GC) and some
    // almost at once (during the first shard file).
    std::uniform_real_distribution<double> when(0.0, 1.25);
    const double fraction = trial % 5 == 4 ? when(rng) * 0.1 : when(rng);
    const auto delay = std::chrono::duration<double>(fraction * cycle);

    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) ChildCheckpoint(*store, version);
    std::this_thread::sleep_for(delay);
    kill(pid, SIGKILL);
    int wstatus = 0;
    ASSERT_EQ(waitpid(pid, &wstatus, 0), pid);
    ASSERT_FALSE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) != 0) << "child failed on its own";
    const bool finished = WIFEXITED(wstatus);

    std::vector<uint64_t> listed = Listed(*store);
    SCOPED_TRACE(::testing::Message() << "trial " << trial << ", version " << version
                                      << ", killed at " << fraction << " of the cycle");
    // The previous checkpoint is still there...
    ASSERT_TRUE(std::find(listed.begin(), listed.end(), newest) != listed.end());
    // ...and every listed checkpoint is complete and exact.
    for (uint64_t v : listed) {
      ASSERT_TRUE(store->Verify(v).ok()) << "v" << v << ": " << store->Verify(v);
      absl::Status exact = CheckFakeCheckpoint(*store, v, v, Model(), 1);
      ASSERT_TRUE(exact.ok()) << exact;
    }
    const bool listed_new = std::find(listed.begin(), listed.end(), version) != listed.end();
    if (finished) {
      ASSERT_TRUE(listed_new);
    }
    if (!listed_new) {
      ++killed_midway;
      int shard_files = 0;
      for (int rank = 0; rank < kWorld; ++rank) {
        shard_files +=
            RegularFileSize(store->VersionDir(version) + "/" + ShardFileName(rank, kWorld)).ok();
      }
      ++partial_by_files[shard_files];
      // Never readable, and a retry of the same version after the crash works.
      ASSERT_FALSE(CheckpointReader::Open(*store, version).ok());
      ASSERT_TRUE(WriteFakeCheckpoint(*store, version, version, Model(), kWorld).ok());
      ASSERT_TRUE(CheckFakeCheckpoint(*store, version, version, Model(), 3).ok());
    } else {
      ++completed;
    }
    newest = version++;
  }
  std::printf(
      "%d kills: %d before the manifest (with 0/1/2 shard files final: %d/%d/%d), "
      "%d after it (during KeepLast or exit)\n",
      killed_midway + completed, killed_midway, partial_by_files[0], partial_by_files[1],
      partial_by_files[2], completed);
  EXPECT_GT(killed_midway, 0) << "no kill landed before the manifest";

  // GC after all that leaves exactly the newest kKeep checkpoints, and no
  // leftovers of killed writers anywhere.
  ASSERT_TRUE(store->KeepLast(kKeep).ok());
  std::vector<uint64_t> listed = Listed(*store);
  EXPECT_EQ(listed, (std::vector<uint64_t>{newest - 1, newest}));
}

}  // namespace
}  // namespace checkpoint
}  // namespace paramd
