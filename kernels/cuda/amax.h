// File: kernels/cuda/amax.h
//
// Multi-tensor amax on the GPU (FORMATS.md §0: NaN ignored, ±Inf counts) of
// each tensor's source values (D1: FP32 input optionally rounded to BF16
// first). Each result is max-updated into its own device float, so partial
// amaxes of many tensors (or of many shards of one tensor) land in one packed
// device vector that a single all-reduce(MAX) can then combine.
//
// Enqueues work on `stream` only; never synchronizes. Up to 256 tensors per
// launch (more are split). InvalidArgument for bad arguments (checked before
// any launch), Internal for CUDA errors.
#ifndef PARAMD_KERNELS_CUDA_AMAX_H_
#define PARAMD_KERNELS_CUDA_AMAX_H_

#include <cstdint>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/cuda/quantize.h"
#include "kernels/format.h"

namespace paramd {
namespace gpu {

struct AmaxArgs {
  const void* source = nullptr;  // `count` elements of `input_type`
  InputType input_type = InputType::kFp32;
  int64_t count = 0;
  SourceDtype source_dtype = SourceDtype::kBf16;
  // Max-updated: set it to 0 (or to a partial amax to combine with) first,
  // or pass zero_first = true.
  float* amax = nullptr;
};

// zero_first: set every output to 0 (cudaMemsetAsync) before the launch.
absl::Status ComputeAmax(absl::Span<const AmaxArgs> tensors, cudaStream_t stream,
                         bool zero_first = false);

// ---- Per-block partial amax of many tensors, into one packed vector ----
//
// For each tensor, the amax of every block its format scales by (FORMATS.md
// §0 rule: NaN ignored, +-Inf counts, -0 counts as +0, a block of only NaN
// and zeros gives +0), over the source values (D1: FP32 input rounded to
// BF16 when source_dtype is kBf16), written to out[offset + bi * grid_cols +
// bj] for block (bi, bj) of the ceil(M / block_rows) x ceil(K / block_cols)
// grid (grid_cols = ceil(K / block_cols); edge blocks cover only the real
// elements, D11). This is the block order of the CPU reference's block grid.
//
// How the daemon uses it. A daemon holds row shards [r0, r1) of each tensor
// whose r0 is a multiple of 128 (sharding/plan.h, PlanOptions::row_alignment
// = 128 by default; a different alignment must stay a multiple of 128). Every block
// size here divides 128, so no block straddles two daemons in the row
// dimension and each daemon's block amaxes of its shard are final: the
// daemon lays out the blocks of all its shards with PackBlockAmaxOffsets,
// calls ComputeBlockAmax once per step (one launch for all tensors), and
// derives the block scales locally. Only per-tensor amaxes (FP8 per-tensor
// delayed / current scaling, NVFP4's global A, which is the max of that
// tensor's block amaxes) must be combined across daemons: an
// all-reduce(MAX) of the per-tensor slots. Were blocks to straddle daemons
// (shards not aligned to the block height, or column sharding across a
// block's columns), a cross-daemon reduction would need every daemon to lay
// out the whole tensor's grid in GLOBAL block coordinates (the shard's row
// and column offsets added to bi, bj), write +0 for the blocks it does not
// touch, and all-reduce(MAX) the whole packed vector (+0 is the identity of
// max over amaxes, which are never NaN); this launcher computes local block
// coordinates only.
//
// The columnwise copy's blocks are those of the source W (not of W^T), so a
// columnwise_source = rowwise_dequantized copy needs its own source values.

// A block shape: block_rows x block_cols, each in {1, 16, 32, 128} and not
// both 1; or 0 x 0 = the whole tensor as one block (per-tensor amax).
struct AmaxBlockShape {
  int block_rows = 0;
  int block_cols = 0;
  bool per_tensor() const { return block_rows == 0 && block_cols == 0; }
};

// The blocks `spec` scales `direction` by: NVFP4 16x16 (2D) or 1x16 / 16x1,
// MXFP8 32x32 (2D) or 1x32 / 32x1, FP8 128x128, FP8 1x128 / 128x1; the whole
// tensor for per-tensor FP8 and the identity formats.
AmaxBlockShape AmaxBlockShapeOf(const QuantSpec& spec, Direction direction);

// Number of block amaxes of a [rows][cols] tensor (1 for per_tensor).
int64_t NumBlockAmaxes(int64_t rows, int64_t cols, AmaxBlockShape shape);

struct BlockAmaxArgs {
  const void* source = nullptr;  // [rows][cols] row-major, `input_type` elements
  InputType input_type = InputType::kFp32;
  int64_t rows = 0;
  int64_t cols = 0;
  SourceDtype source_dtype = SourceDtype::kBf16;
  AmaxBlockShape blocks;
  int64_t offset = 0;  // index in `out` of this tensor's block (0, 0)
};

// Sets each tensor's offset so that the tensors' blocks follow each other in
// order; returns the total number of floats (the size `out` needs).
int64_t PackBlockAmaxOffsets(absl::Span<BlockAmaxArgs> tensors);

// Writes every block amax of every tensor (each output float is written, not
// max-updated; floats of `out` outside the tensors' ranges are untouched).
// `out` is a device vector of `out_size` floats. Up to 256 tensors per launch
// (more are split); one extra small launch zeroes per-tensor slots first.
// Enqueues on `stream` only. InvalidArgument (before any launch) for bad
// shapes or block shapes, a null source or out, or ranges that leave `out`
// or overlap; Internal for CUDA errors.
absl::Status ComputeBlockAmax(absl::Span<const BlockAmaxArgs> tensors, float* out, int64_t out_size,
                              cudaStream_t stream);

}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_AMAX_H_
