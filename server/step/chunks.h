// File: server/step/chunks.h
//
// Validation and reassembly of the chunked value streams of
// proto/paramd.proto (GradientChunk, used by PushGradients and PushWeights)
// against a daemon's model: which tensors exist, which rows this daemon
// owns. Errors carry the status codes of the proto's table.
//
// Not thread-safe (one per stream). ModelView is immutable and shared.
#ifndef PARAMD_SERVER_STEP_CHUNKS_H_
#define PARAMD_SERVER_STEP_CHUNKS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/paramd.pb.h"
#include "server/step/shard_set.h"

namespace paramd {

// The tensors of a loaded manifest and the shards this daemon owns.
struct ModelView {
  int64_t generation = 0;  // changes with every load
  int rank = -1;
  std::vector<TensorDef> tensors;
  std::vector<ShardDef> shards;      // sorted by (tensor, row_begin), as ShardSet
  std::map<std::string, int> index;  // tensor name -> index
  rpc::Manifest manifest;
  // manifest.optimizer_config, if the coordinator sent one.
  std::optional<OptimizerOptions> optimizer;

  // Index of `name` or -1.
  int Find(const std::string& name) const;
  // Index of the shard holding rows [row_begin, row_end) of `tensor`, or -1.
  int FindShard(int tensor, int64_t row_begin, int64_t row_end) const;
};

// Builds the view of daemon `rank` from a manifest. InvalidArgument for a
// bad spec, shape or piece.
absl::StatusOr<ModelView> MakeModelView(const rpc::Manifest& manifest, int rank,
                                        int64_t generation);

// A complete piece of values (decoded to FP32).
struct StagedPiece {
  int shard = 0;
  int tensor = 0;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  std::vector<float> values;  // (row_end - row_begin) * cols
};

class ChunkAssembler {
 public:
  // `view` must outlive the assembler. `allow_non_finite`: accept NaN/Inf
  // values (weights may hold them; gradients may not).
  ChunkAssembler(const ModelView* view, bool allow_non_finite);

  // Validates and appends one chunk. NOT_FOUND: unknown tensor;
  // FAILED_PRECONDITION: rows not owned by this daemon; INVALID_ARGUMENT:
  // bad dtype, rows outside the tensor, offset out of order, too many bytes,
  // partial elements, a piece overlapping an earlier one of this stream,
  // non-finite gradient values.
  absl::Status Add(const rpc::GradientChunk& chunk);
  // INVALID_ARGUMENT if the last piece is incomplete.
  absl::Status Close() const;

  std::vector<StagedPiece>& pieces() { return pieces_; }
  // Whether the last of pieces() is still incomplete (more chunks expected).
  bool piece_open() const { return open_; }
  int64_t bytes() const { return bytes_; }

 private:
  const ModelView* view_;
  bool allow_non_finite_;
  std::vector<StagedPiece> pieces_;
  // The open piece (the last of pieces_) while incomplete.
  bool open_ = false;
  rpc::DType open_dtype_ = rpc::DTYPE_UNSPECIFIED;
  int64_t open_received_ = 0;  // bytes
  int64_t open_expected_ = 0;
  int64_t bytes_ = 0;
};

}  // namespace paramd

#endif  // PARAMD_SERVER_STEP_CHUNKS_H_
