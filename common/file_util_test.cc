#include "common/file_util.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
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

TEST(FileUtilTest, ResolveBelowConfinesToTheRoots) {
  const std::string base = MakeTempDir();
  const std::string root = base + "/root";
  ASSERT_EQ(::mkdir(root.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((root + "/sub").c_str(), 0755), 0);
  for (const std::string& f : {root + "/sub/m.safetensors", base + "/outside"}) {
    const int fd = ::open(f.c_str(), O_CREAT | O_WRONLY, 0644);
    ASSERT_GE(fd, 0);
    ::close(fd);
  }
  ASSERT_EQ(::symlink((base + "/outside").c_str(), (root + "/escape").c_str()), 0);
  ASSERT_EQ(::symlink((root + "/sub").c_str(), (base + "/inward").c_str()), 0);
  const std::vector<std::string> roots = {root};
  // No roots: unchanged.
  EXPECT_EQ(*ResolveBelow({}, "/etc/passwd", "--model_root"), "/etc/passwd");
  absl::StatusOr<std::string> ok = ResolveBelow(roots, root + "/sub/../sub/m.safetensors", "--x");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, root + "/sub/m.safetensors");
  EXPECT_EQ(*ResolveBelow(roots, "sub/m.safetensors", "--x"), root + "/sub/m.safetensors")
      << "relative to the first root";
  EXPECT_TRUE(ResolveBelow(roots, base + "/inward/m.safetensors", "--x").ok())
      << "a symlink from outside that resolves inside is fine";
  // Existing or not, readable or not, outside or inside: one code, one
  // message shape, so the answer is no oracle for files outside the root.
  const std::string unreadable = root + "/sub/unreadable";
  ASSERT_EQ(::close(::open(unreadable.c_str(), O_CREAT | O_WRONLY, 0)), 0);
  const bool can_read_anything = ::access(unreadable.c_str(), R_OK) == 0;  // root
  for (const std::string& bad :
       {std::string("/etc/passwd"), std::string("/etc/no-such-file"), root + "/../outside",
        root + "/../missing", root + "/escape", std::string("../outside"),
        std::string("../missing"), root + "x", root + "/missing", unreadable}) {
    if (bad == unreadable && can_read_anything) continue;
    absl::StatusOr<std::string> r = ResolveBelow(roots, bad, "--model_root");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << bad << ": " << r.status();
    EXPECT_EQ(r.status().message(),
              absl::StrCat("\"", bad, "\" is not a readable file below --model_root (files are "
                           "read only from there)"))
        << bad;
  }
  // A second root (e.g. --checkpoint_dir).
  EXPECT_TRUE(ResolveBelow({root, base}, base + "/outside", "--x").ok());
}

}  // namespace
}  // namespace paramd
