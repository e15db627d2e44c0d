#include "checkpoint/store.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/test_util.h"
#include "gtest/gtest.h"
#include "sharding/plan.h"

namespace paramd {
namespace checkpoint {
namespace {

using testing::CheckFakeCheckpoint;
using testing::FakeTensors;
using testing::WriteFakeCheckpoint;

std::string MakeTempDir() {
  std::string dir = testing::MakeTestDir("store");
  EXPECT_FALSE(dir.empty());
  return dir;
}

// Includes shapes that are not multiples of anything, 1 x N and N x 1.
std::vector<TensorInfo> Model() {
  return FakeTensors({{300, 64}, {1, 257}, {129, 1}, {2, 3}, {512, 33}});
}

bool FileExists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

void FlipByte(const std::string& path, uint64_t offset) {
  int fd = open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  unsigned char byte;
  ASSERT_EQ(pread(fd, &byte, 1, offset), 1);
  byte ^= 0x10;
  ASSERT_EQ(pwrite(fd, &byte, 1, offset), 1);
  close(fd);
}

std::vector<uint64_t> Versions(const CheckpointStore& store) {
  std::vector<uint64_t> versions;
  const std::vector<CheckpointSummary> list = store.List().value();
  for (const CheckpointSummary& summary : list) versions.push_back(summary.version);
  return versions;
}

TEST(StoreTest, RoundTripSameWorld) {
  auto store = CheckpointStore::Open(MakeTempDir() + "/ck", /*create=*/true);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE(WriteFakeCheckpoint(*store, 7, /*seed=*/1, Model(), 2).ok());
  EXPECT_TRUE(store->Verify(7).ok());
  EXPECT_TRUE(CheckFakeCheckpoint(*store, 7, 1, Model(), 2).ok());
  // A different seed's data must not compare equal (the check can fail).
  EXPECT_FALSE(CheckFakeCheckpoint(*store, 7, 2, Model(), 2).ok());

  auto list = store->List();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].version, 7u);
  EXPECT_EQ((*list)[0].world_size, 2);
  EXPECT_EQ((*list)[0].num_tensors, 5);
  EXPECT_GT((*list)[0].created_unix_micros, 0);
  EXPECT_GT((*list)[0].total_bytes, 3u * 4 * (300 * 64 + 257 + 129 + 6 + 512 * 33));
  EXPECT_EQ(store->LatestVersion().value(), 7u);

  auto manifest = store->ReadManifest(7);
  ASSERT_TRUE(manifest.ok());
  EXPECT_EQ(manifest->format_version(), kManifestFormatVersion);
  ASSERT_EQ(manifest->shards_size(), 2);
  EXPECT_EQ(manifest->shards(1).name(), "shard-00001-of-00002.ckpt");
  EXPECT_EQ(manifest->tensors(1).spec(), "spec of layers.1.weight");
  EXPECT_EQ(manifest->metadata().at("optimizer"), "adamw");

  auto reader = CheckpointReader::Open(*store, 7);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->RowSectionNames("layers.0.weight"),
            (std::vector<std::string>{"master", "exp_avg", "exp_avg_sq"}));
}

// Every directory and file of a checkpoint is private to the daemon's user
// (0700 / 0600), or group-readable (0750 / 0640) when the operator says so;
// the umask neither widens nor narrows that.
TEST(StoreTest, CheckpointFilesAndDirectoriesHaveTheConfiguredModes) {
  const std::vector<TensorInfo> tensors = FakeTensors({{40, 8}, {3, 5}});
  for (const bool group : {false, true}) {
    const std::string root = testing::MakeTestDir("modes") + "/ckpt";
    const FileModes modes = FileModes::ForGroupReadable(group);
    const mode_t old_umask = ::umask(group ? 077 : 0);
    auto store = CheckpointStore::OpenUnder(root, "run/a", /*create=*/true, modes);
    absl::Status written =
        store.ok() ? WriteFakeCheckpoint(*store, 3, 1, tensors, 2) : store.status();
    ::umask(old_umask);
    ASSERT_TRUE(written.ok()) << written;
    const mode_t file = group ? 0640 : 0600;
    const mode_t dir = group ? 0750 : 0700;
    for (const auto& [path, mode] : std::vector<std::pair<std::string, mode_t>>{
             {root, dir},
             {root + "/run", dir},
             {root + "/run/a", dir},
             {root + "/run/a/v3", dir},
             {root + "/run/a/v3/MANIFEST", file},
             {root + "/run/a/v3/shard-00000-of-00002.ckpt", file},
             {root + "/run/a/v3/shard-00001-of-00002.ckpt", file}}) {
      struct stat st;
      ASSERT_EQ(::lstat(path.c_str(), &st), 0) << path;
      EXPECT_EQ(st.st_mode & 0777, mode) << path << (group ? " (group readable)" : "");
    }
  }
}

TEST(StoreTest, DaemonBlobCopiesThatDifferAreReported) {
  // The fake's daemon-wide "daemon" blob differs per daemon: with one
  // daemon there is one copy; with three, ReadBlob must report that the
  // copies disagree.
  auto store = CheckpointStore::Open(MakeTempDir(), true);
  ASSERT_TRUE(WriteFakeCheckpoint(*store, 1, 1, Model(), 1).ok());
  ASSERT_TRUE(WriteFakeCheckpoint(*store, 2, 1, Model(), 3).ok());
  EXPECT_EQ(CheckpointReader::Open(*store, 1).value()->ReadBlob("", "daemon").value(), "daemon 0");
  auto status = CheckpointReader::Open(*store, 2).value()->ReadBlob("", "daemon").status();
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
}

TEST(StoreTest, ReshardTwoToOneAndOneToThree) {
  auto store = CheckpointStore::Open(MakeTempDir(), true);
  ASSERT_TRUE(WriteFakeCheckpoint(*store, 10, 5, Model(), 2).ok());
  ASSERT_TRUE(WriteFakeCheckpoint(*store, 11, 6, Model(), 1).ok());
  auto two_to_one = CheckFakeCheckpoint(*store, 10, 5, Model(), 1);
  EXPECT_TRUE(two_to_one.ok()) << two_to_one;
  auto one_to_three = CheckFakeCheckpoint(*store, 11, 6, Model(), 3);
  EXPECT_TRUE(one_to_three.ok()) << one_to_three;
  auto two_to_three = CheckFakeCheckpoint(*store, 10, 5, Model(), 3);
  EXPECT_TRUE(two_to_three.ok()) << two_to_three;

  // A range that spans the 2-daemon cut of tensor 0 (rows 150 | 150).
  auto reader = CheckpointReader::Open(*store, 10).value();
  auto rows = reader->ReadRows("layers.0.weight", "exp_avg", 140, 160);
  ASSERT_TRUE(rows.ok());
  auto want = testing::FakeRows(5, Model()[0], "exp_avg", 140, 160);
  EXPECT_EQ(std::memcmp(rows->data(), want.data(), want.size() * 4), 0);
  EXPECT_TRUE(
      absl::IsInvalidArgument(reader->ReadRows("layers.0.weight", "master", 0, 301).status()));
  EXPECT_TRUE(absl::IsNotFound(reader->ReadRows("nope", "master", 0, 1).status()));
  EXPECT_TRUE(absl::IsNotFound(reader->ReadRows("layers.0.weight", "nope", 0, 1).status()));
  // Names from a request come back quoted, bounded and escaped.
  for (const std::string& name : {std::string(1 << 20, 'n'), std::string("a\nE0101 forged")}) {
    const absl::Status missing = reader->ReadRows(name, "master", 0, 1).status();
    EXPECT_TRUE(absl::IsNotFound(missing));
    EXPECT_LT(missing.message().size(), 1500u);
    EXPECT_EQ(missing.message().find('\n'), absl::string_view::npos) << missing;
    const absl::Status blob = reader->ReadBlob(name, "state").status();
    EXPECT_LT(blob.message().size(), 1500u);
    EXPECT_EQ(blob.message().find('\n'), absl::string_view::npos) << blob;
  }
}

// The project's shard plan (128-row aligned cuts, byte balancing), as the
// daemons use it: written by 2 daemons, restored onto 1 and 3; written by 1,
// restored onto 3 and 2.
testing::PiecePlan ShardingPlan(const std::vector<TensorInfo>& tensors, int daemons) {
  std::vector<sharding::ManifestTensor> manifest;
  for (const TensorInfo& t : tensors) manifest.push_back({t.name(), t.rows(), t.cols(), 12.0});
  sharding::PlanOptions options;
  options.min_split_bytes = 0;  // split everything taller than 128 rows
  auto plan = sharding::MakeShardPlan(manifest, daemons, options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  testing::PiecePlan pieces(daemons);
  for (const sharding::Piece& piece : plan->pieces) {
    PieceInfo info;
    info.set_tensor(tensors[piece.tensor].name());
    info.set_row_begin(piece.row_begin);
    info.set_row_end(piece.row_end);
    pieces[piece.daemon].push_back(info);
  }
  return pieces;
}

TEST(StoreTest, ReshardWithTheShardingPlan) {
  const auto tensors = FakeTensors({{1000, 16}, {300, 8}, {1, 50}, {129, 3}, {640, 5}});
  auto store = CheckpointStore::Open(MakeTempDir(), true);
  const auto two = ShardingPlan(tensors, 2);
  const auto one = ShardingPlan(tensors, 1);
  const auto three = ShardingPlan(tensors, 3);
  ASSERT_TRUE(WriteFakeCheckpoint(*store, 1, 21, tensors, two).ok());
  ASSERT_TRUE(WriteFakeCheckpoint(*store, 2, 22, tensors, one).ok());
  int split = 0;  // the plans must actually cut tensors for this to test anything
  for (const auto& daemon : three) {
    for (const PieceInfo& piece : daemon)
      split += piece.row_end() - piece.row_begin() < 1000 && piece.tensor() == tensors[0].name();
  }
  EXPECT_GE(split, 2);
  for (const auto& [version, seed, to, name] :
       std::vector<std::tuple<uint64_t, uint64_t, testing::PiecePlan, const char*>>{
           {1, 21, one, "2->1"},
           {1, 21, three, "2->3"},
           {2, 22, three, "1->3"},
           {2, 22, two, "1->2"},
           {1, 21, two, "2->2"}}) {
    absl::Status status = CheckFakeCheckpoint(*store, version, seed, tensors, to);
    EXPECT_TRUE(status.ok()) << name << ": " << status;
  }
}

TEST(StoreTest, ShardsWithoutManifestAreNotListed) {
  auto store = CheckpointStore::Open(MakeTempDir(), true);
  ASSERT_TRUE(WriteFakeCheckpoint(*store, 3, 1, Model(), 2).ok());
  // Version 4: both daemons finish, the coordinator never commits.
  for (int rank = 0; rank < 2; ++rank) {
    auto writer = store->NewShardWriter(4, rank, 2);
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE((*writer)->AddBlob("", "x", "y").ok());
    ASSERT_TRUE((*writer)->Finish().ok());
  }
  // Version 5: a writer abandoned midway.
  {
    auto writer = store->NewShardWriter(5, 0, 1);
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE((*writer)->BeginRows("t", "master", 0, 10, 10).ok());
  }
  EXPECT_EQ(Versions(*store), std::vector<uint64_t>{3});
  EXPECT_EQ(store->LatestVersion().value(), 3u);
  EXPECT_TRUE(absl::IsNotFound(store->ReadManifest(4).status()));
  EXPECT_TRUE(absl::IsNotFound(CheckpointReader::Open(*store, 4).status()));
  // The abandoned writer removed its temporary file.
  EXPECT_EQ(rmdir(store->VersionDir(5).c_str()), 0);
}

TEST(StoreTest, CommitRefusesIncompleteShardSets) {
  auto store = CheckpointStore::Open(MakeTempDir(), true);
  auto tensors = FakeTensors({{10, 4}});
  auto write = [&](int rank, int world, int64_t begin, int64_t end) {
    auto writer = store->NewShardWriter(1, rank, world).value();
    std::vector<float> rows((end - begin) * 4, 1.0f);
    EXPECT_TRUE(writer->AddRows(tensors[0].name(), "master", begin, end, 4, rows).ok());
    return writer->Finish().value();
  };
  ShardFileInfo first = write(0, 2, 0, 6);
  Manifest manifest;
  manifest.set_version(1);
  manifest.set_world_size(2);
  *manifest.add_tensors() = tensors[0];
  *manifest.add_shards() = first;
  auto status = store->CommitManifest(manifest);  // daemon 1 missing
  EXPECT_TRUE(absl::IsFailedPrecondition(status)) << status;

  ShardFileInfo second = write(1, 2, 7, 10);  // row 6 missing
  *manifest.add_shards() = second;
  status = store->CommitManifest(manifest);
  EXPECT_TRUE(absl::IsFailedPrecondition(status)) << status;
  EXPECT_NE(status.message().find("gap at row 6"), absl::string_view::npos) << status;

  Manifest wrong_size = manifest;
  wrong_size.mutable_shards(0)->mutable_pieces(0)->set_row_end(7);
  wrong_size.mutable_shards(0)->set_size_bytes(first.size_bytes() + 1);
  status = store->CommitManifest(wrong_size);
  EXPECT_TRUE(absl::IsFailedPrecondition(status)) << status;

  Manifest bad_name = manifest;
  bad_name.mutable_shards(1)->set_name("../../etc/passwd");
  EXPECT_TRUE(absl::IsFailedPrecondition(store->CommitManifest(bad_name)));
  EXPECT_TRUE(Versions(*store).empty());
}

TEST(StoreTest, AlreadyCheckpointedVersionIsRefused) {
  auto store = CheckpointStore::Open(MakeTempDir(), true);
  ASSERT_TRUE(WriteFakeCheckpoint(*store, 2, 1, Model(), 1).ok());
  EXPECT_TRUE(absl::IsAlreadyExists(store->NewShardWriter(2, 0, 1).status()));
  EXPECT_TRUE(absl::IsAlreadyExists(store->CommitManifest(store->ReadManifest(2).value())));
}

TEST(StoreTest, FlippedByteAnywhereIsRefusedNamingTheFile) {
  auto store = CheckpointStore::Open(MakeTempDir(), true);
  ASSERT_TRUE(WriteFakeCheckpoint(*store, 9, 3, Model(), 2).ok());
  const std::string path = store->VersionDir(9) + "/shard-00001-of-00002.ckpt";
  const uint64_t size = RegularFileSize(path).value();
  // Header, data, index, trailer.
  for (uint64_t offset : {uint64_t{3}, uint64_t{100}, size / 2, size - 40, size - 1}) {
    FlipByte(path, offset);
    absl::Status status = store->Verify(9);
    EXPECT_TRUE(absl::IsDataLoss(status)) << offset << ": " << status;
    EXPECT_NE(status.message().find(path), absl::string_view::npos) << status;
    FlipByte(path, offset);  // undo
    EXPECT_TRUE(store->Verify(9).ok()) << offset;
  }
  // Without Verify, a whole-section read still notices a flip in its data.
  auto reader = CheckpointReader::Open(*store, 9).value();
  const Section* master = nullptr;
  auto file = ShardFileReader::Open(path).value();
  for (const Section& section : file->index().sections()) {
    if (section.kind() == Section::ROWS && section.name() == "master") master = &section;
  }
  ASSERT_NE(master, nullptr);
  FlipByte(path, master->offset() + 5);
  std::vector<float> out((master->row_end() - master->row_begin()) * master->cols());
  absl::Status status =
      file->ReadRows(*master, master->row_begin(), master->row_end(), absl::MakeSpan(out));
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
}

TEST(StoreTest, TruncatedOrMissingShardIsRefused) {
  auto store = CheckpointStore::Open(MakeTempDir(), true);
  ASSERT_TRUE(WriteFakeCheckpoint(*store, 4, 3, Model(), 2).ok());
  const std::string path = store->VersionDir(4) + "/shard-00000-of-00002.ckpt";
  const uint64_t size = RegularFileSize(path).value();
  ASSERT_EQ(truncate(path.c_str(), static_cast<off_t>(size - 100)), 0);
  absl::Status status = store->Verify(4);
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_NE(status.message().find(path), absl::string_view::npos) << status;
  EXPECT_NE(status.message().find("truncated"), absl::string_view::npos) << status;
  status = CheckpointReader::Open(*store, 4).status();
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_NE(status.message().find(path), absl::string_view::npos) << status;

  ASSERT_EQ(unlink(path.c_str()), 0);
  status = store->Verify(4);
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_NE(status.message().find(path), absl::string_view::npos) << status;
}

TEST(StoreTest, DamagedManifestIsNotListed) {
  auto store = CheckpointStore::Open(MakeTempDir(), true);
  ASSERT_TRUE(WriteFakeCheckpoint(*store, 1, 3, Model(), 1).ok());
  ASSERT_TRUE(WriteFakeCheckpoint(*store, 2, 3, Model(), 1).ok());
  FlipByte(store->VersionDir(2) + "/MANIFEST", 40);
  EXPECT_EQ(Versions(*store), std::vector<uint64_t>{1});
  auto status = store->ReadManifest(2).status();
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_NE(status.message().find("MANIFEST"), absl::string_view::npos);
}

// A manifest with a valid checksum that names a file outside its version
// directory: never listed, never read (the outside file would verify).
TEST(StoreTest, CraftedManifestNamingAnotherFileIsRefused) {
  const std::string root = MakeTempDir();
  auto store = CheckpointStore::Open(root + "/ckpt", true);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE(WriteFakeCheckpoint(*store, 3, 3, Model(), 2).ok());
  Manifest manifest = store->ReadManifest(3).value();
  const std::string outside = root + "/outside.ckpt";
  ASSERT_EQ(rename((store->VersionDir(3) + "/shard-00001-of-00002.ckpt").c_str(), outside.c_str()),
            0);
  for (const std::string& name : {std::string("../../outside.ckpt"), outside}) {
    SCOPED_TRACE(name);
    manifest.mutable_shards(1)->set_name(name);
    ASSERT_TRUE(testing::WriteManifestUnchecked(store->VersionDir(3) + "/MANIFEST", manifest).ok());
    EXPECT_TRUE(Versions(*store).empty());
    for (absl::Status status : {store->ReadManifest(3).status(), store->Verify(3),
                                CheckpointReader::Open(*store, 3).status()}) {
      EXPECT_TRUE(absl::IsDataLoss(status)) << status;
      EXPECT_NE(status.message().find("unexpected shard file"), absl::string_view::npos) << status;
    }
  }
  // The same manifest with the right name is fine again once the file is back.
  ASSERT_EQ(rename(outside.c_str(), (store->VersionDir(3) + "/shard-00001-of-00002.ckpt").c_str()),
            0);
  manifest.mutable_shards(1)->set_name("shard-00001-of-00002.ckpt");
  ASSERT_TRUE(testing::WriteManifestUnchecked(store->VersionDir(3) + "/MANIFEST", manifest).ok());
  EXPECT_TRUE(store->Verify(3).ok());
  EXPECT_TRUE(CheckFakeCheckpoint(*store, 3, 3, Model(), 1).ok());
}

TEST(StoreTest, KeepLastRemovesOldAndAbandonedOnly) {
  auto store = CheckpointStore::Open(MakeTempDir(), true);
  auto tensors = FakeTensors({{8, 8}});
  for (uint64_t v : {1, 2, 4, 6, 8})
    ASSERT_TRUE(WriteFakeCheckpoint(*store, v, v, tensors, 2).ok());
  // Abandoned (3, 5), protected in-progress (7), newer in-progress (9).
  for (uint64_t v : {3, 5, 7, 9}) {
    auto writer = store->NewShardWriter(v, 0, 1).value();
    ASSERT_TRUE(writer->AddBlob("", "x", "y").ok());
    ASSERT_TRUE(writer->Finish().ok());
  }
  // A leftover temporary file inside a kept checkpoint, and a file that is
  // not the store's inside one that goes.
  ASSERT_TRUE(CreateExclusive(store->VersionDir(8) + "/.shard-00000-of-00002.ckpt.tmp-1-1").ok());
  ASSERT_TRUE(CreateExclusive(store->VersionDir(1) + "/notes.txt").ok());

  EXPECT_TRUE(absl::IsInvalidArgument(store->KeepLast(0).status()));
  auto removed = store->KeepLast(2, /*in_progress=*/{7});
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, (std::vector<uint64_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(Versions(*store), (std::vector<uint64_t>{6, 8}));
  EXPECT_TRUE(store->Verify(6).ok());
  EXPECT_TRUE(store->Verify(8).ok());
  EXPECT_FALSE(FileExists(store->VersionDir(2)));
  EXPECT_FALSE(FileExists(store->VersionDir(3)));
  EXPECT_TRUE(FileExists(store->VersionDir(7)));
  EXPECT_TRUE(FileExists(store->VersionDir(9)));
  EXPECT_FALSE(FileExists(store->VersionDir(8) + "/.shard-00000-of-00002.ckpt.tmp-1-1"));
  // The foreign file and its directory stay; the checkpoint is gone.
  EXPECT_TRUE(FileExists(store->VersionDir(1) + "/notes.txt"));
  EXPECT_FALSE(FileExists(store->VersionDir(1) + "/MANIFEST"));

  // keep = 1 never removes the newest.
  ASSERT_TRUE(store->KeepLast(1).ok());
  EXPECT_EQ(Versions(*store), std::vector<uint64_t>{8});
  EXPECT_TRUE(CheckFakeCheckpoint(*store, 8, 8, tensors, 1).ok());
}

TEST(StoreTest, OpenUnderRefusesTraversal) {
  const std::string base = MakeTempDir();
  const std::string outside = MakeTempDir();
  ASSERT_EQ(symlink(outside.c_str(), (base + "/out").c_str()), 0);
  for (const char* bad : {"../x", "/etc/x", "a/../../x", "out", "out/nightly"}) {
    auto store = CheckpointStore::OpenUnder(base, bad, /*create=*/true);
    EXPECT_TRUE(absl::IsInvalidArgument(store.status())) << bad << ": " << store.status();
  }
  EXPECT_FALSE(FileExists(outside + "/nightly"));
  auto store = CheckpointStore::OpenUnder(base, "nightly/run1", true);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(store->root(), RealPath(base).value() + "/nightly/run1");
  ASSERT_TRUE(WriteFakeCheckpoint(*store, 1, 1, Model(), 1).ok());
  // A version directory replaced by a symlink is not read through.
  ASSERT_EQ(rename(store->VersionDir(1).c_str(), (outside + "/v1").c_str()), 0);
  ASSERT_EQ(symlink((outside + "/v1").c_str(), store->VersionDir(1).c_str()), 0);
  EXPECT_TRUE(Versions(*store).empty());
  EXPECT_TRUE(absl::IsInvalidArgument(store->NewShardWriter(1, 0, 1).status()));
}

TEST(ShardWriterTest, RefusesMisuse) {
  auto store = CheckpointStore::Open(MakeTempDir(), true);
  auto writer = store->NewShardWriter(1, 0, 1).value();
  EXPECT_TRUE(absl::IsInvalidArgument(writer->BeginRows("t", "master", 5, 5, 3)));
  EXPECT_TRUE(absl::IsInvalidArgument(writer->BeginRows("", "master", 0, 1, 3)));
  ASSERT_TRUE(writer->BeginRows("t", "master", 0, 2, 3).ok());
  std::vector<float> four(4, 1.0f);
  ASSERT_TRUE(writer->AppendRows(four).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(writer->AppendRows(four)));  // 8 > 6
  EXPECT_TRUE(absl::IsInvalidArgument(writer->EndSection()));      // 4 < 6
  EXPECT_TRUE(absl::IsFailedPrecondition(writer->Finish().status()));
  EXPECT_TRUE(absl::IsInvalidArgument(store->NewShardWriter(1, 1, 1).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ShardWriter::Create("/tmp", "../x", 1, 0, 1).status()));
}

TEST(ShardFileTest, NotAShardFileIsDataLoss) {
  const std::string dir = MakeTempDir();
  const std::string path = dir + "/junk";
  {
    auto fd = CreateExclusive(path).value();
    std::string junk(200, 'x');
    ASSERT_TRUE(WriteAll(fd.get(), junk.data(), junk.size(), path).ok());
  }
  auto status = ShardFileReader::Open(path).status();
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_NE(status.message().find(path), absl::string_view::npos);
}

}  // namespace
// The pid of a process that has exited (reaped): no writer runs under it.
int DeadPid() {
  const pid_t pid = fork();
  if (pid == 0) _exit(0);
  int status = 0;
  waitpid(pid, &status, 0);
  return pid;
}

// D9: a killed writer's temporary files inside a complete version are gone
// once the version is retried (NewShardWriter) or at a daemon's start
// (RemoveStaleTempFilesEverywhere); a live writer's file stays.
TEST(StoreTest, StaleTempFilesOfKilledWritersAreRemovedOnRetryAndSweep) {
  auto store = CheckpointStore::Open(MakeTempDir(), true);
  ASSERT_TRUE(store.ok());
  auto tensors = FakeTensors({{8, 8}});
  ASSERT_TRUE(WriteFakeCheckpoint(*store, 4, 4, tensors, 2).ok());
  const int dead = DeadPid();
  const std::string stale4 =
      absl::StrCat(store->VersionDir(4), "/.shard-00000-of-00002.ckpt.tmp-", dead, "-0");
  const std::string stale6 =
      absl::StrCat(store->VersionDir(6), "/.shard-00001-of-00002.ckpt.tmp-", dead, "-3");
  const std::string live =
      absl::StrCat(store->VersionDir(6), "/.shard-00000-of-00002.ckpt.tmp-", getpid(), "-9");
  ASSERT_TRUE(CreateExclusive(stale4).ok());
  ASSERT_TRUE(MakeDirsUnder(store->root(), "v6").ok());
  ASSERT_TRUE(CreateExclusive(stale6).ok());
  ASSERT_TRUE(CreateExclusive(live).ok());
  // Retrying version 6: the killed attempt's file goes, the live one stays.
  auto writer = store->NewShardWriter(6, 1, 2);
  ASSERT_TRUE(writer.ok()) << writer.status();
  EXPECT_FALSE(FileExists(stale6));
  EXPECT_TRUE(FileExists(live));
  EXPECT_TRUE(FileExists(stale4)) << "not touched by a retry of another version";
  writer->reset();
  // The start-of-daemon sweep.
  auto removed = store->RemoveStaleTempFilesEverywhere();
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, 1);
  EXPECT_FALSE(FileExists(stale4));
  EXPECT_TRUE(FileExists(live));
  EXPECT_TRUE(store->Verify(4).ok()) << "the complete checkpoint is intact";
}

}  // namespace checkpoint
}  // namespace paramd
