#include "common/file_util.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace paramd {

absl::Status ErrnoStatus(int err, absl::string_view what, absl::string_view path) {
  std::string message = absl::StrCat(what, " ", path, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    case EEXIST:
      return absl::AlreadyExistsError(message);
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(message);
    case ELOOP:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::StatusOr<int> OpenForReading(const std::string& path) {
  for (;;) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) return fd;
    switch (errno) {
      case EINTR:
        continue;
      case ENOENT:
      case ENOTDIR:
        return absl::NotFoundError(absl::StrCat("no such file: ", path));
      case EACCES:
      case EPERM:
        return absl::PermissionDeniedError(absl::StrCat("permission denied: ", path));
      default:
        return ErrnoStatus(errno, "cannot open", path);
    }
  }
}

absl::StatusOr<std::string> ReadAll(int fd, const std::string& path) {
  std::string text;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EISDIR) {
      return absl::InvalidArgumentError(absl::StrCat(path, " is a directory, not a file"));
    }
    if (n < 0) return ErrnoStatus(errno, "read", path);
    if (n == 0) return text;
    text.append(buf, static_cast<size_t>(n));
  }
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  ASSIGN_OR_RETURN(const int fd, OpenForReading(path));
  absl::StatusOr<std::string> text = ReadAll(fd, path);
  ::close(fd);
  return text;
}

absl::Status WithContext(const absl::Status& status, absl::string_view context) {
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

absl::Status WriteAll(int fd, const void* data, size_t size, absl::string_view path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "write", path);
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status FsyncFd(int fd, absl::string_view path) {
  while (::fsync(fd) != 0) {
    if (errno != EINTR) return ErrnoStatus(errno, "fsync", path);
  }
  return absl::OkStatus();
}

absl::Status MakeDirs(const std::string& path, mode_t mode) {
  for (size_t pos = 1; pos <= path.size(); ++pos) {
    if (pos != path.size() && path[pos] != '/') continue;
    const std::string prefix = path.substr(0, pos);
    if (::mkdir(prefix.c_str(), mode) == 0) {
      if (::chmod(prefix.c_str(), mode) != 0) return ErrnoStatus(errno, "chmod", prefix);
    } else if (errno != EEXIST) {
      return ErrnoStatus(errno, "mkdir", prefix);
    }
  }
  return absl::OkStatus();
}

absl::Status FsyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "open directory", dir);
  absl::Status status = FsyncFd(fd, dir);
  if (::close(fd) != 0 && status.ok()) status = ErrnoStatus(errno, "close", dir);
  return status;
}

absl::StatusOr<UniqueFile> CreateUniqueFile(const std::string& dir, absl::string_view prefix,
                                            mode_t mode) {
  static constexpr char kChars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  thread_local std::mt19937_64 random(std::random_device{}() ^ static_cast<uint64_t>(::getpid())
                                                                   << 32);
  const std::string base = absl::StrCat(dir, "/", prefix);
  for (int attempt = 0; attempt < 100; ++attempt) {
    std::string path = base;
    uint64_t bits = random();
    for (int i = 0; i < 10; ++i, bits /= 62) path.push_back(kChars[bits % 62]);
    const int fd =
        ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode & 0777);
    if (fd < 0) {
      if (errno == EEXIST || errno == EINTR) continue;
      return ErrnoStatus(errno, "cannot create", path);
    }
    // open() applied the umask; the caller's mode is the contract.
    if (::fchmod(fd, mode & 0777) != 0) {
      const absl::Status status = ErrnoStatus(errno, "cannot chmod", path);
      ::close(fd);
      ::unlink(path.c_str());
      return status;
    }
    return UniqueFile{fd, std::move(path)};
  }
  return absl::AlreadyExistsError(
      absl::StrCat("cannot create a file ", base, "*: 100 fresh names were all taken"));
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view bytes, mode_t mode) {
  const size_t slash = path.rfind('/');
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  ASSIGN_OR_RETURN(UniqueFile temp,
                   CreateUniqueFile(DirectoryOf(path), absl::StrCat(name, ".tmp-"), mode));
  absl::Status s = WriteAll(temp.fd, bytes.data(), bytes.size(), temp.path);
  if (s.ok()) s = FsyncFd(temp.fd, temp.path);
  if (::close(temp.fd) != 0 && s.ok()) s = ErrnoStatus(errno, "cannot close", temp.path);
  if (s.ok() && ::rename(temp.path.c_str(), path.c_str()) != 0) {
    s = ErrnoStatus(errno, "cannot rename to", path);
  }
  if (!s.ok()) {
    ::unlink(temp.path.c_str());
    return s;
  }
  return FsyncDir(DirectoryOf(path));
}

absl::StatusOr<std::string> ResolveBelow(const std::vector<std::string>& roots,
                                         const std::string& path, absl::string_view flag) {
  if (roots.empty()) return path;
  // One answer for every refusal -- missing, unreadable, outside the roots --
  // so that a client cannot probe which files exist elsewhere on the host.
  const absl::Status refused = absl::PermissionDeniedError(
      absl::StrCat(QuoteForMessage(path), " is not a readable file below ", flag,
                   " (files are read only from there)"));
  auto real = [](const std::string& p) -> std::optional<std::string> {
    char* resolved = ::realpath(p.c_str(), nullptr);
    if (resolved == nullptr) return std::nullopt;
    std::string out(resolved);
    std::free(resolved);
    return out;
  };
  const std::string joined = !path.empty() && path[0] == '/' ? path : roots[0] + "/" + path;
  const std::optional<std::string> target = real(joined);
  if (!target.has_value()) return refused;
  for (const std::string& root : roots) {
    const std::optional<std::string> r = real(root);
    if (!r.has_value()) continue;
    if (*target == *r || absl::StartsWith(*target, *r == "/" ? *r : *r + "/")) {
      if (::access(target->c_str(), R_OK) != 0) return refused;
      return *target;
    }
  }
  return refused;
}

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace paramd
