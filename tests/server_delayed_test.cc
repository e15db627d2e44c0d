// Multi-process: delayed scaling (FORMATS.md §1) over 10 steps on a tensor
// split across two daemon processes matches the single-process reference:
// every version's bytes, scale_inv, and the scale each daemon reports.
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "format/convert.h"
#include "gtest/gtest.h"
#include "kernels/format.h"
#include "server/step/reference_step.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

constexpr int64_t kRows = 520;
constexpr int64_t kCols = 200;
constexpr float kLr = 0.25f;

TEST(ServerDelayedTest, TenStepsMatchTheReference) {
  TestClusterOptions options;
  options.daemons = 2;
  options.expected_pushers = 1;
  options.optimizer = "sgd";
  options.lr = kLr;
  absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(options);
  ASSERT_TRUE(c.ok()) << c.status();
  RawCluster& cluster = **c;
  std::vector<float> w = RandomValues(kRows * kCols, 5);
  const std::string model = cluster.cluster().dir() + "/model.safetensors";
  ASSERT_TRUE(WriteModel(model, {{"w", {kRows, kCols}, w}}).ok());
  const std::string recipe = R"txt(
    default_spec {
      rowwise { format: FP8_DELAYED amax_history_len: 4 }
      columnwise { format: FP8_DELAYED amax_history_len: 3 amax_algo: MOST_RECENT margin: 1 }
    })txt";
  absl::StatusOr<int64_t> v0 = cluster.Load(model, recipe);
  ASSERT_TRUE(v0.ok()) << v0.status() << cluster.cluster().Logs();
  ASSERT_EQ(cluster.manifest().pieces_size(), 2) << "the weight is split across both daemons";
  const HybridSpec spec = cluster.spec("w");
  ReferenceTensorState state = InitialReferenceState(spec);

  for (int64_t v = 0; v <= 10; ++v) {
    SCOPED_TRACE(absl::StrCat("version ", v));
    if (v > 0) {
      // Gradient magnitudes rise then fall, so the amax history matters.
      const float size = v <= 5 ? 0.2f * v : 0.2f * (11 - v);
      const std::vector<float> g = RandomValues(w.size(), 1000 + v, size);
      ASSERT_TRUE(cluster.PushAll(v - 1, "trainer", {{"w", g}}).ok());
      ASSERT_TRUE(cluster.WaitForVersion(v).ok());
      for (size_t i = 0; i < w.size(); ++i) w[i] -= kLr * g[i];
    }
    const float row_scale = state.rowwise.scale;
    const float col_scale = state.columnwise.scale;
    absl::StatusOr<ref::HybridResult> want = ReferencePublish(w, kRows, kCols, spec, state);
    ASSERT_TRUE(want.ok()) << want.status();
    for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
      const QuantizedTensor& expected =
          d == Direction::kRowwise ? *want->rowwise : *want->columnwise;
      absl::StatusOr<QuantizedTensor> got = cluster.FetchAssembled(v, "w", d);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->scale_inv, expected.scale_inv) << DirectionName(d);
      EXPECT_EQ(got->data, expected.data) << DirectionName(d);
    }
    // Both daemons report the scale of this version's cast.
    for (int r = 0; r < 2; ++r) {
      absl::StatusOr<rpc::DaemonStats> stats = cluster.Stats(r, /*include_shards=*/true);
      ASSERT_TRUE(stats.ok()) << stats.status();
      ASSERT_EQ(stats->published_version(), v);
      ASSERT_EQ(stats->shards_size(), 1);
      for (const rpc::DirectionStats& ds : stats->shards(0).directions()) {
        EXPECT_EQ(ds.scale(), ds.direction() == rpc::DIRECTION_ROWWISE ? row_scale : col_scale)
            << "daemon " << r;
      }
    }
  }
  // The scale moved: delayed scaling did something.
  EXPECT_NE(state.rowwise.scale, 1.0f);
}

}  // namespace
}  // namespace testing
}  // namespace paramd
