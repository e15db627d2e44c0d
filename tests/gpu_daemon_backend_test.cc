// GPU only (tag gpu; --config=cuda on a machine with a GPU; the NCCL test
// at the end needs 2 GPUs and skips otherwise). One real
// hybrid-paramd daemon with --backend=gpu (GpuShardStore through the
// daemon's ShardBackend seam) against the CPU reference, for every format
// pair (both columnwise sources, and a columnwise-only copy from a
// temporary rowwise one), with AdamW (weight decay) and with SGD + momentum:
//   - version 0 fetched over the host Fetch stream equals
//     ReferencePublish of the loaded weights byte for byte;
//   - after each of 3 optimizer steps on pushed gradients, every fetched
//     piece (data, scales, scale_inv, and the amax where a format carries
//     one) of the new version AND of the previous one (its host copy is
//     made on this first host request: the gpu backend publishes without a
//     device-to-host copy) equals what an identical --backend=cpu daemon
//     publishes.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "format/convert.h"
#include "gtest/gtest.h"
#include "ipc/cuda_vmm.h"
#include "kernels/format.h"
#include "kernels/reference.h"
#include "server/backend/shard_backend.h"
#include "server/gpu_backend/daemon_backend.h"
#include "server/gpu_backend/shard_store.h"
#include "server/step/chunks.h"
#include "server/step/reference_step.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

constexpr int64_t kRows = 260;  // not a multiple of 32 or 128: partial blocks
constexpr int64_t kCols = 200;
constexpr int kSteps = 3;

// FormatCombos() and a columnwise-only rowwise_dequantized copy (its
// rowwise copy is computed but not published, D16).
std::vector<FormatCombo> GpuCombos() {
  std::vector<FormatCombo> out = FormatCombos();
  out.push_back({"ColumnwiseOnlyNvfp4FromCurrent",
                 "rowwise { format: FP8_CURRENT } columnwise { format: NVFP4 } "
                 "rowwise_usage: false columnwise_source: ROWWISE_DEQUANTIZED"});
  return out;
}

std::unique_ptr<RawCluster> StartOne(const std::string& backend, const std::string& optimizer) {
  TestClusterOptions options;
  options.daemons = 1;
  options.expected_pushers = 1;
  options.optimizer = optimizer;
  options.lr = optimizer == "sgd" ? 0.05 : 0.01;
  options.momentum = optimizer == "sgd" ? 0.9 : 0.0;
  options.daemon_flags = {absl::StrCat("--backend=", backend),
                          optimizer == "sgd" ? "--weight_decay=0.001" : "--weight_decay=0.01"};
  absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(options);
  EXPECT_TRUE(c.ok()) << backend << ": " << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// Parameter: (format combo, optimizer). One gpu and one cpu daemon per
// optimizer, shared by the suite (each Load replaces the model).
class GpuDaemonBackendTest : public ::testing::TestWithParam<std::tuple<FormatCombo, std::string>> {
 protected:
  static void SetUpTestSuite() {
    for (const char* optimizer : {"adamw", "sgd"}) {
      clusters_[optimizer] = {StartOne("gpu", optimizer).release(),
                              StartOne("cpu", optimizer).release()};
    }
    gpu_ = clusters_["adamw"].first;
    cpu_ = clusters_["adamw"].second;
    ASSERT_NE(gpu_, nullptr);
    ASSERT_NE(cpu_, nullptr);
    tensors_ = {{"w", {kRows, kCols}, RandomValues(kRows * kCols, 1)},
                {"b", {77}, RandomValues(77, 2, 0.1f)}};
    model_path_ = gpu_->cluster().dir() + "/model.safetensors";
    ASSERT_TRUE(WriteModel(model_path_, tensors_).ok());
  }
  static void TearDownTestSuite() {
    for (auto& [name, pair] : clusters_) {
      delete pair.first;
      delete pair.second;
    }
    clusters_.clear();
    gpu_ = cpu_ = nullptr;
  }
  void SetUp() override {
    gpu_ = clusters_[std::get<1>(GetParam())].first;
    cpu_ = clusters_[std::get<1>(GetParam())].second;
  }
  void TearDown() override {
    if (HasFailure() && gpu_ != nullptr) ADD_FAILURE() << gpu_->cluster().Logs();
  }

  static std::map<std::string, std::pair<RawCluster*, RawCluster*>> clusters_;
  static RawCluster* gpu_;
  static RawCluster* cpu_;
  static std::vector<TestTensor> tensors_;
  static std::string model_path_;
};

std::map<std::string, std::pair<RawCluster*, RawCluster*>> GpuDaemonBackendTest::clusters_;
RawCluster* GpuDaemonBackendTest::gpu_ = nullptr;
RawCluster* GpuDaemonBackendTest::cpu_ = nullptr;
std::vector<TestTensor> GpuDaemonBackendTest::tensors_;
std::string GpuDaemonBackendTest::model_path_;

void ExpectSamePieces(int64_t version, RawCluster& gpu, RawCluster& cpu,
                      const std::vector<TestTensor>& tensors) {
  for (const TestTensor& t : tensors) {
    const HybridSpec spec = cpu.spec(t.name);
    for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
      if (!(d == Direction::kRowwise ? spec.rowwise_usage : spec.columnwise_usage)) continue;
      SCOPED_TRACE(absl::StrCat(t.name, " ", DirectionName(d), " v", version));
      absl::StatusOr<std::vector<QuantizedTensor>> want = cpu.FetchPieces(version, t.name, d);
      absl::StatusOr<std::vector<QuantizedTensor>> got = gpu.FetchPieces(version, t.name, d);
      ASSERT_TRUE(want.ok()) << want.status();
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->size(), want->size());
      const QuantSpec& qs = d == Direction::kRowwise ? spec.rowwise : spec.columnwise;
      for (size_t i = 0; i < got->size(); ++i) {
        EXPECT_EQ((*got)[i].data, (*want)[i].data);
        EXPECT_EQ((*got)[i].scales, (*want)[i].scales);
        EXPECT_EQ((*got)[i].scale_inv, (*want)[i].scale_inv);
        if (NeedsGlobalAmax(qs.format) || qs.format == Format::kFp8Current ||
            qs.format == Format::kFp8Delayed) {
          EXPECT_EQ((*got)[i].amax, (*want)[i].amax);
        }
      }
    }
  }
}

TEST_P(GpuDaemonBackendTest, FetchedBytesEqualCpuReference) {
  ASSERT_NE(gpu_, nullptr);
  ASSERT_NE(cpu_, nullptr);
  const std::string recipe = absl::StrCat("default_spec { ", std::get<0>(GetParam()).spec, " }");
  absl::StatusOr<int64_t> g0 = gpu_->Load(model_path_, recipe);
  ASSERT_TRUE(g0.ok()) << g0.status();
  absl::StatusOr<int64_t> c0 = cpu_->Load(model_path_, recipe);
  ASSERT_TRUE(c0.ok()) << c0.status();
  ASSERT_EQ(*g0, 0);
  ASSERT_EQ(*c0, 0);

  // Version 0 against the plain reference of the loaded weights.
  for (const TestTensor& t : tensors_) {
    SCOPED_TRACE(t.name);
    const rpc::TensorInfo& info = gpu_->tensor(t.name);
    const HybridSpec spec = gpu_->spec(t.name);
    ReferenceTensorState state = InitialReferenceState(spec);
    absl::StatusOr<ref::HybridResult> expected =
        ReferencePublish(t.values, info.rows(), info.cols(), spec, state);
    ASSERT_TRUE(expected.ok()) << expected.status();
    for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
      const std::optional<QuantizedTensor>& want =
          d == Direction::kRowwise ? expected->rowwise : expected->columnwise;
      if (!want) continue;
      SCOPED_TRACE(DirectionName(d));
      absl::StatusOr<QuantizedTensor> got = gpu_->FetchAssembled(0, t.name, d);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->data, want->data);
      EXPECT_EQ(got->scales, want->scales);
      EXPECT_EQ(got->scale_inv, want->scale_inv);
    }
  }
  ExpectSamePieces(0, *gpu_, *cpu_, tensors_);

  // The same gradients into both daemons: AdamW on the device vs the host.
  for (int step = 0; step < kSteps; ++step) {
    std::map<std::string, std::vector<float>> grads;
    for (const TestTensor& t : tensors_) {
      grads[t.name] = RandomValues(t.values.size(), 100 + step, 0.3f);
    }
    ASSERT_TRUE(gpu_->PushAll(step, "trainer", grads).ok());
    ASSERT_TRUE(cpu_->PushAll(step, "trainer", grads).ok());
    absl::StatusOr<int64_t> gv = gpu_->WaitForVersion(step + 1);
    ASSERT_TRUE(gv.ok()) << gv.status();
    absl::StatusOr<int64_t> cv = cpu_->WaitForVersion(step + 1);
    ASSERT_TRUE(cv.ok()) << cv.status();
    ExpectSamePieces(step + 1, *gpu_, *cpu_, tensors_);
    // The previous version, first requested now on the host.
    if (step >= 1) ExpectSamePieces(step, *gpu_, *cpu_, tensors_);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, GpuDaemonBackendTest,
    ::testing::Combine(::testing::ValuesIn(GpuCombos()), ::testing::Values("adamw", "sgd")),
    [](const ::testing::TestParamInfo<std::tuple<FormatCombo, std::string>>& info) {
      return absl::StrCat(std::get<0>(info.param).name, "_", std::get<1>(info.param));
    });

// Two gpu daemons, one per GPU (--gpu=0/1), all-reducing their packed
// device amax vectors over the "nccl" data plane (no host round trip)
// against two cpu daemons on the host data plane: tensors split across the
// daemons in formats that need the global amax (FP8 current, NVFP4, FP8
// delayed, and a rowwise_dequantized copy needing the second round), every
// piece fetched over the host Fetch stream equal after 3 AdamW steps.
TEST(GpuDaemonBackendNcclTest, TwoGpuDaemonsOverNcclEqualCpuDaemons) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2) {
    GTEST_SKIP() << "needs 2 GPUs, found " << devices;
  }
  auto options = [](const std::string& backend) {
    TestClusterOptions o;
    o.daemons = 2;
    o.expected_pushers = 1;
    o.optimizer = "adamw";
    o.lr = 0.01;
    o.daemon_flags = {"--backend=" + backend, "--weight_decay=0.01"};
    if (backend == "gpu") {
      o.coordinator_flags = {"--data_plane=nccl"};
      o.daemon_flags.push_back("--data_plane=nccl");
      o.per_daemon_flags = {{"--gpu=0"}, {"--gpu=1"}};
    }
    return o;
  };
  absl::StatusOr<std::unique_ptr<RawCluster>> g = RawCluster::Start(options("gpu"));
  absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(options("cpu"));
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_TRUE(c.ok()) << c.status();
  RawCluster& gpu = **g;
  RawCluster& cpu = **c;
  // w1 holds more than half the bytes (and is splittable, sharding/plan.h):
  // the plan's cut falls inside it, so both daemons hold rows of it.
  const std::vector<TestTensor> tensors = {{"w1", {2560, 1024}, RandomValues(2560 * 1024, 7)},
                                           {"w2", {512, 1024}, RandomValues(512 * 1024, 8)},
                                           {"b", {77}, RandomValues(77, 9, 0.1f)}};
  const std::string model = gpu.cluster().dir() + "/model.safetensors";
  ASSERT_TRUE(WriteModel(model, tensors).ok());
  const std::string recipe = R"txt(
    rule {
      pattern: "w1"
      spec {
        rowwise { format: FP8_CURRENT }
        columnwise { format: NVFP4 }
        columnwise_source: ROWWISE_DEQUANTIZED
      }
    }
    rule {
      pattern: "w2"
      spec {
        rowwise { format: NVFP4 }
        columnwise { format: FP8_DELAYED amax_history_len: 4 }
      }
    }
    default_spec { rowwise { format: FP8_CURRENT } columnwise { format: MXFP8 } })txt";
  for (RawCluster* r : {&gpu, &cpu}) {
    absl::StatusOr<int64_t> v = r->Load(model, recipe);
    ASSERT_TRUE(v.ok()) << v.status() << r->cluster().Logs();
  }
  EXPECT_TRUE(absl::StrContains(gpu.cluster().Logs(), "amax all-reduce on the device over NCCL"))
      << gpu.cluster().Logs();
  absl::StatusOr<std::vector<QuantizedTensor>> pieces =
      gpu.FetchPieces(0, "w1", Direction::kRowwise);
  ASSERT_TRUE(pieces.ok()) << pieces.status();
  EXPECT_EQ(pieces->size(), 2u) << "w1 should be split across the daemons";
  ExpectSamePieces(0, gpu, cpu, tensors);
  for (int step = 0; step < kSteps; ++step) {
    std::map<std::string, std::vector<float>> grads;
    for (const TestTensor& t : tensors) {
      grads[t.name] = RandomValues(t.values.size(), 200 + step, 0.3f);
    }
    ASSERT_TRUE(gpu.PushAll(step, "trainer", grads).ok());
    ASSERT_TRUE(cpu.PushAll(step, "trainer", grads).ok());
    absl::StatusOr<int64_t> gv = gpu.WaitForVersion(step + 1);
    ASSERT_TRUE(gv.ok()) << gv.status() << gpu.cluster().Logs();
    ASSERT_TRUE(cpu.WaitForVersion(step + 1).ok());
    ExpectSamePieces(step + 1, gpu, cpu, tensors);
  }
}

// The gpu daemon reports its device memory (DaemonStats, through
// ShardBackend::memory()): equal to what a GpuShardStore built in this
// process for the same shards allocates, and at most 21 bytes per
// parameter for AdamW with FP8 current rowwise + columnwise and two
// published versions (all store buffers counted), also after an optimizer
// step from host-pushed gradients (which allocates the upload staging
// buffer). The cpu daemon reports the parameters and 0 device bytes.
TEST(GpuDaemonBackendMemoryTest, ReportsStoreDeviceBytesPerParameter) {
  constexpr int64_t kBigRows = 2048;
  constexpr int64_t kBigCols = 4096;
  std::unique_ptr<RawCluster> gpu = StartOne("gpu", "adamw");
  std::unique_ptr<RawCluster> cpu = StartOne("cpu", "adamw");
  ASSERT_NE(gpu, nullptr);
  ASSERT_NE(cpu, nullptr);
  const std::vector<TestTensor> tensors = {
      {"w", {kBigRows, kBigCols}, RandomValues(kBigRows * kBigCols, 11)},
      {"b", {kBigCols}, RandomValues(kBigCols, 12, 0.1f)}};
  const int64_t parameters = kBigRows * kBigCols + kBigCols;
  const std::string model = gpu->cluster().dir() + "/model.safetensors";
  ASSERT_TRUE(WriteModel(model, tensors).ok());
  const std::string recipe =
      "default_spec { rowwise { format: FP8_CURRENT } columnwise { format: FP8_CURRENT } }";
  for (RawCluster* r : {gpu.get(), cpu.get()}) {
    absl::StatusOr<int64_t> v = r->Load(model, recipe);
    ASSERT_TRUE(v.ok()) << v.status() << r->cluster().Logs();
  }

  // The store of the daemon's own shards (its view of the manifest), here.
  absl::StatusOr<ModelView> view = MakeModelView(gpu->manifest(), 0, 1);
  ASSERT_TRUE(view.ok()) << view.status();
  ShardBackendOptions options;
  options.optimizer.kind = OptimizerKind::kAdamW;
  absl::StatusOr<std::unique_ptr<ShardBackend>> local =
      CreateShardBackend(DaemonBackend::kGpu, view->tensors, view->shards, options);
  ASSERT_TRUE(local.ok()) << local.status();
  const gpu_backend::GpuShardStore* store = gpu_backend::DeviceStoreOf(local->get());
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->parameters(), parameters);
  EXPECT_EQ((*local)->memory().device_bytes, store->device_bytes());
  EXPECT_EQ((*local)->memory().parameters, store->parameters());

  // The fixed costs beside the per-parameter state: the upload staging of
  // host pushes (4 MiB) and the rounding of the two exportable slot
  // allocations to the VMM granularity (under one granule each).
  ASSERT_EQ(store->exported_regions().size(), 2u);
  absl::StatusOr<size_t> granule = ipc::VmmBuffer::Granularity(0);
  ASSERT_TRUE(granule.ok()) << granule.status();
  EXPECT_EQ(store->host_staging_bytes(), int64_t{4} << 20);
  EXPECT_GE(store->published_padding_bytes(), 0);
  EXPECT_LT(store->published_padding_bytes(), 2 * static_cast<int64_t>(*granule));
  const int64_t fixed = store->host_staging_bytes() + 2 * static_cast<int64_t>(*granule);
  // Masters, both moments, the accumulator (16 B) and both slots of FP8
  // row + col (4 B), plus a few hundred bytes of scalars and alignment.
  const double per_param = 20.01;
  EXPECT_LE(static_cast<double>(store->device_bytes() - store->published_padding_bytes() -
                                store->host_staging_bytes()) /
                parameters,
            per_param);

  absl::StatusOr<rpc::DaemonStats> loaded = gpu->Stats(0);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->backend(), "gpu");
  EXPECT_EQ(loaded->parameters(), parameters);
  EXPECT_EQ(loaded->device_bytes(), store->device_bytes());
  EXPECT_DOUBLE_EQ(loaded->device_bytes_per_parameter(), store->bytes_per_parameter());
  EXPECT_LE(loaded->device_bytes(), per_param * parameters + fixed);
  std::printf(
      "gpu daemon after load: %lld device bytes, %lld parameters, %.3f B/param "
      "(of which staging %lld B, VMM rounding %lld B of granule %zu)\n",
      static_cast<long long>(loaded->device_bytes()), static_cast<long long>(loaded->parameters()),
      loaded->device_bytes_per_parameter(), static_cast<long long>(store->host_staging_bytes()),
      static_cast<long long>(store->published_padding_bytes()), *granule);

  // Nothing is allocated at a push or a step.
  std::map<std::string, std::vector<float>> grads;
  for (const TestTensor& t : tensors) grads[t.name] = RandomValues(t.values.size(), 13, 0.3f);
  ASSERT_TRUE(gpu->PushAll(0, "trainer", grads).ok());
  ASSERT_TRUE(gpu->WaitForVersion(1).ok()) << gpu->cluster().Logs();
  absl::StatusOr<rpc::DaemonStats> stepped = gpu->Stats(0);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_EQ(stepped->device_bytes(), loaded->device_bytes());
  std::printf("gpu daemon after a pushed step: %lld device bytes, %.3f B/param\n",
              static_cast<long long>(stepped->device_bytes()),
              stepped->device_bytes_per_parameter());

  absl::StatusOr<rpc::DaemonStats> host = cpu->Stats(0);
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ(host->backend(), "cpu");
  EXPECT_EQ(host->parameters(), parameters);
  EXPECT_EQ(host->device_bytes(), 0);
  EXPECT_EQ(host->device_bytes_per_parameter(), 0.0);
}

// The per-parameter figure where the fixed costs are negligible: a store of
// 16 x [4096, 4096] (268 M parameters, 5.4 GB) with AdamW and FP8 current
// row + col takes 16 B of FP32 state and 4 B of published slots per
// parameter plus under 64 KiB of scalars and alignment, the 4 MiB upload
// staging and the slots' VMM rounding (0.03 B/param together at this
// size), before and after a host-pushed step.
TEST(GpuDaemonBackendMemoryTest, QuarterBillionParametersTakeTwentyBytesEach) {
  constexpr int kShards = 16;
  constexpr int64_t kRows = 4096, kCols = 4096;
  HybridSpec spec;
  spec.rowwise = DefaultQuantSpec(Format::kFp8Current);
  spec.columnwise = DefaultQuantSpec(Format::kFp8Current);
  std::vector<gpu_backend::GpuShardDef> defs;
  for (int i = 0; i < kShards; ++i) defs.push_back({absl::StrCat("w", i), kRows, kCols, spec, i});
  gpu_backend::GpuStoreOptions options;
  options.num_tensors = kShards;
  options.push_staging_buffers = 0;  // as the daemon's store (pushes arrive on the host)
  absl::StatusOr<std::unique_ptr<gpu_backend::GpuShardStore>> store =
      gpu_backend::GpuShardStore::Create(std::move(defs), options);
  ASSERT_TRUE(store.ok()) << store.status();
  const int64_t params = kShards * kRows * kCols;
  EXPECT_EQ((*store)->parameters(), params);
  const int64_t created = (*store)->device_bytes();
  EXPECT_GE(created, 20 * params);
  EXPECT_LE(created - (*store)->published_padding_bytes() - (*store)->host_staging_bytes(),
            20 * params + 65536);
  EXPECT_LE((*store)->bytes_per_parameter(), 20.05);
  const std::vector<float> g = RandomValues(kRows * kCols, 5, 0.3f);
  for (int i = 0; i < kShards; ++i) {
    ASSERT_TRUE((*store)->AccumulateHost(i, 0, g.data(), static_cast<int64_t>(g.size())).ok());
  }
  absl::Status step =
      (*store)->Step(1, /*apply_optimizer=*/true, nullptr, absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(step.ok()) << step;
  EXPECT_EQ((*store)->device_bytes(), created);
  std::printf("gpu store of %lld parameters: %lld device bytes = %.4f B/param after a step\n",
              static_cast<long long>(params), static_cast<long long>((*store)->device_bytes()),
              (*store)->bytes_per_parameter());
}

// A slow first host copy of the LATEST version (gRPC Fetch,
// export) does not hold up the step that retires the OLDER one, while a
// copy of the version a step retires (whose device slot it rewrites) does
// hold that step until the copy has read it. In process, one backend;
// PARAMD_GPU_HOST_COPY_DELAY_MS makes every host copy kDelay slower.
TEST(GpuHostCopiesTest, RetireWaitsOnlyForCopiesOfTheRetiredVersion) {
  constexpr absl::Duration kDelay = absl::Milliseconds(1000);
  TensorDef tensor;
  tensor.name = "w";
  tensor.rows = 256;
  tensor.cols = 512;
  tensor.spec.rowwise = DefaultQuantSpec(Format::kFp8Current);
  tensor.spec.columnwise = DefaultQuantSpec(Format::kFp8Current);
  ShardBackendOptions options;
  options.optimizer.kind = OptimizerKind::kAdamW;
  options.optimizer.lr = 0.01f;
  ASSERT_EQ(setenv("PARAMD_GPU_HOST_COPY_DELAY_MS",
                   absl::StrCat(absl::ToInt64Milliseconds(kDelay)).c_str(), 1),
            0);
  absl::StatusOr<std::unique_ptr<ShardBackend>> created =
      CreateShardBackend(DaemonBackend::kGpu, {tensor}, {{0, 0, tensor.rows}}, options);
  unsetenv("PARAMD_GPU_HOST_COPY_DELAY_MS");  // read once, at creation
  ASSERT_TRUE(created.ok()) << created.status();
  ShardBackend& backend = **created;
  backend.set_data_plane(nullptr, absl::Seconds(30));  // a single daemon
  const std::vector<float> values = RandomValues(tensor.rows * tensor.cols, 21);
  std::copy(values.begin(), values.end(), backend.load_master(0).begin());
  const AllReduceMaxFn none = [](absl::Span<float>) { return absl::OkStatus(); };
  auto step = [&](int64_t version) -> absl::StatusOr<std::shared_ptr<const PublishedVersion>> {
    if (version > 0) {
      const std::vector<float> g = RandomValues(values.size(), 30 + version, 0.3f);
      std::copy(g.begin(), g.end(), backend.gradient(0).begin());
    }
    return backend.Step(version, /*apply_optimizer=*/version > 0, none, /*update_delayed=*/true);
  };
  std::vector<std::shared_ptr<const PublishedVersion>> v;
  for (int64_t version = 0; version < 2; ++version) {
    absl::StatusOr<std::shared_ptr<const PublishedVersion>> p = step(version);
    ASSERT_TRUE(p.ok()) << p.status();
    v.push_back(*p);
  }
  const HostBytesFn host_bytes = backend.host_bytes();
  ASSERT_TRUE(host_bytes != nullptr);
  const int64_t data_bytes = v[1]->pieces[0].layout.data_bytes();
  ASSERT_GT(data_bytes, 0);

  // A first host copy of version 1 (the latest) in progress; the step to 2
  // retires version 0 and runs at once.
  auto copy1 = std::async(std::launch::async, [&] { return host_bytes(v[1]); });
  absl::SleepFor(absl::Milliseconds(100));
  absl::Time start = absl::Now();
  absl::StatusOr<std::shared_ptr<const PublishedVersion>> p2 = step(2);
  const absl::Duration step2 = absl::Now() - start;
  ASSERT_TRUE(p2.ok()) << p2.status();
  v.push_back(*p2);
  absl::StatusOr<std::shared_ptr<const PublishedVersion>> bytes1 = copy1.get();
  ASSERT_TRUE(bytes1.ok()) << bytes1.status();
  EXPECT_EQ((*bytes1)->version, 1);
  EXPECT_EQ(static_cast<int64_t>((*bytes1)->pieces[0].q.data.size()), data_bytes);
  EXPECT_LT(step2, kDelay / 2) << "the step to 2 waited for the host copy of version 1";
  EXPECT_TRUE(absl::IsNotFound(host_bytes(v[0]).status()));  // retired

  // A first host copy of the OLDER version holds the step that rewrites its
  // slot until it is done: step to 3 (retires 1, whose copy is done), then
  // copy 2 while the step to 4 retires it.
  absl::StatusOr<std::shared_ptr<const PublishedVersion>> p3 = step(3);
  ASSERT_TRUE(p3.ok()) << p3.status();
  auto copy2 = std::async(std::launch::async, [&] { return host_bytes(v[2]); });
  absl::SleepFor(absl::Milliseconds(100));
  start = absl::Now();
  absl::StatusOr<std::shared_ptr<const PublishedVersion>> p4 = step(4);
  const absl::Duration step4 = absl::Now() - start;
  ASSERT_TRUE(p4.ok()) << p4.status();
  absl::StatusOr<std::shared_ptr<const PublishedVersion>> bytes2 = copy2.get();
  ASSERT_TRUE(bytes2.ok()) << bytes2.status();
  EXPECT_EQ((*bytes2)->version, 2);
  EXPECT_GE(step4, kDelay - absl::Milliseconds(200))
      << "the step to 4 rewrote version 2's slot while it was being copied";
  EXPECT_TRUE(absl::IsNotFound(host_bytes(v[2]).status()));
  std::printf(
      "host copy delay %s: step to 2 (retires 0, copy of 1 running) took %s; "
      "step to 4 (retires 2, copy of 2 running) took %s\n",
      absl::FormatDuration(kDelay).c_str(), absl::FormatDuration(step2).c_str(),
      absl::FormatDuration(step4).c_str());
}

}  // namespace
}  // namespace testing
}  // namespace paramd
