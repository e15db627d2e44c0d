#include "checkpoint/file_util.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "gtest/gtest.h"

namespace paramd {
namespace checkpoint {
namespace {

std::string MakeTempDir() {
  const char* base = getenv("TEST_TMPDIR");
  std::string pattern = std::string(base ? base : "/tmp") + "/fu.XXXXXX";
  char* dir = mkdtemp(pattern.data());
  EXPECT_NE(dir, nullptr);
  return RealPath(pattern).value();
}

TEST(SafeJoinTest, AcceptsPlainRelativeNames) {
  const std::string root = MakeTempDir();
  EXPECT_EQ(SafeJoin(root, "").value(), root);
  EXPECT_EQ(SafeJoin(root, "a/b").value(), root + "/a/b");
  EXPECT_EQ(SafeJoin(root, "./a//b/").value(), root + "/a/b");
  EXPECT_EQ(SafeJoin(root, "nightly..2").value(), root + "/nightly..2");
}

TEST(SafeJoinTest, RefusesTraversalAndAbsoluteNames) {
  const std::string root = MakeTempDir();
  for (const char* bad : {"..", "../x", "a/../../x", "a/..", "/etc/x", "/", "a\\..\\x"}) {
    absl::StatusOr<std::string> joined = SafeJoin(root, bad);
    EXPECT_TRUE(absl::IsInvalidArgument(joined.status())) << bad << " -> " << joined.status();
  }
  EXPECT_TRUE(absl::IsInvalidArgument(SafeJoin(root, std::string("a\0b", 3)).status()));
  // Control characters are refused, and refusals quote the name escaped.
  for (const std::string bad : {std::string("a\nE0101 forged"), std::string("x\x1b[2J"),
                                std::string("/etc\nE0101 forged"), std::string("..\nx/../..")}) {
    absl::StatusOr<std::string> joined = SafeJoin(root, bad);
    EXPECT_TRUE(absl::IsInvalidArgument(joined.status())) << joined.status();
    EXPECT_EQ(joined.status().message().find_first_of("\n\x1b"), absl::string_view::npos)
        << joined.status();
  }
}

TEST(SafeJoinTest, RefusesSymlinkLeadingOutside) {
  const std::string root = MakeTempDir();
  const std::string outside = MakeTempDir();
  ASSERT_EQ(symlink(outside.c_str(), (root + "/escape").c_str()), 0);
  ASSERT_EQ(symlink("/etc", (root + "/etc").c_str()), 0);
  ASSERT_EQ(symlink("../", (root + "/up").c_str()), 0);
  for (const char* bad : {"escape", "escape/x", "escape/new/dir", "etc/passwd", "up/x"}) {
    absl::StatusOr<std::string> joined = SafeJoin(root, bad);
    EXPECT_TRUE(absl::IsInvalidArgument(joined.status())) << bad << " -> " << joined.status();
    EXPECT_NE(joined.status().message().find("symlink"), absl::string_view::npos);
  }
  EXPECT_FALSE(MakeDirsUnder(root, "escape/sub").ok());
  struct stat st;
  EXPECT_NE(stat((outside + "/sub").c_str(), &st), 0) << "created a directory outside the root";
}

TEST(SafeJoinTest, FollowsSymlinkThatStaysInside) {
  const std::string root = MakeTempDir();
  ASSERT_EQ(mkdir((root + "/real").c_str(), 0755), 0);
  ASSERT_EQ(symlink("real", (root + "/alias").c_str()), 0);
  EXPECT_EQ(SafeJoin(root, "alias/x").value(), root + "/real/x");
}

TEST(MakeDirsUnderTest, CreatesNestedDirectories) {
  const std::string root = MakeTempDir();
  EXPECT_EQ(MakeDirsUnder(root, "a/b/c").value(), root + "/a/b/c");
  struct stat st;
  ASSERT_EQ(stat((root + "/a/b/c").c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_TRUE(MakeDirsUnder(root, "a/b/c").ok());  // idempotent
  EXPECT_TRUE(absl::IsInvalidArgument(MakeDirsUnder(root, "../a").status()));
}

TEST(FileTest, CreateExclusiveDoesNotFollowOrReplace) {
  const std::string root = MakeTempDir();
  const std::string outside = MakeTempDir();
  ASSERT_EQ(symlink((outside + "/target").c_str(), (root + "/link").c_str()), 0);
  EXPECT_FALSE(CreateExclusive(root + "/link").ok());
  struct stat st;
  EXPECT_NE(stat((outside + "/target").c_str(), &st), 0);
  ASSERT_TRUE(CreateExclusive(root + "/f").ok());
  EXPECT_TRUE(absl::IsAlreadyExists(CreateExclusive(root + "/f").status()));
  EXPECT_FALSE(OpenForRead(root + "/link").ok());
}

TEST(FileTest, WriteThenPReadAndShortReadIsDataLoss) {
  const std::string root = MakeTempDir();
  const std::string path = root + "/data";
  {
    auto fd = CreateExclusive(path);
    ASSERT_TRUE(fd.ok());
    ASSERT_TRUE(WriteAll(fd->get(), "hello world", 11, path).ok());
    ASSERT_TRUE(FsyncFd(fd->get(), path).ok());
    ASSERT_TRUE(fd->Close(path).ok());
  }
  auto fd = OpenForRead(path);
  ASSERT_TRUE(fd.ok());
  char buf[5];
  ASSERT_TRUE(PReadAll(fd->get(), buf, 5, 6, path).ok());
  EXPECT_EQ(std::string(buf, 5), "world");
  absl::Status short_read = PReadAll(fd->get(), buf, 5, 8, path);
  EXPECT_TRUE(absl::IsDataLoss(short_read)) << short_read;
  EXPECT_NE(short_read.message().find(path), absl::string_view::npos);
  EXPECT_EQ(RegularFileSize(path).value(), 11u);
  EXPECT_TRUE(FsyncDir(root).ok());
}

}  // namespace
}  // namespace checkpoint
}  // namespace paramd
