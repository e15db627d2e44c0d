// File: safetensors/safetensors.h
//
// Reading and writing one safetensors file
// (https://github.com/huggingface/safetensors, format of safetensors 0.4):
//
//   8 bytes   N, little-endian u64: length of the header
//   N bytes   UTF-8 JSON object: {"__metadata__": {str: str}?,
//             "<name>": {"dtype": "F32", "shape": [d0, ...],
//                        "data_offsets": [begin, end]}, ...}
//             (padded with spaces so the data starts 8-byte aligned)
//   rest      the data section; offsets are relative to its start.
//
// The reader trusts nothing in a file: every field is checked before use
// (see SafetensorsFile::Open), and a bad file yields an InvalidArgument (or
// DataLoss for a short file) whose message names the file, the tensor and
// the problem. Like the reference implementation it requires the tensors'
// byte ranges, sorted, to cover the data section exactly: no gap, no
// overlap, no trailing bytes (this rules out polyglot files).
//
// Data is little-endian and row-major (C order), as the format defines; this
// library moves bytes and never converts element types (see
// safetensors/convert.h for that).
//
// For the Hugging Face sharded layout (model-0000i-of-0000n.safetensors +
// model.safetensors.index.json) see safetensors/sharded.h.
#ifndef PARAMD_SAFETENSORS_SAFETENSORS_H_
#define PARAMD_SAFETENSORS_SAFETENSORS_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/names.h"

namespace paramd {
namespace safetensors {

class AtomicFile;

// Element types, named as in the JSON header. Sub-byte types (F4, F6_*) are
// not supported and are refused by the reader as "unsupported dtype".
enum class Dtype : uint8_t {
  kBool,    // "BOOL"
  kU8,      // "U8"
  kI8,      // "I8"
  kF8E5M2,  // "F8_E5M2"
  kF8E4M3,  // "F8_E4M3"
  kF8E8M0,  // "F8_E8M0"
  kI16,     // "I16"
  kU16,     // "U16"
  kF16,     // "F16"
  kBF16,    // "BF16"
  kI32,     // "I32"
  kU32,     // "U32"
  kF32,     // "F32"
  kF64,     // "F64"
  kI64,     // "I64"
  kU64,     // "U64"
};

// All supported dtypes, in the order above.
absl::Span<const Dtype> AllDtypes();
absl::string_view DtypeName(Dtype dtype);
// InvalidArgument naming `name` if it is not one of the names above.
absl::StatusOr<Dtype> ParseDtype(absl::string_view name);
// Bytes per element: 1, 2, 4 or 8.
int DtypeSize(Dtype dtype);
// F32, BF16 and F16: the dtypes hybrid-paramd trains (all convert to FP32
// masters exactly). A model file's tensors of any other dtype (integer
// ids, masks, F64) are its frozen buffers: kept whole, never stepped.
bool IsTrainableDtype(Dtype dtype);

// `__metadata__`: free-form string -> string.
using Metadata = std::map<std::string, std::string>;

// A tensor to be written: name, element type and shape.
struct TensorSpec {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;  // [] = scalar (one element); 0 dims allowed
};

// Number of elements of `shape` (1 for a scalar); InvalidArgument for a
// negative dimension or if elements * DtypeSize(dtype) overflows int64.
absl::StatusOr<int64_t> NumElements(absl::Span<const int64_t> shape);
absl::StatusOr<int64_t> NumBytes(Dtype dtype, absl::Span<const int64_t> shape);

// A tensor as found in a file. Offsets are relative to the data section.
struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // data_offsets[0]
  uint64_t end = 0;    // data_offsets[1]
  int64_t num_elements = 0;

  uint64_t num_bytes() const { return end - begin; }
};

// A validated, open safetensors file. Holds the file descriptor open; data
// is read on demand with pread, so opening a 100 GB file costs only its
// header. Move-only. All const methods are thread-safe (pread has no file
// position). Reads block on disk I/O.
class SafetensorsFile {
 public:
  // Header limit of the reference implementation (100 MB).
  static constexpr uint64_t kMaxHeaderBytes = 100'000'000;

  // Opens and validates `path`: header length (at least 2, at most
  // kMaxHeaderBytes and within the file), JSON syntax, a top-level object,
  // `__metadata__` (an object of strings), every tensor's dtype, shape
  // (non-negative, no overflow) and data_offsets (two integers,
  // begin <= end, end - begin == bytes of dtype x shape), and the coverage
  // rule above; duplicate names are refused, and every tensor name must
  // pass CheckTensorName(name, max_name_bytes) (common/names.h: at most
  // 1 KiB by default, no NUL or control characters). NotFound if the file
  // does not exist; DataLoss if it is shorter than its header says;
  // InvalidArgument for any other defect. No message quotes the file's
  // bytes beyond (the start of) a tensor name: a file that is not
  // safetensors at all (say /etc/passwd) is refused without showing what it
  // holds.
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path,
                                              int64_t max_name_bytes = kDefaultMaxTensorNameBytes);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // Tensors in the order of their data in the file.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // nullptr if there is no tensor `name`.
  const TensorInfo* Find(absl::string_view name) const;
  const Metadata& metadata() const { return metadata_; }
  // Absolute file offset of the data section (8 + header length).
  uint64_t data_offset() const { return data_offset_; }
  uint64_t file_size() const { return file_size_; }

  // Copies out.size() bytes of `tensor`'s data starting `offset` bytes into
  // it. OutOfRange if the range is not inside the tensor; DataLoss if the
  // file was truncated since Open. `tensor` must come from this file.
  absl::Status ReadTensorBytes(const TensorInfo& tensor, uint64_t offset,
                               absl::Span<uint8_t> out) const;
  // The whole data of tensor `name` (NotFound if absent).
  absl::StatusOr<std::vector<uint8_t>> ReadTensor(absl::string_view name) const;

 private:
  SafetensorsFile() = default;

  std::string path_;
  int fd_ = -1;
  uint64_t file_size_ = 0;
  uint64_t data_offset_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
  Metadata metadata_;
};

// Writes one safetensors file as a stream: the tensors are declared up
// front (so the header can be written first), then their bytes are appended
// in declaration order, in chunks of any size, so a caller never needs more
// than one chunk in memory. Data goes to a temporary file beside `path`
// ("<path>.tmp-XXXXXX"); Finish() fsyncs it, renames it to `path` and fsyncs
// the directory. A writer destroyed before Finish() (or after a failed
// write) removes the temporary file, and `path` is never partially written.
//
// Tensors are laid out in declaration order with no padding between them.
// The data section starts 8-byte aligned; to keep every tensor aligned to
// its element size, declare larger element types first.
//
// Not thread-safe; calls block on disk I/O.
class SafetensorsWriter {
 public:
  // InvalidArgument for an empty or duplicate name, the name "__metadata__",
  // a negative dimension or a size overflow; an I/O error status if the
  // temporary file cannot be created. The file gets exactly `mode` (the
  // umask does not change it).
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(const std::string& path,
                                                                   std::vector<TensorSpec> tensors,
                                                                   const Metadata& metadata = {},
                                                                   mode_t mode = 0644);

  ~SafetensorsWriter();

  // Appends `chunk` to tensor `name`, which must be the first declared tensor
  // not yet complete (FailedPrecondition otherwise, naming the expected
  // tensor); the chunk must not run past the tensor's end (InvalidArgument).
  absl::Status AppendTensorData(absl::string_view name, absl::Span<const uint8_t> chunk);
  // AppendTensorData of a whole tensor: `bytes` must be exactly its size and
  // nothing of it may have been written yet.
  absl::Status WriteTensor(absl::string_view name, absl::Span<const uint8_t> bytes);

  // The tensor the next AppendTensorData must name, or "" when all are
  // complete.
  absl::string_view next_tensor() const;
  // Bytes the data section will have in total.
  uint64_t data_bytes() const { return data_bytes_; }

  // FailedPrecondition if a tensor is incomplete; then fsync, rename, fsync
  // of the directory. The writer is unusable afterwards.
  absl::Status Finish();

 private:
  SafetensorsWriter() = default;

  std::vector<TensorSpec> specs_;
  std::vector<uint64_t> sizes_;
  size_t current_ = 0;         // index of the tensor being written
  uint64_t current_done_ = 0;  // bytes of it written so far
  uint64_t data_bytes_ = 0;
  std::unique_ptr<AtomicFile> out_;
};

// Encodes a complete header (8-byte length + padded JSON) for `tensors`
// laid out in order; used by SafetensorsWriter, and by tests that craft
// files. Same validation as SafetensorsWriter::Create.
absl::StatusOr<std::string> EncodeHeader(absl::Span<const TensorSpec> tensors,
                                         const Metadata& metadata);

}  // namespace safetensors
}  // namespace paramd

#endif  // PARAMD_SAFETENSORS_SAFETENSORS_H_
