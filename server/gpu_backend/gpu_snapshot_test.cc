// GPU only. A snapshot of the gpu daemon backend (server/snapshot/snapshot.h through
// ShardBackend::CaptureState, server/gpu_backend/state_capture.h), in both
// capture modes (device spare; live buffers with PARAMD_GPU_SNAPSHOT_SPARE=0):
//   - holds the masters, moments and counters of its version byte for byte
//     (against a second backend stepped the same way and read through its
//     host mirror), while the daemon steps on;
//   - does not disturb those steps (their state equals the second backend's);
//   - restored into a fresh backend (as a recovery does), the same pushes
//     give the same masters, moments and published bytes.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "server/backend/shard_backend.h"
#include "server/gpu_backend/daemon_backend.h"
#include "server/snapshot/restore.h"
#include "server/snapshot/snapshot.h"

namespace paramd {
namespace {

std::vector<TensorDef> Tensors() {
  std::vector<TensorDef> t(2);
  t[0].name = "w0";
  t[0].rows = 256;
  t[0].cols = 512;
  t[0].spec.rowwise = DefaultQuantSpec(Format::kFp8Current);
  t[0].spec.columnwise = DefaultQuantSpec(Format::kFp8Current);
  t[1].name = "w1";
  t[1].rows = 384;
  t[1].cols = 256;
  t[1].spec.rowwise = DefaultQuantSpec(Format::kFp8Delayed);
  t[1].spec.rowwise.amax_history_len = 4;
  t[1].spec.columnwise = DefaultQuantSpec(Format::kFp8Delayed);
  t[1].spec.columnwise.amax_history_len = 4;
  return t;
}

std::vector<ShardDef> Shards() { return {{0, 0, 256}, {1, 0, 384}}; }

float Value(uint32_t seed, size_t k) {
  uint32_t s = static_cast<uint32_t>(seed * 2654435761u + k * 40503u + 1);
  s ^= s >> 13;
  s *= 0x5bd1e995u;
  s ^= s >> 15;
  return (static_cast<float>(s >> 8) / 16777216.0f - 0.5f);
}

// `load`: the masters written through load_master() (else the backend is
// as a daemon creates it for a restore: nothing staged).
std::unique_ptr<ShardBackend> Make(bool load = true) {
  ShardBackendOptions options;
  options.optimizer.lr = 0.01f;
  options.optimizer.weight_decay = 0.01f;
  auto b = gpu_backend::CreateGpuShardBackend(Tensors(), Shards(), options);
  EXPECT_TRUE(b.ok()) << b.status();
  if (!b.ok()) return nullptr;
  (*b)->set_data_plane(nullptr, absl::Seconds(60));  // one daemon
  for (int i = 0; load && i < 2; ++i) {
    absl::Span<float> m = (*b)->load_master(i);
    for (size_t k = 0; k < m.size(); ++k) m[k] = Value(100 + i, k);
  }
  return *std::move(b);
}

const AllReduceMaxFn kIdentity = [](absl::Span<float>) { return absl::OkStatus(); };

// The pushed step to `version` (gradients depend on the version only).
std::shared_ptr<const PublishedVersion> PushAndStep(ShardBackend& b, int64_t version) {
  const std::vector<TensorDef> tensors = Tensors();
  for (int i = 0; i < 2; ++i) {
    std::vector<float> g(static_cast<size_t>(tensors[i].rows * tensors[i].cols));
    for (size_t k = 0; k < g.size(); ++k)
      g[k] = 0.1f * Value(static_cast<uint32_t>(version * 7 + i), k);
    EXPECT_TRUE(b.AccumulateGradient(i, 0, g, /*last_pusher=*/true).ok());
  }
  auto p = b.Step(version, true, kIdentity, true);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : nullptr;
}

// Masters, m, v of every shard read through the host mirror.
std::vector<std::vector<float>> State(ShardBackend& b) {
  std::vector<std::vector<float>> out;
  ShardSet* set = b.host_state();
  EXPECT_NE(set, nullptr);
  if (set == nullptr) return out;
  for (size_t i = 0; i < set->shards().size(); ++i) {
    absl::Span<const float> m = set->master(static_cast<int>(i));
    out.emplace_back(m.begin(), m.end());
    out.push_back(set->optimizer_state(static_cast<int>(i)).m);
    out.push_back(set->optimizer_state(static_cast<int>(i)).v);
  }
  return out;
}

void ExpectSameBytes(const std::vector<std::vector<float>>& got,
                     const std::vector<std::vector<float>>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].size(), want[i].size()) << what << " array " << i;
    ASSERT_FALSE(got[i].empty()) << what << " array " << i;
    EXPECT_EQ(std::memcmp(got[i].data(), want[i].data(), got[i].size() * 4), 0)
        << what << " array " << i;
  }
}

std::vector<std::vector<uint8_t>> Bytes(ShardBackend& b,
                                        const std::shared_ptr<const PublishedVersion>& v) {
  std::vector<std::vector<uint8_t>> out;
  auto host = b.host_bytes()(v);
  EXPECT_TRUE(host.ok()) << host.status();
  if (!host.ok()) return out;
  for (const PublishedPiece& p : (*host)->pieces) out.push_back(p.q.data);
  return out;
}

class GpuSnapshotTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (GetParam()) {
      unsetenv("PARAMD_GPU_SNAPSHOT_SPARE");
    } else {
      setenv("PARAMD_GPU_SNAPSHOT_SPARE", "0", 1);
    }
  }
  void TearDown() override { unsetenv("PARAMD_GPU_SNAPSHOT_SPARE"); }
};

TEST_P(GpuSnapshotTest, HoldsItsVersionWhileStepsGoOnAndRestoresToTheSameBytes) {
  std::unique_ptr<ShardBackend> a = Make(), b = Make(), c = Make(/*load=*/false), d = Make();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_NE(c, nullptr);
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(a->Step(0, false, kIdentity, true).ok());
  ASSERT_TRUE(b->Step(0, false, kIdentity, true).ok());
  std::shared_ptr<const PublishedVersion> at2;
  for (int64_t v = 1; v <= 2; ++v) {
    at2 = PushAndStep(*a, v);
    ASSERT_NE(PushAndStep(*b, v), nullptr);
  }
  ASSERT_NE(at2, nullptr);

  SnapshotOptions options;
  options.every_steps = 2;
  SnapshotKeeper keeper(options);
  keeper.SetModel(0, {"127.0.0.1:1"}, ShardLayoutHash(Tensors(), Shards()),
                  /*model_generation=*/1);
  keeper.AfterPublish(*a, *at2);
  const std::vector<std::vector<float>> want = State(*b);  // of version 2

  // Two more steps of a while the copy may still run.
  keeper.BeforeStep();
  std::shared_ptr<const PublishedVersion> a4;
  for (int64_t v = 3; v <= 4; ++v) {
    a4 = PushAndStep(*a, v);
    ASSERT_NE(PushAndStep(*b, v), nullptr);
  }
  keeper.BeforeChange();  // the copy is done
  std::shared_ptr<const DaemonSnapshot> snap = keeper.Find(0, 2, /*model_generation=*/1);
  ASSERT_NE(snap, nullptr);
  rpc::DaemonStats stats;
  keeper.FillStats(&stats);
  EXPECT_EQ(stats.snapshot_capture(), GetParam() ? "device spare" : "device direct");
  EXPECT_EQ(stats.snapshot_version(), 2);
  EXPECT_EQ(snap->header.optimizer_steps(), 2);
  std::vector<std::vector<float>> got;
  for (const auto& arrays : snap->arrays) {
    for (const auto& v : arrays) got.push_back(v);
  }
  ExpectSameBytes(got, want, "snapshot v2");
  ExpectSameBytes(State(*a), State(*b), "v4 after the snapshot");

  // A recovery: c takes the snapshot as a daemon does (its state sink,
  // straight into device memory), d through the host mirror; each
  // republishes 2 and is pushed 3, 4.
  for (ShardBackend* r : {c.get(), d.get()}) {
    ShardStateSink* sink = r == c.get() ? r->state_sink() : r->host_state();
    ASSERT_NE(sink, nullptr);
    auto delayed = RestoreSnapshot(*snap, *sink);
    ASSERT_TRUE(delayed.ok()) << delayed.status();
    ASSERT_TRUE(r->Step(2, false, kIdentity, /*update_delayed=*/false).ok());
    ASSERT_TRUE(ApplyDelayedStates(*delayed, *r->state_sink()).ok());
    std::shared_ptr<const PublishedVersion> r4;
    for (int64_t v = 3; v <= 4; ++v) r4 = PushAndStep(*r, v);
    ASSERT_NE(r4, nullptr);
  }
  ASSERT_NE(a4, nullptr);
  ExpectSameBytes(State(*c), State(*a), "restored (device) and pushed to v4");
  ExpectSameBytes(State(*d), State(*a), "restored (host mirror) and pushed to v4");
  // The published bytes too (FP8 delayed: the restored scaling state).
  auto pa = PushAndStep(*a, 5), pc = PushAndStep(*c, 5), pd = PushAndStep(*d, 5);
  ASSERT_NE(pa, nullptr);
  ASSERT_NE(pc, nullptr);
  ASSERT_NE(pd, nullptr);
  EXPECT_EQ(Bytes(*a, pa), Bytes(*c, pc));
  EXPECT_EQ(Bytes(*a, pa), Bytes(*d, pd));
}

INSTANTIATE_TEST_SUITE_P(Capture, GpuSnapshotTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("DeviceSpare")
                                             : std::string("LiveBuffers");
                         });

}  // namespace
}  // namespace paramd
