// Multi-process restore: a run (coordinator + 2 daemon processes, AdamW,
// delayed/current/MXFP8/NVFP4 formats) is checkpointed at version 3 and
// stepped once more; fresh clusters of 1 and 3 daemons restore the
// checkpoint (resharded), republish version 3, and from the same gradient
// publish version 4 byte-identical to the uninterrupted run. A damaged
// checkpoint is refused with DATA_LOSS naming the file.
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "proto/checkpoint_service.grpc.pb.h"
#include "tests/checkpoint_test_util.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

constexpr char kRecipe[] = R"txt(
  rule {
    pattern: "w1"
    spec {
      rowwise { format: FP8_DELAYED amax_history_len: 4 }
      columnwise { format: MXFP8 }
    }
  }
  rule {
    pattern: "w2"
    spec {
      rowwise { format: NVFP4 }
      columnwise { format: FP8_CURRENT }
      columnwise_source: ROWWISE_DEQUANTIZED
    }
  }
  default_spec { rowwise { format: IDENTITY_FP32 } columnwise { format: IDENTITY_BF16 } })txt";

const std::vector<TestTensor>& Model() {
  static const auto* model =
      new std::vector<TestTensor>{{"w1", {520, 200}, RandomValues(520 * 200, 1)},
                                  {"w2", {300, 96}, RandomValues(300 * 96, 2)},
                                  {"b", {77}, RandomValues(77, 3)}};
  return *model;
}

std::map<std::string, std::vector<float>> Gradient(int64_t version) {
  std::map<std::string, std::vector<float>> g;
  for (const TestTensor& t : Model()) {
    g[t.name] = RandomValues(t.values.size(), 100 + version, 0.05f * (1 + version));
  }
  return g;
}

using Published = std::map<std::tuple<std::string, int>, QuantizedTensor>;

Published FetchAll(RawCluster& cluster, int64_t version) {
  Published out;
  for (const TestTensor& t : Model()) {
    for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
      absl::StatusOr<QuantizedTensor> q = cluster.FetchAssembled(version, t.name, d);
      EXPECT_TRUE(q.ok()) << q.status();
      if (q.ok()) out[{t.name, static_cast<int>(d)}] = *std::move(q);
    }
  }
  return out;
}

void ExpectSame(const Published& want, const Published& got, const std::string& what) {
  ASSERT_EQ(want.size(), got.size());
  for (const auto& [key, q] : want) {
    SCOPED_TRACE(absl::StrCat(what, " ", std::get<0>(key), " direction ", std::get<1>(key)));
    const QuantizedTensor& g = got.at(key);
    EXPECT_EQ(g.data, q.data);
    EXPECT_EQ(g.scales, q.scales);
    EXPECT_EQ(g.scale_inv, q.scale_inv);
  }
}

TestClusterOptions Options(int daemons, const std::string& checkpoint_dir) {
  TestClusterOptions o;
  o.daemons = daemons;
  o.expected_pushers = 1;
  o.optimizer = "adamw";
  o.lr = 0.01;
  if (!checkpoint_dir.empty()) {
    o.coordinator_flags = {"--checkpoint_dir=" + checkpoint_dir};
    o.daemon_flags = {"--checkpoint_dir=" + checkpoint_dir};
  }
  return o;
}

TEST(CheckpointRestoreTest, RestoredClustersContinueByteIdentically) {
  absl::StatusOr<demo::TempDir> ckpt = demo::TempDir::Create("paramd_restore");
  ASSERT_TRUE(ckpt.ok());
  Published v3, v4;
  {
    absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(Options(2, ckpt->path()));
    ASSERT_TRUE(c.ok()) << c.status();
    RawCluster& a = **c;
    const std::string model = a.cluster().dir() + "/model.safetensors";
    ASSERT_TRUE(WriteModel(model, Model()).ok());
    ASSERT_TRUE(a.Load(model, kRecipe).ok());
    for (int64_t v = 0; v < 3; ++v) {
      ASSERT_TRUE(a.PushAll(v, "trainer", Gradient(v)).ok());
      ASSERT_TRUE(a.WaitForVersion(v + 1).ok());
    }
    const grpc::Status s = Checkpoint(a, 3);
    ASSERT_TRUE(s.ok()) << s.error_message() << a.cluster().Logs();
    v3 = FetchAll(a, 3);
    ASSERT_TRUE(a.PushAll(3, "trainer", Gradient(3)).ok());
    ASSERT_TRUE(a.WaitForVersion(4).ok());
    v4 = FetchAll(a, 4);
  }
  for (int daemons : {1, 3}) {
    SCOPED_TRACE(absl::StrCat(daemons, " daemons"));
    absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(Options(daemons, ""));
    ASSERT_TRUE(c.ok()) << c.status();
    RawCluster& b = **c;
    absl::StatusOr<int64_t> v = Restore(b, ckpt->path());
    ASSERT_TRUE(v.ok()) << v.status() << b.cluster().Logs();
    EXPECT_EQ(*v, 3);
    EXPECT_EQ(b.manifest().daemons_size(), daemons);
    ExpectSame(v3, FetchAll(b, 3), "republished v3");
    ASSERT_TRUE(b.PushAll(3, "trainer", Gradient(3)).ok());
    ASSERT_TRUE(b.WaitForVersion(4).ok());
    ExpectSame(v4, FetchAll(b, 4), "v4 after restore");
  }
}

TEST(CheckpointRestoreTest, DamagedCheckpointIsDataLossNamingTheFile) {
  absl::StatusOr<demo::TempDir> ckpt = demo::TempDir::Create("paramd_damaged");
  ASSERT_TRUE(ckpt.ok());
  absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(Options(2, ckpt->path()));
  ASSERT_TRUE(c.ok()) << c.status();
  RawCluster& a = **c;
  const std::string model = a.cluster().dir() + "/model.safetensors";
  ASSERT_TRUE(WriteModel(model, Model()).ok());
  ASSERT_TRUE(a.Load(model, kRecipe).ok());
  ASSERT_TRUE(Checkpoint(a, 0).ok());
  // Flip one byte in the middle of one shard file.
  std::string victim;
  for (const auto& e : std::filesystem::recursive_directory_iterator(ckpt->path())) {
    if (e.is_regular_file() && e.file_size() > 4096 &&
        e.path().filename().string().find("manifest") == std::string::npos) {
      victim = e.path().string();
      break;
    }
  }
  ASSERT_FALSE(victim.empty());
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(2048);
    char byte = 0;
    f.read(&byte, 1);
    byte ^= 0x10;
    f.seekp(2048);
    f.write(&byte, 1);
  }
  absl::StatusOr<int64_t> v = Restore(a, ckpt->path());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDataLoss) << v.status();
  EXPECT_NE(v.status().message().find(std::filesystem::path(victim).filename().string()),
            std::string::npos)
      << v.status();
  // The cluster still serves the model it had.
  EXPECT_TRUE(a.WaitForVersion(0).ok());
}

}  // namespace
}  // namespace testing
}  // namespace paramd
