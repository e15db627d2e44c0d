#include "server/step/shard_set.h"

#include <cmath>
#include <condition_variable>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/format.h"
#include "kernels/reference.h"
#include "server/step/reference_step.h"
#include "server/step/thread_all_reduce.h"
#include "sharding/assemble.h"

namespace paramd {
namespace {

std::vector<float> RandomValues(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

HybridSpec Spec(Format row, Format col, ColumnwiseSource source = ColumnwiseSource::kOriginal) {
  HybridSpec s;
  s.rowwise = DefaultQuantSpec(row);
  s.columnwise = DefaultQuantSpec(col);
  s.columnwise_source = source;
  return s;
}

struct TwoDaemons {
  std::unique_ptr<ShardSet> a, b;
  ThreadAllReduce reduce{2};

  TwoDaemons(const TensorDef& def, int64_t split, const OptimizerOptions& opt = {}) {
    a = *ShardSet::Create({def}, {{0, 0, split}}, opt);
    b = *ShardSet::Create({def}, {{0, split, def.rows}}, opt);
  }
  void SetMaster(const std::vector<float>& w) {
    auto ma = a->master(0);
    auto mb = b->master(0);
    std::copy(w.begin(), w.begin() + ma.size(), ma.begin());
    std::copy(w.begin() + ma.size(), w.end(), mb.begin());
  }
  void AddGradient(const std::vector<float>& g) {
    auto ga = a->gradient(0);
    auto gb = b->gradient(0);
    for (size_t i = 0; i < ga.size(); ++i) ga[i] += g[i];
    for (size_t i = 0; i < gb.size(); ++i) gb[i] += g[ga.size() + i];
  }
  std::pair<std::shared_ptr<const PublishedVersion>, std::shared_ptr<const PublishedVersion>> Step(
      int64_t version, bool optimizer) {
    absl::StatusOr<std::shared_ptr<const PublishedVersion>> ra, rb;
    std::thread t([&] { rb = b->Step(version, optimizer, reduce.Member()); });
    ra = a->Step(version, optimizer, reduce.Member());
    t.join();
    EXPECT_TRUE(ra.ok()) << ra.status();
    EXPECT_TRUE(rb.ok()) << rb.status();
    return {*ra, *rb};
  }
};

const PublishedPiece* FindPiece(const PublishedVersion& v, Direction d) {
  for (const PublishedPiece& p : v.pieces) {
    if (p.direction == d) return &p;
  }
  return nullptr;
}

void ExpectAssembledEqualsReference(const PublishedVersion& va, const PublishedVersion& vb,
                                    const HybridSpec& spec, const ref::HybridResult& whole) {
  for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
    const std::optional<QuantizedTensor>& expected =
        d == Direction::kRowwise ? whole.rowwise : whole.columnwise;
    const PublishedPiece* pa = FindPiece(va, d);
    const PublishedPiece* pb = FindPiece(vb, d);
    ASSERT_EQ(expected.has_value(), pa != nullptr);
    if (!expected) continue;
    ASSERT_NE(pb, nullptr);
    SCOPED_TRACE(DirectionName(d));
    EXPECT_EQ(pa->q.scale_inv, pb->q.scale_inv) << "one global scale";
    EXPECT_EQ(pa->q.amax, pb->q.amax) << "one global amax";
    const QuantSpec& qs = d == Direction::kRowwise ? spec.rowwise : spec.columnwise;
    absl::StatusOr<QuantizedTensor> assembled =
        sharding::Assemble(qs, std::vector<QuantizedTensor>{pa->q, pb->q});
    ASSERT_TRUE(assembled.ok()) << assembled.status();
    EXPECT_EQ(assembled->data, expected->data);
    EXPECT_EQ(assembled->scales, expected->scales);
    EXPECT_EQ(assembled->scale_inv, expected->scale_inv);
    if (NeedsGlobalAmax(qs.format)) {
      EXPECT_EQ(assembled->amax, expected->amax);
    }
  }
}

class SplitTensorTest : public ::testing::TestWithParam<std::tuple<Format, Format, bool>> {};

TEST_P(SplitTensorTest, PiecesAssembleToWholeTensorReference) {
  const auto [row, col, dequantized] = GetParam();
  const HybridSpec spec = Spec(
      row, col, dequantized ? ColumnwiseSource::kRowwiseDequantized : ColumnwiseSource::kOriginal);
  const TensorDef def{"w", 256, 96, spec};
  // Daemon B's half has the larger values: its amax is the global one.
  std::vector<float> w = RandomValues(def.rows * def.cols, 7);
  for (size_t i = w.size() / 2; i < w.size(); ++i) w[i] *= 3.0f;
  TwoDaemons d(def, 128);
  d.SetMaster(w);
  auto [va, vb] = d.Step(0, /*optimizer=*/false);
  ReferenceTensorState state = InitialReferenceState(spec);
  absl::StatusOr<ref::HybridResult> whole = ReferencePublish(w, def.rows, def.cols, spec, state);
  ASSERT_TRUE(whole.ok()) << whole.status();
  ExpectAssembledEqualsReference(*va, *vb, spec, *whole);
}

INSTANTIATE_TEST_SUITE_P(
    Formats, SplitTensorTest,
    ::testing::Values(std::make_tuple(Format::kFp8Current, Format::kFp8Current, false),
                      std::make_tuple(Format::kFp8Delayed, Format::kFp8Delayed, false),
                      std::make_tuple(Format::kMxfp8, Format::kMxfp8, false),
                      std::make_tuple(Format::kNvfp4, Format::kNvfp4, false),
                      std::make_tuple(Format::kFp8Block128x128, Format::kFp8Block128x128, false),
                      std::make_tuple(Format::kFp8Block1x128, Format::kFp8Block1x128, false),
                      std::make_tuple(Format::kIdentityBf16, Format::kIdentityFp32, false),
                      std::make_tuple(Format::kFp8Current, Format::kMxfp8, false),
                      // rowwise_dequantized: block-local rowwise (one all-reduce round) and
                      // global rowwise (a second round for the columnwise amax).
                      std::make_tuple(Format::kMxfp8, Format::kFp8Current, true),
                      std::make_tuple(Format::kFp8Delayed, Format::kNvfp4, true),
                      std::make_tuple(Format::kFp8Current, Format::kNvfp4, true),
                      std::make_tuple(Format::kNvfp4, Format::kFp8Current, true)));

TEST(ShardSetTest, DelayedScalingOverTenStepsMatchesReference) {
  HybridSpec spec = Spec(Format::kFp8Delayed, Format::kFp8Delayed);
  spec.rowwise.amax_history_len = 4;
  spec.columnwise.amax_history_len = 4;
  const TensorDef def{"w", 256, 64, spec};
  OptimizerOptions opt;
  opt.kind = OptimizerKind::kSgd;
  opt.lr = 0.5f;
  TwoDaemons d(def, 128, opt);
  std::vector<float> w = RandomValues(def.rows * def.cols, 11);
  d.SetMaster(w);
  ReferenceTensorState state = InitialReferenceState(spec);
  for (int64_t v = 0; v <= 10; ++v) {
    SCOPED_TRACE(v);
    std::vector<float> g;
    if (v > 0) {
      g = RandomValues(w.size(), 100 + v, 0.5f * v);
      d.AddGradient(g);
      for (size_t i = 0; i < w.size(); ++i) w[i] -= opt.lr * g[i];  // SGD, exact
    }
    auto [va, vb] = d.Step(v, /*optimizer=*/v > 0);
    absl::StatusOr<ref::HybridResult> whole = ReferencePublish(w, def.rows, def.cols, spec, state);
    ASSERT_TRUE(whole.ok());
    ExpectAssembledEqualsReference(*va, *vb, spec, *whole);
    EXPECT_EQ(d.a->delayed_state(0, Direction::kRowwise).scale, state.rowwise.scale);
    EXPECT_EQ(d.b->delayed_state(0, Direction::kColumnwise).amax_history,
              state.columnwise.amax_history);
  }
  EXPECT_EQ(d.a->optimizer_steps(), 10);
}

TEST(ShardSetTest, FailedAllReduceChangesNothing) {
  const TensorDef def{"w", 128, 32, Spec(Format::kFp8Current, Format::kFp8Current)};
  OptimizerOptions opt;
  opt.kind = OptimizerKind::kSgd;
  auto set = *ShardSet::Create({def}, {{0, 0, 128}}, opt);
  const std::vector<float> w = RandomValues(128 * 32, 3);
  std::copy(w.begin(), w.end(), set->master(0).begin());
  set->gradient(0)[5] = 1.0f;
  absl::StatusOr<std::shared_ptr<const PublishedVersion>> r =
      set->Step(1, true, [](absl::Span<float>) { return absl::UnavailableError("peer gone"); });
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(std::equal(w.begin(), w.end(), set->master(0).begin()));
  EXPECT_EQ(set->gradient(0)[5], 1.0f);
  EXPECT_EQ(set->optimizer_steps(), 0);
  // A retry succeeds and consumes the gradient once.
  r = set->Step(1, true, [](absl::Span<float>) { return absl::OkStatus(); });
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(set->gradient(0)[5], 0.0f);
  EXPECT_EQ(set->master(0)[5], w[5] - opt.lr * 1.0f);
}

TEST(ShardSetTest, AsStateSinkRefusesWrongSizesAndKeepsUnsetCounts) {
  const TensorDef def{"w", 128, 32, Spec(Format::kFp8Current, Format::kFp8Current)};
  auto set = *ShardSet::Create({def}, {{0, 0, 128}}, OptimizerOptions());
  ShardStateSink& sink = *set;
  const std::vector<float> w = RandomValues(128 * 32, 4);
  ASSERT_TRUE(sink.RestoreMaster(0, w).ok());
  EXPECT_TRUE(std::equal(w.begin(), w.end(), set->master(0).begin()));
  // A master of another size, or of a shard not here: refused, nothing written.
  const std::vector<float> short_master(100, 7.0f);
  EXPECT_EQ(sink.RestoreMaster(0, short_master).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sink.RestoreMaster(1, w).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(std::equal(w.begin(), w.end(), set->master(0).begin()));
  // Moments: empty (none saved) or of the shard's size.
  ASSERT_TRUE(sink.RestoreOptimizerState(0, w, w).ok());
  EXPECT_EQ(set->optimizer_state(0).m, w);
  EXPECT_EQ(set->optimizer_state(0).v, w);
  ASSERT_TRUE(sink.RestoreOptimizerState(0, {}, {}).ok());
  EXPECT_TRUE(set->optimizer_state(0).m.empty());
  EXPECT_FALSE(sink.RestoreOptimizerState(0, short_master, {}).ok());
  EXPECT_EQ(sink.RestoreOptimizerState(1, {}, {}).code(), absl::StatusCode::kInvalidArgument);
  // A negative count leaves that count as it is.
  ASSERT_TRUE(sink.RestoreStepCounts(12, 3).ok());
  ASSERT_TRUE(sink.RestoreStepCounts(-1, 5).ok());
  EXPECT_EQ(set->optimizer_steps(), 12);
  EXPECT_EQ(set->skipped_steps(), 5);
  ASSERT_TRUE(sink.RestoreStepCounts(14, -1).ok());
  EXPECT_EQ(set->optimizer_steps(), 14);
  EXPECT_EQ(set->skipped_steps(), 5);
}

TEST(ShardSetTest, AllReduceCallsDependOnTheManifestOnly) {
  // A daemon holding no piece of a current-scaling tensor still takes part
  // in the all-reduce (with a zero contribution).
  const TensorDef def{"w", 128, 32, Spec(Format::kFp8Current, Format::kIdentityBf16)};
  auto empty = *ShardSet::Create({def}, {}, OptimizerOptions());
  int calls = 0;
  auto r = empty->Step(0, false, [&](absl::Span<float> v) {
    ++calls;
    EXPECT_EQ(v.size(), 2u);
    return absl::OkStatus();
  });
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE((*r)->pieces.empty());
}

TEST(ShardSetTest, RefusesBadShards) {
  const TensorDef def{"w", 128, 32, HybridSpec()};
  EXPECT_FALSE(ShardSet::Create({def}, {{0, 0, 129}}, OptimizerOptions()).ok());
  EXPECT_FALSE(ShardSet::Create({def}, {{0, 0, 64}, {0, 32, 128}}, OptimizerOptions()).ok());
  EXPECT_FALSE(ShardSet::Create({def}, {{1, 0, 64}}, OptimizerOptions()).ok());
}

}  // namespace
}  // namespace paramd
