#include "safetensors/sharded.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "safetensors/test_util.h"

namespace paramd::safetensors {
namespace {

using testing::ListDir;
using testing::MakeTempDir;
using testing::PatternBytes;
using testing::RawSafetensors;
using testing::ReadFile;
using testing::WriteFile;

std::vector<TensorSpec> SomeTensors() {
  return {
      {"embed.weight", Dtype::kBF16, {64, 16}},    // 2048 bytes
      {"layer.0.bias", Dtype::kF32, {16}},         // 64
      {"layer.0.weight", Dtype::kBF16, {16, 16}},  // 512
      {"layer.1.weight", Dtype::kBF16, {16, 16}},  // 512
      {"layer.1.scale", Dtype::kF32, {}},          // 4
      {"head.weight", Dtype::kBF16, {33, 16}},     // 1056
  };
}

TEST(ShardFileName, HuggingFaceSpelling) {
  EXPECT_EQ(ShardFileName("model", 0, 3), "model-00001-of-00003.safetensors");
  EXPECT_EQ(ShardFileName("x", 11, 12), "x-00012-of-00012.safetensors");
}

TEST(PlanShards, GreedyInOrderWithOversizedTensorsAlone) {
  absl::StatusOr<ShardPlan> plan = PlanShards(SomeTensors(), 1000);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // 2048 alone (over the limit); 64+512 = 576 (+512 would exceed); 512+4;
  // 1056.
  ASSERT_EQ(plan->shards.size(), 4u);
  EXPECT_EQ(plan->shards[0].data_bytes, 2048u);
  EXPECT_EQ(plan->shards[1].data_bytes, 576u);
  EXPECT_EQ(plan->shards[2].data_bytes, 516u);
  EXPECT_EQ(plan->shards[3].data_bytes, 1056u);
  EXPECT_EQ(plan->shards[2].tensors[1].name, "layer.1.scale");
  EXPECT_EQ(plan->shards[3].file_name, "model-00004-of-00004.safetensors");
  EXPECT_EQ(plan->total_size, 2048u + 64 + 512 + 512 + 4 + 1056);

  auto one = PlanShards(SomeTensors(), 1ull << 30);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->shards.size(), 1u);
  EXPECT_EQ(one->shards[0].file_name, "model-00001-of-00001.safetensors");

  auto empty = PlanShards({}, 100);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->shards.size(), 1u);

  EXPECT_EQ(PlanShards(SomeTensors(), 0).status().code(), absl::StatusCode::kInvalidArgument);
  auto dup = PlanShards({{"a", Dtype::kF32, {1}}, {"a", Dtype::kF32, {1}}}, 10);
  EXPECT_NE(dup.status().message().find("tensor 'a' declared twice"), std::string::npos);
}

// Writes SomeTensors() sharded at 1000 bytes, in 100-byte chunks.
std::vector<std::vector<uint8_t>> WriteSharded(const std::string& dir) {
  auto plan = PlanShards(SomeTensors(), 1000);
  EXPECT_TRUE(plan.ok());
  auto writer = ShardedWriter::Create(dir, *plan);
  EXPECT_TRUE(writer.ok()) << writer.status();
  std::vector<std::vector<uint8_t>> data;
  uint32_t seed = 0;
  for (const TensorSpec& t : SomeTensors()) {
    EXPECT_EQ((*writer)->next_tensor(), t.name);
    data.push_back(PatternBytes(*NumBytes(t.dtype, t.shape), ++seed));
    for (size_t off = 0; off < data.back().size(); off += 100) {
      size_t n = std::min<size_t>(100, data.back().size() - off);
      absl::Status s =
          (*writer)->AppendTensorData(t.name, absl::MakeConstSpan(data.back().data() + off, n));
      EXPECT_TRUE(s.ok()) << s;
    }
  }
  absl::Status s = (*writer)->Finish();
  EXPECT_TRUE(s.ok()) << s;
  return data;
}

TEST(Sharded, RoundTripWithIndex) {
  std::string dir = MakeTempDir();
  auto data = WriteSharded(dir);
  EXPECT_EQ(ListDir(dir), (std::vector<std::string>{
                              "model-00001-of-00004.safetensors",
                              "model-00002-of-00004.safetensors",
                              "model-00003-of-00004.safetensors",
                              "model-00004-of-00004.safetensors",
                              "model.safetensors.index.json",
                          }));
  nlohmann::json index = nlohmann::json::parse(ReadFile(dir + "/" + kIndexFileName));
  EXPECT_EQ(index["metadata"]["total_size"], 4196);
  EXPECT_EQ(index["weight_map"]["layer.1.scale"], "model-00003-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"].size(), 6u);

  for (const std::string& path : {dir, dir + "/" + kIndexFileName}) {
    absl::StatusOr<ShardedSafetensors> model = ShardedSafetensors::Open(path);
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_EQ(model->num_files(), 4u);
    EXPECT_EQ(model->total_size(), 4196u);
    EXPECT_EQ(model->data_bytes(), 4196u);
    ASSERT_EQ(model->tensors().size(), 6u);
    std::vector<TensorSpec> specs = SomeTensors();
    for (size_t i = 0; i < specs.size(); ++i) {
      EXPECT_EQ(model->tensors()[i].info->name, specs[i].name);  // file order = write order
      const ShardedSafetensors::Entry* e = model->Find(specs[i].name);
      ASSERT_NE(e, nullptr);
      EXPECT_EQ(e->info->shape, specs[i].shape);
      EXPECT_EQ(*model->ReadTensor(specs[i].name), data[i]) << specs[i].name;
    }
    EXPECT_EQ(model->file(0).metadata().at("format"), "pt");
    EXPECT_EQ(model->ReadTensor("nope").status().code(), absl::StatusCode::kNotFound);
  }
}

TEST(Sharded, OpensSingleFiles) {
  std::string dir = MakeTempDir();
  auto writer = SafetensorsWriter::Create(dir + "/" + kSingleFileName, {{"x", Dtype::kI32, {2}}});
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->WriteTensor("x", PatternBytes(8, 3)).ok());
  ASSERT_TRUE((*writer)->Finish().ok());
  for (const std::string& path : {dir, dir + "/" + kSingleFileName}) {
    auto model = ShardedSafetensors::Open(path);
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_EQ(model->num_files(), 1u);
    EXPECT_FALSE(model->total_size().has_value());
    EXPECT_EQ(*model->ReadTensor("x"), PatternBytes(8, 3));
  }
  auto empty_dir = ShardedSafetensors::Open(MakeTempDir());
  EXPECT_EQ(empty_dir.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(empty_dir.status().message().find("has neither model.safetensors.index.json"),
            std::string::npos);
}

TEST(ShardedWriter, OrderErrorsAndNoIndexUntilComplete) {
  std::string dir = MakeTempDir();
  auto plan = PlanShards(SomeTensors(), 1000);
  auto writer = ShardedWriter::Create(dir, *plan);
  ASSERT_TRUE(writer.ok());
  absl::Status s = (*writer)->WriteTensor("head.weight", PatternBytes(1056, 1));
  EXPECT_NE(s.message().find("expected data for tensor 'embed.weight'"), std::string::npos) << s;
  ASSERT_TRUE((*writer)->WriteTensor("embed.weight", PatternBytes(2048, 1)).ok());
  s = (*writer)->Finish();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("model-00002-of-00004.safetensors: tensor 'layer.0.bias' incomplete"),
            std::string::npos)
      << s;
  // The first shard is complete and in place; there is no index.
  std::vector<std::string> names = ListDir(dir);
  EXPECT_EQ(names.front(), "model-00001-of-00004.safetensors");
  for (const std::string& n : names) EXPECT_NE(n, kIndexFileName);
  EXPECT_EQ(ShardedWriter::Create(dir + "/missing", *plan).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(ShardedWriter, EmptyModelGivesOneEmptyShardAndAnIndex) {
  std::string dir = MakeTempDir();
  auto writer = ShardedWriter::Create(dir, *PlanShards({}, 100));
  ASSERT_TRUE(writer.ok()) << writer.status();
  EXPECT_EQ((*writer)->next_tensor(), "");
  ASSERT_TRUE((*writer)->Finish().ok());
  auto model = ShardedSafetensors::Open(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_TRUE(model->tensors().empty());
  EXPECT_EQ(model->total_size(), 0u);
  EXPECT_EQ(ListDir(dir).size(), 2u);
  auto shard = SafetensorsFile::Open(dir + "/model-00001-of-00001.safetensors");
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_TRUE(shard->tensors().empty());
}

// A valid two-shard directory to corrupt: a.safetensors {x}, b.safetensors {y}.
std::string TwoShardDir() {
  std::string dir = MakeTempDir();
  WriteFile(dir + "/a.safetensors",
            RawSafetensors(R"({"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "ab"));
  WriteFile(dir + "/b.safetensors",
            RawSafetensors(R"({"y":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "c"));
  return dir;
}

TEST(ShardedMalformed, IndexProblemsAreNamed) {
  struct Case {
    std::string name;
    std::string index;
    absl::StatusCode code;
    std::string message;
  };
  const auto inv = absl::StatusCode::kInvalidArgument;
  std::vector<Case> cases = {
      {"ok",
       R"({"metadata":{"total_size":3},"weight_map":{"x":"a.safetensors","y":"b.safetensors"}})",
       absl::StatusCode::kOk, ""},
      {"missing_file",
       R"({"weight_map":{"x":"a.safetensors","y":"b.safetensors","z":"c.safetensors"}})",
       absl::StatusCode::kNotFound, "shard 'c.safetensors' (holds tensor 'z'): cannot open"},
      {"tensor_not_in_file", R"({"weight_map":{"x":"a.safetensors","y":"a.safetensors"}})", inv,
       "weight_map puts tensor 'y' in 'a.safetensors', which has no such tensor"},
      {"bad_json", R"({"weight_map":{"x":)", inv, "is not valid JSON"},
      {"not_object", R"(["a.safetensors"])", inv, "index is not a JSON object"},
      {"missing_weight_map", R"({"metadata":{}})", inv, "missing \"weight_map\""},
      {"weight_map_not_object", R"({"weight_map":["a.safetensors"]})", inv,
       "\"weight_map\" is not a JSON object"},
      {"value_not_string", R"({"weight_map":{"x":1}})", inv,
       "weight_map: tensor 'x' maps to a non-string 1"},
      {"path_traversal", R"({"weight_map":{"x":"../a.safetensors"}})", inv,
       "maps to '../a.safetensors', which is not a plain file name"},
      {"duplicate_tensor", R"({"weight_map":{"x":"a.safetensors","x":"b.safetensors"}})", inv,
       "weight_map lists tensor 'x' more than once"},
      {"negative_total_size", R"({"metadata":{"total_size":-1},"weight_map":{}})", inv,
       "metadata.total_size is not a non-negative integer: -1"},
      {"metadata_not_object", R"({"metadata":3,"weight_map":{}})", inv,
       "\"metadata\" is not a JSON object"},
  };
  for (const Case& c : cases) {
    std::string dir = TwoShardDir();
    std::string index_path = dir + "/" + kIndexFileName;
    WriteFile(index_path, c.index);
    absl::StatusOr<ShardedSafetensors> model = ShardedSafetensors::Open(dir);
    if (c.code == absl::StatusCode::kOk) {
      EXPECT_TRUE(model.ok()) << c.name << ": " << model.status();
      continue;
    }
    ASSERT_FALSE(model.ok()) << c.name << " was accepted";
    EXPECT_EQ(model.status().code(), c.code) << c.name << ": " << model.status();
    EXPECT_NE(model.status().message().find(c.message), std::string::npos)
        << c.name << ": got " << model.status();
    EXPECT_NE(model.status().message().find(index_path), std::string::npos) << model.status();
  }
}

TEST(ShardedMalformed, ShardHoldingAnUnlistedTensor) {
  std::string dir = TwoShardDir();
  WriteFile(dir + "/b.safetensors",
            RawSafetensors(R"({"y":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                           R"("extra":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                           "cd"));
  WriteFile(dir + "/" + kIndexFileName,
            R"({"weight_map":{"x":"a.safetensors","y":"b.safetensors"}})");
  auto model = ShardedSafetensors::Open(dir);
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find(
                "shard 'b.safetensors' holds tensor 'extra', which the weight_map does not list"),
            std::string::npos)
      << model.status();

  // The same tensor in two shards, mapped to one of them.
  WriteFile(dir + "/b.safetensors",
            RawSafetensors(R"({"y":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                           R"("x":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                           "cd"));
  model = ShardedSafetensors::Open(dir);
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find(
                "shard 'b.safetensors' holds tensor 'x', which the weight_map puts in another"),
            std::string::npos)
      << model.status();
}

TEST(ShardedMalformed, CorruptShardIsNamedWithItsIndex) {
  std::string dir = TwoShardDir();
  WriteFile(dir + "/b.safetensors", RawSafetensors("{\"y\": 1}", ""));
  WriteFile(dir + "/" + kIndexFileName,
            R"({"weight_map":{"x":"a.safetensors","y":"b.safetensors"}})");
  auto model = ShardedSafetensors::Open(dir);
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find("shard 'b.safetensors' (holds tensor 'y'): "),
            std::string::npos);
  EXPECT_NE(model.status().message().find("tensor 'y': entry is not a JSON object"),
            std::string::npos)
      << model.status();
}

}  // namespace
}  // namespace paramd::safetensors
