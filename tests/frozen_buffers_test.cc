// Multi-process: frozen buffers (a model's integer, bool and F64 tensors)
// through the real hybrid-paramd processes. A safetensors file with
// position ids, a mask, an F64 table and a scalar step counter loads (the
// coordinator reads them; before, the load was refused); GetManifest names
// them without their bytes unless asked; a push naming one is refused and a
// step leaves them as they were; a checkpoint keeps them (on disk, described
// without bytes); a restore brings them back; `hpctl export` writes them in
// their dtype; `hpctl load DIR` streams them; over --max_frozen_bytes a
// load is refused before anything changes.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/store.h"
#include "gtest/gtest.h"
#include "proto/checkpoint_service.grpc.pb.h"
#include "safetensors/safetensors.h"
#include "tests/checkpoint_test_util.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

constexpr float kLr = 0.5f;

// One frozen buffer of the test model, with its bytes.
struct Buffer {
  std::string name;
  safetensors::Dtype dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

template <class T>
std::string BytesOf(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

std::vector<Buffer> Buffers() {
  std::vector<int64_t> ids(16);
  for (int i = 0; i < 16; ++i) ids[i] = 1000 + i;
  std::vector<uint8_t> mask(12);
  for (int i = 0; i < 12; ++i) mask[i] = i % 3 == 0;
  return {
      {"rope.table",
       safetensors::Dtype::kF64,
       {2, 3},
       BytesOf(std::vector<double>{0.1, 0.2, 1e300, -3.5, 0, 1.0 / 3})},
      {"embed.position_ids", safetensors::Dtype::kI64, {1, 16}, BytesOf(ids)},
      {"bn.num_batches_tracked", safetensors::Dtype::kI64, {}, BytesOf(std::vector<int64_t>{7})},
      {"attn.mask", safetensors::Dtype::kBool, {3, 4}, BytesOf(mask)},
  };
}

// A safetensors file with `buffers` and one F32 weight "w" [rows][cols].
void WriteModelWithBuffers(const std::string& path, const std::vector<Buffer>& buffers,
                           const std::vector<float>& w, int64_t rows, int64_t cols) {
  std::vector<safetensors::TensorSpec> specs;
  for (const Buffer& b : buffers) specs.push_back({b.name, b.dtype, b.shape});
  specs.push_back({"w", safetensors::Dtype::kF32, {rows, cols}});
  auto writer = safetensors::SafetensorsWriter::Create(path, specs);
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (const Buffer& b : buffers) {
    ASSERT_TRUE(
        (*writer)
            ->WriteTensor(b.name, absl::MakeSpan(reinterpret_cast<const uint8_t*>(b.bytes.data()),
                                                 b.bytes.size()))
            .ok());
  }
  ASSERT_TRUE((*writer)
                  ->WriteTensor(
                      "w", absl::MakeSpan(reinterpret_cast<const uint8_t*>(w.data()), w.size() * 4))
                  .ok());
  ASSERT_TRUE((*writer)->Finish().ok());
}

absl::StatusOr<rpc::Manifest> GetManifest(RawCluster& cluster, bool with_frozen_data) {
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(10));
  rpc::GetManifestRequest request;
  request.set_with_frozen_data(with_frozen_data);
  rpc::GetManifestResponse response;
  const grpc::Status s = cluster.coordinator().GetManifest(&context, request, &response);
  if (!s.ok()) return absl::UnavailableError(s.error_message());
  return response.manifest();
}

// "" if `frozen` holds exactly `want` (names, dtypes, shapes and, with
// `with_data`, bytes; without, no bytes at all), else what differs.
std::string CompareFrozen(const google::protobuf::RepeatedPtrField<FrozenTensor>& frozen,
                          const std::vector<Buffer>& want, bool with_data) {
  if (frozen.size() != static_cast<int>(want.size())) {
    return absl::StrCat(frozen.size(), " frozen buffers, want ", want.size());
  }
  for (size_t i = 0; i < want.size(); ++i) {
    const FrozenTensor& f = frozen.Get(static_cast<int>(i));
    const Buffer& b = want[i];
    if (f.name() != b.name || f.dtype() != safetensors::DtypeName(b.dtype) ||
        std::vector<int64_t>(f.shape().begin(), f.shape().end()) != b.shape) {
      return absl::StrCat("buffer ", i, " is ", f.name(), " ", f.dtype(), "; want ", b.name);
    }
    if (f.data() != (with_data ? b.bytes : std::string())) {
      return absl::StrCat(b.name, ": ", f.data().size(), " bytes differ (want ",
                          with_data ? b.bytes.size() : 0, ")");
    }
  }
  return "";
}

class FrozenBuffersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<demo::TempDir> ckpt = demo::TempDir::Create("paramd_frozen");
    ASSERT_TRUE(ckpt.ok());
    ckpt_ = std::make_unique<demo::TempDir>(*std::move(ckpt));
    TestClusterOptions options;
    options.daemons = 2;
    options.expected_pushers = 1;
    options.optimizer = "sgd";
    options.lr = kLr;
    // The test model's buffers hold 186 bytes; the oversized one more.
    options.coordinator_flags = {"--checkpoint_dir=" + ckpt_->path(), "--max_frozen_bytes=4096"};
    options.daemon_flags = {"--checkpoint_dir=" + ckpt_->path()};
    absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(options);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = *std::move(c);
  }

  ProgramRun Hpctl(std::vector<std::string> args) {
    args.insert(args.begin(), "hpctl/hpctl");
    args.push_back("--address=" + cluster_->cluster().coordinator_address());
    args.push_back("--timeout=30");
    return RunProgram(args, cluster_->cluster().dir());
  }

  std::unique_ptr<demo::TempDir> ckpt_;
  std::unique_ptr<RawCluster> cluster_;
};

TEST_F(FrozenBuffersTest, LoadedCheckpointedRestoredExportedNeverStepped) {
  RawCluster& cluster = *cluster_;
  const std::vector<Buffer> buffers = Buffers();
  constexpr int64_t kRows = 96, kCols = 40;
  std::vector<float> w = RandomValues(kRows * kCols, 5);
  const std::string model = cluster.cluster().dir() + "/model.safetensors";
  WriteModelWithBuffers(model, buffers, w, kRows, kCols);
  ASSERT_TRUE(cluster.Load(model, kFp32PassthroughRecipe).ok()) << cluster.cluster().Logs();

  // The weights are the tensors; the buffers are named, not shipped, unless asked.
  ASSERT_EQ(cluster.manifest().tensors_size(), 1);
  EXPECT_EQ(cluster.manifest().tensors(0).name(), "w");
  EXPECT_EQ(CompareFrozen(cluster.manifest().frozen(), buffers, false), "");
  absl::StatusOr<rpc::Manifest> whole = GetManifest(cluster, true);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(CompareFrozen(whole->frozen(), buffers, true), "");

  // A push naming a buffer is refused (the daemon steps weights only); a
  // step leaves the buffers as they were.
  {
    rpc::PushGradientsRequest m;
    m.set_version(0);
    m.set_pusher_id("trainer");
    rpc::GradientChunk* chunk = m.mutable_chunk();
    chunk->set_tensor("embed.position_ids");
    chunk->set_row_begin(0);
    chunk->set_row_end(1);
    chunk->set_dtype(rpc::DTYPE_FP32);
    chunk->set_data(std::string(16 * 4, '\0'));
    const grpc::Status s = cluster.PushRaw(0, {m});
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.error_message().find("embed.position_ids"), std::string::npos) << s.error_message();
  }
  const std::vector<float> g = RandomValues(w.size(), 6, 0.1f);
  ASSERT_TRUE(cluster.PushAll(0, "trainer", {{"w", g}}).ok()) << cluster.cluster().Logs();
  ASSERT_TRUE(cluster.WaitForVersion(1).ok());
  for (size_t i = 0; i < w.size(); ++i) w[i] -= kLr * g[i];
  whole = GetManifest(cluster, true);
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(CompareFrozen(whole->frozen(), buffers, true), "");

  // A checkpoint keeps them whole on disk, and describes them without bytes.
  checkpoint::CheckpointResponse saved;
  ASSERT_TRUE(
      CheckpointVia(cluster.cluster().coordinator_address(), -1, absl::Seconds(30), &saved).ok());
  ASSERT_EQ(saved.version(), 1u);
  absl::StatusOr<checkpoint::CheckpointStore> store =
      checkpoint::CheckpointStore::Open(ckpt_->path(), /*create=*/false);
  ASSERT_TRUE(store.ok()) << store.status();
  absl::StatusOr<checkpoint::Manifest> on_disk = store->ReadManifest(1);
  ASSERT_TRUE(on_disk.ok()) << on_disk.status();
  EXPECT_EQ(CompareFrozen(on_disk->frozen(), buffers, true), "");
  {
    auto stub = checkpoint::CheckpointCoordinator::NewStub(grpc::CreateChannel(
        cluster.cluster().coordinator_address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(30));
    checkpoint::DescribeCheckpointRequest request;
    request.set_version(-1);
    checkpoint::DescribeCheckpointResponse described;
    ASSERT_TRUE(stub->DescribeCheckpoint(&context, request, &described).ok());
    EXPECT_EQ(CompareFrozen(described.manifest().frozen(), buffers, false), "");
  }

  // Another model replaces this one (no buffers), then the restore brings them back.
  const std::string plain = cluster.cluster().dir() + "/plain.safetensors";
  ASSERT_TRUE(WriteModel(plain, {{"v", {8, 8}, RandomValues(64, 7)}}).ok());
  ASSERT_TRUE(cluster.Load(plain, "").ok());
  EXPECT_EQ(cluster.manifest().frozen_size(), 0);
  absl::StatusOr<int64_t> restored = Restore(cluster, ckpt_->path(), /*force=*/true);
  ASSERT_TRUE(restored.ok()) << restored.status() << cluster.cluster().Logs();
  EXPECT_EQ(*restored, 1);
  whole = GetManifest(cluster, true);
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(CompareFrozen(whole->frozen(), buffers, true), "");
  absl::StatusOr<std::vector<float>> masters = ExportMasters(cluster, 1, "w");
  ASSERT_TRUE(masters.ok()) << masters.status();
  EXPECT_EQ(*masters, w);

  // hpctl export writes the buffers in their own dtype, bytes as loaded.
  const std::string out = cluster.cluster().dir() + "/export";
  ProgramRun run = Hpctl({"export", "--out", out});
  ASSERT_EQ(run.exit_code, 0) << run.out;
  absl::StatusOr<safetensors::SafetensorsFile> file =
      safetensors::SafetensorsFile::Open(out + "/model-00001-of-00001.safetensors");
  ASSERT_TRUE(file.ok()) << file.status() << run.out;
  ASSERT_EQ(file->tensors().size(), buffers.size() + 1);
  for (const Buffer& b : buffers) {
    const safetensors::TensorInfo* info = file->Find(b.name);
    ASSERT_NE(info, nullptr) << b.name;
    EXPECT_EQ(info->dtype, b.dtype) << b.name;
    EXPECT_EQ(info->shape, b.shape) << b.name;
    std::string bytes(b.bytes.size(), '\0');
    ASSERT_TRUE(
        file->ReadTensorBytes(
                *info, 0, absl::MakeSpan(reinterpret_cast<uint8_t*>(bytes.data()), bytes.size()))
            .ok());
    EXPECT_EQ(bytes, b.bytes) << b.name;
  }
  EXPECT_EQ(file->Find("w")->dtype, safetensors::Dtype::kBF16);

  // `hpctl load DIR` streams the files from here: the buffers travel with
  // the declaration.
  run = Hpctl({"load", out, "--force"});
  ASSERT_EQ(run.exit_code, 0) << run.out;
  EXPECT_NE(run.out.find("4 frozen buffers"), std::string::npos) << run.out;
  whole = GetManifest(cluster, true);
  ASSERT_TRUE(whole.ok());
  std::vector<Buffer> got_order;  // the files' order, not the first model's
  for (const FrozenTensor& f : whole->frozen()) {
    for (const Buffer& b : buffers) {
      if (b.name == f.name()) got_order.push_back(b);
    }
  }
  EXPECT_EQ(CompareFrozen(whole->frozen(), got_order, true), "");
  EXPECT_EQ(got_order.size(), buffers.size());
}

TEST_F(FrozenBuffersTest, OverTheLimitIsRefusedAndChangesNothing) {
  RawCluster& cluster = *cluster_;
  constexpr int64_t kRows = 16, kCols = 8;
  const std::string small = cluster.cluster().dir() + "/small.safetensors";
  WriteModelWithBuffers(small, Buffers(), RandomValues(kRows * kCols, 8), kRows, kCols);
  ASSERT_TRUE(cluster.Load(small, "").ok()) << cluster.cluster().Logs();
  const uint64_t fingerprint = cluster.manifest().plan_fingerprint();

  std::vector<Buffer> big = Buffers();
  big.push_back({"huge.ids",
                 safetensors::Dtype::kI64,
                 {1024},
                 BytesOf(std::vector<int64_t>(1024, 3))});  // 8 KiB > 4096
  const std::string model = cluster.cluster().dir() + "/big.safetensors";
  WriteModelWithBuffers(model, big, RandomValues(kRows * kCols, 9), kRows, kCols);
  absl::StatusOr<int64_t> loaded = cluster.Load(model, "");
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kResourceExhausted) << loaded.status();
  EXPECT_NE(loaded.status().message().find("--max_frozen_bytes=4096"), std::string::npos)
      << loaded.status();
  absl::StatusOr<rpc::Manifest> now = GetManifest(cluster, true);
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(now->plan_fingerprint(), fingerprint);
  EXPECT_EQ(CompareFrozen(now->frozen(), Buffers(), true), "");
  EXPECT_EQ(now->committed_version(), 0);
}

}  // namespace
}  // namespace testing
}  // namespace paramd
