#include "server/step/step_pipeline.h"

#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/format.h"
#include "server/step/optimizer_test_model.h"
#include "server/step/shard_set.h"
#include "server/step/thread_all_reduce.h"

namespace paramd {
namespace {

using testing::OptimizerTestLayout;
using testing::OptimizerTestModel;
using testing::RandomGradient;

HybridSpec Spec(Format row, Format col, bool dequantized) {
  HybridSpec s;
  s.rowwise = DefaultQuantSpec(row);
  s.columnwise = DefaultQuantSpec(col);
  s.columnwise_source =
      dequantized ? ColumnwiseSource::kRowwiseDequantized : ColumnwiseSource::kOriginal;
  return s;
}

// Two clusters of the same model and layout: `reference` steps with
// ShardSet::Step, `pipelined` with RunPipelinedStep.
struct Clusters {
  std::vector<TensorDef> tensors;
  std::vector<std::vector<ShardDef>> layout;
  std::vector<std::unique_ptr<ShardSet>> reference, pipelined;
  std::unique_ptr<ThreadAllReduce> reference_reduce, pipelined_reduce;

  Clusters(std::vector<TensorDef> t, std::vector<std::vector<ShardDef>> l,
           const OptimizerOptions& opt)
      : tensors(std::move(t)), layout(std::move(l)) {
    for (const auto& shards : layout) {
      reference.push_back(*ShardSet::Create(tensors, shards, opt));
      pipelined.push_back(*ShardSet::Create(tensors, shards, opt));
    }
    reference_reduce = std::make_unique<ThreadAllReduce>(static_cast<int>(layout.size()));
    pipelined_reduce = std::make_unique<ThreadAllReduce>(static_cast<int>(layout.size()));
  }
  int daemons() const { return static_cast<int>(layout.size()); }

  // Whole-tensor values `per_tensor[t]` into every daemon's shards, through
  // `span_of(set, shard)` (master or gradient).
  static void Scatter(std::vector<std::unique_ptr<ShardSet>>& sets,
                      const std::vector<std::vector<float>>& per_tensor,
                      const std::function<absl::Span<float>(ShardSet&, int)>& span_of) {
    for (auto& s : sets) {
      for (size_t i = 0; i < s->shards().size(); ++i) {
        const ShardDef& d = s->shards()[i];
        const int64_t cols = s->tensors()[d.tensor].cols;
        absl::Span<float> dst = span_of(*s, static_cast<int>(i));
        for (size_t k = 0; k < dst.size(); ++k) {
          dst[k] += per_tensor[d.tensor][d.row_begin * cols + k];
        }
      }
    }
  }

  std::vector<std::vector<float>> Random(uint32_t seed, float scale) const {
    std::vector<std::vector<float>> v;
    for (const TensorDef& t : tensors) v.push_back(RandomGradient(t.rows * t.cols, seed++, scale));
    return v;
  }
};

using StepResult = absl::StatusOr<std::shared_ptr<const PublishedVersion>>;

// Runs `step(d)` on one thread per daemon.
std::vector<StepResult> OnEveryDaemon(int n, const std::function<StepResult(int)>& step) {
  std::vector<StepResult> results(n);
  std::vector<std::thread> threads;
  for (int d = 0; d < n; ++d) threads.emplace_back([&, d] { results[d] = step(d); });
  for (auto& t : threads) t.join();
  return results;
}

void ExpectSameVersion(const PublishedVersion& a, const PublishedVersion& b) {
  EXPECT_EQ(a.version, b.version);
  ASSERT_EQ(a.pieces.size(), b.pieces.size());
  for (size_t k = 0; k < a.pieces.size(); ++k) {
    const PublishedPiece& p = a.pieces[k];
    const PublishedPiece& q = b.pieces[k];
    SCOPED_TRACE(::testing::Message() << "piece " << k << " tensor " << p.tensor);
    EXPECT_EQ(p.shard, q.shard);
    EXPECT_EQ(p.tensor, q.tensor);
    EXPECT_EQ(p.row_begin, q.row_begin);
    EXPECT_EQ(p.direction, q.direction);
    EXPECT_EQ(p.q.format, q.q.format);
    EXPECT_EQ(p.q.data, q.q.data);
    EXPECT_EQ(p.q.scales, q.q.scales);
    EXPECT_EQ(std::memcmp(&p.q.scale_inv, &q.q.scale_inv, sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(&p.q.amax, &q.q.amax, sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(&p.scale, &q.scale, sizeof(float)), 0);
    EXPECT_EQ(p.layout.data_rows, q.layout.data_rows);
    EXPECT_EQ(p.layout.scale_cols, q.layout.scale_cols);
  }
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t t = 0; t < a.tensors.size(); ++t) {
    EXPECT_EQ(a.tensors[t].held, b.tensors[t].held);
    EXPECT_EQ(a.tensors[t].rowwise_scale, b.tensors[t].rowwise_scale);
    EXPECT_EQ(a.tensors[t].rowwise_amax, b.tensors[t].rowwise_amax);
    EXPECT_EQ(a.tensors[t].columnwise_scale, b.tensors[t].columnwise_scale);
    EXPECT_EQ(a.tensors[t].columnwise_amax, b.tensors[t].columnwise_amax);
  }
  EXPECT_EQ(a.report.optimizer_steps, b.report.optimizer_steps);
  EXPECT_EQ(a.report.skipped_steps, b.report.skipped_steps);
  EXPECT_EQ(a.report.grad_norm, b.report.grad_norm);
  EXPECT_EQ(a.report.clip_factor, b.report.clip_factor);
  EXPECT_EQ(a.report.lr, b.report.lr);
}

void ExpectSameState(const ShardSet& a, const ShardSet& b) {
  for (size_t i = 0; i < a.shards().size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "shard " << i);
    EXPECT_TRUE(std::equal(a.master(i).begin(), a.master(i).end(), b.master(i).begin()));
    EXPECT_EQ(a.optimizer_state(i).m, b.optimizer_state(i).m);
    EXPECT_EQ(a.optimizer_state(i).v, b.optimizer_state(i).v);
  }
  EXPECT_EQ(a.optimizer_steps(), b.optimizer_steps());
  EXPECT_EQ(a.skipped_steps(), b.skipped_steps());
}

// Publishes version 0, then `steps` optimizer steps with random gradients,
// on both clusters; `hand_over`: the pipelined cluster's gradients come
// through await_bucket instead of its accumulators.
void RunAndCompare(Clusters& c, int steps, int64_t bucket_elements, bool hand_over) {
  const auto weights = c.Random(11, 1.0f);
  auto master = [](ShardSet& s, int i) { return s.master(i); };
  auto gradient = [](ShardSet& s, int i) { return s.gradient(i); };
  Clusters::Scatter(c.reference, weights, master);
  Clusters::Scatter(c.pipelined, weights, master);
  std::vector<std::vector<StepBucket>> buckets;
  for (auto& s : c.pipelined) buckets.push_back(PlanStepBuckets(*s, bucket_elements));
  for (int v = 0; v <= steps; ++v) {
    SCOPED_TRACE(::testing::Message() << "version " << v);
    const bool optimizer = v > 0;
    std::vector<std::vector<float>> grads;
    if (optimizer) {
      grads = c.Random(100 + 10 * v, 0.1f);
      Clusters::Scatter(c.reference, grads, gradient);
      if (!hand_over) Clusters::Scatter(c.pipelined, grads, gradient);
    }
    std::vector<StepResult> ref = OnEveryDaemon(c.daemons(), [&](int d) {
      return c.reference[d]->Step(v, optimizer, c.reference_reduce->Member());
    });
    std::vector<StepResult> got = OnEveryDaemon(c.daemons(), [&](int d) {
      ShardSet& s = *c.pipelined[d];
      PipelinedStepHooks hooks;
      if (hand_over && optimizer) {
        hooks.await_bucket = [&](const StepBucket& b, BucketGradients* out) {
          for (int i : b.shards) {
            const ShardDef& sd = s.shards()[i];
            const int64_t cols = s.tensors()[sd.tensor].cols;
            const auto& g = grads[sd.tensor];
            out->emplace_back(g.begin() + sd.row_begin * cols, g.begin() + sd.row_end * cols);
          }
          return absl::OkStatus();
        };
      }
      return RunPipelinedStep(s, v, optimizer, c.pipelined_reduce->Member(), true, buckets[d],
                              hooks, nullptr);
    });
    for (int d = 0; d < c.daemons(); ++d) {
      SCOPED_TRACE(::testing::Message() << "daemon " << d);
      ASSERT_TRUE(ref[d].ok()) << ref[d].status();
      ASSERT_TRUE(got[d].ok()) << got[d].status();
      ExpectSameVersion(**ref[d], **got[d]);
      ExpectSameState(*c.reference[d], *c.pipelined[d]);
      for (size_t i = 0; i < c.pipelined[d]->shards().size(); ++i) {
        for (float g : c.pipelined[d]->gradient(i)) ASSERT_EQ(g, 0.0f);
      }
    }
  }
}

// Every format pair and both columnwise sources, 1 and 3 daemons, one
// bucket per tensor and one bucket for all: bytes and state equal Step's.
using FormatPair = std::tuple<Format, Format, bool>;
class PipelineFormatsTest : public ::testing::TestWithParam<std::tuple<FormatPair, int, int64_t>> {
};

TEST_P(PipelineFormatsTest, BytesEqualTheWholeVersionStep) {
  const auto [formats, daemons, bucket] = GetParam();
  const auto [row, col, dequantized] = formats;
  OptimizerOptions opt;
  opt.lr = 1e-2f;
  Clusters c(OptimizerTestModel(Spec(row, col, dequantized)), OptimizerTestLayout(daemons), opt);
  RunAndCompare(c, 3, bucket, /*hand_over=*/false);
}

INSTANTIATE_TEST_SUITE_P(
    Formats, PipelineFormatsTest,
    ::testing::Combine(
        ::testing::Values(FormatPair{Format::kFp8Current, Format::kFp8Current, false},
                          FormatPair{Format::kFp8Delayed, Format::kFp8Delayed, false},
                          FormatPair{Format::kMxfp8, Format::kMxfp8, false},
                          FormatPair{Format::kNvfp4, Format::kNvfp4, false},
                          FormatPair{Format::kFp8Block128x128, Format::kFp8Block128x128, false},
                          FormatPair{Format::kFp8Block1x128, Format::kFp8Block1x128, false},
                          FormatPair{Format::kIdentityBf16, Format::kIdentityFp32, false},
                          FormatPair{Format::kFp8Current, Format::kMxfp8, false},
                          // rowwise_dequantized: one round, and a second
                          // round for the columnwise amax.
                          FormatPair{Format::kMxfp8, Format::kFp8Current, true},
                          FormatPair{Format::kFp8Delayed, Format::kNvfp4, true},
                          FormatPair{Format::kFp8Current, Format::kNvfp4, true},
                          FormatPair{Format::kNvfp4, Format::kFp8Current, true}),
        // 1 or 3 daemons; one bucket per tensor, or one for everything.
        ::testing::Values(1, 3), ::testing::Values(int64_t{0}, int64_t{1} << 30)));

TEST(PipelineTest, HandedOverGradientsEqualAccumulated) {
  OptimizerOptions opt;
  Clusters c(OptimizerTestModel(Spec(Format::kFp8Current, Format::kMxfp8, false)),
             OptimizerTestLayout(3), opt);
  RunAndCompare(c, 2, 0, /*hand_over=*/true);
}

TEST(PipelineTest, ClippingWaitsForTheNormAndEqualsStep) {
  for (bool hand_over : {false, true}) {
    SCOPED_TRACE(hand_over ? "handed over" : "accumulated");
    OptimizerOptions opt;
    opt.max_grad_norm = 0.5f;  // the random gradients' norm is larger: clipped
    Clusters c(OptimizerTestModel(Spec(Format::kFp8Current, Format::kFp8Current, false)),
               OptimizerTestLayout(3), opt);
    RunAndCompare(c, 2, 0, hand_over);
    EXPECT_LT(c.pipelined[0]->optimizer_steps(), 3);
  }
}

TEST(PipelineTest, ClippingAwaitsEveryBucketBeforeAnyIsReady) {
  OptimizerOptions opt;
  opt.max_grad_norm = 1.0f;
  std::vector<TensorDef> tensors =
      OptimizerTestModel(Spec(Format::kFp8Current, Format::kMxfp8, false));
  std::unique_ptr<ShardSet> s = *ShardSet::Create(tensors, OptimizerTestLayout(1)[0], opt);
  const auto buckets = PlanStepBuckets(*s, 0);
  ASSERT_EQ(buckets.size(), tensors.size());
  std::vector<std::string> events;
  PipelinedStepHooks hooks;
  hooks.await_bucket = [&](const StepBucket& b, BucketGradients*) {
    events.push_back(absl::StrCat("await ", b.tensor_begin));
    return absl::OkStatus();
  };
  hooks.on_bucket_ready = [&](int b) { events.push_back(absl::StrCat("ready ", b)); };
  auto identity = [](absl::Span<float>) { return absl::OkStatus(); };
  ASSERT_TRUE(RunPipelinedStep(*s, 1, true, identity, true, buckets, hooks, nullptr).ok());
  EXPECT_EQ(events, (std::vector<std::string>{"await 0", "await 1", "await 2", "await 3", "ready 0",
                                              "ready 1", "ready 2", "ready 3"}));
  // Without clipping each bucket is ready before the next is awaited.
  OptimizerOptions plain;
  s = *ShardSet::Create(tensors, OptimizerTestLayout(1)[0], plain);
  events.clear();
  ASSERT_TRUE(RunPipelinedStep(*s, 1, true, identity, true, buckets, hooks, nullptr).ok());
  EXPECT_EQ(events, (std::vector<std::string>{"await 0", "ready 0", "await 1", "ready 1", "await 2",
                                              "ready 2", "await 3", "ready 3"}));
}

TEST(PipelineTest, BucketsFollowTheManifest) {
  std::vector<TensorDef> tensors =
      OptimizerTestModel(Spec(Format::kFp8Current, Format::kMxfp8, false));
  // 384x40 = 15360, 1x40, 256x300 = 76800, 130x8 = 1040.
  std::unique_ptr<ShardSet> s = *ShardSet::Create(tensors, OptimizerTestLayout(3)[1], {});
  std::vector<StepBucket> b = PlanStepBuckets(*s, 20000);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0].tensor_begin, 0);
  EXPECT_EQ(b[0].tensor_end, 2);
  EXPECT_EQ(b[1].tensor_begin, 2);
  EXPECT_EQ(b[1].tensor_end, 3);
  EXPECT_EQ(b[2].tensor_end, 4);
  // Daemon 1 holds rows 128..256 of tensor 0 and rows 0..128 of tensor 2.
  EXPECT_EQ(b[0].shards, std::vector<int>({0}));
  EXPECT_EQ(b[1].shards, std::vector<int>({1}));
  EXPECT_TRUE(b[2].shards.empty());
  EXPECT_EQ(b[0].piece_begin, 0);
  EXPECT_EQ(b[0].piece_end, 2);
  EXPECT_EQ(b[1].piece_end, 4);
  EXPECT_EQ(b[2].piece_end, 4);
}

// Daemon `failing` fails its await of bucket `at` (or, at -1, its
// before_commit): every daemon leaves at the same all-reduce, only the
// buckets before were ready, and nothing is committed anywhere (the next
// steps equal a cluster that never saw the failure).
void AbandonAndRecover(int failing, int at) {
  OptimizerOptions opt;
  Clusters c(OptimizerTestModel(Spec(Format::kFp8Current, Format::kNvfp4, true)),
             OptimizerTestLayout(3), opt);
  auto master = [](ShardSet& s, int i) { return s.master(i); };
  auto gradient = [](ShardSet& s, int i) { return s.gradient(i); };
  Clusters::Scatter(c.reference, c.Random(1, 1.0f), master);
  Clusters::Scatter(c.pipelined, c.Random(1, 1.0f), master);
  for (int d = 0; d < 3; ++d) {
    ASSERT_TRUE(
        c.pipelined[d]->Step(0, false, [](absl::Span<float>) { return absl::OkStatus(); }).ok());
    ASSERT_TRUE(
        c.reference[d]->Step(0, false, [](absl::Span<float>) { return absl::OkStatus(); }).ok());
  }
  const auto grads = c.Random(50, 0.1f);
  Clusters::Scatter(c.reference, grads, gradient);
  Clusters::Scatter(c.pipelined, grads, gradient);
  std::vector<std::vector<int>> ready(3);
  std::vector<StepResult> failed = OnEveryDaemon(3, [&](int d) {
    ShardSet& s = *c.pipelined[d];
    PipelinedStepHooks hooks;
    hooks.await_bucket = [&, d](const StepBucket& b, BucketGradients*) {
      if (d == failing && b.tensor_begin == at) return absl::CancelledError("push failed");
      return absl::OkStatus();
    };
    hooks.on_bucket_ready = [&, d](int b) { ready[d].push_back(b); };
    hooks.before_commit = [&, d]() {
      return d == failing && at < 0 ? absl::CancelledError("push failed") : absl::OkStatus();
    };
    return RunPipelinedStep(s, 1, true, c.pipelined_reduce->Member(), true, PlanStepBuckets(s, 0),
                            hooks, nullptr);
  });
  const int buckets_ready = at < 0 ? 4 : at;
  for (int d = 0; d < 3; ++d) {
    SCOPED_TRACE(::testing::Message() << "daemon " << d);
    ASSERT_FALSE(failed[d].ok());
    if (d == failing) {
      EXPECT_TRUE(absl::IsCancelled(failed[d].status())) << failed[d].status();
    } else {
      EXPECT_TRUE(absl::IsAborted(failed[d].status())) << failed[d].status();
      EXPECT_TRUE(IsStepAbandoned(failed[d].status()));
    }
    EXPECT_EQ(ready[d].size(), static_cast<size_t>(buckets_ready));
    EXPECT_EQ(c.pipelined[d]->optimizer_steps(), 0);
  }
  // Retried (the same gradients are still accumulated): equal to Step.
  std::vector<StepResult> ref = OnEveryDaemon(
      3, [&](int d) { return c.reference[d]->Step(1, true, c.reference_reduce->Member()); });
  std::vector<StepResult> got = OnEveryDaemon(3, [&](int d) {
    return RunPipelinedStep(*c.pipelined[d], 1, true, c.pipelined_reduce->Member(), true,
                            PlanStepBuckets(*c.pipelined[d], 0), {}, nullptr);
  });
  for (int d = 0; d < 3; ++d) {
    ASSERT_TRUE(ref[d].ok() && got[d].ok());
    ExpectSameVersion(**ref[d], **got[d]);
    ExpectSameState(*c.reference[d], *c.pipelined[d]);
  }
}

TEST(PipelineTest, AFailedAwaitAbandonsTheStepOnEveryDaemon) {
  AbandonAndRecover(/*failing=*/2, /*at=*/2);
  AbandonAndRecover(/*failing=*/0, /*at=*/0);
}

TEST(PipelineTest, AFailedBeforeCommitAbandonsTheStepOnEveryDaemon) {
  AbandonAndRecover(/*failing=*/1, /*at=*/-1);
}

// An abandon before the step's first all-reduce leaves at once: the other
// daemons wait in that all-reduce, and the next attempt lines up with them.
TEST(PipelineTest, AnEarlyAbandonLeavesWithoutAnAllReduce) {
  OptimizerOptions opt;
  Clusters c(OptimizerTestModel(Spec(Format::kFp8Current, Format::kMxfp8, false)),
             OptimizerTestLayout(3), opt);
  RunAndCompare(c, 1, 0, /*hand_over=*/false);  // both clusters at version 1
  const auto grads = c.Random(70, 0.1f);
  auto gradient = [](ShardSet& s, int i) { return s.gradient(i); };
  Clusters::Scatter(c.reference, grads, gradient);
  Clusters::Scatter(c.pipelined, grads, gradient);
  std::vector<StepResult> ref = OnEveryDaemon(
      3, [&](int d) { return c.reference[d]->Step(2, true, c.reference_reduce->Member()); });
  int left = 0;
  std::vector<StepResult> got = OnEveryDaemon(3, [&](int d) {
    ShardSet& s = *c.pipelined[d];
    PipelinedStepHooks hooks;
    bool first = true;
    hooks.await_bucket = [&](const StepBucket& b, BucketGradients*) {
      if (d == 1 && b.tensor_begin == 0 && first) {
        first = false;
        return StepAbandonedError("not yet");
      }
      return absl::OkStatus();
    };
    StepResult r = RunPipelinedStep(s, 2, true, c.pipelined_reduce->Member(), true,
                                    PlanStepBuckets(s, 0), hooks, nullptr);
    if (d == 1) {
      EXPECT_TRUE(IsStepAbandoned(r.status())) << r.status();
      ++left;
      r = RunPipelinedStep(s, 2, true, c.pipelined_reduce->Member(), true, PlanStepBuckets(s, 0),
                           hooks, nullptr);
    }
    return r;
  });
  EXPECT_EQ(left, 1);
  for (int d = 0; d < 3; ++d) {
    ASSERT_TRUE(ref[d].ok() && got[d].ok()) << got[d].status();
    ExpectSameVersion(**ref[d], **got[d]);
    ExpectSameState(*c.reference[d], *c.pipelined[d]);
  }
}

TEST(PipelineTest, AFailedAllReduceCommitsNothing) {
  OptimizerOptions opt;
  std::vector<TensorDef> tensors =
      OptimizerTestModel(Spec(Format::kFp8Delayed, Format::kFp8Current, false));
  std::unique_ptr<ShardSet> s = *ShardSet::Create(tensors, OptimizerTestLayout(1)[0], opt);
  std::unique_ptr<ShardSet> fresh = *ShardSet::Create(tensors, OptimizerTestLayout(1)[0], opt);
  auto identity = [](absl::Span<float>) { return absl::OkStatus(); };
  ASSERT_TRUE(s->Step(0, false, identity).ok());
  ASSERT_TRUE(fresh->Step(0, false, identity).ok());
  for (size_t i = 0; i < s->shards().size(); ++i) {
    for (float& g : s->gradient(i)) g = 0.25f;
    for (float& g : fresh->gradient(i)) g = 0.25f;
  }
  int calls = 0;
  auto fails_third = [&](absl::Span<float>) {
    return ++calls == 3 ? absl::UnavailableError("peer gone") : absl::OkStatus();
  };
  std::vector<int> ready;
  PipelinedStepHooks hooks;
  hooks.on_bucket_ready = [&](int b) { ready.push_back(b); };
  StepResult r =
      RunPipelinedStep(*s, 1, true, fails_third, true, PlanStepBuckets(*s, 0), hooks, nullptr);
  ASSERT_TRUE(absl::IsAborted(r.status())) << r.status();
  EXPECT_FALSE(IsStepAbandoned(r.status()));
  EXPECT_EQ(ready, std::vector<int>({0, 1}));
  ExpectSameState(*s, *fresh);
  EXPECT_EQ(s->delayed_state(0, Direction::kRowwise).amax_history,
            fresh->delayed_state(0, Direction::kRowwise).amax_history);
  StepResult a = s->Step(1, true, identity);
  StepResult b = fresh->Step(1, true, identity);
  ASSERT_TRUE(a.ok() && b.ok());
  ExpectSameVersion(**a, **b);
}

}  // namespace
}  // namespace paramd
