#include "server/snapshot/snapshot.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/format.h"
#include "server/backend/shard_backend.h"

namespace paramd {
namespace {

const AllReduceMaxFn kAlone = [](absl::Span<float>) { return absl::OkStatus(); };

std::vector<TensorDef> Tensors() {
  TensorDef a;
  a.name = "a.weight";
  a.rows = 256;
  a.cols = 64;
  a.spec.rowwise = DefaultQuantSpec(Format::kFp8Delayed);  // amax history + scale
  a.spec.columnwise = DefaultQuantSpec(Format::kMxfp8);
  TensorDef b;
  b.name = "b.weight";
  b.rows = 128;
  b.cols = 32;
  b.spec.rowwise = DefaultQuantSpec(Format::kFp8Current);
  b.spec.columnwise = DefaultQuantSpec(Format::kFp8Delayed);
  return {a, b};
}

std::vector<ShardDef> Shards() { return {{0, 0, 128}, {0, 128, 256}, {1, 0, 128}}; }

OptimizerOptions Adam() {
  OptimizerOptions o;
  o.kind = OptimizerKind::kAdamW;
  o.lr = 0.01f;
  o.weight_decay = 0.01f;
  return o;
}

std::unique_ptr<ShardBackend> NewBackend() {
  auto b =
      CreateShardBackend(DaemonBackend::kCpu, Tensors(), Shards(), {Adam(), absl::Seconds(10)});
  EXPECT_TRUE(b.ok()) << b.status();
  return *std::move(b);
}

void AddGradients(ShardBackend& b, int64_t version) {
  for (size_t i = 0; i < b.shards().size(); ++i) {
    std::mt19937 rng(static_cast<uint32_t>(version * 131 + i));
    std::normal_distribution<float> d(0.0f, 0.1f);
    std::vector<float> g(b.gradient(static_cast<int>(i)).size());
    for (float& x : g) x = d(rng);
    ASSERT_TRUE(b.AccumulateGradient(static_cast<int>(i), 0, g, /*last_pusher=*/true).ok());
  }
}

std::shared_ptr<const PublishedVersion> Load(ShardBackend& b) {
  for (size_t i = 0; i < b.shards().size(); ++i) {
    absl::Span<float> m = b.load_master(static_cast<int>(i));
    for (size_t k = 0; k < m.size(); ++k) m[k] = 0.001f * static_cast<float>((k * 37 + i) % 101);
  }
  auto v = b.Step(0, false, kAlone, true);
  EXPECT_TRUE(v.ok()) << v.status();
  return *v;
}

std::shared_ptr<const PublishedVersion> Step(ShardBackend& b, int64_t from) {
  AddGradients(b, from);
  auto v = b.Step(from + 1, true, kAlone, true);
  EXPECT_TRUE(v.ok()) << v.status();
  return *v;
}

void ExpectSamePublished(const PublishedVersion& a, const PublishedVersion& b) {
  ASSERT_EQ(a.pieces.size(), b.pieces.size());
  for (size_t i = 0; i < a.pieces.size(); ++i) {
    EXPECT_EQ(a.pieces[i].q.data, b.pieces[i].q.data) << "piece " << i;
    EXPECT_EQ(a.pieces[i].q.scales, b.pieces[i].q.scales) << "piece " << i;
    EXPECT_EQ(a.pieces[i].q.scale_inv, b.pieces[i].q.scale_inv) << "piece " << i;
  }
}

void ExpectSameState(ShardBackend& a, ShardBackend& b) {
  const ShardSet& x = *a.host_state();
  const ShardSet& y = *b.host_state();
  EXPECT_EQ(x.optimizer_steps(), y.optimizer_steps());
  for (size_t i = 0; i < x.shards().size(); ++i) {
    const int s = static_cast<int>(i);
    ASSERT_EQ(x.master(s).size(), y.master(s).size());
    EXPECT_EQ(std::memcmp(x.master(s).data(), y.master(s).data(), x.master(s).size() * 4), 0);
    EXPECT_EQ(x.optimizer_state(s).m, y.optimizer_state(s).m);
    EXPECT_EQ(x.optimizer_state(s).v, y.optimizer_state(s).v);
  }
  for (size_t t = 0; t < x.tensors().size(); ++t) {
    for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
      EXPECT_EQ(x.delayed_state(static_cast<int>(t), d).scale,
                y.delayed_state(static_cast<int>(t), d).scale);
      EXPECT_EQ(x.delayed_state(static_cast<int>(t), d).amax_history,
                y.delayed_state(static_cast<int>(t), d).amax_history);
    }
  }
}

// A snapshot of version 4, restored into a fresh backend, republishes
// version 4's bytes exactly and, given the same gradients, steps to the
// same state as the run that took it (masters, moments, amax histories).
TEST(SnapshotTest, RestoredSnapshotRepublishesAndStepsByteForByte) {
  SnapshotOptions options;
  options.every_steps = 2;
  SnapshotKeeper keeper(options);
  auto live = NewBackend();
  keeper.SetModel(0, {"127.0.0.1:1"}, ShardLayoutHash(live->tensors(), live->shards()),
                  /*model_generation=*/1);
  std::shared_ptr<const PublishedVersion> v = Load(*live);
  std::shared_ptr<const PublishedVersion> v4;
  for (int64_t from = 0; from < 7; ++from) {
    keeper.BeforeChange();  // as the daemon's RunStep
    v = Step(*live, from);
    keeper.AfterPublish(*live, *v);
    if (v->version == 4) v4 = v;
  }
  keeper.BeforeChange();
  ASSERT_NE(keeper.Find(0, 6, 1), nullptr);
  std::shared_ptr<const DaemonSnapshot> snap = keeper.Find(0, 4, 1);
  ASSERT_NE(snap, nullptr);  // keep = 2: 4 and 6
  EXPECT_EQ(keeper.Find(0, 2, 1), nullptr);
  EXPECT_EQ(snap->header.optimizer_steps(), 4);
  rpc::DaemonStats stats;
  keeper.FillStats(&stats);
  EXPECT_EQ(stats.snapshot_version(), 6);
  EXPECT_GT(stats.snapshot_bytes(), 0);

  // A cluster that restored version 4 and replays 4 -> 7 with the same gradients.
  auto restored = NewBackend();
  auto next = RestoreSnapshot(*snap, *restored->host_state());
  ASSERT_TRUE(next.ok()) << next.status();
  auto republished = restored->Step(4, false, kAlone, /*update_delayed=*/false);
  ASSERT_TRUE(republished.ok()) << republished.status();
  ApplyDelayedStates(*next, *restored->host_state());
  ExpectSamePublished(**republished, *v4);

  auto reference = NewBackend();
  Load(*reference);
  for (int64_t from = 0; from < 7; ++from) Step(*reference, from);
  for (int64_t from = 4; from < 7; ++from) v = Step(*restored, from);
  ExpectSameState(*restored, *reference);
  ExpectSameState(*restored, *live);
}

TEST(SnapshotTest, SnapshotOfAnotherLayoutIsRefused) {
  SnapshotOptions options;
  options.every_steps = 1;
  SnapshotKeeper keeper(options);
  auto live = NewBackend();
  keeper.SetModel(0, {"127.0.0.1:1"}, ShardLayoutHash(live->tensors(), live->shards()),
                  /*model_generation=*/1);
  Load(*live);
  keeper.AfterPublish(*live, *Step(*live, 0));
  keeper.BeforeChange();
  std::shared_ptr<const DaemonSnapshot> snap = keeper.Find(0, 1, 1);
  ASSERT_NE(snap, nullptr);
  auto other = CreateShardBackend(DaemonBackend::kCpu, Tensors(), {{0, 0, 256}, {1, 0, 128}},
                                  {Adam(), absl::Seconds(10)});
  ASSERT_TRUE(other.ok());
  auto s = RestoreSnapshot(*snap, *(*other)->host_state());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
}

// Snapshots newer than the version a recovery went back to belong to an
// abandoned history; HoldForRecovery keeps everything until then.
TEST(SnapshotTest, RecoveryDropsNewerSnapshotsAndHoldingKeepsOlderOnes) {
  SnapshotOptions options;
  options.every_steps = 1;
  options.keep = 2;
  SnapshotKeeper keeper(options);
  auto live = NewBackend();
  keeper.SetModel(1, {"127.0.0.1:1", "127.0.0.1:2"},
                  ShardLayoutHash(live->tensors(), live->shards()),
                  /*model_generation=*/1);
  std::shared_ptr<const PublishedVersion> v = Load(*live);
  for (int64_t from = 0; from < 2; ++from) {
    keeper.BeforeChange();
    v = Step(*live, from);
    keeper.AfterPublish(*live, *v);
  }
  keeper.BeforeChange();
  std::vector<rpc::SnapshotHeld> held = keeper.HoldForRecovery();
  ASSERT_EQ(held.size(), 2u);
  EXPECT_EQ(held[0].version(), 1);
  EXPECT_EQ(held[1].version(), 2);
  keeper.BeforeChange();
  v = Step(*live, 2);
  keeper.AfterPublish(*live, *v);  // 3 arrives while held: 1 stays
  keeper.BeforeChange();
  EXPECT_NE(keeper.Find(1, 1, 1), nullptr);
  keeper.AfterRecovery(1, nullptr);
  EXPECT_NE(keeper.Find(1, 1, 1), nullptr);
  EXPECT_EQ(keeper.Find(1, 2, 1), nullptr);
  EXPECT_EQ(keeper.Find(1, 3, 1), nullptr);
}

// Every snapshot records the model generation it was taken of; a recovery
// asking for another generation's finds nothing, and a buddy copy of a
// model a load replaced (a send slow across the load) is not kept, whatever
// its version.
TEST(SnapshotTest, SnapshotsBelongToTheirModelGeneration) {
  SnapshotOptions options;
  options.every_steps = 1;
  SnapshotKeeper keeper(options);
  auto live = NewBackend();
  keeper.SetModel(1, {"", ""}, ShardLayoutHash(live->tensors(), live->shards()),
                  /*model_generation=*/2);
  Load(*live);
  keeper.AfterPublish(*live, *Step(*live, 0));
  keeper.BeforeChange();
  ASSERT_NE(keeper.Find(1, 1, 2), nullptr);
  EXPECT_EQ(keeper.Find(1, 1, 2)->header.model_generation(), 2);
  EXPECT_EQ(keeper.Find(1, 1, 1), nullptr);

  auto copy = [](int rank, int64_t version, int64_t generation) {
    auto s = std::make_shared<DaemonSnapshot>();
    s->header.set_rank(rank);
    s->header.set_version(version);
    s->header.set_model_generation(generation);
    return std::shared_ptr<const DaemonSnapshot>(s);
  };
  keeper.AddBuddyCopy(copy(0, 9, 1));  // the replaced model's, newer version
  EXPECT_EQ(keeper.Find(0, 9, 1), nullptr);
  keeper.AddBuddyCopy(copy(0, 1, 2));
  keeper.AddBuddyCopy(copy(0, 5, 3));  // a newer load's: replaces generation 2's
  keeper.AddBuddyCopy(copy(0, 2, 2));  // late: older than what is held
  EXPECT_EQ(keeper.Find(0, 1, 2), nullptr);
  EXPECT_EQ(keeper.Find(0, 2, 2), nullptr);
  EXPECT_NE(keeper.Find(0, 5, 3), nullptr);

  std::vector<rpc::SnapshotHeld> held = keeper.HoldForRecovery();
  ASSERT_EQ(held.size(), 2u);
  EXPECT_EQ(held[0].rank(), 1);
  EXPECT_EQ(held[0].model_generation(), 2);
  EXPECT_EQ(held[1].rank(), 0);
  EXPECT_EQ(held[1].model_generation(), 3);
  keeper.AfterRecovery(1, nullptr);

  // The daemon loads generation 4: generation 3's copy goes.
  keeper.SetModel(1, {"", ""}, ShardLayoutHash(live->tensors(), live->shards()), 4);
  EXPECT_EQ(keeper.Find(0, 5, 3), nullptr);
}

// The arrays (master, m, v per shard) of `b`'s live state.
std::vector<std::array<std::vector<float>, 3>> LiveArrays(ShardBackend& b) {
  const ShardSet& x = *b.host_state();
  std::vector<std::array<std::vector<float>, 3>> out;
  for (size_t i = 0; i < x.shards().size(); ++i) {
    const int s = static_cast<int>(i);
    out.push_back({std::vector<float>(x.master(s).begin(), x.master(s).end()),
                   x.optimizer_state(s).m, x.optimizer_state(s).v});
  }
  return out;
}

// A capture copies into the vectors it is given when they have the sizes
// already (a recycled snapshot's): the same memory, the live values.
TEST(SnapshotTest, CaptureCopiesIntoTheArraysItIsGiven) {
  auto live = NewBackend();
  Load(*live);
  Step(*live, 0);
  std::vector<std::array<std::vector<float>, 3>> arrays = LiveArrays(*live);
  for (auto& a : arrays) {
    for (auto& x : a) std::fill(x.begin(), x.end(), -7.0f);  // stale values
  }
  std::vector<const float*> memory;
  for (const auto& a : arrays) {
    for (const auto& x : a) memory.push_back(x.data());
  }
  Step(*live, 1);
  absl::StatusOr<CapturedState> captured = live->CaptureState();
  ASSERT_TRUE(captured.ok()) << captured.status();
  ASSERT_TRUE(captured->arrays->Copy(arrays).ok());
  EXPECT_EQ(arrays, LiveArrays(*live));
  std::vector<const float*> after;
  for (const auto& a : arrays) {
    for (const auto& x : a) after.push_back(x.data());
  }
  EXPECT_EQ(after, memory);
}

// With keep = 2 the snapshot that falls out when a third completes gives
// its arrays to the next copy unless something still holds it: every kept
// or held snapshot has exactly its own version's state.
TEST(SnapshotTest, SnapshotsCopiedIntoReusedMemoryHoldTheirOwnVersion) {
  SnapshotOptions options;
  options.every_steps = 1;
  options.keep = 2;
  SnapshotKeeper keeper(options);
  auto live = NewBackend();
  keeper.SetModel(0, {"", ""}, ShardLayoutHash(live->tensors(), live->shards()),
                  /*model_generation=*/1);
  std::shared_ptr<const PublishedVersion> v = Load(*live);
  std::map<int64_t, std::vector<std::array<std::vector<float>, 3>>> want;
  std::shared_ptr<const DaemonSnapshot> held3;
  for (int64_t from = 0; from < 6; ++from) {
    keeper.BeforeChange();
    v = Step(*live, from);
    want[from + 1] = LiveArrays(*live);
    keeper.AfterPublish(*live, *v);
    keeper.BeforeChange();                            // the copy is done
    if (from + 1 == 3) held3 = keeper.Find(0, 3, 1);  // still held when 3 falls out
  }
  EXPECT_EQ(keeper.Find(0, 3, 1), nullptr);
  ASSERT_NE(held3, nullptr);
  EXPECT_EQ(held3->arrays, want[3]);
  for (int64_t version : {5, 6}) {
    std::shared_ptr<const DaemonSnapshot> s = keeper.Find(0, version, 1);
    ASSERT_NE(s, nullptr) << version;
    EXPECT_EQ(s->arrays, want[version]) << version;
  }
}

}  // namespace
}  // namespace paramd
