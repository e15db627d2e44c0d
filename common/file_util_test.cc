#include "common/file_util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
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

std::string ReadAll(const std::string& path) {
  std::string out;
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW);
  if (fd < 0) return "<cannot open>";
  char buf[256];
  for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) > 0;) out.append(buf, n);
  ::close(fd);
  return out;
}

// A missing file and a directory are told apart from a file read back
// (the unreadable file: auth/security_test's UnreadableIsPermissionDenied...).
TEST(FileUtilTest, ReadFileToStringSaysWhatIsWrong) {
  const std::string dir = MakeTempDir();
  ASSERT_TRUE(WriteFileAtomically(dir + "/f", "bytes", 0600).ok());
  absl::StatusOr<std::string> read = ReadFileToString(dir + "/f");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "bytes");
  read = ReadFileToString(dir + "/missing");
  EXPECT_EQ(read.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(read.status().message(), "no such file: " + dir + "/missing");
  read = ReadFileToString(dir);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WithContext(read.status(), "--config").message(),
            "--config: " + dir + " is a directory, not a file");
}

TEST(FileUtilTest, CreateUniqueFileNeverFollowsAndHasExactlyTheMode) {
  const std::string dir = MakeTempDir();
  const mode_t old_umask = ::umask(077);  // narrower than 0640: the mode still wins
  absl::StatusOr<UniqueFile> a = CreateUniqueFile(dir, ".x.tmp-", 0640);
  absl::StatusOr<UniqueFile> b = CreateUniqueFile(dir, ".x.tmp-", 0600);
  ::umask(0);  // wider: still exactly the mode
  absl::StatusOr<UniqueFile> c = CreateUniqueFile(dir, "y-", 0600);
  ::umask(old_umask);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok()) << a.status() << b.status() << c.status();
  EXPECT_NE(a->path, b->path);
  EXPECT_EQ(a->path.rfind(dir + "/.x.tmp-", 0), 0u) << a->path;
  for (const auto& [file, mode] :
       {std::pair{&*a, 0640}, std::pair{&*b, 0600}, std::pair{&*c, 0600}}) {
    struct stat st;
    ASSERT_EQ(::lstat(file->path.c_str(), &st), 0);
    EXPECT_TRUE(S_ISREG(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, static_cast<mode_t>(mode)) << file->path;
    ::close(file->fd);
  }
}

TEST(FileUtilTest, MakeDirsGivesNewDirectoriesExactlyTheModeAndLeavesOldOnes) {
  const std::string dir = MakeTempDir();
  ASSERT_EQ(::chmod(dir.c_str(), 0755), 0);
  const mode_t old_umask = ::umask(077);  // narrower than 0750: the mode still wins
  absl::Status made = MakeDirs(dir + "/a/b", 0750);
  ::umask(old_umask);
  ASSERT_TRUE(made.ok()) << made;
  auto mode_of = [](const std::string& path) {
    struct stat st;
    EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
    return st.st_mode & 07777;
  };
  EXPECT_EQ(mode_of(dir), 0755u);  // existed: untouched
  EXPECT_EQ(mode_of(dir + "/a"), 0750u);
  EXPECT_EQ(mode_of(dir + "/a/b"), 0750u);
  EXPECT_TRUE(MakeDirs(dir + "/a/b", 0700).ok());  // all there: nothing changes
  EXPECT_EQ(mode_of(dir + "/a/b"), 0750u);
  std::ofstream(dir + "/file") << "x";
  EXPECT_FALSE(MakeDirs(dir + "/file/c", 0700).ok());
}

TEST(FileUtilTest, WriteFileAtomicallyIgnoresSymlinksPlantedBesideIt) {
  const std::string dir = MakeTempDir();
  const std::string victim = dir + "/victim";
  ASSERT_TRUE(WriteFileAtomically(victim, "keep", 0644).ok());
  const std::string path = dir + "/state";
  // The names a writer with a predictable temporary name would use.
  for (const std::string& planted :
       {path + ".tmp", absl::StrCat(path, ".tmp-", ::getpid()), path + ".tmp-XXXXXX"}) {
    ASSERT_EQ(::symlink(victim.c_str(), planted.c_str()), 0) << planted;
  }
  ASSERT_TRUE(WriteFileAtomically(path, "secret", 0600).ok());
  ASSERT_TRUE(WriteFileAtomically(path, "secret2", 0600).ok()) << "replaces the old one";
  EXPECT_EQ(ReadAll(victim), "keep");
  struct stat st;
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(ReadAll(path), "secret2");
  // A symlink at the path itself is replaced by the file, not written through.
  const std::string linked = dir + "/linked";
  ASSERT_EQ(::symlink(victim.c_str(), linked.c_str()), 0);
  ASSERT_TRUE(WriteFileAtomically(linked, "new", 0600).ok());
  EXPECT_EQ(ReadAll(victim), "keep");
  EXPECT_EQ(ReadAll(linked), "new");
  // No temporary file is left behind: victim, state, linked, the 3 planted.
  int entries = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    (void)entry;
    ++entries;
  }
  EXPECT_EQ(entries, 6);
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
              absl::StrCat("\"", bad,
                           "\" is not a readable file below --model_root (files are "
                           "read only from there)"))
        << bad;
  }
  // A second root (e.g. --checkpoint_dir).
  EXPECT_TRUE(ResolveBelow({root, base}, base + "/outside", "--x").ok());
}

}  // namespace
}  // namespace paramd
