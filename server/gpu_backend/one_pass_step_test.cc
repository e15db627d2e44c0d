// GPU only (tag gpu): the store's one-pass AdamW step (GpuStoreOptions::
// one_pass_step: update, amax and both quantized directions from one read of
// the masters) publishes exactly the bytes of the two-kernel path (AdamW +
// amax, then QuantizeHybrid), and leaves the same masters, moments, delayed
// scaling state and amax vector, step after step, for every format whose
// scale is known before the step; stores with FP8 current or NVFP4 keep the
// two-kernel path.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/format.h"
#include "server/gpu_backend/shard_store.h"

namespace paramd {
namespace gpu_backend {
namespace {

std::vector<float> RandomValues(int64_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

std::vector<uint8_t> Download(const void* device, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  if (bytes > 0) {
    EXPECT_EQ(cudaMemcpy(out.data(), device, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return out;
}

struct Case {
  std::string name;
  Format row, col;
  bool col_usage = true;
  bool expect_one_pass = true;
};

HybridSpec SpecOf(const Case& c) {
  HybridSpec h;
  h.rowwise = DefaultQuantSpec(c.row);
  h.columnwise = DefaultQuantSpec(c.col);
  h.columnwise_usage = c.col_usage;
  return h;
}

// Shards: a whole tensor with full 128x128 tiles, a ragged one, and a tensor
// split in two row ranges (one amax slot).
std::vector<GpuShardDef> Shards(const HybridSpec& spec) {
  return {{"w", 256, 384, spec, 0},
          {"r", 100, 72, spec, 1},
          {"s0", 64, 96, spec, 2},
          {"s1", 40, 96, spec, 2}};
}

std::unique_ptr<GpuShardStore> MakeStore(const HybridSpec& spec, bool one_pass) {
  GpuStoreOptions options;
  options.num_tensors = 3;
  options.one_pass_step = one_pass;
  options.adamw.lr = 0.01;
  options.adamw.weight_decay = 0.01;
  absl::StatusOr<std::unique_ptr<GpuShardStore>> s = GpuShardStore::Create(Shards(spec), options);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return nullptr;
  GpuShardStore& store = **s;
  for (int i = 0; i < static_cast<int>(store.shards().size()); ++i) {
    const GpuShardDef& d = store.shards()[i];
    const std::vector<float> m = RandomValues(d.rows * d.cols, 7 + i, 1.0f);
    EXPECT_EQ(cudaMemcpy(store.master(i), m.data(), m.size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
    for (int dir = 0; dir < 2; ++dir) {
      if (store.scale(i, dir) == nullptr) continue;
      const float scale = 96.0f;  // the delayed scale of the first cast (saturates some values)
      EXPECT_EQ(cudaMemcpy(store.scale(i, dir), &scale, 4, cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  return std::move(*s);
}

void PushGradients(GpuShardStore& store, int step) {
  for (int i = 0; i < static_cast<int>(store.shards().size()); ++i) {
    const GpuShardDef& d = store.shards()[i];
    const std::vector<float> g = RandomValues(d.rows * d.cols, 1000 * step + i, 0.3f);
    ASSERT_TRUE(store.AccumulateHost(i, 0, g.data(), g.size()).ok());
  }
}

void ExpectSameState(GpuShardStore& a, GpuShardStore& b, int64_t version) {
  for (int i = 0; i < static_cast<int>(a.shards().size()); ++i) {
    const GpuShardDef& d = a.shards()[i];
    SCOPED_TRACE(absl::StrCat(d.name, " v", version));
    const size_t n = d.rows * d.cols * 4;
    EXPECT_EQ(Download(a.master(i), n), Download(b.master(i), n)) << "master";
    EXPECT_EQ(Download(a.exp_avg(i), n), Download(b.exp_avg(i), n)) << "exp_avg";
    EXPECT_EQ(Download(a.exp_avg_sq(i), n), Download(b.exp_avg_sq(i), n)) << "exp_avg_sq";
    for (Direction dir : {Direction::kRowwise, Direction::kColumnwise}) {
      const int di = dir == Direction::kRowwise ? 0 : 1;
      if (!(di == 0 ? d.spec.rowwise_usage : d.spec.columnwise_usage)) continue;
      absl::StatusOr<GpuPublishedDirection> pa = a.Published(version, i, dir);
      absl::StatusOr<GpuPublishedDirection> pb = b.Published(version, i, dir);
      ASSERT_TRUE(pa.ok()) << pa.status();
      ASSERT_TRUE(pb.ok()) << pb.status();
      ASSERT_EQ(pa->present, pb->present);
      if (!pa->present) continue;
      SCOPED_TRACE(DirectionName(dir));
      EXPECT_EQ(Download(pa->data, pa->layout.data_bytes()),
                Download(pb->data, pb->layout.data_bytes()))
          << "data";
      if (pa->layout.scale_bytes() > 0) {
        EXPECT_EQ(Download(pa->scales, pa->layout.scale_bytes()),
                  Download(pb->scales, pb->layout.scale_bytes()))
            << "scales";
      }
      EXPECT_EQ(Download(pa->scale_inv, 4), Download(pb->scale_inv, 4)) << "scale_inv";
      EXPECT_EQ(Download(pa->amax, 4), Download(pb->amax, 4)) << "amax";
      if (a.scale(i, di) != nullptr) {
        EXPECT_EQ(Download(pa->scale, 4), Download(pb->scale, 4)) << "scale of the cast";
        EXPECT_EQ(Download(a.scale(i, di), 4), Download(b.scale(i, di), 4)) << "next scale";
      }
      if (a.history(i, di) != nullptr) {
        const QuantSpec& q = di == 0 ? d.spec.rowwise : d.spec.columnwise;
        const size_t hb = 4 * static_cast<size_t>(q.amax_history_len > 1 ? q.amax_history_len : 1);
        EXPECT_EQ(Download(a.history(i, di), hb), Download(b.history(i, di), hb)) << "history";
      }
    }
  }
  EXPECT_EQ(Download(a.amax_vector(), a.amax_count() * 4),
            Download(b.amax_vector(), b.amax_count() * 4))
      << "amax vector";
}

class OnePassStepTest : public ::testing::TestWithParam<Case> {};

TEST_P(OnePassStepTest, PublishesTheTwoKernelPathsBytes) {
  const Case& c = GetParam();
  const HybridSpec spec = SpecOf(c);
  std::unique_ptr<GpuShardStore> one = MakeStore(spec, true);
  std::unique_ptr<GpuShardStore> two = MakeStore(spec, false);
  ASSERT_NE(one, nullptr);
  ASSERT_NE(two, nullptr);
  constexpr int kSteps = 3;
  for (int step = 1; step <= kSteps; ++step) {
    PushGradients(*one, step);
    PushGradients(*two, step);
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    ASSERT_TRUE(one->Step(step, true, {}, deadline).ok());
    ASSERT_TRUE(two->Step(step, true, {}, deadline).ok());
    ExpectSameState(*one, *two, step);
  }
  EXPECT_EQ(one->one_pass_steps(), c.expect_one_pass ? kSteps : 0);
  EXPECT_EQ(two->one_pass_steps(), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Formats, OnePassStepTest,
    ::testing::Values(Case{"fp8_delayed", Format::kFp8Delayed, Format::kFp8Delayed},
                      Case{"mxfp8", Format::kMxfp8, Format::kMxfp8},
                      Case{"block128x128", Format::kFp8Block128x128, Format::kFp8Block128x128},
                      Case{"block1x128", Format::kFp8Block1x128, Format::kFp8Block1x128},
                      Case{"bf16_row", Format::kIdentityBf16, Format::kIdentityBf16, false},
                      Case{"fp8_delayed_row_mxfp8_col", Format::kFp8Delayed, Format::kMxfp8},
                      Case{"mxfp8_row_block1x128_col", Format::kMxfp8, Format::kFp8Block1x128},
                      // Scales from this step's amax: the two-kernel path in both stores.
                      Case{"fp8_current", Format::kFp8Current, Format::kFp8Current, true, false},
                      Case{"nvfp4", Format::kNvfp4, Format::kNvfp4, true, false}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
}  // namespace gpu_backend
}  // namespace paramd
