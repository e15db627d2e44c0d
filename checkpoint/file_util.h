// File: checkpoint/file_util.h
//
// POSIX file helpers for the checkpoint code: an owning file descriptor,
// full reads and writes, durable directory updates, and confinement of every
// path a request names to one configured root directory.
//
// Confinement (SafeJoin): a daemon writes only inside its configured
// checkpoint directory. Names that come from requests are relative paths
// made of plain components; `..`, absolute paths, empty components, NUL
// bytes, other control characters, backslashes and names longer than
// PATH_MAX / 2 are refused (the refusal quotes the name with
// QuoteForMessage, bounded), and the deepest existing ancestor of the
// result (the result itself when it exists) must resolve, through any
// symlinks, to a path inside the root. Files are then created with
// O_NOFOLLOW | O_EXCL, so a symlink planted after the check is not followed
// for the leaf either.
//
// All functions are thread-safe (no shared state) and block on the file
// system. Errors name the path and carry strerror(errno).
//
// ErrnoStatus, WriteAll, FsyncFd and FsyncDir live in //common:file_util
// (included here; code in namespace paramd::checkpoint calls them unqualified).
#ifndef PARAMD_CHECKPOINT_FILE_UTIL_H_
#define PARAMD_CHECKPOINT_FILE_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/file_util.h"

namespace paramd {
namespace checkpoint {

// Owns a file descriptor; closes it on destruction. Movable, not copyable.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd();

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release();
  // Closes now and reports a failed close (which can lose written data).
  absl::Status Close(absl::string_view path);

 private:
  int fd_ = -1;
};

// Opens `path` for reading without following a symlink at the leaf.
absl::StatusOr<UniqueFd> OpenForRead(const std::string& path);

// Creates `path` exclusively (O_EXCL | O_NOFOLLOW) with `mode` (less the
// umask).
absl::StatusOr<UniqueFd> CreateExclusive(const std::string& path, mode_t mode = 0600);

// pread() exactly `size` bytes at `offset`; DataLoss if the file ends first.
absl::Status PReadAll(int fd, void* data, size_t size, uint64_t offset, absl::string_view path);

// Checks that `relative` is a relative path of plain components (see the
// file comment). An empty string is accepted and means the root itself.
absl::Status ValidateRelativePath(absl::string_view relative);

// `root` (which must exist; resolved with realpath) joined with `relative`,
// confined as described in the file comment. InvalidArgument for a name
// that is refused or escapes the root through a symlink.
absl::StatusOr<std::string> SafeJoin(absl::string_view root, absl::string_view relative);

// SafeJoin, then creates every missing directory component (exactly
// `dir_mode`) and fsyncs the parents it changed. Returns the resolved path;
// `created`, if given, gets the directories it made, outermost first (so
// that a caller whose later step fails can remove them again).
absl::StatusOr<std::string> MakeDirsUnder(absl::string_view root, absl::string_view relative,
                                          mode_t dir_mode = FileModes().dir,
                                          std::vector<std::string>* created = nullptr);

// Removes the directories MakeDirsUnder reported as `created`, innermost
// first, as far as they are empty: undoes a refused request's mkdirs.
void RemoveCreatedDirs(const std::vector<std::string>& created);

// realpath(3) of an existing path.
absl::StatusOr<std::string> RealPath(const std::string& path);

// The size of a regular file, without following a symlink at the leaf
// (FailedPrecondition for anything that is not a regular file).
absl::StatusOr<uint64_t> RegularFileSize(const std::string& path);

}  // namespace checkpoint
}  // namespace paramd

#endif  // PARAMD_CHECKPOINT_FILE_UTIL_H_
