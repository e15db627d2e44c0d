#include "checkpoint/export_dir.h"

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "absl/strings/match.h"

namespace paramd {
namespace checkpoint {
namespace {

namespace fs = std::filesystem;

class ExportDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / "export_dir_test";
    fs::remove_all(dir_);
  }
  void Touch(const std::string& name) { std::ofstream(dir_ / name) << "x"; }
  fs::path dir_;
};

TEST(IsExportFile, ExportNamesOnly) {
  for (const char* yes :
       {"model.safetensors.index.json", "model-00001-of-00003.safetensors", "model.safetensors",
        "model-00002-of-00002.safetensors.tmp-Ab12Cd", "model.safetensors.index.json.tmp-x1Y2z3"}) {
    EXPECT_TRUE(IsExportFile(yes)) << yes;
  }
  for (const char* no : {"config.json", "tokenizer.json", "model-final.safetensors",
                         "model-1-of-x.safetensors", "other.safetensors", "model.bin"}) {
    EXPECT_FALSE(IsExportFile(no)) << no;
  }
}

TEST_F(ExportDirTest, MissingOrEmptyIsFine) {
  auto a = PrepareExportDir(dir_.string(), false);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->empty());
  fs::create_directories(dir_);
  auto b = PrepareExportDir(dir_.string(), false);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(b->empty());
}

TEST_F(ExportDirTest, NonEmptyNeedsOverwriteWhichRemovesOnlyTheOldExport) {
  fs::create_directories(dir_);
  Touch("model-00001-of-00002.safetensors");
  Touch("model-00002-of-00002.safetensors");
  Touch("model.safetensors.index.json");
  Touch("config.json");
  auto refused = PrepareExportDir(dir_.string(), false);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "--overwrite")) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "config.json")) << refused.status();
  EXPECT_TRUE(fs::exists(dir_ / "model-00002-of-00002.safetensors"));  // nothing touched

  auto removed = PrepareExportDir(dir_.string(), true);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                                "model-00002-of-00002.safetensors",
                                                "model.safetensors.index.json"}));
  EXPECT_TRUE(fs::exists(dir_ / "config.json"));
  EXPECT_FALSE(fs::exists(dir_ / "model.safetensors.index.json"));
}

TEST_F(ExportDirTest, AFileIsNotADirectory) {
  fs::create_directories(dir_);
  Touch("f");
  EXPECT_EQ(PrepareExportDir((dir_ / "f").string(), true).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace checkpoint
}  // namespace paramd
