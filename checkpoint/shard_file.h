// File: checkpoint/shard_file.h
//
// One shard file of a checkpoint: what one daemon writes for one version.
//
// Layout (little-endian):
//
//   [0, 16)        header: magic "HPCKSHRD", u32 format version (1), u32 0
//   sections       each starts at a 64-byte-aligned offset; zero padding
//                  between them. A ROWS section is the row-major FP32 rows
//                  [row_begin, row_end) x cols of one tensor (the master or
//                  an optimizer moment); a BLOB section is opaque bytes (a
//                  serialized TensorState, or daemon-wide state).
//   index          a serialized paramd.checkpoint.ShardIndex: every section
//                  with its offset, length and XXH3-64
//   trailer (32)   u64 index offset, u64 index length, u64 XXH3-64 of the
//                  index, magic "HPCKEND1"
//
// The manifest (store.h) records the file's size and the XXH3-64 of all of
// its bytes; Verify compares both before anything is restored.
//
// Durability: ShardWriter writes to a fresh temporary name
// (".<name>.tmp-<pid>-<random>", common/file_util.h CreateUniqueFile:
// O_EXCL | O_NOFOLLOW, exactly the store's file mode) in the target
// directory, and Finish()
// fsyncs the file, renames it to its final name and fsyncs the directory. A
// writer destroyed before Finish() (or a process killed at any point) leaves
// at most a temporary file, which no reader looks at and KeepLast removes.
#ifndef PARAMD_CHECKPOINT_SHARD_FILE_H_
#define PARAMD_CHECKPOINT_SHARD_FILE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "checkpoint/file_util.h"
#include "proto/checkpoint.pb.h"

namespace paramd {
namespace checkpoint {

inline constexpr char kShardMagic[8] = {'H', 'P', 'C', 'K', 'S', 'H', 'R', 'D'};
inline constexpr char kShardTrailerMagic[8] = {'H', 'P', 'C', 'K', 'E', 'N', 'D', '1'};
inline constexpr uint32_t kShardFormatVersion = 1;
inline constexpr uint64_t kShardHeaderBytes = 16;
inline constexpr uint64_t kShardTrailerBytes = 32;
inline constexpr uint64_t kSectionAlignment = 64;

// Section names used by the daemons. Any other name is allowed.
inline constexpr char kMasterSection[] = "master";
inline constexpr char kTensorStateSection[] = "state";

// "shard-00001-of-00003.ckpt" for daemon 1 of 3.
std::string ShardFileName(int rank, int world_size);

// A section as errors name it: "\"<tensor>\"/\"<name>\"", each part quoted
// and bounded with QuoteForMessage (common/names.h): the names come from
// files and requests.
std::string SectionForMessage(const Section& section);

// Streams one shard file. Not thread-safe; one writer per file. Every call
// blocks on the file system.
class ShardWriter {
 public:
  // Creates the temporary file in `dir` (an existing directory the caller
  // has already confined) with exactly `mode`. `name` is the final file
  // name (no '/').
  static absl::StatusOr<std::unique_ptr<ShardWriter>> Create(std::string dir, std::string name,
                                                             uint64_t version, int daemon_rank,
                                                             int world_size,
                                                             mode_t mode = FileModes().file);
  // Unlinks the temporary file unless Finish() succeeded.
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // One ROWS section in one call: `data` holds (row_end - row_begin) * cols
  // floats.
  absl::Status AddRows(absl::string_view tensor, absl::string_view name, int64_t row_begin,
                       int64_t row_end, int64_t cols, absl::Span<const float> data);

  // The same, streamed: BeginRows, then AppendRows with consecutive pieces
  // (row-major order, any split), then EndSection once all rows are in.
  absl::Status BeginRows(absl::string_view tensor, absl::string_view name, int64_t row_begin,
                         int64_t row_end, int64_t cols);
  absl::Status AppendRows(absl::Span<const float> data);
  absl::Status EndSection();

  // One BLOB section. `tensor` may be empty for daemon-wide state.
  absl::Status AddBlob(absl::string_view tensor, absl::string_view name, absl::string_view bytes);

  // Writes index and trailer, fsyncs, renames to the final name, fsyncs the
  // directory. Returns what the manifest records about this file (pieces =
  // the "master" ROWS sections). The writer is unusable afterwards.
  absl::StatusOr<ShardFileInfo> Finish();

  // Bytes written so far (for progress reports).
  uint64_t bytes_written() const { return offset_; }

 private:
  ShardWriter(std::string dir, std::string name, std::string temp_path, UniqueFd fd);
  absl::Status Write(const void* data, size_t size);
  absl::Status FlushBuffer();
  absl::Status PadToAlignment();
  absl::Status BeginSection(Section section);
  absl::Status CheckOpen() const;

  struct HashState;
  std::string dir_;
  std::string name_;
  std::string temp_path_;
  UniqueFd fd_;
  std::unique_ptr<HashState> file_hash_;
  std::unique_ptr<HashState> section_hash_;
  std::string buffer_;
  uint64_t offset_ = 0;
  ShardIndex index_;
  bool in_section_ = false;
  uint64_t section_expected_ = 0;
  bool finished_ = false;
  absl::Status sticky_error_;
};

// Reads one shard file: its index, then sections or row ranges of them by
// pread. Thread-safe after Open (reads do not share a file offset).
class ShardFileReader {
 public:
  // Opens `path`, reads and checks the header, the trailer and the index
  // (offsets inside the file, lengths matching rows x cols, the index
  // checksum). DataLoss naming the file for anything malformed.
  static absl::StatusOr<std::unique_ptr<ShardFileReader>> Open(std::string path);

  const std::string& path() const { return path_; }
  const ShardIndex& index() const { return index_; }
  uint64_t size_bytes() const { return size_; }

  // Rows [row_begin, row_end) of ROWS section `section` into `out` (exactly
  // (row_end - row_begin) * cols floats). A read of the whole section also
  // checks the section's XXH3-64.
  absl::Status ReadRows(const Section& section, int64_t row_begin, int64_t row_end,
                        absl::Span<float> out) const;

  // A whole BLOB section, checksum checked.
  absl::StatusOr<std::string> ReadBlob(const Section& section) const;

 private:
  ShardFileReader(std::string path, UniqueFd fd, uint64_t size, ShardIndex index);
  std::string path_;
  UniqueFd fd_;
  uint64_t size_ = 0;
  ShardIndex index_;
};

// XXH3-64 and size of a whole file, read in large blocks. Errors name `path`.
struct FileDigest {
  uint64_t size = 0;
  uint64_t xxh3_64 = 0;
};
// `on_bytes`, if set, is called with the number of bytes of each block read.
absl::StatusOr<FileDigest> DigestFile(const std::string& path,
                                      const std::function<void(uint64_t)>& on_bytes = nullptr);

// XXH3-64 (seed 0) of a byte string.
uint64_t Xxh3(absl::string_view bytes);

}  // namespace checkpoint
}  // namespace paramd

#endif  // PARAMD_CHECKPOINT_SHARD_FILE_H_
