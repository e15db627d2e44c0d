#include "common/file_util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <string>

#include "gtest/gtest.h"

namespace paramd {
namespace {

std::string MakeTempDir() {
  const char* base = getenv("TEST_TMPDIR");
  std::string pattern = std::string(base ? base : "/tmp") + "/fu.XXXXXX";
  EXPECT_NE(mkdtemp(pattern.data()), nullptr);
  return pattern;
}

TEST(ErrnoStatusTest, CodeFollowsErrno) {
  EXPECT_EQ(ErrnoStatus(ENOENT, "open", "/x").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ErrnoStatus(ENOTDIR, "open", "/x").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ErrnoStatus(EACCES, "open", "/x").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrnoStatus(EPERM, "open", "/x").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrnoStatus(EROFS, "open", "/x").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrnoStatus(EEXIST, "create", "/x").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(ErrnoStatus(ENOSPC, "write", "/x").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoStatus(EDQUOT, "write", "/x").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoStatus(ELOOP, "open", "/x").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ErrnoStatus(EIO, "fsync", "/x").code(), absl::StatusCode::kInternal);
  EXPECT_EQ(ErrnoStatus(ENOENT, "open", "/x").message(), "open /x: No such file or directory");
}

TEST(FileUtilTest, WriteAllThenFsyncFileAndDirectory) {
  const std::string dir = MakeTempDir();
  const std::string path = dir + "/f";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  EXPECT_TRUE(WriteAll(fd, "hello", 5, path).ok());
  EXPECT_TRUE(FsyncFd(fd, path).ok());
  char buf[5];
  EXPECT_EQ(::pread(fd, buf, 5, 0), 5);
  EXPECT_EQ(std::string(buf, 5), "hello");
  ASSERT_EQ(::close(fd), 0);
  EXPECT_TRUE(FsyncDir(dir).ok());
}

TEST(FileUtilTest, ErrorsNameThePath) {
  const std::string dir = MakeTempDir();
  absl::Status missing = FsyncDir(dir + "/absent");
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_EQ(missing.message(), "open directory " + dir + "/absent: No such file or directory");
  // A file is not a directory.
  const std::string file = dir + "/f";
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::close(fd), 0);
  EXPECT_EQ(FsyncDir(file).code(), absl::StatusCode::kNotFound);
  // No descriptor (EBADF).
  absl::Status bad_fd = FsyncFd(-1, file);
  EXPECT_EQ(bad_fd.code(), absl::StatusCode::kInternal) << bad_fd;
  EXPECT_NE(bad_fd.message().find(file), absl::string_view::npos);
  EXPECT_EQ(WriteAll(-1, "x", 1, file).code(), absl::StatusCode::kInternal);
}

TEST(FileUtilTest, DirectoryOf) {
  EXPECT_EQ(DirectoryOf("a/b/c.safetensors"), "a/b");
  EXPECT_EQ(DirectoryOf("/tmp/x"), "/tmp");
  EXPECT_EQ(DirectoryOf("/x"), "/");
  EXPECT_EQ(DirectoryOf("x"), ".");
  EXPECT_EQ(DirectoryOf("a/b/"), "a/b");
}

}  // namespace
}  // namespace paramd
