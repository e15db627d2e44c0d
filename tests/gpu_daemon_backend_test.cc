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
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/format.h"
#include "kernels/reference.h"
#include "server/convert.h"
#include "server/reference_step.h"
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
class GpuDaemonBackendTest
    : public ::testing::TestWithParam<std::tuple<FormatCombo, std::string>> {
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
  const std::string recipe =
      absl::StrCat("default_spec { ", std::get<0>(GetParam()).spec, " }");
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
  const std::string recipe = R"pb(
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
    default_spec { rowwise { format: FP8_CURRENT } columnwise { format: MXFP8 } })pb";
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

}  // namespace
}  // namespace testing
}  // namespace paramd
