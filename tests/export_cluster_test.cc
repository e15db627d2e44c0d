// `hpctl export` end to end: the //hpctl binary, run as a process, against a
// coordinator and two hybrid-paramd daemon processes holding a model with a
// tensor split across both daemons. The output is checked twice:
//   - here, in C++: the index lists every tensor exactly once, in the shard
//     file that holds it, with its logical shape, and nothing else lies in
//     the directory; every BF16 value is ref::EncodeBf16 of the master the
//     daemons hold (read back through ExportRows; equal to the masters the
//     test computes itself), every FP32 value is the master bit for bit;
//   - by tests/read_safetensors.py, an independent reader (Python standard
//     library + struct) that recomputes BF16 round-to-nearest-even.
// Also --direction rowwise|columnwise (the dequantized published copies),
// an older version served from a checkpoint (taken with `hpctl checkpoint`),
// and a version nobody holds (refused, no index written).
#include <dirent.h>
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/base/casts.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/reference.h"
#include "nlohmann/json.hpp"
#include "safetensors/safetensors.h"
#include "tests/checkpoint_test_util.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

constexpr float kLr = 0.5f;
constexpr char kRecipe[] = R"txt(
  rule {
    pattern: "model\\.embed\\.weight"
    spec {
      rowwise { format: FP8_CURRENT }
      columnwise { format: MXFP8 }
    }
  }
  rule {
    pattern: "lm_head\\.weight"
    spec {
      rowwise { format: NVFP4 }
      columnwise { format: FP8_DELAYED amax_history_len: 4 }
    }
  }
  default_spec { rowwise { format: IDENTITY_FP32 } columnwise { format: IDENTITY_BF16 } })txt";

// FP32 bit patterns at the edges of BF16 round-to-nearest-even: ties to
// even (down and up), just off ties, overflow to Inf, -0, subnormals, NaNs
// with payloads. (No Inf master: the daemon's SGD step computes
// w - lr * (g + weight_decay * w), and 0 * Inf is NaN.)
const uint32_t kSpecialBits[] = {0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x3F808001,
                                 0x3F807FFF, 0x7F7FFFFF, 0x7F7F7FFF, 0xFF7FFFFF, 0x80000000,
                                 0x00000001, 0x00008000, 0x00018000, 0x807FFFFF, 0x7FC12345,
                                 0xFFC00001, 0x7F800001, 0x3F800000};

const std::vector<TestTensor>& Model() {
  static const auto* model = [] {
    auto* m = new std::vector<TestTensor>{
        {"model.embed.weight", {384, 256}, RandomValues(384 * 256, 21)},  // split
        {"model.special", {4, 64}, RandomValues(4 * 64, 22)},
        {"lm_head.weight", {300, 128}, RandomValues(300 * 128, 23)},
        {"model.norm.bias", {77}, RandomValues(77, 24)}};
    std::vector<float>& special = (*m)[1].values;
    for (size_t i = 0; i < sizeof(kSpecialBits) / sizeof(kSpecialBits[0]); ++i) {
      special[3 * i] = absl::bit_cast<float>(kSpecialBits[i]);
    }
    return m;
  }();
  return *model;
}

// Pushed for version 0 (not for model.special: its masters stay as loaded).
std::map<std::string, std::vector<float>> Gradient(int64_t version) {
  std::map<std::string, std::vector<float>> g;
  for (const TestTensor& t : Model()) {
    if (t.name == "model.special") continue;
    g[t.name] = RandomValues(static_cast<int64_t>(t.values.size()),
                             static_cast<uint32_t>(300 + version), 0.1f);
  }
  return g;
}

bool SameFloat(float a, float b) {
  return std::isnan(a) ? std::isnan(b) : absl::bit_cast<uint32_t>(a) == absl::bit_cast<uint32_t>(b);
}

std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
        names.push_back(e->d_name);
      }
    }
    closedir(d);
  }
  return names;
}

class ExportClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ckpt = demo::TempDir::Create("export_ckpt");
    ASSERT_TRUE(ckpt.ok());
    ckpt_ = std::make_unique<demo::TempDir>(*std::move(ckpt));
    TestClusterOptions o;
    o.daemons = 2;
    o.expected_pushers = 1;
    o.optimizer = "sgd";
    o.lr = kLr;
    o.coordinator_flags = {"--checkpoint_dir=" + ckpt_->path()};
    o.daemon_flags = {"--checkpoint_dir=" + ckpt_->path()};
    auto c = RawCluster::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = *std::move(c);
    dir_ = cluster_->cluster().dir();
    python_ = FindOnPath("python3");
    ASSERT_FALSE(python_.empty()) << "python3 not found";
    const std::string path = dir_ + "/model.safetensors";
    ASSERT_TRUE(WriteModel(path, Model()).ok());
    ASSERT_TRUE(cluster_->Load(path, kRecipe).ok()) << cluster_->cluster().Logs();
    // The split: model.embed.weight has rows on both daemons.
    std::set<int> ranks;
    for (const rpc::ShardPiece& p : cluster_->manifest().pieces()) {
      if (p.tensor() == "model.embed.weight") ranks.insert(p.daemon_rank());
    }
    ASSERT_EQ(ranks.size(), 2u) << "model.embed.weight is not split across the daemons";
    ASSERT_TRUE(cluster_->PushAll(0, "trainer", Gradient(0)).ok());
    ASSERT_TRUE(cluster_->WaitForVersion(1).ok());
    // The masters of v1, computed here and as the daemons hold them.
    const auto g = Gradient(0);
    for (const TestTensor& t : Model()) {
      std::vector<float> want = t.values;
      if (g.count(t.name) > 0) {
        for (size_t i = 0; i < want.size(); ++i) want[i] -= kLr * g.at(t.name)[i];
      }
      absl::StatusOr<std::vector<float>> got = ExportMasters(*cluster_, 1, t.name);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->size(), want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_TRUE(SameFloat((*got)[i], want[i])) << t.name << "[" << i << "]";
      }
      masters_[t.name] = *std::move(got);
    }
  }

  ProgramRun Hpctl(std::vector<std::string> args) {
    args.insert(args.begin(), "hpctl/hpctl");
    args.push_back("--address=" + cluster_->cluster().coordinator_address());
    args.push_back("--timeout=30");
    return RunProgram(args, dir_);
  }

  // tests/read_safetensors.py on `out`, comparing with `values` (written
  // as its masters.json + <name>.f32).
  ProgramRun Reader(const std::string& out, const std::map<std::string, std::vector<float>>& values,
                    const std::string& dtype) {
    const std::string masters = out + ".masters";
    EXPECT_EQ(mkdir(masters.c_str(), 0755), 0);
    nlohmann::json shapes = nlohmann::json::object();
    for (const TestTensor& t : Model()) {
      shapes[t.name] = t.shape;
      const std::vector<float>& v = values.at(t.name);
      std::ofstream(masters + "/" + t.name + ".f32", std::ios::binary)
          .write(reinterpret_cast<const char*>(v.data()),
                 static_cast<std::streamsize>(v.size() * 4));
    }
    std::ofstream(masters + "/masters.json") << shapes.dump();
    return RunProgram({python_, "tests/read_safetensors.py", out, "--masters", masters, "--dtype",
                       dtype, "--format", "pt"},
                      dir_);
  }

  // Checks the export in `out` against `values` (BF16: ref::EncodeBf16 of
  // each; FP32: the bits), and its index and directory. Returns the number
  // of shard files.
  int CheckExport(const std::string& out, const std::map<std::string, std::vector<float>>& values,
                  bool bf16) {
    std::ifstream in(out + "/model.safetensors.index.json");
    nlohmann::json index = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(index.is_discarded()) << "index of " << out;
    if (index.is_discarded()) return 0;
    const nlohmann::json& weight_map = index["weight_map"];
    EXPECT_EQ(weight_map.size(), Model().size());
    std::set<std::string> files;
    uint64_t total = 0;
    std::map<std::string, int> listed;  // tensor -> shard files holding it
    for (auto it = weight_map.begin(); it != weight_map.end(); ++it) files.insert(it.value());
    for (const std::string& file : files) {
      auto f = safetensors::SafetensorsFile::Open(out + "/" + file);
      EXPECT_TRUE(f.ok()) << f.status();
      if (!f.ok()) continue;
      EXPECT_EQ(f->metadata().at("format"), "pt") << file;
      for (const safetensors::TensorInfo& t : f->tensors()) {
        ++listed[t.name];
        total += t.num_bytes();
        EXPECT_EQ(weight_map.value(t.name, ""), file) << t.name;
      }
    }
    EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
    // Nothing else in the directory (no temporary files left).
    for (const std::string& name : ListDir(out)) {
      EXPECT_TRUE(name == "model.safetensors.index.json" || files.count(name) > 0)
          << "unexpected file " << name << " in " << out;
    }
    for (const TestTensor& t : Model()) {
      SCOPED_TRACE(t.name);
      EXPECT_EQ(listed[t.name], 1) << "shard files holding it";
      auto f = safetensors::SafetensorsFile::Open(out + "/" + weight_map.value(t.name, ""));
      if (!f.ok()) continue;
      const safetensors::TensorInfo* info = f->Find(t.name);
      if (info == nullptr) continue;
      EXPECT_EQ(info->shape, t.shape);
      EXPECT_EQ(info->dtype, bf16 ? safetensors::Dtype::kBF16 : safetensors::Dtype::kF32);
      auto bytes = f->ReadTensor(t.name);
      EXPECT_TRUE(bytes.ok());
      const std::vector<float>& want = values.at(t.name);
      const size_t width = bf16 ? 2 : 4;
      EXPECT_EQ(bytes->size(), want.size() * width);
      if (!bytes.ok() || bytes->size() != want.size() * width) continue;
      int bad = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        if (bf16) {
          uint16_t got;
          std::memcpy(&got, bytes->data() + 2 * i, 2);
          if (got != ref::EncodeBf16(want[i]) && bad++ < 3) {
            ADD_FAILURE() << "[" << i << "] 0x" << std::hex << got << ", want 0x"
                          << ref::EncodeBf16(want[i]);
          }
        } else if (std::memcmp(bytes->data() + 4 * i, &want[i], 4) != 0 && bad++ < 3) {
          ADD_FAILURE() << "[" << i << "] FP32 bits differ";
        }
      }
      EXPECT_EQ(bad, 0);
    }
    return static_cast<int>(files.size());
  }

  std::unique_ptr<demo::TempDir> ckpt_;
  std::unique_ptr<RawCluster> cluster_;
  std::string dir_;
  std::string python_;
  std::map<std::string, std::vector<float>> masters_;  // of version 1
};

TEST_F(ExportClusterTest, Bf16AndFp32OfTheMastersFromTwoDaemons) {
  const std::string bf16 = dir_ + "/bf16";
  ProgramRun run = Hpctl({"export", "--out", bf16, "--max_shard_size", "60KB"});
  ASSERT_EQ(run.exit_code, 0) << run.out << cluster_->cluster().Logs();
  EXPECT_TRUE(absl::StrContains(run.out, "exported version 1 (bf16, master): 4 tensors"))
      << run.out;
  // Greedy in manifest order: embed (196608 B, alone), special (512 B),
  // lm_head (76800 B, alone), bias (154 B).
  EXPECT_EQ(CheckExport(bf16, masters_, /*bf16=*/true), 4) << "shards of at most 60 KB";
  ProgramRun reader = Reader(bf16, masters_, "bf16");
  EXPECT_EQ(reader.exit_code, 0) << reader.out;
  EXPECT_TRUE(absl::StrContains(reader.out, "OK: ")) << reader.out;
  EXPECT_TRUE(absl::StrContains(reader.out, " 4 tensor(s)")) << reader.out;

  const std::string fp32 = dir_ + "/fp32";
  run = Hpctl({"export", "--out", fp32, "--dtype", "fp32"});
  ASSERT_EQ(run.exit_code, 0) << run.out;
  EXPECT_TRUE(absl::StrContains(run.out, "exported version 1 (fp32, master)")) << run.out;
  EXPECT_EQ(CheckExport(fp32, masters_, /*bf16=*/false), 1) << "one shard under 5GB";
  reader = Reader(fp32, masters_, "fp32");
  EXPECT_EQ(reader.exit_code, 0) << reader.out;

  // The independent reader notices a changed value (so its OK means something).
  {
    std::fstream f(fp32 + "/model-00001-of-00001.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    char byte = 0;
    f.read(&byte, 1);
    byte ^= 0x01;
    f.seekp(-1, std::ios::end);
    f.write(&byte, 1);
  }
  std::string tampered = fp32 + "2";
  ASSERT_EQ(rename(fp32.c_str(), tampered.c_str()), 0);
  reader = Reader(tampered, masters_, "fp32");
  EXPECT_EQ(reader.exit_code, 1) << reader.out;
}

TEST_F(ExportClusterTest, DirectionsExportTheDequantizedPublishedCopies) {
  for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
    SCOPED_TRACE(DirectionName(d));
    std::map<std::string, std::vector<float>> want;
    int differ = 0;
    for (const TestTensor& t : Model()) {
      absl::StatusOr<QuantizedTensor> q = cluster_->FetchAssembled(1, t.name, d);
      ASSERT_TRUE(q.ok()) << q.status();
      const HybridSpec spec = cluster_->spec(t.name);
      absl::StatusOr<std::vector<float>> values =
          ref::Dequantize(*q, d == Direction::kRowwise ? spec.rowwise : spec.columnwise);
      ASSERT_TRUE(values.ok()) << values.status();
      for (size_t i = 0; i < values->size(); ++i) {
        differ += !SameFloat((*values)[i], masters_.at(t.name)[i]);
      }
      want[t.name] = *std::move(values);
    }
    EXPECT_GT(differ, 0) << "the quantized copies cannot all equal the masters";
    const std::string out = absl::StrCat(dir_, "/", DirectionName(d));
    ProgramRun run = Hpctl({"export", "--out", out, "--direction", std::string(DirectionName(d))});
    ASSERT_EQ(run.exit_code, 0) << run.out;
    EXPECT_TRUE(absl::StrContains(run.out, absl::StrCat("(bf16, ", DirectionName(d), ")")))
        << run.out;
    CheckExport(out, want, /*bf16=*/true);
    ProgramRun reader = Reader(out, want, "bf16");
    EXPECT_EQ(reader.exit_code, 0) << reader.out;
  }
  ProgramRun bad = Hpctl({"export", "--out", dir_ + "/x", "--direction", "diagonal"});
  EXPECT_EQ(bad.exit_code, 2) << bad.out;
}

TEST_F(ExportClusterTest, OlderVersionComesFromItsCheckpoint) {
  ProgramRun run = Hpctl({"checkpoint"});
  ASSERT_EQ(run.exit_code, 0) << run.out << cluster_->cluster().Logs();
  EXPECT_TRUE(absl::StrContains(run.out, "checkpoint of version 1")) << run.out;
  // The daemons move on to v2 (they keep v1's published copies, not its
  // masters).
  ASSERT_TRUE(cluster_->PushAll(1, "trainer", Gradient(1)).ok());
  ASSERT_TRUE(cluster_->WaitForVersion(2).ok());

  const std::string v1 = dir_ + "/v1";
  run = Hpctl({"export", "--out", v1, "--version", "1", "--max_shard_size", "150KB"});
  ASSERT_EQ(run.exit_code, 0) << run.out << cluster_->cluster().Logs();
  EXPECT_TRUE(absl::StrContains(run.out, "exported version 1 (bf16, master)")) << run.out;
  EXPECT_GE(CheckExport(v1, masters_, /*bf16=*/true), 2);
  ProgramRun reader = Reader(v1, masters_, "bf16");
  EXPECT_EQ(reader.exit_code, 0) << reader.out;

  // Version 0: neither in memory nor checkpointed.
  const std::string v0 = dir_ + "/v0";
  run = Hpctl({"export", "--out", v0, "--version", "0"});
  EXPECT_EQ(run.exit_code, 1) << run.out;
  EXPECT_TRUE(absl::StrContains(run.out, "FAILED_PRECONDITION")) << run.out;
  std::ifstream index(v0 + "/model.safetensors.index.json");
  EXPECT_FALSE(index.good()) << "an index was written for a failed export";
}

}  // namespace
}  // namespace testing
}  // namespace paramd
