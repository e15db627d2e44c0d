// Fetched bytes == CPU reference quantization, for every format and
// direction: the daemon's GpuShardStore quantizes known masters on GPU 0,
// the trainer fetches every published direction over the "nccl" transport
// into device buffers on GPU 1, and the bytes (data, scales, scale_inv,
// amax) are compared with ref::QuantizeHybrid. Then a few AdamW steps with
// pushed BF16 gradients: the versions advance and the newest stays equal to
// the reference quantization of the daemon's own masters. Tag gpu, 2 GPUs.
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/gpu_fetch/fetch.h"
#include "gtest/gtest.h"
#include "kernels/format.h"
#include "kernels/reference.h"
#include "server/gpu_backend/fetch_server.h"
#include "server/gpu_backend/shard_store.h"
#include "transport/nccl_transport.h"

namespace paramd {
namespace {

// A shard by field name (GpuShardDef gains fields over time).
gpu_backend::GpuShardDef Def(std::string name, int64_t rows, int64_t cols, const HybridSpec& spec) {
  gpu_backend::GpuShardDef d;
  d.name = std::move(name);
  d.rows = rows;
  d.cols = cols;
  d.spec = spec;
  return d;
}

using gpu_backend::FetchItem;
using gpu_backend::GpuShardStore;

absl::Time In(absl::Duration d) { return absl::Now() + d; }

struct Case {
  std::string name;
  HybridSpec spec;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  auto add = [&](const std::string& name, QuantSpec row, QuantSpec col) {
    Case c;
    c.name = name;
    c.spec.rowwise = row;
    c.spec.columnwise = col;
    cases.push_back(c);
  };
  for (Format f :
       {Format::kIdentityBf16, Format::kIdentityFp32, Format::kFp8Delayed, Format::kFp8Current,
        Format::kMxfp8, Format::kNvfp4, Format::kFp8Block128x128, Format::kFp8Block1x128}) {
    add(std::string(FormatName(f)), DefaultQuantSpec(f), DefaultQuantSpec(f));
  }
  QuantSpec mx2d = DefaultQuantSpec(Format::kMxfp8);
  mx2d.two_d = true;
  add("mxfp8_2d", mx2d, mx2d);
  QuantSpec nv1d = DefaultQuantSpec(Format::kNvfp4);
  nv1d.two_d = false;
  add("nvfp4_1d", nv1d, nv1d);
  // Hybrids: a different format per direction.
  add("fp8cur_row_mxfp8_col", DefaultQuantSpec(Format::kFp8Current),
      DefaultQuantSpec(Format::kMxfp8));
  add("bf16_row_block_col", DefaultQuantSpec(Format::kIdentityBf16),
      DefaultQuantSpec(Format::kFp8Block128x128));
  return cases;
}

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::vector<float> v(n);
  uint32_t x = seed * 747796405u + 1;
  for (int64_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = (static_cast<int32_t>(x >> 8) - (1 << 23)) * (1.0f / (1 << 23)) *
           (1.0f + static_cast<float>(i % 7));
  }
  return v;
}

std::vector<uint8_t> Download(int device, const void* p, size_t n) {
  std::vector<uint8_t> out(n);
  cudaSetDevice(device);
  EXPECT_EQ(cudaMemcpy(out.data(), p, n, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

float DownloadFloat(int device, const float* p) {
  float f = 0;
  cudaSetDevice(device);
  EXPECT_EQ(cudaMemcpy(&f, p, 4, cudaMemcpyDeviceToHost), cudaSuccess);
  return f;
}

class GpuFetchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int gpus = 0;
    cudaGetDeviceCount(&gpus);
    if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs";
    std::vector<std::unique_ptr<TransportEndpoint>> endpoints;
    std::vector<std::string> addresses;
    for (int r = 0; r < 2; ++r) {
      cudaSetDevice(r);
      absl::StatusOr<std::unique_ptr<TransportEndpoint>> e = OpenNcclEndpoint();
      ASSERT_TRUE(e.ok()) << e.status();
      addresses.push_back((*e)->address());
      endpoints.push_back(*std::move(e));
    }
    world_.resize(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        absl::StatusOr<std::unique_ptr<Transport>> t = endpoints[r]->Connect(r, addresses);
        if (t.ok()) world_[r] = *std::move(t);
      });
    }
    for (auto& t : threads) t.join();
    ASSERT_NE(world_[0], nullptr);
    ASSERT_NE(world_[1], nullptr);
  }

  NcclTransport& daemon() { return *AsNcclTransport(world_[0].get()); }
  NcclTransport& trainer() { return *AsNcclTransport(world_[1].get()); }

  // Fetches every direction of `version` to GPU 1 and compares each with the
  // reference quantization of `masters` (delayed scaling with `scale`).
  void FetchAndCompare(GpuShardStore& store, int64_t version,
                       const std::vector<std::vector<float>>& masters, uint64_t tag) {
    gpu_fetch::DevicePool pool(1);
    std::vector<FetchItem> items;
    std::vector<gpu_fetch::DeviceDirection> dst;
    for (int i = 0; i < static_cast<int>(store.shards().size()); ++i) {
      for (int dir = 0; dir < 2; ++dir) {
        absl::StatusOr<gpu_backend::GpuPublishedDirection> pub =
            store.Published(version, i, static_cast<Direction>(dir));
        ASSERT_TRUE(pub.ok()) << pub.status();
        absl::StatusOr<gpu_fetch::DeviceDirection> d = pool.Allocate(pub->layout);
        ASSERT_TRUE(d.ok()) << d.status();
        items.push_back({i, static_cast<Direction>(dir)});
        dst.push_back(*d);
      }
    }
    absl::Status served;
    std::thread server([&] {
      served = gpu_backend::ServeFetch(daemon(), 1, tag, store, version, items, false,
                                       In(absl::Seconds(60)));
    });
    absl::Status fetched =
        gpu_fetch::FetchDirections(trainer(), 0, tag, dst, In(absl::Seconds(60)));
    server.join();
    ASSERT_TRUE(served.ok()) << served;
    ASSERT_TRUE(fetched.ok()) << fetched;

    for (size_t k = 0; k < items.size(); ++k) {
      const gpu_backend::GpuShardDef& def = store.shards()[items[k].shard];
      const std::vector<float>& master = masters[items[k].shard];
      const int dir = static_cast<int>(items[k].direction);
      const QuantSpec& q = dir == 0 ? def.spec.rowwise : def.spec.columnwise;
      SCOPED_TRACE(absl::StrCat(def.name, " ", DirectionName(items[k].direction), " v", version));
      const float amax = ref::Amax(ref::RoundToSource(master, def.spec.source_dtype));
      ref::HybridScaling scaling;
      scaling.rowwise = ref::ScalingFromAmax(def.spec.rowwise, amax);
      scaling.columnwise = ref::ScalingFromAmax(def.spec.columnwise, amax);
      if (def.spec.rowwise.format == Format::kFp8Delayed) scaling.rowwise.scale = delayed_scale_;
      if (def.spec.columnwise.format == Format::kFp8Delayed) {
        scaling.columnwise.scale = delayed_scale_;
      }
      absl::StatusOr<ref::HybridResult> want =
          ref::QuantizeHybrid(master, def.rows, def.cols, def.spec, scaling);
      ASSERT_TRUE(want.ok()) << want.status();
      const QuantizedTensor& w = dir == 0 ? *want->rowwise : *want->columnwise;
      const gpu_fetch::DeviceDirection& d = dst[k];
      EXPECT_TRUE(Download(1, d.data, d.layout.data_bytes()) == w.data) << "data bytes differ";
      if (d.layout.scale_bytes() > 0) {
        EXPECT_TRUE(Download(1, d.scales, d.layout.scale_bytes()) == w.scales)
            << "scale bytes differ";
      }
      if (q.format == Format::kFp8Current || q.format == Format::kFp8Delayed) {
        const float got = DownloadFloat(1, d.scale_inv);
        EXPECT_EQ(std::memcmp(&got, &w.scale_inv, 4), 0) << got << " vs " << w.scale_inv;
      }
      if (q.format == Format::kNvfp4 || q.format == Format::kFp8Current) {
        EXPECT_EQ(DownloadFloat(1, d.amax), amax);
      }
    }
  }

  std::vector<std::unique_ptr<Transport>> world_;
  float delayed_scale_ = 1.0f;
};

TEST_F(GpuFetchTest, EveryFormatAndDirectionEqualsTheCpuReference) {
  std::vector<gpu_backend::GpuShardDef> shards;
  std::vector<std::vector<float>> masters;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{256, 384}, {130, 200}};
  for (const Case& c : Cases()) {
    for (auto [rows, cols] : shapes) {
      shards.push_back(Def(absl::StrCat(c.name, "_", rows, "x", cols), rows, cols, c.spec));
      masters.push_back(Random(rows * cols, static_cast<uint32_t>(shards.size())));
    }
  }
  gpu_backend::GpuStoreOptions options;
  options.device = 0;
  absl::StatusOr<std::unique_ptr<GpuShardStore>> store = GpuShardStore::Create(shards, options);
  ASSERT_TRUE(store.ok()) << store.status();
  cudaSetDevice(0);
  for (size_t i = 0; i < masters.size(); ++i) {
    ASSERT_EQ(cudaMemcpy((*store)->master(i), masters[i].data(), masters[i].size() * 4,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  absl::Status s = (*store)->Step(1, /*apply_optimizer=*/false, nullptr, In(absl::Seconds(60)));
  ASSERT_TRUE(s.ok()) << s;
  FetchAndCompare(**store, 1, masters, 100);
}

TEST_F(GpuFetchTest, StepsWithPushedGradientsPublishNewVersions) {
  HybridSpec spec;
  spec.rowwise = DefaultQuantSpec(Format::kFp8Current);
  spec.columnwise = DefaultQuantSpec(Format::kFp8Current);
  std::vector<gpu_backend::GpuShardDef> shards = {Def("a", 256, 512, spec),
                                                  Def("b", 384, 128, spec)};
  gpu_backend::GpuStoreOptions options;
  options.device = 0;
  absl::StatusOr<std::unique_ptr<GpuShardStore>> store_or = GpuShardStore::Create(shards, options);
  ASSERT_TRUE(store_or.ok()) << store_or.status();
  GpuShardStore& store = **store_or;
  EXPECT_GT(store.bytes_per_parameter(), 16.0);
  EXPECT_LE(store.bytes_per_parameter(), 21.0 + 4096.0 / 512);  // tiny shapes: fixed overhead
  cudaSetDevice(0);
  std::vector<std::vector<float>> masters;
  for (int i = 0; i < 2; ++i) {
    masters.push_back(Random(shards[i].rows * shards[i].cols, 50 + i));
    ASSERT_EQ(cudaMemcpy(store.master(i), masters[i].data(), masters[i].size() * 4,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  ASSERT_TRUE(store.Step(1, false, nullptr, In(absl::Seconds(60))).ok());
  // Trainer gradients (BF16 ones = 0x3F80) pushed over NCCL into staging.
  cudaSetDevice(1);
  std::vector<void*> grads(2);
  for (int i = 0; i < 2; ++i) {
    const size_t n = shards[i].rows * shards[i].cols;
    std::vector<uint16_t> ones(n, 0x3F80);
    ASSERT_EQ(cudaMalloc(&grads[i], n * 2), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(grads[i], ones.data(), n * 2, cudaMemcpyHostToDevice), cudaSuccess);
  }
  for (int64_t version = 2; version <= 4; ++version) {
    for (int i = 0; i < 2; ++i) {
      const size_t bytes = shards[i].rows * shards[i].cols * 2;
      absl::Status sent;
      std::thread pusher([&] {
        sent = trainer().SendDevice(0, 500 + version * 10 + i, {{grads[i], bytes}}, nullptr,
                                    In(absl::Seconds(30)));
      });
      absl::Status got = daemon().RecvDevice(
          1, 500 + version * 10 + i, {{store.push_staging(0), bytes}}, In(absl::Seconds(30)));
      pusher.join();
      ASSERT_TRUE(sent.ok()) << sent;
      ASSERT_TRUE(got.ok()) << got;
      ASSERT_TRUE(store.Accumulate(i, store.push_staging(0), true).ok());
    }
    ASSERT_TRUE(store.Step(version, true, nullptr, In(absl::Seconds(60))).ok());
    EXPECT_EQ(store.versions(), (std::vector<int64_t>{version - 1, version}));
  }
  // AdamW with a constant gradient moved every weight by about -lr per step.
  for (int i = 0; i < 2; ++i) {
    std::vector<float> now(masters[i].size());
    cudaSetDevice(0);
    ASSERT_EQ(cudaMemcpy(now.data(), store.master(i), now.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (size_t j = 0; j < now.size(); j += 97) {
      EXPECT_LT(now[j], masters[i][j]) << j;
    }
    masters[i] = now;
  }
  FetchAndCompare(store, 4, masters, 900);
  EXPECT_FALSE(store.Published(1, 0, Direction::kRowwise).ok());  // only two versions kept
  cudaSetDevice(1);
  for (void* g : grads) cudaFree(g);
}

}  // namespace
}  // namespace paramd
