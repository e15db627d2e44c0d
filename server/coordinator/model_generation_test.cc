// Which checkpoints a recovery of the served model may restore: those of
// its generation, and exactly the one it was restored from.
#include "server/coordinator/model_generation.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "checkpoint/store.h"
#include "checkpoint/test_util.h"

namespace paramd {
namespace {

rpc::Manifest Served(int64_t generation, const std::string& loaded_from = "/m/b.safetensors") {
  rpc::Manifest m;
  m.set_model_generation(generation);
  m.set_loaded_from(loaded_from);
  return m;
}

TEST(ChooseRecoveryCheckpointTest, OnlyTheServedGenerationsCheckpointsAndSaysWhyNotTheOthers) {
  const std::vector<CheckpointOfModel> seen = {
      {"/ckpt", 3, 1}, {"/ckpt", 7, 1}, {"/ckpt", 1, 2}, {"/ckpt", 2, 2}};
  RecoveryCheckpointChoice choice = ChooseRecoveryCheckpoint(seen, Served(2));
  ASSERT_TRUE(choice.chosen.has_value());
  EXPECT_EQ(choice.chosen->version, 2);
  EXPECT_EQ(choice.refused,
            "checkpoint 7 in /ckpt belongs to another model (generation 1; the cluster serves "
            "generation 2, loaded from /m/b.safetensors)");

  // The older generation's own recovery takes its newest.
  choice = ChooseRecoveryCheckpoint(seen, Served(1));
  ASSERT_TRUE(choice.chosen.has_value());
  EXPECT_EQ(choice.chosen->version, 7);
  EXPECT_EQ(choice.refused, "");
}

TEST(ChooseRecoveryCheckpointTest, NothingOfTheServedGenerationChoosesNothing) {
  const std::vector<CheckpointOfModel> seen = {{"/ckpt", 3, 1}, {"/ckpt", 7, 1}};
  RecoveryCheckpointChoice choice = ChooseRecoveryCheckpoint(seen, Served(2));
  EXPECT_FALSE(choice.chosen.has_value());
  EXPECT_NE(choice.refused.find("checkpoint 7 in /ckpt belongs to another model (generation 1"),
            std::string::npos)
      << choice.refused;
  EXPECT_FALSE(ChooseRecoveryCheckpoint({}, Served(2)).chosen.has_value());
  EXPECT_EQ(ChooseRecoveryCheckpoint({}, Served(2)).refused, "");
}

// Checkpoints written before generations were recorded serve only a model
// loaded before then (generation 0), never one of a recorded Load.
TEST(ChooseRecoveryCheckpointTest, UnrecordedGenerationOnlyForAnUnrecordedModel) {
  const std::vector<CheckpointOfModel> seen = {{"/ckpt", 4, 0}};
  RecoveryCheckpointChoice choice = ChooseRecoveryCheckpoint(seen, Served(0, ""));
  ASSERT_TRUE(choice.chosen.has_value());
  EXPECT_EQ(choice.chosen->version, 4);

  choice = ChooseRecoveryCheckpoint(seen, Served(1));
  EXPECT_FALSE(choice.chosen.has_value());
  EXPECT_NE(choice.refused.find("records no model generation"), std::string::npos)
      << choice.refused;
}

// A model restored from generation 1's checkpoint 3 may go back to
// checkpoint 3, but not to generation 1's later checkpoint 7 (another
// history), and not to a checkpoint 3 of another store.
TEST(CheckpointsForRecoveryTest, TheRestoredFromCheckpointAndTheGenerationsOwn) {
  const std::string dir = checkpoint::testing::MakeTestDir("model_generation");
  const auto tensors = checkpoint::testing::FakeTensors({{8, 4}});
  auto write = [&](const std::string& root, uint64_t version, const std::string& generation) {
    auto store = checkpoint::CheckpointStore::Open(root, /*create=*/true);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE(checkpoint::testing::WriteFakeCheckpoint(*store, version, 1, tensors, 2).ok());
    if (generation.empty()) return;
    auto manifest = store->ReadManifest(version);
    ASSERT_TRUE(manifest.ok()) << manifest.status();
    (*manifest->mutable_metadata())[checkpoint::kModelGenerationKey] = generation;
    ASSERT_TRUE(checkpoint::testing::WriteManifestUnchecked(
                    store->VersionDir(version) + "/" + checkpoint::kManifestFileName, *manifest)
                    .ok());
  };
  const std::string a = dir + "/a", own = dir + "/own";
  write(a, 3, "1");
  write(a, 7, "1");
  write(own, 3, "1");
  write(own, 2, "2");
  write(own, 5, "not a number");  // damaged: never a source
  write(own, 6, "");              // written before generations were recorded
  if (HasFatalFailure()) return;

  rpc::Manifest served = Served(2, absl::StrCat("checkpoint 3 of ", a));
  served.mutable_restored_from()->set_path(a + "/");  // not the store's spelling
  served.mutable_restored_from()->set_version(3);

  const std::vector<CheckpointOfModel> seen = CheckpointsForRecovery(own, served);
  std::vector<std::string> listed;
  for (const CheckpointOfModel& c : seen) {
    listed.push_back(absl::StrCat(c.path.substr(dir.size()), " v", c.version, " g", c.generation));
  }
  EXPECT_EQ(listed,
            (std::vector<std::string>{"/own v2 g2", "/own v3 g1", "/own v6 g0", "/a/ v3 g1"}));

  RecoveryCheckpointChoice choice = ChooseRecoveryCheckpoint(seen, served);
  ASSERT_TRUE(choice.chosen.has_value());
  EXPECT_EQ(choice.chosen->path, a + "/");
  EXPECT_EQ(choice.chosen->version, 3);
  EXPECT_EQ(choice.refused,
            absl::StrCat("checkpoint 6 in ", own,
                         " belongs to another model (it records no model generation: written "
                         "before generations were recorded; the cluster serves generation 2, "
                         "loaded from checkpoint 3 of ",
                         a, ")"));
  // The same version of another store is not what it was restored from.
  EXPECT_FALSE(MayRecoverFrom({own, 3, 1}, served));
  EXPECT_TRUE(MayRecoverFrom({a, 3, 1}, served));
  EXPECT_FALSE(MayRecoverFrom({a, 7, 1}, served));

  // With its checkpoint store the one it was restored from: listed once.
  EXPECT_EQ(CheckpointsForRecovery(a, served).size(), 2u);
}

TEST(CheckpointGenerationTest, AbsentIsZeroAndGarbageIsDataLoss) {
  checkpoint::Manifest m;
  EXPECT_EQ(*CheckpointGeneration(m), 0);
  (*m.mutable_metadata())[checkpoint::kModelGenerationKey] = "12";
  EXPECT_EQ(*CheckpointGeneration(m), 12);
  (*m.mutable_metadata())[checkpoint::kModelGenerationKey] = "-1";
  EXPECT_EQ(CheckpointGeneration(m).status().code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace paramd
