#include "safetensors/atomic_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace paramd {
namespace safetensors {

absl::Status ErrnoStatus(int err, absl::string_view what, absl::string_view path) {
  std::string message = absl::StrCat(what, " '", path, "': ", strerror(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

namespace {

std::string DirectoryOf(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

absl::StatusOr<std::unique_ptr<AtomicFile>> AtomicFile::Create(const std::string& path) {
  std::string templ = path + ".tmp-XXXXXX";
  std::vector<char> buffer(templ.begin(), templ.end());
  buffer.push_back('\0');
  int fd = mkstemp(buffer.data());
  if (fd < 0) return ErrnoStatus(errno, "cannot create a temporary file for", path);
  std::string temp_path(buffer.data());
  if (fchmod(fd, 0644) != 0) {
    int err = errno;
    close(fd);
    unlink(temp_path.c_str());
    return ErrnoStatus(err, "cannot chmod", temp_path);
  }
  return std::unique_ptr<AtomicFile>(new AtomicFile(path, std::move(temp_path), fd));
}

AtomicFile::AtomicFile(std::string path, std::string temp_path, int fd)
    : path_(std::move(path)), temp_path_(std::move(temp_path)), fd_(fd) {}

AtomicFile::~AtomicFile() { Abandon(); }

void AtomicFile::Abandon() {
  if (fd_ >= 0) {
    close(fd_);
    fd_ = -1;
    unlink(temp_path_.c_str());
  }
}

absl::Status AtomicFile::Append(absl::string_view bytes) {
  return Append(absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
}

absl::Status AtomicFile::Append(absl::Span<const uint8_t> bytes) {
  if (!error_.ok()) return error_;
  if (fd_ < 0)
    return absl::FailedPreconditionError(absl::StrCat("'", path_, "' already committed"));
  const uint8_t* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    ssize_t n = write(fd_, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      error_ = ErrnoStatus(errno, "cannot write", temp_path_);
      Abandon();
      return error_;
    }
    p += n;
    left -= static_cast<size_t>(n);
    bytes_written_ += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status AtomicFile::Commit() {
  if (!error_.ok()) return error_;
  if (fd_ < 0)
    return absl::FailedPreconditionError(absl::StrCat("'", path_, "' already committed"));
  if (fsync(fd_) != 0) {
    error_ = ErrnoStatus(errno, "cannot fsync", temp_path_);
    Abandon();
    return error_;
  }
  if (close(fd_) != 0) {
    fd_ = -1;
    error_ = ErrnoStatus(errno, "cannot close", temp_path_);
    unlink(temp_path_.c_str());
    return error_;
  }
  fd_ = -1;
  if (rename(temp_path_.c_str(), path_.c_str()) != 0) {
    error_ = ErrnoStatus(errno, "cannot rename to", path_);
    unlink(temp_path_.c_str());
    return error_;
  }
  // Make the rename itself durable.
  std::string dir = DirectoryOf(path_);
  int dir_fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dir_fd < 0) return ErrnoStatus(errno, "cannot open directory", dir);
  int rc = fsync(dir_fd);
  int err = errno;
  close(dir_fd);
  if (rc != 0) return ErrnoStatus(err, "cannot fsync directory", dir);
  return absl::OkStatus();
}

}  // namespace safetensors
}  // namespace paramd
