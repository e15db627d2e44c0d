// GPU only (tag gpu). The gpu backend's pipelined step
// (ShardBackend::StepPipelined, server/gpu_backend/pipelined_step.h) ==
// its whole step == the cpu backend's whole step, bit for bit: published
// bytes, scales, amaxes and reports of every version, and at the end the
// masters and both AdamW moments, for several format pairs (per-tensor FP8
// current and delayed, MXFP8, NVFP4, FP8 blocks, rowwise_dequantized with
// the second all-reduce round), AdamW and SGD, with and without clipping,
// one bucket per tensor and several tensors per bucket, 1 daemon (no
// all-reduce at all) and 3 daemons on the one GPU (host all-reduce bridge,
// threads). Then the abandon rules: an attempt left by one daemon after
// some buckets were stepped (await, check_bucket, before_commit) changes
// nothing on any daemon and announces only buckets that passed their check;
// the attempt run again equals the reference.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "server/backend/shard_backend.h"
#include "server/gpu_backend/daemon_backend.h"
#include "server/step/optimizer_test_model.h"
#include "server/step/step_pipeline.h"
#include "server/step/thread_all_reduce.h"

namespace paramd {
namespace {

using testing::OptimizerTestLayout;
using testing::OptimizerTestModel;
using testing::RandomGradient;
using StepResult = absl::StatusOr<std::shared_ptr<const PublishedVersion>>;
using Grads = std::vector<std::vector<std::vector<float>>>;  // [pusher][tensor]

HybridSpec Spec(Format row, Format col, bool dequantized) {
  HybridSpec s;
  s.rowwise = DefaultQuantSpec(row);
  s.columnwise = DefaultQuantSpec(col);
  s.columnwise_source =
      dequantized ? ColumnwiseSource::kRowwiseDequantized : ColumnwiseSource::kOriginal;
  return s;
}

std::vector<StepResult> OnEveryDaemon(int n, const std::function<StepResult(int)>& step) {
  std::vector<StepResult> results(n);
  std::vector<std::thread> threads;
  for (int d = 0; d < n; ++d) threads.emplace_back([&, d] { results[d] = step(d); });
  for (auto& t : threads) t.join();
  return results;
}

// One world of `n` daemons of `kind`, masters loaded with the same weights.
struct World {
  std::vector<std::unique_ptr<ShardBackend>> daemons;
  std::unique_ptr<ThreadAllReduce> reduce;
  World(DaemonBackend kind, const std::vector<TensorDef>& model, int n, const OptimizerOptions& o) {
    reduce = std::make_unique<ThreadAllReduce>(n);
    ShardBackendOptions options;
    options.optimizer = o;
    for (const auto& shards : OptimizerTestLayout(n)) {
      absl::StatusOr<std::unique_ptr<ShardBackend>> b =
          CreateShardBackend(kind, model, shards, options);
      EXPECT_TRUE(b.ok()) << b.status();
      if (!b.ok()) return;
      daemons.push_back(*std::move(b));
      ShardBackend& d = *daemons.back();
      // One daemon: no data plane, so the gpu backend reduces nothing.
      if (n == 1) d.set_data_plane(nullptr, absl::Seconds(30));
      for (size_t i = 0; i < d.shards().size(); ++i) {
        const ShardDef& s = d.shards()[i];
        const std::vector<float> w =
            RandomGradient(model[s.tensor].rows * model[s.tensor].cols, 1 + s.tensor, 0.5f);
        std::memcpy(d.load_master(i).data(), w.data() + s.row_begin * model[s.tensor].cols,
                    d.load_master(i).size() * 4);
      }
    }
  }
  int n() const { return static_cast<int>(daemons.size()); }

  // Every pusher's rows added into the accumulators (the whole step's way).
  void Push(const Grads& pushes) {
    for (size_t p = 0; p < pushes.size(); ++p) {
      for (auto& d : daemons) {
        for (size_t i = 0; i < d->shards().size(); ++i) {
          const ShardDef& s = d->shards()[i];
          const int64_t cols = d->tensors()[s.tensor].cols;
          ASSERT_TRUE(d->AccumulateGradient(
                           static_cast<int>(i), 0,
                           absl::MakeConstSpan(pushes[p][s.tensor].data() + s.row_begin * cols,
                                               s.rows() * cols),
                           p + 1 == pushes.size())
                          .ok());
        }
      }
    }
  }

  // The versions with their bytes (the gpu backend's host copies).
  static std::vector<std::shared_ptr<const PublishedVersion>> WithBytes(
      World& w, const std::vector<StepResult>& r) {
    std::vector<std::shared_ptr<const PublishedVersion>> out;
    for (size_t d = 0; d < r.size(); ++d) {
      EXPECT_TRUE(r[d].ok()) << "daemon " << d << ": " << r[d].status();
      if (!r[d].ok()) return {};
      HostBytesFn bytes = w.daemons[d]->host_bytes();
      if (bytes == nullptr) {
        out.push_back(*r[d]);
        continue;
      }
      StepResult full = bytes(*r[d]);
      EXPECT_TRUE(full.ok()) << full.status();
      if (!full.ok()) return {};
      out.push_back(*full);
    }
    return out;
  }

  std::vector<std::shared_ptr<const PublishedVersion>> Step(int64_t version, bool optimizer) {
    std::vector<StepResult> r = OnEveryDaemon(
        n(), [&](int d) { return daemons[d]->Step(version, optimizer, reduce->Member(), true); });
    return WithBytes(*this, r);
  }
};

// The bucket's gradient per shard: the pushers' rows summed in push order
// from 0 (what PushPipeline hands over; the same FP32 adds as the
// accumulators').
BucketGradients SumOf(const ShardBackend& d, const StepBucket& b, const Grads& pushes) {
  BucketGradients g;
  for (int i : b.shards) {
    const ShardDef& s = d.shards()[i];
    const int64_t cols = d.tensors()[s.tensor].cols;
    std::vector<float> sum(s.rows() * cols, 0.0f);
    for (const auto& p : pushes) {
      const float* v = p[s.tensor].data() + s.row_begin * cols;
      for (size_t k = 0; k < sum.size(); ++k) sum[k] += v[k];
    }
    g.push_back(std::move(sum));
  }
  return g;
}

void ExpectSamePieces(const PublishedVersion& c, const PublishedVersion& g) {
  ASSERT_EQ(c.pieces.size(), g.pieces.size());
  for (size_t k = 0; k < c.pieces.size(); ++k) {
    const PublishedPiece& a = c.pieces[k];
    const PublishedPiece& b = g.pieces[k];
    SCOPED_TRACE(::testing::Message() << "piece " << k << " (shard " << a.shard << ")");
    EXPECT_EQ(a.shard, b.shard);
    EXPECT_EQ(a.tensor, b.tensor);
    EXPECT_EQ(a.direction, b.direction);
    EXPECT_TRUE(a.q.data == b.q.data);
    EXPECT_TRUE(a.q.scales == b.q.scales);
    EXPECT_EQ(std::memcmp(&a.q.scale_inv, &b.q.scale_inv, 4), 0);
    EXPECT_EQ(std::memcmp(&a.q.amax, &b.q.amax, 4), 0);
    EXPECT_EQ(std::memcmp(&a.scale, &b.scale, 4), 0);
  }
}

bool SameDouble(double a, double b) {
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 8) == 0;
}

void ExpectSameReport(const StepReport& a, const StepReport& b) {
  EXPECT_TRUE(SameDouble(a.grad_norm, b.grad_norm)) << a.grad_norm << " vs " << b.grad_norm;
  EXPECT_EQ(a.clip_factor, b.clip_factor);
  EXPECT_EQ(a.lr, b.lr);
  EXPECT_EQ(a.optimizer_steps, b.optimizer_steps);
  EXPECT_EQ(a.skipped_steps, b.skipped_steps);
}

// Equal moments; a moment never sized (the cpu backend's frozen tensors)
// equals one of zeros (the gpu backend's mirror of its zeroed buffer).
bool SameMoment(const std::vector<float>& a, const std::vector<float>& b) {
  auto zeros = [](const std::vector<float>& v) {
    return std::all_of(v.begin(), v.end(), [](float x) { return x == 0.0f && !std::signbit(x); });
  };
  if (a.empty() || b.empty()) return zeros(a) && zeros(b);
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

void ExpectSameState(ShardBackend& a, ShardBackend& b) {
  ShardSet* x = a.host_state();
  ShardSet* y = b.host_state();
  ASSERT_NE(x, nullptr);
  ASSERT_NE(y, nullptr);
  EXPECT_EQ(x->optimizer_steps(), y->optimizer_steps());
  EXPECT_EQ(x->skipped_steps(), y->skipped_steps());
  for (size_t i = 0; i < x->shards().size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "shard " << i);
    EXPECT_EQ(std::memcmp(x->master(i).data(), y->master(i).data(), x->master(i).size() * 4), 0);
    EXPECT_TRUE(SameMoment(x->optimizer_state(i).m, y->optimizer_state(i).m));
    EXPECT_TRUE(SameMoment(x->optimizer_state(i).v, y->optimizer_state(i).v));
  }
}

Grads RandomPushes(const std::vector<TensorDef>& model, int step, int pushers) {
  Grads g(pushers);
  for (int p = 0; p < pushers; ++p) {
    for (size_t t = 0; t < model.size(); ++t) {
      g[p].push_back(RandomGradient(model[t].rows * model[t].cols,
                                    100 + 10 * step + p + 1000 * static_cast<int>(t),
                                    step % 2 == 0 ? 0.5f : 0.02f));
    }
  }
  return g;
}

// The pipelined world's step: every daemon's buckets handed over from
// `pushes`; `hooks_of(d, hooks)` may add to a daemon's hooks.
std::vector<StepResult> StepPipelined(
    World& w, int64_t version, int64_t bucket_elements, const Grads& pushes,
    const std::function<void(int, PipelinedStepHooks&)>& hooks_of = nullptr) {
  return OnEveryDaemon(w.n(), [&](int d) {
    ShardBackend& b = *w.daemons[d];
    const std::vector<StepBucket> buckets =
        PlanStepBuckets(b.tensors(), b.shards(), bucket_elements);
    PipelinedStepHooks hooks;
    hooks.await_bucket = [&](const StepBucket& bucket, BucketGradients* g) {
      *g = SumOf(b, bucket, pushes);
      return absl::OkStatus();
    };
    if (hooks_of) hooks_of(d, hooks);
    return b.StepPipelined(version, w.reduce->Member(), true, buckets, hooks, nullptr);
  });
}

struct Case {
  Format row, col;
  bool dequantized;
  int optimizer;  // 0 AdamW, 1 AdamW + clipping + skip_step, 2 SGD momentum
};

OptimizerOptions OptionsOf(int optimizer) {
  OptimizerOptions o;
  o.lr = 1e-2f;
  o.beta2 = 0.99f;
  o.weight_decay = 0.1f;
  if (optimizer == 1) {
    o.schedule = {2, LrDecay::kCosine, 8, 1e-3f};
    o.max_grad_norm = 20.0f;
    o.non_finite = NonFinitePolicy::kSkipStep;
  } else if (optimizer == 2) {
    o.kind = OptimizerKind::kSgd;
    o.lr = 5e-3f;
    o.momentum = 0.9f;
    o.weight_decay = 0.01f;
  }
  return o;
}

// (case, daemons, bucket elements)
class GpuPipelinedStepTest : public ::testing::TestWithParam<std::tuple<Case, int, int64_t>> {};

TEST_P(GpuPipelinedStepTest, EqualsWholeStepAndCpuBackend) {
  const auto [c, daemons, bucket] = GetParam();
  const OptimizerOptions o = OptionsOf(c.optimizer);
  const std::vector<TensorDef> model = OptimizerTestModel(Spec(c.row, c.col, c.dequantized));
  World cpu(DaemonBackend::kCpu, model, daemons, o);
  World whole(DaemonBackend::kGpu, model, daemons, o);
  World piped(DaemonBackend::kGpu, model, daemons, o);
  ASSERT_EQ(piped.n(), daemons);
  cpu.Step(0, false);
  whole.Step(0, false);
  piped.Step(0, false);
  bool clipped = false;
  for (int step = 0; step < 6; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    Grads pushes = RandomPushes(model, step, 2);
    if (c.optimizer == 1 && step == 3) pushes[1][2][77] = std::nanf("");  // a skipped step
    cpu.Push(pushes);
    whole.Push(pushes);
    const auto pc = cpu.Step(step + 1, true);
    const auto pw = whole.Step(step + 1, true);
    std::vector<int> announced(daemons, 0);
    std::vector<StepResult> r =
        StepPipelined(piped, step + 1, bucket, pushes, [&](int d, PipelinedStepHooks& h) {
          h.on_bucket_ready = [&announced, d](int b) {
            EXPECT_EQ(b, announced[d]);  // in order
            ++announced[d];
          };
        });
    const auto pp = World::WithBytes(piped, r);
    ASSERT_EQ(pc.size(), static_cast<size_t>(daemons));
    ASSERT_EQ(pw.size(), pc.size());
    ASSERT_EQ(pp.size(), pc.size());
    for (int d = 0; d < daemons; ++d) {
      SCOPED_TRACE(::testing::Message() << "daemon " << d);
      // The pipelined version carries its bytes: the host copy is itself.
      EXPECT_EQ(pp[d].get(), r[d]->get());
      EXPECT_EQ(announced[d], static_cast<int>(PlanStepBuckets(piped.daemons[d]->tensors(),
                                                               piped.daemons[d]->shards(), bucket)
                                                   .size()));
      ExpectSamePieces(*pc[d], *pp[d]);
      ExpectSamePieces(*pw[d], *pp[d]);
      ExpectSameReport(pc[d]->report, pp[d]->report);
      ExpectSameReport(pw[d]->report, pp[d]->report);
      clipped |= pp[d]->report.clip_factor < 1.0f;
    }
  }
  if (c.optimizer == 1) {
    EXPECT_TRUE(clipped) << "no step was clipped";
    EXPECT_EQ(piped.daemons[0]->host_state()->skipped_steps(), 1);
  }
  for (int d = 0; d < daemons; ++d) {
    SCOPED_TRACE(::testing::Message() << "daemon " << d);
    ExpectSameState(*cpu.daemons[d], *piped.daemons[d]);
    ExpectSameState(*whole.daemons[d], *piped.daemons[d]);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, GpuPipelinedStepTest,
    ::testing::Combine(::testing::Values(Case{Format::kFp8Current, Format::kFp8Current, false, 0},
                                         Case{Format::kFp8Delayed, Format::kMxfp8, false, 0},
                                         Case{Format::kNvfp4, Format::kNvfp4, false, 0},
                                         Case{Format::kFp8Block1x128, Format::kFp8Block128x128,
                                              false, 2},
                                         Case{Format::kFp8Current, Format::kNvfp4, true, 0},
                                         Case{Format::kFp8Current, Format::kMxfp8, false, 1}),
                       ::testing::Values(1, 3), ::testing::Values(int64_t{0}, int64_t{40000})));

// Three daemons; `leave(d, hooks)` makes one daemon leave an attempt. The
// attempt ends abandoned on every daemon, changes nothing (the next attempt
// equals the cpu reference bit for bit) and announces only checked buckets.
void ExpectAbandonedThenEqual(
    const std::function<void(int, PipelinedStepHooks&, std::vector<int>&)>& leave,
    int max_announced) {
  const OptimizerOptions o = OptionsOf(0);
  const std::vector<TensorDef> model =
      OptimizerTestModel(Spec(Format::kFp8Current, Format::kFp8Current, false));
  World cpu(DaemonBackend::kCpu, model, 3, o);
  World piped(DaemonBackend::kGpu, model, 3, o);
  cpu.Step(0, false);
  piped.Step(0, false);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    const Grads pushes = RandomPushes(model, step, 2);
    std::vector<std::vector<int>> announced(3);
    if (step == 1) {
      std::vector<StepResult> r =
          StepPipelined(piped, step + 1, 0, pushes, [&](int d, PipelinedStepHooks& h) {
            h.on_bucket_ready = [&announced, d](int b) { announced[d].push_back(b); };
            leave(d, h, announced[d]);
          });
      for (int d = 0; d < 3; ++d) {
        EXPECT_FALSE(r[d].ok()) << "daemon " << d;
        EXPECT_TRUE(IsStepAbandoned(r[d].status())) << "daemon " << d << ": " << r[d].status();
        EXPECT_LE(static_cast<int>(announced[d].size()), max_announced) << "daemon " << d;
      }
    }
    cpu.Push(pushes);
    const auto pc = cpu.Step(step + 1, true);
    const auto pp = World::WithBytes(piped, StepPipelined(piped, step + 1, 0, pushes));
    ASSERT_EQ(pp.size(), 3u);
    for (int d = 0; d < 3; ++d) {
      SCOPED_TRACE(::testing::Message() << "daemon " << d);
      ExpectSamePieces(*pc[d], *pp[d]);
      ExpectSameReport(pc[d]->report, pp[d]->report);
      ExpectSameState(*cpu.daemons[d], *piped.daemons[d]);
    }
  }
}

TEST(GpuPipelinedAbandonTest, APushFailingAtTheThirdBucketCommitsNothing) {
  // Daemon 1's third bucket never completes (its push failed): every daemon
  // had stepped its first buckets already.
  ExpectAbandonedThenEqual(
      [](int d, PipelinedStepHooks& h, std::vector<int>&) {
        if (d != 1) return;
        auto inner = h.await_bucket;
        int calls = 0;
        h.await_bucket = [inner, calls](const StepBucket& b, BucketGradients* g) mutable {
          if (++calls == 3) return StepAbandonedError("a push used by the step failed");
          return inner(b, g);
        };
      },
      /*max_announced=*/4);
}

TEST(GpuPipelinedAbandonTest, AFailedCheckIsNotAnnouncedAndAbandons) {
  ExpectAbandonedThenEqual(
      [](int d, PipelinedStepHooks& h, std::vector<int>&) {
        if (d != 0) return;
        int calls = 0;
        h.check_bucket = [calls]() mutable {
          return ++calls == 2 ? StepAbandonedError("a push went away") : absl::OkStatus();
        };
      },
      /*max_announced=*/4);
  // Only the first bucket of daemon 0 may have been announced: checked
  // directly (the helper bounds every daemon alike).
  const OptimizerOptions o = OptionsOf(0);
  const std::vector<TensorDef> model =
      OptimizerTestModel(Spec(Format::kFp8Current, Format::kFp8Current, false));
  World piped(DaemonBackend::kGpu, model, 1, o);
  piped.Step(0, false);
  std::vector<int> announced;
  absl::Mutex mu;
  std::vector<StepResult> r =
      StepPipelined(piped, 1, 0, RandomPushes(model, 0, 1), [&](int, PipelinedStepHooks& h) {
        int calls = 0;
        h.check_bucket = [calls]() mutable {
          return ++calls == 2 ? StepAbandonedError("a push went away") : absl::OkStatus();
        };
        h.on_bucket_ready = [&](int b) {
          absl::MutexLock lock(&mu);
          announced.push_back(b);
        };
      });
  EXPECT_TRUE(IsStepAbandoned(r[0].status())) << r[0].status();
  absl::MutexLock lock(&mu);
  EXPECT_LE(announced.size(), 1u);
  for (int b : announced) EXPECT_EQ(b, 0);
}

TEST(GpuPipelinedAbandonTest, AFailingCommitBarrierCommitsNothing) {
  ExpectAbandonedThenEqual(
      [](int d, PipelinedStepHooks& h, std::vector<int>&) {
        if (d != 2) return;
        h.before_commit = [] { return StepAbandonedError("a push used by the step failed"); };
      },
      /*max_announced=*/4);
}

TEST(GpuPipelinedAbandonTest, LeavingBeforeTheFirstAllReduceMakesNone) {
  // Daemon 0 leaves at its first bucket without any all-reduce; the others
  // wait in theirs for its next attempt, whose calls line up with theirs:
  // here that attempt is the helper's second one, so the first one of
  // daemons 1 and 2 goes on and publishes with it (not abandoned).
  const OptimizerOptions o = OptionsOf(0);
  const std::vector<TensorDef> model =
      OptimizerTestModel(Spec(Format::kFp8Current, Format::kFp8Current, false));
  World cpu(DaemonBackend::kCpu, model, 3, o);
  World piped(DaemonBackend::kGpu, model, 3, o);
  cpu.Step(0, false);
  piped.Step(0, false);
  const Grads pushes = RandomPushes(model, 0, 2);
  std::vector<StepResult> r(3);
  std::vector<std::thread> threads;
  for (int d = 0; d < 3; ++d) {
    threads.emplace_back([&, d] {
      ShardBackend& b = *piped.daemons[d];
      const auto buckets = PlanStepBuckets(b.tensors(), b.shards(), 0);
      PipelinedStepHooks hooks;
      hooks.await_bucket = [&](const StepBucket& bucket, BucketGradients* g) {
        *g = SumOf(b, bucket, pushes);
        return absl::OkStatus();
      };
      if (d == 0) {
        PipelinedStepHooks first = hooks;
        first.await_bucket = [](const StepBucket&, BucketGradients*) {
          return StepAbandonedError("waiting for a pusher that has not begun");
        };
        StepResult left = b.StepPipelined(1, piped.reduce->Member(), true, buckets, first, nullptr);
        EXPECT_TRUE(IsStepAbandoned(left.status())) << left.status();
      }
      r[d] = b.StepPipelined(1, piped.reduce->Member(), true, buckets, hooks, nullptr);
    });
  }
  for (auto& t : threads) t.join();
  cpu.Push(pushes);
  const auto pc = cpu.Step(1, true);
  const auto pp = World::WithBytes(piped, r);
  ASSERT_EQ(pp.size(), 3u);
  for (int d = 0; d < 3; ++d) {
    SCOPED_TRACE(::testing::Message() << "daemon " << d);
    ExpectSamePieces(*pc[d], *pp[d]);
    ExpectSameState(*cpu.daemons[d], *piped.daemons[d]);
  }
}

// hooks.host_readers: while nobody reads, a bucket is neither copied to the
// host nor announced; the first bucket announced after that carries the
// skipped ones' bytes too. Never read: nothing announced, the published
// version has every piece's metadata and host_bytes() copies its bytes on
// demand. Both equal the whole step's bytes.
TEST(GpuPipelinedHostReadersTest, SkippedBucketsAreCopiedBeforeALaterAnnouncement) {
  const OptimizerOptions o = OptionsOf(0);
  const std::vector<TensorDef> model =
      OptimizerTestModel(Spec(Format::kFp8Current, Format::kMxfp8, false));
  for (int readers_from : {2, 1000}) {
    SCOPED_TRACE(::testing::Message() << "readers from bucket " << readers_from);
    World whole(DaemonBackend::kGpu, model, 1, o);
    World piped(DaemonBackend::kGpu, model, 1, o);
    whole.Step(0, false);
    piped.Step(0, false);
    const Grads pushes = RandomPushes(model, 0, 2);
    whole.Push(pushes);
    const auto pw = whole.Step(1, true);
    std::vector<int> announced;
    int asked = 0;
    std::vector<StepResult> r = StepPipelined(piped, 1, 0, pushes, [&](int, PipelinedStepHooks& h) {
      h.host_readers = [&] { return asked++ >= readers_from; };
      h.on_bucket_ready = [&](int b) { announced.push_back(b); };
    });
    ASSERT_TRUE(r[0].ok()) << r[0].status();
    const PublishedVersion& v = **r[0];
    const int buckets = static_cast<int>(
        PlanStepBuckets(piped.daemons[0]->tensors(), piped.daemons[0]->shards(), 0).size());
    std::vector<int> expected;
    for (int b = readers_from; b < buckets; ++b) expected.push_back(b);
    EXPECT_EQ(announced, expected);
    // Every piece has its metadata.
    ASSERT_EQ(v.pieces.size(), pw[0]->pieces.size());
    for (size_t k = 0; k < v.pieces.size(); ++k) {
      EXPECT_EQ(v.pieces[k].shard, pw[0]->pieces[k].shard) << k;
      EXPECT_EQ(v.pieces[k].direction, pw[0]->pieces[k].direction) << k;
      // Announced through the last bucket: every bucket was copied; never
      // read: none was.
      EXPECT_EQ(v.pieces[k].q.data.empty(), announced.empty()) << k;
    }
    const auto pp = World::WithBytes(piped, r);
    ASSERT_EQ(pp.size(), 1u);
    ExpectSamePieces(*pw[0], *pp[0]);
    ExpectSameReport(pw[0]->report, pp[0]->report);
  }
}

}  // namespace
}  // namespace paramd
