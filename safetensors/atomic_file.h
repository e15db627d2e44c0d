// File: safetensors/atomic_file.h
//
// A file that appears at its final path complete or not at all: bytes go to
// a fresh "<path>.tmp-<random>" in the same directory (common/file_util.h
// CreateUniqueFile: never an existing file or a planted symlink); Commit() fsyncs, renames over
// `path` and fsyncs the directory. Destroying an uncommitted AtomicFile
// removes the temporary file.
//
// Not thread-safe; every call blocks on disk I/O.
#ifndef PARAMD_SAFETENSORS_ATOMIC_FILE_H_
#define PARAMD_SAFETENSORS_ATOMIC_FILE_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace paramd {
namespace safetensors {

class AtomicFile {
 public:
  // Creates the temporary file with exactly `mode`. The error status (from
  // errno) names the path.
  static absl::StatusOr<std::unique_ptr<AtomicFile>> Create(const std::string& path,
                                                            mode_t mode = 0644);

  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // Appends all of `bytes` (retrying short writes and EINTR). After an error
  // the file is abandoned: later calls fail.
  absl::Status Append(absl::Span<const uint8_t> bytes);
  absl::Status Append(absl::string_view bytes);

  // fsync + rename + directory fsync. FailedPrecondition after an error or a
  // second Commit.
  absl::Status Commit();

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_path_; }
  uint64_t bytes_written() const { return bytes_written_; }

 private:
  AtomicFile(std::string path, std::string temp_path, int fd);
  void Abandon();

  std::string path_;
  std::string temp_path_;
  int fd_ = -1;
  uint64_t bytes_written_ = 0;
  absl::Status error_;  // first failure; sticky
};

// paramd::ErrnoStatus (//common:file_util: the code follows errno) with the
// path quoted, as safetensors/ words its errors: "<what> '<path>': <strerror>".
absl::Status ErrnoStatus(int err, absl::string_view what, absl::string_view path);

}  // namespace safetensors
}  // namespace paramd

#endif  // PARAMD_SAFETENSORS_ATOMIC_FILE_H_
