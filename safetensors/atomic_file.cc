#include "safetensors/atomic_file.h"

#include <errno.h>
#include <unistd.h>

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"

namespace paramd {
namespace safetensors {

absl::Status ErrnoStatus(int err, absl::string_view what, absl::string_view path) {
  return paramd::ErrnoStatus(err, what, absl::StrCat("'", path, "'"));
}

absl::StatusOr<std::unique_ptr<AtomicFile>> AtomicFile::Create(const std::string& path,
                                                               mode_t mode) {
  const size_t slash = path.rfind('/');
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  absl::StatusOr<UniqueFile> temp =
      CreateUniqueFile(DirectoryOf(path), absl::StrCat(name, ".tmp-"), mode);
  if (!temp.ok()) {
    return absl::Status(temp.status().code(), absl::StrCat("cannot create a temporary file for '",
                                                           path, "': ", temp.status().message()));
  }
  return std::unique_ptr<AtomicFile>(new AtomicFile(path, std::move(temp->path), temp->fd));
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
  absl::Status status = WriteAll(fd_, bytes.data(), bytes.size(), temp_path_);
  if (!status.ok()) {
    error_ = std::move(status);
    Abandon();
    return error_;
  }
  bytes_written_ += bytes.size();
  return absl::OkStatus();
}

absl::Status AtomicFile::Commit() {
  if (!error_.ok()) return error_;
  if (fd_ < 0)
    return absl::FailedPreconditionError(absl::StrCat("'", path_, "' already committed"));
  if (absl::Status status = FsyncFd(fd_, temp_path_); !status.ok()) {
    error_ = std::move(status);
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
  return FsyncDir(DirectoryOf(path_));  // makes the rename itself durable
}

}  // namespace safetensors
}  // namespace paramd
