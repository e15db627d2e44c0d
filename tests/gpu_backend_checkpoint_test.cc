// GPU only (tag gpu; --config=cuda on a machine with a GPU). Checkpoint
// write, export and restore through a --backend=gpu daemon (its host_state
// mirror downloaded from / uploaded to the device) against the cpu backend,
// for AdamW and SGD with momentum, on a model with FP8 delayed (history
// state), MXFP8, NVFP4 -> FP8 current rowwise_dequantized and identity
// copies:
//   - after 3 steps both clusters checkpoint version 3: every shard file
//     (masters, moments, scaling state, optimizer blob) is byte-identical,
//     and so is the export snapshot (FP32 masters through ExportRows and
//     every published byte);
//   - a fresh gpu daemon restores the gpu checkpoint (--restore_from): the
//     republished version 3 and, from the same gradient, version 4 equal
//     the cpu cluster's uninterrupted ones.
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "deploy/process.h"
#include "gtest/gtest.h"
#include "tests/checkpoint_test_util.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

// A rowwise_dequantized copy that needs the second all-reduce round (NVFP4
// rowwise -> FP8 current columnwise), delayed scaling with a history, and
// identity copies of the FP32 masters.
constexpr char kRecipe[] = R"txt(
  rule {
    pattern: "a"
    spec {
      rowwise { format: NVFP4 }
      columnwise { format: FP8_CURRENT }
      columnwise_source: ROWWISE_DEQUANTIZED
    }
  }
  rule {
    pattern: "b"
    spec {
      rowwise { format: FP8_DELAYED amax_history_len: 3 }
      columnwise { format: MXFP8 }
    }
  }
  default_spec { rowwise { format: IDENTITY_BF16 } columnwise { format: IDENTITY_FP32 } })txt";

const std::vector<TestTensor>& Model() {
  static const auto* model = new std::vector<TestTensor>{{"a", {200, 160}, RandomValues(32000, 4)},
                                                         {"b", {130, 64}, RandomValues(8320, 5)},
                                                         {"c", {33}, RandomValues(33, 6)}};
  return *model;
}

// Gradient of step `v` (the same for both clusters).
std::map<std::string, std::vector<float>> Gradient(int64_t v) {
  std::map<std::string, std::vector<float>> out;
  for (const TestTensor& t : Model()) out[t.name] = RandomValues(t.values.size(), 50 + v, 0.1f);
  return out;
}

TestClusterOptions Options(const std::string& backend, const std::string& optimizer,
                           const std::string& checkpoint_dir, const std::string& restore_from) {
  TestClusterOptions o;
  o.daemons = 1;
  o.expected_pushers = 1;
  o.optimizer = optimizer;
  o.lr = optimizer == "sgd" ? 0.05 : 0.01;
  o.momentum = optimizer == "sgd" ? 0.9 : 0.0;
  o.coordinator_flags = {"--checkpoint_dir=" + checkpoint_dir};
  if (!restore_from.empty()) o.coordinator_flags.push_back("--restore_from=" + restore_from);
  o.daemon_flags = {"--checkpoint_dir=" + checkpoint_dir, "--backend=" + backend,
                    "--weight_decay=0.01"};
  return o;
}

// Relative path -> bytes of every checkpoint file but the manifests (they
// carry a creation time).
std::map<std::string, std::string> ShardFiles(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    const std::string rel = std::filesystem::relative(e.path(), dir).string();
    if (absl::StrContains(absl::AsciiStrToLower(rel), "manifest")) continue;
    std::ifstream in(e.path(), std::ios::binary);
    std::stringstream bytes;
    bytes << in.rdbuf();
    files[rel] = bytes.str();
  }
  return files;
}

class GpuBackendCheckpointTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GpuBackendCheckpointTest, CheckpointExportRestoreEqualCpuBackend) {
  const std::string optimizer = GetParam();
  absl::StatusOr<demo::TempDir> gpu_dir = demo::TempDir::Create("paramd_gpu_ckpt");
  absl::StatusOr<demo::TempDir> cpu_dir = demo::TempDir::Create("paramd_cpu_ckpt");
  ASSERT_TRUE(gpu_dir.ok() && cpu_dir.ok());
  absl::StatusOr<std::unique_ptr<RawCluster>> g =
      RawCluster::Start(Options("gpu", optimizer, gpu_dir->path(), ""));
  absl::StatusOr<std::unique_ptr<RawCluster>> c =
      RawCluster::Start(Options("cpu", optimizer, cpu_dir->path(), ""));
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_TRUE(c.ok()) << c.status();
  RawCluster& gpu = **g;
  RawCluster& cpu = **c;
  const std::string model = gpu.cluster().dir() + "/model.safetensors";
  ASSERT_TRUE(WriteModel(model, Model()).ok());
  for (RawCluster* r : {&gpu, &cpu}) {
    absl::StatusOr<int64_t> v = r->Load(model, kRecipe);
    ASSERT_TRUE(v.ok()) << v.status() << r->cluster().Logs();
    for (int64_t step = 0; step < 3; ++step) {
      ASSERT_TRUE(r->PushAll(step, "trainer", Gradient(step)).ok());
      ASSERT_TRUE(r->WaitForVersion(step + 1).ok()) << r->cluster().Logs();
    }
    const grpc::Status s = CheckpointVia(r->cluster().coordinator_address(), 3, absl::Seconds(30));
    ASSERT_TRUE(s.ok()) << s.error_message() << r->cluster().Logs();
  }
  // Checkpoint files.
  const std::map<std::string, std::string> want_files = ShardFiles(cpu_dir->path());
  const std::map<std::string, std::string> got_files = ShardFiles(gpu_dir->path());
  ASSERT_FALSE(want_files.empty());
  ASSERT_EQ(got_files.size(), want_files.size());
  for (const auto& [name, bytes] : want_files) {
    auto it = got_files.find(name);
    ASSERT_NE(it, got_files.end()) << name;
    EXPECT_TRUE(it->second == bytes)
        << name << " differs (" << it->second.size() << " vs " << bytes.size() << " bytes)";
  }
  // Export: masters and every published byte of version 3.
  absl::StatusOr<Snapshot> want3 = TakeSnapshot(cpu, 3);
  absl::StatusOr<Snapshot> got3 = TakeSnapshot(gpu, 3);
  ASSERT_TRUE(want3.ok()) << want3.status();
  ASSERT_TRUE(got3.ok()) << got3.status() << gpu.cluster().Logs();
  EXPECT_EQ(CompareSnapshots(*want3, *got3), "");
  // The cpu cluster's uninterrupted version 4.
  ASSERT_TRUE(cpu.PushAll(3, "trainer", Gradient(3)).ok());
  ASSERT_TRUE(cpu.WaitForVersion(4).ok());
  absl::StatusOr<Snapshot> want4 = TakeSnapshot(cpu, 4);
  ASSERT_TRUE(want4.ok()) << want4.status();

  // A fresh gpu daemon restores the gpu checkpoint.
  g->reset();
  absl::StatusOr<std::unique_ptr<RawCluster>> r =
      RawCluster::Start(Options("gpu", optimizer, gpu_dir->path(), gpu_dir->path()));
  ASSERT_TRUE(r.ok()) << r.status();
  RawCluster& restored = **r;
  absl::StatusOr<int64_t> v = restored.WaitForVersion(3);
  ASSERT_TRUE(v.ok()) << v.status() << restored.cluster().Logs();
  ASSERT_EQ(*v, 3);
  ASSERT_TRUE(restored.RefreshManifest().ok());
  absl::StatusOr<Snapshot> restored3 = TakeSnapshot(restored, 3);
  ASSERT_TRUE(restored3.ok()) << restored3.status() << restored.cluster().Logs();
  EXPECT_EQ(CompareSnapshots(*want3, *restored3), "") << "republished version 3";
  ASSERT_TRUE(restored.PushAll(3, "trainer", Gradient(3)).ok());
  ASSERT_TRUE(restored.WaitForVersion(4).ok()) << restored.cluster().Logs();
  absl::StatusOr<Snapshot> restored4 = TakeSnapshot(restored, 4);
  ASSERT_TRUE(restored4.ok()) << restored4.status();
  EXPECT_EQ(CompareSnapshots(*want4, *restored4), "") << "version 4 after the restore";
}

INSTANTIATE_TEST_SUITE_P(Optimizers, GpuBackendCheckpointTest, ::testing::Values("adamw", "sgd"));

}  // namespace
}  // namespace testing
}  // namespace paramd
