#include "checkpoint/file_util.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace paramd {
namespace checkpoint {
namespace {

bool IsWithin(const std::string& path, const std::string& root) {
  if (root == "/") return true;
  return path == root || (path.size() > root.size() && path.compare(0, root.size(), root) == 0 &&
                          path[root.size()] == '/');
}

// The components of a validated relative path, without "" and ".".
std::vector<std::string> Components(absl::string_view relative) {
  std::vector<std::string> parts;
  for (absl::string_view part : absl::StrSplit(relative, '/')) {
    if (part.empty() || part == ".") continue;
    parts.emplace_back(part);
  }
  return parts;
}

// ErrnoStatus for an O_NOFOLLOW open: ELOOP there means the leaf is a symlink.
absl::Status NoFollowOpenError(int err, absl::string_view what, absl::string_view path) {
  absl::Status status = ErrnoStatus(err, what, path);
  if (err != ELOOP) return status;
  return absl::InvalidArgumentError(absl::StrCat(status.message(), " (symlinks are not followed)"));
}

}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.release();
  }
  return *this;
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

int UniqueFd::release() {
  int fd = fd_;
  fd_ = -1;
  return fd;
}

absl::Status UniqueFd::Close(absl::string_view path) {
  if (fd_ < 0) return absl::OkStatus();
  int fd = release();
  if (::close(fd) != 0) return ErrnoStatus(errno, "close", path);
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> OpenForRead(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return NoFollowOpenError(errno, "open", path);
  return UniqueFd(fd);
}

absl::StatusOr<UniqueFd> CreateExclusive(const std::string& path, mode_t mode) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, mode);
  if (fd < 0) return NoFollowOpenError(errno, "create", path);
  return UniqueFd(fd);
}

absl::Status PReadAll(int fd, void* data, size_t size, uint64_t offset, absl::string_view path) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    ssize_t n = ::pread(fd, p, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "read", path);
    }
    if (n == 0) {
      return absl::DataLossError(absl::StrCat("read ", path, ": file ends at byte ", offset, ", ",
                                              size, " more bytes expected (truncated?)"));
    }
    p += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status ValidateRelativePath(absl::string_view relative) {
  // NUL and other control characters, and more than PATH_MAX / 2 bytes.
  RETURN_IF_ERROR(CheckClientPath("checkpoint directory name", relative, PATH_MAX / 2));
  if (!relative.empty() && relative[0] == '/') {
    return absl::InvalidArgumentError(absl::StrCat(QuoteForMessage(relative),
                                                   " is absolute; only names relative to the "
                                                   "checkpoint directory are accepted"));
  }
  if (relative.find('\\') != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(QuoteForMessage(relative), " contains a backslash"));
  }
  for (absl::string_view part : absl::StrSplit(relative, '/')) {
    if (part == "..") {
      return absl::InvalidArgumentError(absl::StrCat(
          QuoteForMessage(relative), " contains '..'; it may not leave the checkpoint directory"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> RealPath(const std::string& path) {
  char* resolved = ::realpath(path.c_str(), nullptr);
  if (resolved == nullptr) return ErrnoStatus(errno, "resolve", path);
  std::string result(resolved);
  ::free(resolved);
  return result;
}

absl::StatusOr<std::string> SafeJoin(absl::string_view root, absl::string_view relative) {
  RETURN_IF_ERROR(ValidateRelativePath(relative));
  ASSIGN_OR_RETURN(const std::string root_real, RealPath(std::string(root)));
  std::string current = root_real;
  std::vector<std::string> parts = Components(relative);
  for (size_t i = 0; i < parts.size(); ++i) {
    std::string next = current == "/" ? "/" + parts[i] : current + "/" + parts[i];
    struct stat st;
    if (::lstat(next.c_str(), &st) != 0) {
      if (errno != ENOENT) return ErrnoStatus(errno, "stat", next);
      // Nothing below a missing component exists: no symlink can follow.
      for (size_t j = i + 1; j < parts.size(); ++j) absl::StrAppend(&next, "/", parts[j]);
      return next;
    }
    if (S_ISLNK(st.st_mode)) {
      absl::StatusOr<std::string> target = RealPath(next);
      if (!target.ok() || !IsWithin(*target, root_real)) {
        return absl::InvalidArgumentError(
            absl::StrCat(QuoteForMessage(relative), ": ", next,
                         " is a symlink that leads outside the checkpoint "
                         "directory ",
                         root_real));
      }
      next = *target;
    }
    current = next;
  }
  return current;
}

absl::StatusOr<std::string> MakeDirsUnder(absl::string_view root, absl::string_view relative,
                                          mode_t dir_mode, std::vector<std::string>* created) {
  ASSIGN_OR_RETURN(std::string resolved, SafeJoin(root, relative));
  ASSIGN_OR_RETURN(const std::string root_real, RealPath(std::string(root)));
  std::string current = root_real;
  for (const std::string& part : Components(relative)) {
    std::string next = current == "/" ? "" : current;
    next.append("/").append(part);
    if (::mkdir(next.c_str(), dir_mode) == 0) {
      if (created != nullptr) created->push_back(next);
      // mkdir applied the umask; the operator's mode is the contract.
      if (::chmod(next.c_str(), dir_mode) != 0) return ErrnoStatus(errno, "chmod", next);
      RETURN_IF_ERROR(FsyncDir(current));
    } else if (errno != EEXIST) {
      return ErrnoStatus(errno, "mkdir", next);
    }
    current = next;
  }
  // Re-check after creating: a component may have been swapped for a
  // symlink meanwhile.
  ASSIGN_OR_RETURN(resolved, SafeJoin(root, relative));
  struct stat st;
  if (::stat(resolved.c_str(), &st) != 0) return ErrnoStatus(errno, "stat", resolved);
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(resolved, " exists and is not a directory"));
  }
  return resolved;
}

void RemoveCreatedDirs(const std::vector<std::string>& created) {
  for (auto it = created.rbegin(); it != created.rend(); ++it) {
    if (::rmdir(it->c_str()) != 0) return;  // not empty (or gone): keep the rest too
  }
}

absl::StatusOr<uint64_t> RegularFileSize(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return ErrnoStatus(errno, "stat", path);
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " is not a regular file"));
  }
  return static_cast<uint64_t>(st.st_size);
}

}  // namespace checkpoint
}  // namespace paramd
