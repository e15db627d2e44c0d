#include "checkpoint/export.h"

#include <sys/stat.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/test_util.h"
#include "gtest/gtest.h"
#include "kernels/reference.h"
#include "kernels/test_util.h"
#include "safetensors/sharded.h"

namespace paramd {
namespace checkpoint {
namespace {

using ref::testing::F;

// An in-memory model: FP32 masters of each tensor.
struct MemoryModel {
  std::vector<ExportTensor> tensors;
  std::map<std::string, std::vector<float>> values;

  FloatRowSource Source(uint64_t chunk_bytes) const {
    return FloatRowSource(
        [this](const ExportTensor& tensor, int64_t row_begin, int64_t row_end,
               absl::Span<float> out) {
          const std::vector<float>& all = values.at(tensor.name);
          std::memcpy(out.data(), all.data() + row_begin * tensor.cols, out.size() * sizeof(float));
          return absl::OkStatus();
        },
        chunk_bytes);
  }
};

MemoryModel FakeModel() {
  MemoryModel model;
  auto add = [&](std::string name, std::vector<int64_t> shape, int64_t rows, int64_t cols) {
    model.tensors.push_back({name, shape, rows, cols});
    TensorInfo info;
    info.set_name(name);
    info.set_rows(rows);
    info.set_cols(cols);
    model.values[name] = testing::FakeRows(3, info, "master", 0, rows);
  };
  add("model.embed_tokens.weight", {97, 64}, 97, 64);
  add("model.layers.0.mlp.up_proj.weight", {130, 33}, 130, 33);
  add("model.layers.0.input_layernorm.weight", {257}, 1, 257);
  add("model.layers.0.conv.weight", {4, 3, 5}, 4, 15);
  add("lm_head.weight", {1, 1}, 1, 1);
  return model;
}

std::string OutDir(const std::string& name) { return testing::MakeTestDir("export") + "/" + name; }

TEST(AppendForExportTest, Bf16IsRoundToNearestEvenAndKeepsNaN) {
  // Hand-computed: input bits -> BF16 bits.
  const std::vector<std::pair<uint32_t, uint16_t>> cases = {
      {0x3F800000u, 0x3F80},  // 1.0
      {0x3F808000u, 0x3F80},  // tie, even stays
      {0x3F818000u, 0x3F82},  // tie, odd rounds up
      {0x3F808001u, 0x3F81},  // above the tie
      {0x3F807FFFu, 0x3F80},  // below the tie
      {0xBF818000u, 0xBF82},  // negative tie, odd
      {0x7F7FFFFFu, 0x7F80},  // FLT_MAX rounds to +Inf
      {0xFF800000u, 0xFF80},  // -Inf
      {0x80000000u, 0x8000},  // -0
      {0x00010000u, 0x0001},  // subnormal kept
      {0x00008000u, 0x0000},  // subnormal tie to even (zero)
  };
  for (const auto& [in, want] : cases) {
    std::vector<uint8_t> out;
    const float value = F(in);
    AppendForExport(absl::MakeConstSpan(&value, 1), ExportDtype::kBf16, out);
    ASSERT_EQ(out.size(), 2u);
    uint16_t got;
    std::memcpy(&got, out.data(), 2);
    EXPECT_EQ(got, want) << std::hex << in;
  }
  for (uint32_t nan : {0x7FC00000u, 0x7F800001u, 0xFFC12345u, 0xFF800001u}) {
    const float value = F(nan);
    std::vector<uint8_t> out;
    AppendForExport(absl::MakeConstSpan(&value, 1), ExportDtype::kBf16, out);
    uint16_t got;
    std::memcpy(&got, out.data(), 2);
    EXPECT_EQ(got & 0x7F80, 0x7F80) << std::hex << nan;
    EXPECT_NE(got & 0x007F, 0) << "NaN " << std::hex << nan << " became " << got;
  }
}

TEST(ExportTest, Bf16ShardsEqualReferenceRoundingAndIndexCoversAll) {
  const MemoryModel model = FakeModel();
  FloatRowSource source = model.Source(/*chunk_bytes=*/1000);  // many chunks
  ExportOptions options;
  options.out_dir = OutDir("bf16");
  options.max_shard_bytes = 9000;  // several shards
  std::vector<std::pair<uint64_t, uint64_t>> progress;
  options.progress = [&](uint64_t done, uint64_t total) { progress.emplace_back(done, total); };
  auto result = ExportSafetensors(model.tensors, source, options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->num_tensors, 5);
  const uint64_t total = 2 * (97 * 64 + 130 * 33 + 257 + 60 + 1);
  EXPECT_EQ(result->total_bytes, total);
  ASSERT_GE(result->files.size(), 3u);
  EXPECT_EQ(result->files[0],
            absl::StrCat("model-00001-of-0000", result->files.size() - 1, ".safetensors"));
  EXPECT_EQ(result->files.back(), "model.safetensors.index.json");

  ASSERT_FALSE(progress.empty());
  EXPECT_EQ(progress.front().first, 0u);
  EXPECT_EQ(progress.back().first, total);
  for (size_t i = 1; i < progress.size(); ++i) {
    EXPECT_GE(progress[i].first, progress[i - 1].first);
    EXPECT_EQ(progress[i].second, total);
  }

  auto files = safetensors::ShardedSafetensors::Open(options.out_dir);
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_EQ(files->num_files(), result->files.size() - 1);
  ASSERT_EQ(files->tensors().size(), model.tensors.size());
  for (size_t i = 0; i < files->num_files(); ++i) {
    EXPECT_EQ(files->file(i).metadata(), (safetensors::Metadata{{"format", "pt"}}));
  }
  for (const ExportTensor& tensor : model.tensors) {
    const auto* entry = files->Find(tensor.name);
    ASSERT_NE(entry, nullptr) << tensor.name;
    EXPECT_EQ(entry->info->dtype, safetensors::Dtype::kBF16);
    EXPECT_EQ(entry->info->shape, tensor.shape);
    auto bytes = files->ReadTensor(tensor.name);
    ASSERT_TRUE(bytes.ok());
    const std::vector<float>& masters = model.values.at(tensor.name);
    ASSERT_EQ(bytes->size(), masters.size() * 2);
    int mismatches = 0;
    for (size_t j = 0; j < masters.size(); ++j) {
      uint16_t got;
      std::memcpy(&got, bytes->data() + 2 * j, 2);
      mismatches += got != ref::EncodeBf16(masters[j]);
    }
    EXPECT_EQ(mismatches, 0) << tensor.name;
  }
}

TEST(ExportTest, Fp32IsBitExact) {
  const MemoryModel model = FakeModel();
  FloatRowSource source = model.Source(1 << 20);
  ExportOptions options;
  options.out_dir = OutDir("a/b/fp32");  // parents created
  options.dtype = ExportDtype::kFp32;
  auto result = ExportSafetensors(model.tensors, source, options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->files, (std::vector<std::string>{"model-00001-of-00001.safetensors",
                                                     "model.safetensors.index.json"}));
  auto files = safetensors::ShardedSafetensors::Open(options.out_dir);
  ASSERT_TRUE(files.ok()) << files.status();
  for (const ExportTensor& tensor : model.tensors) {
    auto bytes = files->ReadTensor(tensor.name);
    ASSERT_TRUE(bytes.ok());
    const std::vector<float>& masters = model.values.at(tensor.name);
    ASSERT_EQ(bytes->size(), masters.size() * 4);
    EXPECT_EQ(std::memcmp(bytes->data(), masters.data(), bytes->size()), 0) << tensor.name;
  }
}

TEST(ExportTest, FromCheckpointOfTwoDaemons) {
  auto store = CheckpointStore::Open(testing::MakeTestDir("export_ckpt"), true);
  ASSERT_TRUE(store.ok());
  const auto tensors = testing::FakeTensors({{300, 64}, {1, 257}, {129, 1}});
  ASSERT_TRUE(testing::WriteFakeCheckpoint(*store, 4, 11, tensors, 2).ok());
  auto reader = CheckpointReader::Open(*store, 4);
  ASSERT_TRUE(reader.ok());
  auto source = NewCheckpointExportSource(reader->get(), /*chunk_bytes=*/4096);
  ExportOptions options;
  options.out_dir = OutDir("from_ckpt");
  auto export_tensors = ExportTensorsOf((*reader)->manifest());
  ASSERT_EQ(export_tensors.size(), 3u);
  EXPECT_EQ(export_tensors[1].shape, (std::vector<int64_t>{1, 257}));
  ASSERT_TRUE(ExportSafetensors(export_tensors, *source, options).ok());
  auto files = safetensors::ShardedSafetensors::Open(options.out_dir);
  ASSERT_TRUE(files.ok()) << files.status();
  for (const TensorInfo& tensor : tensors) {
    auto bytes = files->ReadTensor(tensor.name());
    ASSERT_TRUE(bytes.ok());
    const auto masters = testing::FakeRows(11, tensor, "master", 0, tensor.rows());
    int mismatches = 0;
    for (size_t j = 0; j < masters.size(); ++j) {
      uint16_t got;
      std::memcpy(&got, bytes->data() + 2 * j, 2);
      mismatches += got != ref::EncodeBf16(masters[j]);
    }
    EXPECT_EQ(mismatches, 0) << tensor.name();
  }
}

mode_t ModeOf(const std::string& path) {
  struct stat st;
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

// An export is model data: its files are the user's only (the umask of a
// shell would have made them world-readable), and so are the directories it
// creates; FileModes::ForGroupReadable widens both for a group.
TEST(ExportTest, FilesAndCreatedDirectoriesAreTheUsersOnlyUnlessWidened) {
  const MemoryModel model = FakeModel();
  const mode_t old_umask = ::umask(0);  // the modes must not come from the umask
  struct Case {
    FileModes modes;
    mode_t file, dir;
  };
  for (const Case& c :
       {Case{FileModes(), 0600, 0700}, Case{FileModes::ForGroupReadable(true), 0640, 0750}}) {
    FloatRowSource source = model.Source(1 << 20);
    const std::string parent = OutDir(absl::StrCat("modes", c.file));
    ExportOptions options;
    options.out_dir = parent + "/inner";  // both created
    options.max_shard_bytes = 9000;       // several shards
    options.modes = c.modes;
    auto result = ExportSafetensors(model.tensors, source, options);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_GE(result->files.size(), 3u);
    for (const std::string& file : result->files) {
      EXPECT_EQ(ModeOf(options.out_dir + "/" + file), c.file) << file;
    }
    EXPECT_EQ(ModeOf(parent), c.dir);
    EXPECT_EQ(ModeOf(options.out_dir), c.dir);
  }
  ::umask(old_umask);
}

class BrokenSource : public ExportSource {
 public:
  explicit BrokenSource(int mode) : mode_(mode) {}
  absl::Status StreamTensor(const ExportTensor& tensor, ExportDtype dtype,
                            const Sink& sink) override {
    std::vector<uint8_t> bytes(tensor.rows * tensor.cols * ExportDtypeSize(dtype), 0);
    if (mode_ == 0) return absl::UnavailableError("daemon 1 went away");
    if (mode_ == 1) bytes.pop_back(), bytes.pop_back();  // one element short
    if (mode_ == 2) bytes.resize(bytes.size() + 2);      // one element too many
    return sink(bytes);
  }

 private:
  int mode_;
};

TEST(ExportTest, SourceFailuresLeaveNoIndex) {
  const MemoryModel model = FakeModel();
  for (int mode = 0; mode < 3; ++mode) {
    BrokenSource source(mode);
    ExportOptions options;
    options.out_dir = OutDir(absl::StrCat("broken", mode));
    auto result = ExportSafetensors(model.tensors, source, options);
    ASSERT_FALSE(result.ok()) << mode;
    if (mode == 0) {
      EXPECT_TRUE(absl::IsUnavailable(result.status()));
    }
    if (mode > 0) {
      EXPECT_TRUE(absl::IsInternal(result.status())) << result.status();
      EXPECT_NE(result.status().message().find(model.tensors[0].name), absl::string_view::npos);
    }
    struct stat st;
    EXPECT_NE(stat((options.out_dir + "/model.safetensors.index.json").c_str(), &st), 0);
    EXPECT_NE(stat((options.out_dir + "/model-00001-of-00001.safetensors").c_str(), &st), 0);
  }
}

TEST(ExportTest, RefusesInconsistentTensors) {
  MemoryModel model = FakeModel();
  model.tensors[2].shape = {258};
  FloatRowSource source = model.Source(1 << 20);
  ExportOptions options;
  options.out_dir = OutDir("bad");
  EXPECT_TRUE(absl::IsInvalidArgument(ExportSafetensors(model.tensors, source, options).status()));
  options.out_dir = "";
  EXPECT_TRUE(absl::IsInvalidArgument(ExportSafetensors({}, source, options).status()));
}

TEST(ParseTest, ByteSizesAndDtypes) {
  EXPECT_EQ(ParseByteSize("5GB").value(), 5'000'000'000u);
  EXPECT_EQ(ParseByteSize("500mb").value(), 500'000'000u);
  EXPECT_EQ(ParseByteSize("1.5GiB").value(), 1610612736u);
  EXPECT_EQ(ParseByteSize("64KiB").value(), 65536u);
  EXPECT_EQ(ParseByteSize("123").value(), 123u);
  EXPECT_EQ(ParseByteSize(" 7 B ").value(), 7u);
  for (const char* bad : {"", "GB", "-1GB", "0", "1XB", "abc", "1e30TB", "0.1"}) {
    EXPECT_FALSE(ParseByteSize(bad).ok()) << bad;
  }
  EXPECT_EQ(ParseExportDtype("BF16").value(), ExportDtype::kBf16);
  EXPECT_EQ(ParseExportDtype("float32").value(), ExportDtype::kFp32);
  EXPECT_FALSE(ParseExportDtype("fp8").ok());
  EXPECT_EQ(ExportDtypeName(ExportDtype::kFp32), "fp32");
}

}  // namespace
}  // namespace checkpoint
}  // namespace paramd
