// GPU only (tag gpu). The gpu backend's optimizer step with an lr schedule,
// global-norm clipping, per-rule weight decay / lr multiplier, a frozen
// tensor and skip_step is bit-identical to the cpu backend (ShardSet): the
// same gradient norm bits, clip factors, lr, counters, published bytes and
// masters after 20 steps of 3 pushers, for one daemon and for three daemons
// (three gpu backends on one GPU, host all-reduce) with tensors split
// across them; AdamW through the two-kernel step (FP8 current rowwise) and
// through the one-pass step (FP8 delayed rowwise), and SGD. On odd steps
// the second and third pushers push through device memory (the device
// push's add, GpuShardStore::AddPiece: FP32, and BF16 for the last pusher,
// whose add takes the norm's row sums); on even steps all push from the
// host. Two steps hold a NaN (one on each path) and are skipped; after step
// 10 SetOptimizer lowers the peak lr and the clip bound. One daemon runs
// without an all-reduce (the gpu store's one-launch norm phase), three
// through the host all-reduce (two launches around it).
// SgdMomentumOnAndOff: SGD loaded without momentum, then momentum turned
// on (new buffers, started from the gradient), off (plain SGD, buffers
// kept) and on again (the kept buffers carry on), with a skipped step in
// the first momentum phase: bit-identical to the cpu backend, and the
// host state (momentum buffers present or not) the same.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/backend/shard_backend.h"
#include "server/gpu_backend/daemon_backend.h"
#include "server/step/optimizer_test_model.h"
#include "server/step/thread_all_reduce.h"

namespace paramd {
namespace {

using testing::OptimizerTestLayout;
using testing::RandomGradient;

std::vector<TensorDef> Model(bool one_pass) {
  HybridSpec spec;
  spec.rowwise = DefaultQuantSpec(one_pass ? Format::kFp8Delayed : Format::kFp8Current);
  spec.columnwise = DefaultQuantSpec(Format::kMxfp8);
  return testing::OptimizerTestModel(spec);
}

// BF16 truncation: values a BF16 device push carries exactly.
std::vector<float> Bf16Values(std::vector<float> v) {
  for (float& x : v) {
    uint32_t b;
    std::memcpy(&b, &x, 4);
    b &= 0xFFFF0000u;
    std::memcpy(&x, &b, 4);
  }
  return v;
}

std::vector<uint16_t> Bf16Bits(const float* v, int64_t n) {
  std::vector<uint16_t> out(n);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, &v[i], 4);
    out[i] = static_cast<uint16_t>(b >> 16);
  }
  return out;
}

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
      daemons.push_back(*std::move(b));
      ShardBackend& d = *daemons.back();
      // One daemon: no all-reduce (the gpu store's one-launch norm phase).
      if (n == 1) d.set_data_plane(nullptr, absl::Seconds(60));
      for (size_t i = 0; i < d.shards().size(); ++i) {
        const ShardDef& s = d.shards()[i];
        const std::vector<float> w =
            RandomGradient(model[s.tensor].rows * model[s.tensor].cols, 1 + s.tensor, 0.5f);
        std::memcpy(d.load_master(i).data(), w.data() + s.row_begin * model[s.tensor].cols,
                    d.load_master(i).size() * 4);
      }
    }
  }
  // pushes[p][tensor]; `device`: pushers 1 (FP32) and 2 (BF16, the last)
  // add from device memory on the gpu backend.
  void Push(const std::vector<std::vector<std::vector<float>>>& pushes, bool device) {
    for (size_t p = 0; p < pushes.size(); ++p) {
      const bool last = p + 1 == pushes.size();
      for (auto& d : daemons) {
        gpu_backend::GpuShardStore* store = gpu_backend::DeviceStoreOf(d.get());
        for (size_t i = 0; i < d->shards().size(); ++i) {
          const ShardDef& s = d->shards()[i];
          const int64_t cols = d->tensors()[s.tensor].cols;
          const float* values = pushes[p][s.tensor].data() + s.row_begin * cols;
          const int64_t count = s.rows() * cols;
          if (store == nullptr || !device || p == 0) {
            ASSERT_TRUE(d->AccumulateGradient(static_cast<int>(i), 0,
                                              absl::MakeConstSpan(values, count), last)
                            .ok());
            continue;
          }
          const bool bf16 = p == 2;
          const std::vector<uint16_t> bits = Bf16Bits(values, count);
          const void* host = bf16 ? static_cast<const void*>(bits.data()) : values;
          const size_t bytes = count * (bf16 ? 2 : 4);
          void* dev = nullptr;
          ASSERT_EQ(cudaMalloc(&dev, bytes), cudaSuccess);
          // On the store's stream: a plain cudaMemcpy may return before its
          // DMA is done, and the store's stream does not wait for it.
          ASSERT_EQ(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, store->stream()),
                    cudaSuccess);
          ASSERT_TRUE(store->AddPiece(static_cast<int>(i), 0, dev, bf16, count, last).ok());
          ASSERT_EQ(cudaStreamSynchronize(store->stream()), cudaSuccess);
          ASSERT_EQ(cudaFree(dev), cudaSuccess);
        }
      }
    }
  }
  // The published versions, with their bytes (the gpu backend's host
  // copies); `meta` gets what Step returned.
  std::vector<std::shared_ptr<const PublishedVersion>> Step(
      int64_t version, bool optimizer,
      std::vector<std::shared_ptr<const PublishedVersion>>* meta = nullptr) {
    std::vector<absl::StatusOr<std::shared_ptr<const PublishedVersion>>> r(daemons.size());
    std::vector<std::thread> threads;
    for (size_t d = 0; d < daemons.size(); ++d) {
      threads.emplace_back(
          [&, d] { r[d] = daemons[d]->Step(version, optimizer, reduce->Member(), true); });
    }
    for (std::thread& t : threads) t.join();
    std::vector<std::shared_ptr<const PublishedVersion>> out;
    for (size_t d = 0; d < r.size(); ++d) {
      EXPECT_TRUE(r[d].ok()) << r[d].status();
      if (!r[d].ok()) return {};
      if (meta != nullptr) meta->push_back(*r[d]);
      // The gpu backend publishes metadata; its bytes come on request.
      HostBytesFn bytes = daemons[d]->host_bytes();
      if (bytes == nullptr) {
        out.push_back(*r[d]);
        continue;
      }
      absl::StatusOr<std::shared_ptr<const PublishedVersion>> full = bytes(*r[d]);
      EXPECT_TRUE(full.ok()) << full.status();
      if (!full.ok()) return {};
      out.push_back(*full);
    }
    return out;
  }
};

OptimizerOptions AdamWCosine() {
  OptimizerOptions o;
  o.lr = 1e-2f;
  o.beta2 = 0.99f;
  o.weight_decay = 0.1f;
  o.schedule = {3, LrDecay::kCosine, 12, 1e-3f};
  o.max_grad_norm = 20.0f;
  o.non_finite = NonFinitePolicy::kSkipStep;
  return o;
}

OptimizerOptions SgdLinear() {
  OptimizerOptions o = AdamWCosine();
  o.kind = OptimizerKind::kSgd;
  o.lr = 5e-3f;
  o.momentum = 0.9f;
  o.weight_decay = 0.01f;
  o.schedule = {2, LrDecay::kLinear, 10, 5e-4f};
  return o;
}

// The same float64 bits, or both NaN (a skipped step: the payload is not
// part of the result).
bool SameNorm(double a, double b) {
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 8) == 0;
}

void ExpectSamePieces(const PublishedVersion& c, const PublishedVersion& g) {
  ASSERT_EQ(c.pieces.size(), g.pieces.size());
  for (size_t k = 0; k < c.pieces.size(); ++k) {
    const PublishedPiece& a = c.pieces[k];
    const PublishedPiece& b = g.pieces[k];
    SCOPED_TRACE(::testing::Message() << "piece " << k << " (shard " << a.shard << ")");
    EXPECT_EQ(a.shard, b.shard);
    EXPECT_EQ(a.direction, b.direction);
    EXPECT_TRUE(a.q.data == b.q.data);
    EXPECT_TRUE(a.q.scales == b.q.scales);
    EXPECT_EQ(a.q.scale_inv, b.q.scale_inv);
    EXPECT_EQ(a.q.amax, b.q.amax);
    EXPECT_EQ(a.scale, b.scale);
  }
}

// (daemons, 0 AdamW / 1 SGD, 0 two-kernel formats / 1 one-pass formats)
class GpuClipTest : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(GpuClipTest, BitIdenticalToCpuBackend) {
  const int daemons = std::get<0>(GetParam());
  const bool adamw = std::get<1>(GetParam()) == 0;
  const bool one_pass = std::get<2>(GetParam()) == 1;
  const OptimizerOptions o = adamw ? AdamWCosine() : SgdLinear();
  const std::vector<TensorDef> model = Model(one_pass);
  World cpu(DaemonBackend::kCpu, model, daemons, o);
  World gpu(DaemonBackend::kGpu, model, daemons, o);
  ASSERT_EQ(gpu.daemons.size(), static_cast<size_t>(daemons));
  cpu.Step(0, false);
  gpu.Step(0, false);
  bool clipped = false;
  for (int step = 0; step < 20; ++step) {
    std::vector<std::vector<std::vector<float>>> pushes(3);
    for (int p = 0; p < 3; ++p) {
      for (size_t t = 0; t < model.size(); ++t) {
        pushes[p].push_back(RandomGradient(model[t].rows * model[t].cols,
                                           100 + 10 * step + p + 1000 * t,
                                           step % 2 == 0 ? 0.5f : 0.01f));
      }
    }
    pushes[2] = {Bf16Values(pushes[2][0]), Bf16Values(pushes[2][1]), Bf16Values(pushes[2][2]),
                 Bf16Values(pushes[2][3])};
    // Skipped steps: a NaN on the device path (odd step) and on the host.
    if (step == 5) pushes[2][2][200 * 300 + 1] = std::nanf("");
    if (step == 8) pushes[1][0][3] = std::nanf("");
    const bool device = step % 2 == 1;
    if (step == 10) {
      // Daemon.SetOptimizer between steps: a lower peak lr and clip bound.
      OptimizerOptions changed = o;
      changed.lr *= 0.5f;
      changed.max_grad_norm = 8.0f;
      for (World* w : {&cpu, &gpu}) {
        for (auto& d : w->daemons) ASSERT_TRUE(d->SetOptimizer(changed).ok());
      }
    }
    cpu.Push(pushes, device);
    gpu.Push(pushes, device);
    std::vector<std::shared_ptr<const PublishedVersion>> meta;
    const auto pc = cpu.Step(step + 1, true);
    const auto pg = gpu.Step(step + 1, true, &meta);
    ASSERT_EQ(pc.size(), pg.size());
    ASSERT_EQ(pc.size(), static_cast<size_t>(daemons));
    ASSERT_EQ(meta.size(), pg.size());
    for (size_t d = 0; d < pc.size(); ++d) {
      SCOPED_TRACE(::testing::Message() << "step " << step << " daemon " << d);
      const StepReport& rc = pc[d]->report;
      const StepReport& rg = meta[d]->report;
      // The host copy carries the version's report too.
      EXPECT_EQ(pg[d]->report.optimizer_steps, rg.optimizer_steps);
      EXPECT_TRUE(SameNorm(pg[d]->report.grad_norm, rg.grad_norm));
      EXPECT_TRUE(SameNorm(rc.grad_norm, rg.grad_norm)) << rc.grad_norm << " vs " << rg.grad_norm;
      EXPECT_EQ(rc.clip_factor, rg.clip_factor);
      EXPECT_EQ(rc.lr, rg.lr);
      EXPECT_EQ(rc.optimizer_steps, rg.optimizer_steps);
      EXPECT_EQ(rc.skipped_steps, rg.skipped_steps);
      clipped |= rc.clip_factor < 1.0f;
      ExpectSamePieces(*pc[d], *pg[d]);
    }
  }
  EXPECT_TRUE(clipped) << "no step was clipped: the test does not test clipping";
  EXPECT_EQ(cpu.daemons[0]->host_state()->skipped_steps(), 2);
  EXPECT_EQ(cpu.daemons[0]->host_state()->optimizer_steps(), 18);
  for (size_t d = 0; d < cpu.daemons.size(); ++d) {
    ShardSet* c = cpu.daemons[d]->host_state();
    ShardSet* g = gpu.daemons[d]->host_state();
    ASSERT_NE(g, nullptr);
    EXPECT_EQ(g->skipped_steps(), 2);
    EXPECT_EQ(g->optimizer_steps(), 18);
    for (size_t i = 0; i < c->shards().size(); ++i) {
      ASSERT_EQ(std::memcmp(c->master(i).data(), g->master(i).data(), c->master(i).size() * 4), 0)
          << "daemon " << d << " shard " << i;
    }
    gpu_backend::GpuShardStore* store = gpu_backend::DeviceStoreOf(gpu.daemons[d].get());
    ASSERT_NE(store, nullptr);
    // The one-pass formats did run as the one pass (AdamW only).
    EXPECT_EQ(store->one_pass_steps() > 0, adamw && one_pass);
  }
}

class GpuSgdMomentumTest : public ::testing::TestWithParam<int> {};

TEST_P(GpuSgdMomentumTest, SgdMomentumOnAndOff) {
  const int daemons = GetParam();
  OptimizerOptions o = SgdLinear();
  o.momentum = 0.0f;
  const std::vector<TensorDef> model = Model(false);
  World cpu(DaemonBackend::kCpu, model, daemons, o);
  World gpu(DaemonBackend::kGpu, model, daemons, o);
  ASSERT_EQ(gpu.daemons.size(), static_cast<size_t>(daemons));
  cpu.Step(0, false);
  gpu.Step(0, false);
  // Momentum by step: off 0-2, on 3-6 (a NaN skipped at 3, the first
  // momentum step), off 7-8, on 9-11.
  auto momentum = [](int step) { return (step >= 3 && step <= 6) || step >= 9 ? 0.8f : 0.0f; };
  for (int step = 0; step < 12; ++step) {
    if (step == 0 || momentum(step) != momentum(step - 1)) {
      OptimizerOptions changed = o;
      changed.momentum = momentum(step);
      for (World* w : {&cpu, &gpu}) {
        for (auto& d : w->daemons) ASSERT_TRUE(d->SetOptimizer(changed).ok()) << step;
      }
      // The host state between the change and the next step: the same
      // momentum buffers (none before the first momentum step ran).
      for (size_t d = 0; d < cpu.daemons.size(); ++d) {
        ShardSet* c = cpu.daemons[d]->host_state();
        ShardSet* g = gpu.daemons[d]->host_state();
        ASSERT_NE(g, nullptr);
        for (size_t i = 0; i < c->shards().size(); ++i) {
          ASSERT_EQ(c->optimizer_state(i).m.size(), g->optimizer_state(i).m.size())
              << "step " << step << " daemon " << d << " shard " << i;
          EXPECT_EQ(c->optimizer_state(i).m, g->optimizer_state(i).m);
        }
      }
    }
    std::vector<std::vector<std::vector<float>>> pushes(3);
    for (int p = 0; p < 3; ++p) {
      for (size_t t = 0; t < model.size(); ++t) {
        pushes[p].push_back(
            RandomGradient(model[t].rows * model[t].cols, 500 + 10 * step + p + 1000 * t, 0.05f));
      }
    }
    pushes[2] = {Bf16Values(pushes[2][0]), Bf16Values(pushes[2][1]), Bf16Values(pushes[2][2]),
                 Bf16Values(pushes[2][3])};
    if (step == 3) pushes[1][0][7] = std::nanf("");
    const bool device = step % 2 == 1;
    cpu.Push(pushes, device);
    gpu.Push(pushes, device);
    std::vector<std::shared_ptr<const PublishedVersion>> meta;
    const auto pc = cpu.Step(step + 1, true);
    const auto pg = gpu.Step(step + 1, true, &meta);
    ASSERT_EQ(pc.size(), static_cast<size_t>(daemons));
    ASSERT_EQ(pg.size(), pc.size());
    for (size_t d = 0; d < pc.size(); ++d) {
      SCOPED_TRACE(::testing::Message() << "step " << step << " daemon " << d);
      EXPECT_EQ(pc[d]->report.optimizer_steps, meta[d]->report.optimizer_steps);
      EXPECT_EQ(pc[d]->report.skipped_steps, meta[d]->report.skipped_steps);
      ExpectSamePieces(*pc[d], *pg[d]);
    }
  }
  for (size_t d = 0; d < cpu.daemons.size(); ++d) {
    ShardSet* c = cpu.daemons[d]->host_state();
    ShardSet* g = gpu.daemons[d]->host_state();
    ASSERT_NE(g, nullptr);
    EXPECT_EQ(c->skipped_steps(), 1);
    EXPECT_EQ(g->skipped_steps(), 1);
    EXPECT_EQ(g->optimizer_steps(), c->optimizer_steps());
    for (size_t i = 0; i < c->shards().size(); ++i) {
      ASSERT_EQ(std::memcmp(c->master(i).data(), g->master(i).data(), c->master(i).size() * 4), 0)
          << "daemon " << d << " shard " << i;
      ASSERT_EQ(c->optimizer_state(i).m.size(), g->optimizer_state(i).m.size());
      EXPECT_EQ(std::memcmp(c->optimizer_state(i).m.data(), g->optimizer_state(i).m.data(),
                            c->optimizer_state(i).m.size() * 4),
                0)
          << "daemon " << d << " shard " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, GpuSgdMomentumTest, ::testing::Values(1, 3));

INSTANTIATE_TEST_SUITE_P(Layouts, GpuClipTest,
                         ::testing::Combine(::testing::Values(1, 3), ::testing::Values(0, 1),
                                            ::testing::Values(0, 1)));

}  // namespace
}  // namespace paramd
