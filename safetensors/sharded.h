// File: safetensors/sharded.h
//
// The Hugging Face sharded layout: tensors split over
// "model-00001-of-00003.safetensors", ... plus "model.safetensors.index.json":
//
//   {"metadata": {"total_size": <sum of all tensors' data bytes>},
//    "weight_map": {"<tensor name>": "<shard file name>", ...}}
//
// PlanShards splits a tensor list by a maximum shard size, ShardedWriter
// streams the data into the shards and writes the index last (so a model
// directory with an index is complete), and ShardedSafetensors opens and
// cross-checks such a directory (or a single file) for reading.
#ifndef PARAMD_SAFETENSORS_SHARDED_H_
#define PARAMD_SAFETENSORS_SHARDED_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "safetensors/safetensors.h"

namespace paramd {
namespace safetensors {

inline constexpr char kIndexFileName[] = "model.safetensors.index.json";
inline constexpr char kSingleFileName[] = "model.safetensors";

// "<prefix>-00002-of-00005.safetensors" for index 1 (0-based) of 5.
std::string ShardFileName(absl::string_view prefix, int index, int count);

struct ShardPlan {
  struct Shard {
    std::string file_name;            // e.g. model-00001-of-00003.safetensors
    std::vector<TensorSpec> tensors;  // in write order
    uint64_t data_bytes = 0;
  };
  std::vector<Shard> shards;
  uint64_t total_size = 0;  // data bytes of all tensors (index metadata)
};

// Greedy and order-preserving, like Hugging Face's splitter: tensors fill
// the current shard until the next one would take it past
// `max_shard_bytes` of data; a tensor larger than the limit gets a shard of
// its own. Always at least one shard (an empty model gives one empty
// shard). InvalidArgument for max_shard_bytes == 0 or a bad TensorSpec.
absl::StatusOr<ShardPlan> PlanShards(std::vector<TensorSpec> tensors, uint64_t max_shard_bytes,
                                     absl::string_view prefix = "model");

// Streams tensors into the shards of a plan in directory `dir` (which must
// exist): the same call pattern as SafetensorsWriter, across files. Each
// shard is an atomic SafetensorsWriter, finished as soon as its last tensor
// is complete; Finish() writes model.safetensors.index.json (atomically,
// last). Every shard gets `metadata` as its __metadata__ (Hugging Face's
// loaders like {"format": "pt"}); every file, shards and index, gets
// exactly `mode`. Not thread-safe; blocks on disk I/O.
class ShardedWriter {
 public:
  static absl::StatusOr<std::unique_ptr<ShardedWriter>> Create(
      const std::string& dir, ShardPlan plan, Metadata metadata = {{"format", "pt"}},
      mode_t mode = 0644);
  ~ShardedWriter();

  // As SafetensorsWriter: `name` must be the next declared tensor (plan
  // order) and the chunk must fit in it.
  absl::Status AppendTensorData(absl::string_view name, absl::Span<const uint8_t> chunk);
  absl::Status WriteTensor(absl::string_view name, absl::Span<const uint8_t> bytes);
  // The tensor the next AppendTensorData must name, or "" when all are done.
  absl::string_view next_tensor() const;
  const ShardPlan& plan() const { return plan_; }

  // FailedPrecondition if data is missing; then writes the index.
  absl::Status Finish();

 private:
  ShardedWriter() = default;
  // Finishes full shards and opens the next one if there is more to write.
  absl::Status Advance();

  std::string dir_;
  ShardPlan plan_;
  Metadata metadata_;
  mode_t mode_ = 0644;
  size_t shard_ = 0;  // index of the shard being written
  std::unique_ptr<SafetensorsWriter> writer_;
  bool finished_ = false;
};

// The JSON text of an index for `plan` (weight_map sorted by name).
std::string EncodeIndex(const ShardPlan& plan);

// A model as a set of validated safetensors files. Move-only; const
// methods are thread-safe.
class ShardedSafetensors {
 public:
  struct Entry {
    const SafetensorsFile* file;
    const TensorInfo* info;
  };

  // `path` may be:
  //  - an index file (any name ending in ".json"), whose shard files are
  //    looked up beside it;
  //  - a directory holding model.safetensors.index.json, or else
  //    model.safetensors;
  //  - a single .safetensors file.
  // Every file is opened with SafetensorsFile::Open (same checks). For an
  // index: it must be a JSON object whose "weight_map" is an object of
  // tensor name -> plain file name (no '/'), listing no tensor twice;
  // "metadata", if present, is an object whose "total_size", if present, is
  // a non-negative integer; each mapped file must exist and hold the tensor;
  // every tensor of every shard must be mapped to that shard. Errors name the
  // index, the shard file and the tensor.
  // Every tensor name (of the index and of each file) must pass
  // CheckTensorName(name, max_name_bytes) (common/names.h).
  static absl::StatusOr<ShardedSafetensors> Open(
      const std::string& path, int64_t max_name_bytes = kDefaultMaxTensorNameBytes);

  // Tensors in file order (shards in index order, then data order).
  const std::vector<Entry>& tensors() const { return entries_; }
  // nullptr if absent.
  const Entry* Find(absl::string_view name) const;
  size_t num_files() const { return files_.size(); }
  const SafetensorsFile& file(size_t i) const { return *files_[i]; }
  // The index's metadata.total_size (nullopt for a single file or if the
  // index has none). Informational: not compared with the tensors.
  std::optional<uint64_t> total_size() const { return total_size_; }
  // Sum of all tensors' data bytes.
  uint64_t data_bytes() const;

  // The whole data of tensor `name` (NotFound if absent).
  absl::StatusOr<std::vector<uint8_t>> ReadTensor(absl::string_view name) const;

 private:
  ShardedSafetensors() = default;
  static absl::StatusOr<ShardedSafetensors> OpenIndex(const std::string& index_path,
                                                      int64_t max_name_bytes);
  void BuildEntries();

  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<Entry> entries_;
  std::map<std::string, size_t, std::less<>> by_name_;
  std::optional<uint64_t> total_size_;
};

}  // namespace safetensors
}  // namespace paramd

#endif  // PARAMD_SAFETENSORS_SHARDED_H_
