// hpctl's cluster commands (load, status, fetch, step) as an operator runs
// them: the //hpctl:hpctl binary against a coordinator and two daemon
// processes.
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "deploy/process.h"
#include "nlohmann/json.hpp"
#include "safetensors/safetensors.h"
#include "tests/client_cluster.h"

namespace paramd {
namespace {

constexpr char kRecipe[] = R"txt(
  name: "hpctl_test"
  rule {
    pattern: "w\\.weight"
    spec {
      rowwise { format: NVFP4 }
      columnwise { format: FP8_CURRENT }
    }
  }
  default_spec {
    rowwise { format: MXFP8 }
    columnwise { format: MXFP8 }
    columnwise_source: ROWWISE_DEQUANTIZED
  }
)txt";

struct HpctlRun {
  int exit_code = -1;
  std::string out;  // stdout and stderr
};

class HpctlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cluster = testing::TestCluster::Start({});
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    dir_ = cluster_->dir();
    // w.weight [384][256] is large enough to be cut into 128-row pieces.
    values_.resize(384 * 256);
    for (size_t i = 0; i < values_.size(); ++i) {
      values_[i] = std::sin(0.001f * i) * (1 + i % 5);
    }
    std::vector<float> v(64 * 64, 0.25f);
    auto writer = safetensors::SafetensorsWriter::Create(
        dir_ + "/model.safetensors", {{"w.weight", safetensors::Dtype::kF32, {384, 256}},
                                      {"v.weight", safetensors::Dtype::kF32, {64, 64}}});
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE((*writer)->WriteTensor("w.weight", Bytes(values_)).ok());
    ASSERT_TRUE((*writer)->WriteTensor("v.weight", Bytes(v)).ok());
    ASSERT_TRUE((*writer)->Finish().ok());
    std::ofstream(dir_ + "/recipe.textproto") << kRecipe;
  }

  static absl::Span<const uint8_t> Bytes(const std::vector<float>& v) {
    return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(v.data()), v.size() * 4);
  }

  HpctlRun Hpctl(std::vector<std::string> args) {
    args.insert(args.begin(), "hpctl/hpctl");
    args.push_back("--address=" + cluster_->coordinator_address());
    if (std::none_of(args.begin(), args.end(),
                     [](const std::string& a) { return absl::StartsWith(a, "--timeout="); })) {
      args.push_back("--timeout=20");
    }
    const std::string log = absl::StrCat(dir_, "/hpctl", ++runs_, ".out");
    demo::ChildProcesses children;
    HpctlRun run;
    auto index = children.Start({"hpctl", args, log, log});
    EXPECT_TRUE(index.ok()) << index.status();
    if (!index.ok()) return run;
    auto status = children.Wait(*index, absl::Seconds(30));
    EXPECT_TRUE(status.ok()) << status.status();
    if (status.ok() && WIFEXITED(*status)) run.exit_code = WEXITSTATUS(*status);
    std::ifstream in(log);
    std::stringstream text;
    text << in.rdbuf();
    run.out = text.str();
    return run;
  }

  // `hpctl load`, retried while the daemons are still joining.
  void Load() {
    HpctlRun run;
    for (int attempt = 0; attempt < 100; ++attempt) {
      run = Hpctl({"load", dir_ + "/model.safetensors", "--recipe=" + dir_ + "/recipe.textproto"});
      if (run.exit_code == 0 || !absl::StrContains(run.out, "UNAVAILABLE")) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
    ASSERT_EQ(run.exit_code, 0) << run.out << cluster_->Logs();
    EXPECT_TRUE(absl::StrContains(run.out, "loaded 2 tensors on 2 daemons; committed version 0"))
        << run.out;
  }

  std::unique_ptr<testing::TestCluster> cluster_;
  std::string dir_;
  std::vector<float> values_;
  int runs_ = 0;
};

TEST_F(HpctlTest, LoadStatusStepAndStatusJson) {
  Load();
  HpctlRun status = Hpctl({"status"});
  ASSERT_EQ(status.exit_code, 0) << status.out;
  EXPECT_TRUE(absl::StrContains(status.out, "committed version 0")) << status.out;
  EXPECT_TRUE(absl::StrContains(status.out, "w.weight")) << status.out;
  EXPECT_TRUE(absl::StrContains(status.out, "nvfp4")) << status.out;
  EXPECT_TRUE(absl::StrContains(status.out, "rowwise_dequantized")) << status.out;
  EXPECT_TRUE(absl::StrContains(status.out, "SCALES")) << status.out;
  // Memory: the cpu backend holds every parameter on the host (no device
  // bytes, shown as "-"); the total is the model's 384*256 + 64*64.
  EXPECT_TRUE(absl::StrContains(status.out, "MEMORY")) << status.out;
  EXPECT_TRUE(absl::StrContains(status.out, "device B/param")) << status.out;
  const size_t total = status.out.find("\n  total ");
  ASSERT_NE(total, std::string::npos) << status.out;
  const std::string line =
      status.out.substr(total + 1, status.out.find('\n', total + 1) - total - 1);
  EXPECT_EQ(std::vector<std::string>(absl::StrSplit(line, ' ', absl::SkipEmpty())),
            (std::vector<std::string>{"total", "102400", "-", "-"}))
      << status.out;

  HpctlRun step = Hpctl({"step"});
  ASSERT_EQ(step.exit_code, 0) << step.out << cluster_->Logs();
  EXPECT_TRUE(absl::StrContains(step.out, "stepped from version 0; committed version 1"))
      << step.out;
  // Stepping from a version that is not the committed one is refused.
  HpctlRun stale = Hpctl({"step", "--version=0"});
  EXPECT_EQ(stale.exit_code, 1) << stale.out;
  EXPECT_TRUE(absl::StrContains(stale.out, "FAILED_PRECONDITION")) << stale.out;

  HpctlRun json = Hpctl({"status", "--json"});
  ASSERT_EQ(json.exit_code, 0) << json.out;
  nlohmann::json j = nlohmann::json::parse(json.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << json.out;
  EXPECT_EQ(j["committed_version"], "1");  // int64 fields are JSON strings in proto3 JSON
  EXPECT_EQ(j["daemons"].size(), 2u);
  EXPECT_EQ(j["manifest"]["tensors"].size(), 2u);
  // The coordinator passes each daemon's memory report through.
  int64_t parameters = 0;
  for (const auto& d : j["daemons"]) {
    EXPECT_EQ(d.value("backend", ""), "cpu") << d.dump();
    EXPECT_FALSE(d.contains("device_bytes")) << d.dump();  // 0: omitted in proto3 JSON
    ASSERT_TRUE(d.contains("parameters")) << d.dump();
    parameters += std::stoll(d["parameters"].get<std::string>());
  }
  EXPECT_EQ(parameters, 384 * 256 + 64 * 64);
}

// The permission bits of `path` (07777 part of st_mode).
mode_t ModeOf(const std::string& path) {
  struct stat st;
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

TEST_F(HpctlTest, FetchWritesTheAssembledLayoutAndDequantizedValues) {
  Load();
  const std::string raw = dir_ + "/w_col.safetensors";
  HpctlRun fetch = Hpctl({"fetch", "w.weight", "--direction=columnwise", "--out=" + raw});
  ASSERT_EQ(fetch.exit_code, 0) << fetch.out;
  EXPECT_EQ(ModeOf(raw), 0600u);
  auto file = safetensors::SafetensorsFile::Open(raw);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata().at("format"), "fp8_current");
  EXPECT_EQ(file->metadata().at("direction"), "columnwise");
  EXPECT_EQ(file->metadata().at("transposed"), "true");
  EXPECT_EQ(file->metadata().at("version"), "0");
  const safetensors::TensorInfo* data = file->Find("w.weight");
  ASSERT_NE(data, nullptr);
  EXPECT_EQ(data->dtype, safetensors::Dtype::kF8E4M3);
  EXPECT_EQ(data->shape, (std::vector<int64_t>{256, 384}));  // [K][M]
  EXPECT_EQ(file->Find("w.weight.scales"), nullptr);         // per-tensor: no scale buffer
  const safetensors::TensorInfo* scale_inv = file->Find("w.weight.scale_inv");
  ASSERT_NE(scale_inv, nullptr);
  EXPECT_EQ(scale_inv->dtype, safetensors::Dtype::kF32);
  EXPECT_TRUE(scale_inv->shape.empty());
  ASSERT_NE(file->Find("w.weight.amax"), nullptr);

  // The same bytes a trainer gets through the library.
  client::ClientOptions options;
  options.coordinator_address = cluster_->coordinator_address();
  options.role = client::ClientOptions::Role::kObserver;
  auto c = client::Client::Connect(options);
  ASSERT_TRUE(c.ok()) << c.status();
  auto fetched = (*c)->Fetch(0, {{"w.weight", Direction::kColumnwise, {}, {}}});
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_TRUE(*file->ReadTensor("w.weight") == fetched->tensors[0].value.data);
  auto si = file->ReadTensor("w.weight.scale_inv");
  ASSERT_TRUE(si.ok());
  float scale_inv_value;
  std::memcpy(&scale_inv_value, si->data(), 4);
  EXPECT_EQ(scale_inv_value, fetched->tensors[0].value.scale_inv);

  // NVFP4 rowwise: packed U8 data, UE4M3 scales as F8_E4M3, the global amax.
  const std::string nv = dir_ + "/w_nv.safetensors";
  HpctlRun fetch_nv = Hpctl({"fetch", "w.weight", "--out=" + nv});
  ASSERT_EQ(fetch_nv.exit_code, 0) << fetch_nv.out;
  auto nv_file = safetensors::SafetensorsFile::Open(nv);
  ASSERT_TRUE(nv_file.ok()) << nv_file.status();
  ASSERT_NE(nv_file->Find("w.weight"), nullptr);
  EXPECT_EQ(nv_file->Find("w.weight")->dtype, safetensors::Dtype::kU8);
  ASSERT_NE(nv_file->Find("w.weight.scales"), nullptr);
  EXPECT_EQ(nv_file->Find("w.weight.scales")->dtype, safetensors::Dtype::kF8E4M3);
  EXPECT_NE(nv_file->Find("w.weight.amax"), nullptr);
  EXPECT_EQ(nv_file->Find("w.weight.scale_inv"), nullptr);

  const std::string deq = dir_ + "/w_row.safetensors";
  HpctlRun fetch2 = Hpctl({"fetch", "w.weight", "--out=" + deq, "--dequantize"});
  ASSERT_EQ(fetch2.exit_code, 0) << fetch2.out;
  auto file2 = safetensors::SafetensorsFile::Open(deq);
  ASSERT_TRUE(file2.ok()) << file2.status();
  EXPECT_EQ(file2->metadata().at("format"), "nvfp4");
  auto bytes = file2->ReadTensor("w.weight");
  ASSERT_TRUE(bytes.ok());
  ASSERT_EQ(bytes->size(), values_.size() * 4);
  const float* got = reinterpret_cast<const float*>(bytes->data());
  double err = 0, norm = 0;
  for (size_t i = 0; i < values_.size(); ++i) {
    err += (got[i] - values_[i]) * (got[i] - values_[i]);
    norm += values_[i] * values_[i];
  }
  EXPECT_LT(std::sqrt(err / norm), 0.15) << "NVFP4 relative RMS error";
  EXPECT_GT(err, 0) << "NVFP4 cannot be lossless here";

  HpctlRun missing = Hpctl({"fetch", "nope", "--out=" + dir_ + "/x"});
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(missing.out, "NOT_FOUND")) << missing.out;
  HpctlRun usage = Hpctl({"fetch", "w.weight"});
  EXPECT_EQ(usage.exit_code, 2) << usage.out;
  // A version not committed yet is waited for up to --timeout, then refused
  // naming the committed one (not a bare "Deadline Exceeded").
  const absl::Time asked = absl::Now();
  HpctlRun future = Hpctl({"fetch", "w.weight", "--version=50", "--timeout=1", "--out=" + raw});
  EXPECT_LT(absl::Now() - asked, absl::Seconds(15));
  EXPECT_EQ(future.exit_code, 1) << future.out;
  EXPECT_TRUE(absl::StrContains(future.out, "version 50 was not committed within 1s"))
      << future.out;
  EXPECT_TRUE(absl::StrContains(future.out, "the committed version is 0")) << future.out;
}

// A sharded Hugging Face checkpoint (two shards + model.safetensors.index.json
// with F32, BF16 and F16 tensors), streamed from "this machine": the values
// the daemons hold are exactly the files' (identity FP32 copies).
TEST_F(HpctlTest, LoadStreamsAShardedCheckpoint) {
  namespace st = safetensors;
  const std::string ckpt = dir_ + "/hf";
  ASSERT_EQ(system(("mkdir -p " + ckpt).c_str()), 0);
  std::vector<float> a(300 * 40), c(7);
  for (size_t i = 0; i < a.size(); ++i) a[i] = std::cos(0.01f * i);
  for (size_t i = 0; i < c.size(); ++i) c[i] = 0.5f * i;
  std::vector<uint16_t> b16(64 * 3), f16(16);
  std::vector<float> b_want(b16.size()), f_want(f16.size());
  for (size_t i = 0; i < b16.size(); ++i) {
    b16[i] = static_cast<uint16_t>(0x3F80 + i);  // 1.0 + i ulps (BF16)
    const uint32_t bits = static_cast<uint32_t>(b16[i]) << 16;
    std::memcpy(&b_want[i], &bits, 4);
  }
  for (size_t i = 0; i < f16.size(); ++i) {
    f16[i] = static_cast<uint16_t>(0x3C00 + 3 * i);  // 1.0 + 3i ulps (F16)
    f_want[i] = 1.0f + 3.0f * i / 1024.0f;
  }
  f16[15] = 0x0001;  // the smallest F16 subnormal
  f_want[15] = std::ldexp(1.0f, -24);
  auto u8 = [](const auto& v) {
    return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(v[0]));
  };
  {
    auto w = st::SafetensorsWriter::Create(
        ckpt + "/model-00001-of-00002.safetensors",
        {{"a.weight", st::Dtype::kF32, {300, 40}}, {"b.weight", st::Dtype::kBF16, {64, 3}}});
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->WriteTensor("a.weight", u8(a)).ok());
    ASSERT_TRUE((*w)->WriteTensor("b.weight", u8(b16)).ok());
    ASSERT_TRUE((*w)->Finish().ok());
    auto w2 = st::SafetensorsWriter::Create(
        ckpt + "/model-00002-of-00002.safetensors",
        {{"c.bias", st::Dtype::kF32, {7}}, {"f.weight", st::Dtype::kF16, {4, 4}}});
    ASSERT_TRUE(w2.ok());
    ASSERT_TRUE((*w2)->WriteTensor("c.bias", u8(c)).ok());
    ASSERT_TRUE((*w2)->WriteTensor("f.weight", u8(f16)).ok());
    ASSERT_TRUE((*w2)->Finish().ok());
  }
  std::ofstream(ckpt + "/model.safetensors.index.json")
      << R"({"metadata": {"total_size": 1}, "weight_map": {)"
      << R"("a.weight": "model-00001-of-00002.safetensors", )"
      << R"("b.weight": "model-00001-of-00002.safetensors", )"
      << R"("c.bias": "model-00002-of-00002.safetensors", )"
      << R"("f.weight": "model-00002-of-00002.safetensors"}})";
  std::ofstream(dir_ + "/fp32.textproto")
      << "default_spec { rowwise { format: IDENTITY_FP32 } columnwise_usage: false "
         "source_dtype: FP32 }";
  HpctlRun run;
  for (int attempt = 0; attempt < 100; ++attempt) {
    run = Hpctl(
        {"load", ckpt + "/model.safetensors.index.json", "--recipe=" + dir_ + "/fp32.textproto"});
    if (run.exit_code == 0 || !absl::StrContains(run.out, "UNAVAILABLE")) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_EQ(run.exit_code, 0) << run.out << cluster_->Logs();
  EXPECT_TRUE(absl::StrContains(run.out, "streaming 4 tensors from 2 file(s)")) << run.out;
  EXPECT_TRUE(absl::StrContains(run.out, "streamed")) << run.out;  // progress (not a tty)
  EXPECT_TRUE(absl::StrContains(run.out, "loaded 4 tensors on 2 daemons; committed version 0"))
      << run.out;
  client::ClientOptions options;
  options.coordinator_address = cluster_->coordinator_address();
  options.role = client::ClientOptions::Role::kObserver;
  auto cl = client::Client::Connect(options);
  ASSERT_TRUE(cl.ok()) << cl.status();
  auto fetched = (*cl)->Fetch(0, client::AllTargets((*cl)->manifest(), {Direction::kRowwise}));
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  std::map<std::string, std::vector<float>> want = {
      {"a.weight", a}, {"b.weight", b_want}, {"c.bias", c}, {"f.weight", f_want}};
  ASSERT_EQ(fetched->tensors.size(), 4u);
  for (const client::FetchedTensor& t : fetched->tensors) {
    const std::vector<float>& w = want.at(t.tensor);
    ASSERT_EQ(t.value.data.size(), w.size() * 4) << t.tensor;
    EXPECT_EQ(std::memcmp(t.value.data.data(), w.data(), t.value.data.size()), 0) << t.tensor;
  }
  // A directory works the same (its index); a bad index is refused clearly.
  std::ofstream(dir_ + "/bad.index.json") << R"({"weight_map": {"x": "../etc/passwd"}})";
  HpctlRun bad = Hpctl({"load", dir_ + "/bad.index.json"});
  EXPECT_EQ(bad.exit_code, 1) << bad.out;
  EXPECT_TRUE(absl::StrContains(bad.out, "not a file beside the index")) << bad.out;
}

// A second load onto a trained cluster is refused (by the coordinator, so
// every client gets it) unless forced; the model keeps its version.
TEST_F(HpctlTest, LoadOntoAClusterHoldingAModelNeedsForce) {
  Load();
  HpctlRun step = Hpctl({"step"});
  ASSERT_EQ(step.exit_code, 0) << step.out << cluster_->Logs();
  const std::string model = dir_ + "/model.safetensors";
  HpctlRun refused = Hpctl({"load", model});
  EXPECT_EQ(refused.exit_code, 1) << refused.out;
  EXPECT_TRUE(absl::StrContains(refused.out, "FAILED_PRECONDITION")) << refused.out;
  EXPECT_TRUE(
      absl::StrContains(refused.out, "already holds a model (2 tensors, committed version 1)"))
      << refused.out;
  EXPECT_TRUE(absl::StrContains(refused.out, "--force")) << refused.out;
  // Not only hpctl: a library client is refused the same way.
  client::ClientOptions options;
  options.coordinator_address = cluster_->coordinator_address();
  options.role = client::ClientOptions::Role::kObserver;
  auto c = client::Client::Connect(options);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->Load(model).status().code(), absl::StatusCode::kFailedPrecondition);
  HpctlRun status = Hpctl({"status"});
  EXPECT_TRUE(absl::StrContains(status.out, "committed version 1")) << status.out;
  // A file that is not safetensors is refused before the cluster is asked,
  // even with --force; the model stays.
  const std::string junk = dir_ + "/junk.safetensors";
  std::ofstream(junk) << "not a model";
  HpctlRun bad = Hpctl({"load", junk, "--force"});
  EXPECT_EQ(bad.exit_code, 1) << bad.out;
  EXPECT_FALSE(absl::StrContains(bad.out, "replacing")) << bad.out;
  EXPECT_TRUE(absl::StrContains(bad.out, junk)) << bad.out;
  status = Hpctl({"status"});
  EXPECT_TRUE(absl::StrContains(status.out, "committed version 1")) << status.out;

  HpctlRun forced = Hpctl({"load", model, "--force"});
  ASSERT_EQ(forced.exit_code, 0) << forced.out << cluster_->Logs();
  EXPECT_TRUE(absl::StrContains(forced.out, "replacing the model at version 1")) << forced.out;
  EXPECT_TRUE(absl::StrContains(forced.out, "committed version 0")) << forced.out;
  // Not a terminal: whole lines only, no carriage returns.
  EXPECT_FALSE(absl::StrContains(forced.out, "\r")) << forced.out;
  EXPECT_TRUE(absl::StrContains(forced.out, "loading " + model)) << forced.out;
}

std::vector<std::string> DirNames(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST_F(HpctlTest, ExportIntoANonEmptyDirectoryNeedsOverwrite) {
  Load();
  const std::string out = dir_ + "/export";
  // w.weight (192 KiB in BF16) and v.weight in separate shards.
  HpctlRun first = Hpctl({"export", "--out=" + out, "--max_shard_size=100KB"});
  ASSERT_EQ(first.exit_code, 0) << first.out << cluster_->Logs();
  // Model data is the user's only, whatever the umask.
  EXPECT_EQ(ModeOf(out), 0700u);
  for (const std::string& name : DirNames(out)) EXPECT_EQ(ModeOf(out + "/" + name), 0600u) << name;
  std::ofstream(out + "/config.json") << "{}";
  const std::vector<std::string> before = DirNames(out);
  EXPECT_EQ(before, (std::vector<std::string>{"config.json", "model-00001-of-00002.safetensors",
                                              "model-00002-of-00002.safetensors",
                                              "model.safetensors.index.json"}));

  HpctlRun refused = Hpctl({"export", "--out=" + out});
  EXPECT_EQ(refused.exit_code, 1) << refused.out;
  EXPECT_TRUE(absl::StrContains(refused.out, "is not empty")) << refused.out;
  EXPECT_TRUE(absl::StrContains(refused.out, "--overwrite")) << refused.out;
  EXPECT_EQ(DirNames(out), before);  // nothing touched

  HpctlRun again = Hpctl({"export", "--out=" + out, "--overwrite", "--group_readable"});
  ASSERT_EQ(again.exit_code, 0) << again.out << cluster_->Logs();
  EXPECT_TRUE(absl::StrContains(again.out, "removed 3 file(s) of the older export")) << again.out;
  // One shard now; the older second shard is gone, config.json kept.
  EXPECT_EQ(DirNames(out),
            (std::vector<std::string>{"config.json", "model-00001-of-00001.safetensors",
                                      "model.safetensors.index.json"}));
  EXPECT_EQ(ModeOf(out + "/model-00001-of-00001.safetensors"), 0640u);
  EXPECT_EQ(ModeOf(out + "/model.safetensors.index.json"), 0640u);
  std::ifstream index_file(out + "/model.safetensors.index.json");
  nlohmann::json index = nlohmann::json::parse(index_file, nullptr, false);
  ASSERT_FALSE(index.is_discarded());
  for (const auto& [tensor, file] : index["weight_map"].items()) {
    EXPECT_EQ(file, "model-00001-of-00001.safetensors") << tensor;
  }
  auto shard = safetensors::SafetensorsFile::Open(out + "/model-00001-of-00001.safetensors");
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_NE(shard->Find("w.weight"), nullptr);
  EXPECT_NE(shard->Find("v.weight"), nullptr);
}

// Before any model: step and fetch say there is none (after --timeout, a
// load may be running), not a bare deadline.
TEST_F(HpctlTest, StepAndFetchWithoutAModelSayThereIsNone) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"step", "--timeout=1"},
        std::vector<std::string>{"fetch", "w.weight", "--out=" + dir_ + "/w", "--timeout=1"}}) {
    HpctlRun run = Hpctl(args);
    EXPECT_EQ(run.exit_code, 1) << run.out;
    EXPECT_TRUE(absl::StrContains(run.out, "no model was loaded within 1s")) << run.out;
    EXPECT_TRUE(absl::StrContains(run.out, "hpctl load")) << run.out;
  }
}

// Versions export cannot give: one not committed yet, and (no checkpoints
// here) one whose masters the daemons no longer hold; each named, with why.
TEST_F(HpctlTest, ExportOfAVersionItCannotReadSaysWhy) {
  Load();
  HpctlRun step = Hpctl({"step"});
  ASSERT_EQ(step.exit_code, 0) << step.out << cluster_->Logs();
  HpctlRun future = Hpctl({"export", "--out=" + dir_ + "/future", "--version=7"});
  EXPECT_EQ(future.exit_code, 1) << future.out;
  EXPECT_TRUE(absl::StrContains(future.out, "version 7 is not committed yet (committed: 1)"))
      << future.out;
  HpctlRun old = Hpctl({"export", "--out=" + dir_ + "/old", "--version=0"});
  EXPECT_EQ(old.exit_code, 1) << old.out;
  EXPECT_TRUE(absl::StrContains(old.out, "not 0")) << old.out;
  EXPECT_TRUE(absl::StrContains(old.out, "runs without --checkpoint_dir")) << old.out;
}

// hpctl with an --address that cannot work, at the default --timeout (30 s):
// the reason within a few seconds.
HpctlRun HpctlAlone(const std::vector<std::string>& args, absl::Duration* took) {
  demo::ChildProcesses children;
  auto dir = demo::TempDir::Create("hpctl");
  EXPECT_TRUE(dir.ok());
  HpctlRun run;
  if (!dir.ok()) return run;
  const std::string log = dir->path() + "/out";
  std::vector<std::string> argv = {"hpctl/hpctl"};
  argv.insert(argv.end(), args.begin(), args.end());
  const absl::Time start = absl::Now();
  auto index = children.Start({"hpctl", argv, log, log});
  EXPECT_TRUE(index.ok()) << index.status();
  if (!index.ok()) return run;
  auto status = children.Wait(*index, absl::Seconds(40));
  *took = absl::Now() - start;
  EXPECT_TRUE(status.ok()) << status.status();
  if (status.ok() && WIFEXITED(*status)) run.exit_code = WEXITSTATUS(*status);
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  run.out = text.str();
  return run;
}

TEST(HpctlNoCluster, UnusableAddressesFailFastWithTheReason) {
  struct Case {
    std::vector<std::string> args;
    std::string reason;
  };
  // A one-tensor model, so that load gets as far as connecting.
  auto dir = demo::TempDir::Create("hpctl_addresses");
  ASSERT_TRUE(dir.ok());
  const std::string model = dir->path() + "/m.safetensors";
  {
    const std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
    const uint64_t n = header.size();
    std::ofstream out(model, std::ios::binary);
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header << std::string(4, '\0');
  }
  const std::vector<Case> cases = {
      {{"status", "--address=127.0.0.1:1"}, "Connection refused"},
      {{"load", model, "--address=127.0.0.1:1"}, "Connection refused"},
      {{"load", "/etc/passwd", "--address=127.0.0.1:1"}, "not a safetensors file"},
      {{"checkpoint", "list", "--address=127.0.0.1:1"}, "Connection refused"},
      {{"status", "--address=no-such-host.invalid:7070"},
       "cannot resolve host 'no-such-host.invalid'"},
      {{"step", "--address=127.0.0.1"}, "has no port"},
  };
  for (const Case& c : cases) {
    absl::Duration took;
    HpctlRun run = HpctlAlone(c.args, &took);
    EXPECT_EQ(run.exit_code, 1) << c.args[0] << ": " << run.out;
    EXPECT_TRUE(absl::StrContains(run.out, c.reason)) << run.out;
    EXPECT_LT(took, absl::Seconds(5)) << c.args[0] << " " << c.args.back();
  }
}

// hpctl reads model files with the servers' name rule and default limit
// (--max_tensor_name_bytes, 1 KiB): a 2000-byte name in a safetensors
// header (hpctl inspect) or in a sharded checkpoint's index (hpctl load) is
// refused without being echoed, before anything is connected to; a larger
// limit lets it through; a limit below 1 is a usage error.
TEST(HpctlNoCluster, ModelFilesFollowTheServersTensorNameLimit) {
  auto dir = demo::TempDir::Create("hpctl_names");
  ASSERT_TRUE(dir.ok());
  const std::string name(2000, 'n');
  const std::string header =
      absl::StrCat(R"({")", name, R"(":{"dtype":"F32","shape":[2],)", R"("data_offsets":[0,8]}})");
  const std::string file = dir->path() + "/long.safetensors";
  {
    std::ofstream out(file, std::ios::binary);
    const uint64_t n = header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header << std::string(8, '\0');
  }
  const std::string ckpt = dir->path() + "/ckpt";
  std::filesystem::create_directories(ckpt);
  std::ofstream(ckpt + "/model.safetensors.index.json")
      << R"({"weight_map":{")" << name << R"(":"model-00001.safetensors"}})";

  absl::Duration took;
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"inspect", file},
        std::vector<std::string>{"load", ckpt, "--address=127.0.0.1:1"}}) {
    HpctlRun run = HpctlAlone(args, &took);
    EXPECT_EQ(run.exit_code, 1) << args[0] << ": " << run.out;
    EXPECT_TRUE(absl::StrContains(run.out, "2000 bytes")) << run.out;
    EXPECT_TRUE(absl::StrContains(run.out, "--max_tensor_name_bytes")) << run.out;
    EXPECT_FALSE(absl::StrContains(run.out, std::string(100, 'n'))) << "the name was echoed";
    EXPECT_FALSE(absl::StrContains(run.out, "Connection refused")) << run.out;
  }
  HpctlRun run = HpctlAlone({"inspect", file, "--max_tensor_name_bytes=4096"}, &took);
  EXPECT_EQ(run.exit_code, 0) << run.out;
  run = HpctlAlone({"load", ckpt, "--max_tensor_name_bytes=4096", "--address=127.0.0.1:1"}, &took);
  EXPECT_EQ(run.exit_code, 1) << run.out;
  EXPECT_TRUE(absl::StrContains(run.out, "Connection refused"))
      << "got past the index: " << run.out;
  run = HpctlAlone({"inspect", file, "--max_tensor_name_bytes=0"}, &took);
  EXPECT_EQ(run.exit_code, 2) << run.out;
  EXPECT_TRUE(absl::StrContains(run.out, "at least 1")) << run.out;
}

TEST(HpctlNoCluster, StatusWithoutACoordinatorFailsFast) {
  demo::ChildProcesses children;
  auto dir = demo::TempDir::Create("hpctl");
  ASSERT_TRUE(dir.ok());
  const std::string log = dir->path() + "/out";
  auto index = children.Start(
      {"hpctl", {"hpctl/hpctl", "status", "--address=127.0.0.1:1", "--timeout=0.5"}, log, log});
  ASSERT_TRUE(index.ok());
  auto status = children.Wait(*index, absl::Seconds(10));
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(WEXITSTATUS(*status), 1);
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_TRUE(absl::StrContains(text.str(), "hpctl status: UNAVAILABLE")) << text.str();
}

}  // namespace
}  // namespace paramd
