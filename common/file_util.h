// File: common/file_util.h
//
// POSIX helpers shared by checkpoint/, safetensors/ and server/: the
// absl::Status for a failed system call, a full write(), the fsyncs that
// make a write-then-rename durable (fsync the file, rename, fsync the
// directory), and the one way every file this code writes is created
// (CreateUniqueFile, WriteFileAtomically): a fresh name with O_CREAT |
// O_EXCL | O_NOFOLLOW, so that neither an existing file nor a symlink
// planted at the name -- predictable or not -- is ever followed or
// truncated, with exactly the mode asked for (the umask does not widen or
// narrow it).
//
// Thread-safe (no state). Every function but ErrnoStatus and DirectoryOf
// blocks on the file system. Errors name the path and carry strerror(errno).
#ifndef PARAMD_COMMON_FILE_UTIL_H_
#define PARAMD_COMMON_FILE_UTIL_H_

#include <sys/types.h>

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace paramd {

// The status for a failed system call: "<what> <path>: <strerror(err)>",
// with the code chosen by errno so that a caller can decide whether a retry
// helps:
//   ENOENT, ENOTDIR        -> NotFound
//   EACCES, EPERM, EROFS   -> PermissionDenied
//   EEXIST                 -> AlreadyExists
//   ENOSPC, EDQUOT         -> ResourceExhausted
//   ELOOP                  -> InvalidArgument
//   anything else          -> Internal
absl::Status ErrnoStatus(int err, absl::string_view what, absl::string_view path);

// write() until all `size` bytes are written (retries EINTR and short
// writes). `path` only names the file in errors.
absl::Status WriteAll(int fd, const void* data, size_t size, absl::string_view path);

// fsync() of an open file (retries EINTR). `path` only names it in errors.
absl::Status FsyncFd(int fd, absl::string_view path);

// fsync() of a directory, so that a rename, create or unlink inside it is
// durable. Opens and closes `dir` (a failed close is reported).
absl::Status FsyncDir(const std::string& dir);

// The permissions of the files and directories a server writes: its own
// user's only, unless the operator lets the group read them
// (hybrid-paramd --checkpoint_group_readable).
struct FileModes {
  mode_t file = 0600;
  mode_t dir = 0700;
  static FileModes ForGroupReadable(bool group_readable) {
    return group_readable ? FileModes{0640, 0750} : FileModes{};
  }
};

// Creates directory `path` and every missing parent, each new one with
// exactly `mode` (chmod after mkdir: the umask does not change it);
// directories that exist are left as they are. For paths the operator or
// user names (symlinks are followed); a path from a request goes through
// checkpoint/file_util.h MakeDirsUnder instead.
absl::Status MakeDirs(const std::string& path, mode_t mode);

// A new, empty file "<dir>/<prefix><random suffix>", opened for writing.
// The caller owns `fd` (close it) and removes `path` if it does not keep it.
struct UniqueFile {
  int fd = -1;
  std::string path;
};

// Creates a UniqueFile with O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC and
// then exactly `mode` (fchmod). Retries a name that exists.
absl::StatusOr<UniqueFile> CreateUniqueFile(const std::string& dir, absl::string_view prefix,
                                            mode_t mode);

// Opens `path` for reading (O_RDONLY | O_CLOEXEC; the caller closes the
// descriptor). The error tells a missing file from an unreadable one:
// NotFound "no such file: PATH" (ENOENT, ENOTDIR), PermissionDenied
// "permission denied: PATH" (EACCES, EPERM), else ErrnoStatus("cannot
// open", path).
absl::StatusOr<int> OpenForReading(const std::string& path);

// Everything left to read from `fd` (retries EINTR; the caller closes it).
// InvalidArgument for a directory, else ErrnoStatus("read", path).
absl::StatusOr<std::string> ReadAll(int fd, const std::string& path);

// The whole content of the file `path`: OpenForReading, ReadAll, close.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

// `status` (not OK) with "<context>: " before its message, same code.
absl::Status WithContext(const absl::Status& status, absl::string_view context);

// Replaces `path` with `bytes` so that a crash leaves the old content or the
// new, never a torn file: a CreateUniqueFile "<name>.tmp-" beside it, write,
// fsync, rename over `path`, fsync the directory. The file ends with exactly
// `mode`. A symlink at `path` itself is replaced, not followed.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view bytes, mode_t mode);

// Confines a path read on a client's behalf to trusted roots. With `roots`
// empty, returns `path` unchanged (no confinement). Otherwise `path`
// (relative ones are taken relative to roots[0]) is resolved with
// realpath(3) -- every "..", "." and symlink, at any depth -- and must be
// one of the resolved roots or lie below one of them; the resolved path is
// returned, to be opened instead of `path`. A path that does not exist, is
// not readable by this process or lies outside every root gets the same
// PermissionDenied ("\"<path>\" is not a readable file below <flag> ..."),
// so that the answer tells a client nothing about files outside the roots.
absl::StatusOr<std::string> ResolveBelow(const std::vector<std::string>& roots,
                                         const std::string& path, absl::string_view flag);

// The directory part of `path`: "." for a bare name, "/" for an entry of the
// root ("a/b" -> "a", "b" -> ".", "/b" -> "/"). Pure string work.
std::string DirectoryOf(const std::string& path);

}  // namespace paramd

#endif  // PARAMD_COMMON_FILE_UTIL_H_
