// File: checkpoint/export.h
//
// Export of a model version to Hugging Face style safetensors:
//
//   <out>/model-00001-of-0000n.safetensors ...   __metadata__ {"format": "pt"}
//   <out>/model.safetensors.index.json            written last
//
// in BF16 (round to nearest even from the FP32 masters; a NaN stays a NaN,
// canonical 0x7FFF per FORMATS.md D14) or FP32. The bytes come from an
// ExportSource, one tensor after the other, in chunks, so that memory stays
// bounded by one chunk whatever the model size: from remote daemons (which
// convert their master shards with AppendForExport and stream them), from a
// checkpoint on disk (CheckpointExportSource), or from memory (tests).
// Files are written with //safetensors's ShardedWriter: each shard appears
// complete or not at all, and the index appears last.
//
// Threading: ExportSafetensors runs on the caller's thread and blocks on the
// source and on disk; sources are used from that one thread.
#ifndef PARAMD_CHECKPOINT_EXPORT_H_
#define PARAMD_CHECKPOINT_EXPORT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "checkpoint/store.h"
#include "common/file_util.h"
#include "proto/frozen.pb.h"

namespace paramd {
namespace checkpoint {

enum class ExportDtype : uint8_t { kBf16 = 0, kFp32 = 1 };

// "bf16" / "fp32"; Parse accepts those (any case) and "bfloat16"/"float32".
absl::string_view ExportDtypeName(ExportDtype dtype);
absl::StatusOr<ExportDtype> ParseExportDtype(absl::string_view name);
int ExportDtypeSize(ExportDtype dtype);  // 2 or 4

// Appends FP32 values to `out` as little-endian bytes of `dtype`: BF16 by
// RNE with canonical NaN (ref::EncodeBf16, via //safetensors:convert), FP32
// bit for bit. What the daemons run on their master shards for an export.
void AppendForExport(absl::Span<const float> values, ExportDtype dtype, std::vector<uint8_t>& out);

// "5GB" (10^9), "500MB", "1.5GiB" (2^30), "64KiB", "123" (bytes).
// InvalidArgument for anything else, zero, or overflow.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);

// One exported tensor: its safetensors shape and its row-major [rows][cols]
// view (rows * cols == product(shape); the plan's row ranges are over rows).
struct ExportTensor {
  std::string name;
  std::vector<int64_t> shape;
  int64_t rows = 0;
  int64_t cols = 0;
};

// The tensors of a checkpoint manifest, in manifest order.
std::vector<ExportTensor> ExportTensorsOf(const Manifest& manifest);

// Supplies the exported bytes of each tensor.
class ExportSource {
 public:
  // Receives consecutive chunks; returning an error stops the stream.
  using Sink = std::function<absl::Status(absl::Span<const uint8_t> bytes)>;
  virtual ~ExportSource() = default;

  // Streams all rows * cols elements of `tensor`, row-major, encoded as
  // `dtype`, to `sink` in consecutive chunks of whole elements (any sizes).
  // Must return the sink's error unchanged if the sink fails.
  virtual absl::Status StreamTensor(const ExportTensor& tensor, ExportDtype dtype,
                                    const Sink& sink) = 0;
};

// A source over FP32 rows read by a callback, converted here. `read` fills
// `out` with rows [row_begin, row_end) of `tensor`; it is called with
// consecutive row ranges of about `chunk_bytes` of FP32 (at least one row).
class FloatRowSource : public ExportSource {
 public:
  using ReadRowsFn = std::function<absl::Status(const ExportTensor& tensor, int64_t row_begin,
                                                int64_t row_end, absl::Span<float> out)>;
  explicit FloatRowSource(ReadRowsFn read, uint64_t chunk_bytes = 8 << 20);
  absl::Status StreamTensor(const ExportTensor& tensor, ExportDtype dtype,
                            const Sink& sink) override;

 private:
  ReadRowsFn read_;
  uint64_t chunk_bytes_;
};

// The "master" rows of a complete checkpoint (`reader` must outlive it).
std::unique_ptr<ExportSource> NewCheckpointExportSource(const CheckpointReader* reader,
                                                        uint64_t chunk_bytes = 8 << 20);

struct ExportOptions {
  std::string out_dir;  // created (with parents, modes.dir) if missing
  // The modes of the files written (shards and index) and of the
  // directories created: the user's only unless widened (hpctl export
  // --group_readable).
  FileModes modes;
  ExportDtype dtype = ExportDtype::kBf16;
  uint64_t max_shard_bytes = 5'000'000'000;  // Hugging Face's "5GB"
  std::string prefix = "model";
  // (bytes written, bytes in all) after every chunk; may be null.
  std::function<void(uint64_t done, uint64_t total)> progress;
};

struct ExportResult {
  std::vector<std::string> files;  // shard file names, then the index
  uint64_t total_bytes = 0;        // tensor data bytes
  int num_tensors = 0;
};

// Writes the export of `tensors` (in that order) from `source`, then the
// model's frozen buffers (proto/frozen.proto) in their own dtype, as they
// are. InvalidArgument for a bad tensor list, frozen buffer or options; the
// source's status if it fails; Internal (naming the tensor) if it delivers
// the wrong number of bytes; I/O errors name the file.
absl::StatusOr<ExportResult> ExportSafetensors(const std::vector<ExportTensor>& tensors,
                                               ExportSource& source, const ExportOptions& options,
                                               absl::Span<const FrozenTensor> frozen = {});

}  // namespace checkpoint
}  // namespace paramd

#endif  // PARAMD_CHECKPOINT_EXPORT_H_
