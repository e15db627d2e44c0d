// File: sharding/assemble.h
//
// Client-side assembly of a weight from its shards, and the
// inverse split.
//
// A daemon owning rows [r0, r1) of a weight W[M, K] quantizes exactly those
// rows, as if they were a tensor of shape [r1 - r0, K], with the per-tensor
// numbers (TensorScaling: FP8 scale, NVFP4 global amax) agreed across daemons
// beforehand. The trainer must see the buffers FORMATS.md defines for the
// whole [M, K] tensor. This file maps every byte of a piece to its place in
// the whole:
//   * rowwise data, MXFP8 columnwise data and identity copies are [M][...]:
//     a piece's data rows are a contiguous run of the full buffer;
//   * transposed columnwise data (per-tensor FP8, FP8 blocks: [K][M]; NVFP4:
//     [K][ceil(M/2)]) takes each piece as a column block of the transpose
//     (NVFP4 nibbles pack along M, so a piece starting at an even row starts
//     on a byte boundary; only the last piece may end in half a byte);
//   * scale buffers: the piece's valid scale entries land at the piece's
//     block offset along the M axis of the full padded buffer, which can be
//     its rows (MXFP8 both directions, NVFP4 rowwise, 128x128 rowwise, 1x128
//     columnwise) or its columns (NVFP4 columnwise, 128x128 columnwise, and
//     1x128 rowwise with its transposed [kb][i] order). Padding stays 0 (D8).
// Each mapping is one strided copy per buffer (the shape of cudaMemcpy2D),
// so a client can place a received piece straight into the caller's device
// buffer, and a daemon can send a piece out of a full buffer, without any
// intermediate copy.
//
// Assembled bytes equal quantizing the whole tensor at once (tested against
// ref::Quantize for every format and direction) provided inner piece
// boundaries are multiples of RequiredRowAlignment(); the shard plan's 128
// satisfies every format.
//
// Pure host code: thread-compatible, no shared state, allocations only in
// the results of Assemble() and Split().
#ifndef PARAMD_SHARDING_ASSEMBLE_H_
#define PARAMD_SHARDING_ASSEMBLE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/format.h"

namespace paramd {
namespace sharding {

// `height` runs of `width` bytes. Run h starts at piece_offset + h *
// piece_pitch in the piece's buffer and at full_offset + h * full_pitch in
// the whole tensor's buffer. height == 0 or width == 0: nothing to copy.
struct Copy2D {
  int64_t piece_offset = 0;
  int64_t piece_pitch = 0;
  int64_t full_offset = 0;
  int64_t full_pitch = 0;
  int64_t width = 0;
  int64_t height = 0;

  int64_t bytes() const { return width * height; }
};

// Where rows [row_begin, row_end) of a [rows, cols] tensor go, for one
// (format, direction).
struct PiecePlacement {
  Layout full;    // ComputeLayout(spec, direction, rows, cols)
  Layout piece;   // ComputeLayout(spec, direction, row_end - row_begin, cols)
  Copy2D data;    // piece data buffer <-> full data buffer
  Copy2D scales;  // valid scale entries only; empty when there is no scale buffer
};

// The multiple that inner piece boundaries (row_begin > 0) must be for the
// assembled bytes to equal whole-tensor quantization: the block extent
// along M in this direction (MXFP8 32, or 1 for 1x32 rowwise; NVFP4 16, or
// 1 for 1D rowwise; FP8 128x128: 128; 1x128: 128 columnwise, 1 rowwise),
// and 1 for identity and per-tensor FP8. Always divides 128.
int64_t RequiredRowAlignment(const QuantSpec& spec, Direction direction);

// The mapping of one piece. InvalidArgument for a bad shape, an empty or
// out-of-range row range, or a row_begin (or a row_end other than `rows`)
// that is not a multiple of RequiredRowAlignment().
absl::StatusOr<PiecePlacement> PlacePiece(const QuantSpec& spec, Direction direction, int64_t rows,
                                          int64_t cols, int64_t row_begin, int64_t row_end);

// Copies a piece's data and scale bytes into the whole tensor's buffers.
// Writes only the piece's bytes: the caller zero-fills the full scale buffer
// once (padding, D8). Buffer sizes must equal the layouts' byte counts
// (InvalidArgument otherwise). Pieces of one tensor write disjoint bytes, so
// they may be copied in concurrently.
absl::Status CopyPieceIn(const PiecePlacement& placement, absl::Span<const uint8_t> piece_data,
                         absl::Span<const uint8_t> piece_scales, absl::Span<uint8_t> full_data,
                         absl::Span<uint8_t> full_scales);

// The inverse: copies the piece's bytes out of the whole tensor's buffers.
// Writes only valid entries: the caller zero-fills piece_scales.
absl::Status CopyPieceOut(const PiecePlacement& placement, absl::Span<const uint8_t> full_data,
                          absl::Span<const uint8_t> full_scales, absl::Span<uint8_t> piece_data,
                          absl::Span<uint8_t> piece_scales);

// The whole tensor from its pieces, given in row order and tiling [0, M)
// (M = sum of the pieces' rows; K, format and direction shared by all).
// scale_inv must be identical in every piece (agreed per-tensor scale);
// for NVFP4 so must amax (the global A). The result's amax is the maximum of
// the pieces' (NaN ignored): per-tensor FP8 records the whole tensor's amax.
// InvalidArgument on any mismatch, a buffer of the wrong size, or a
// misaligned boundary.
absl::StatusOr<QuantizedTensor> Assemble(const QuantSpec& spec,
                                         absl::Span<const QuantizedTensor> pieces);

// Rows [row_begin, row_end) of `full` as the piece a daemon would have
// produced: data and scales exactly (scale padding 0); scale_inv and amax
// are copied from `full` (a piece's own per-tensor FP8 amax is not
// recoverable from the whole).
absl::StatusOr<QuantizedTensor> Split(const QuantSpec& spec, const QuantizedTensor& full,
                                      int64_t row_begin, int64_t row_end);

}  // namespace sharding
}  // namespace paramd

#endif  // PARAMD_SHARDING_ASSEMBLE_H_
