// File: kernels/reference_internal.h
//
// Pieces shared by the CPU reference's .cc files (//kernels:reference only;
// not part of the public API, which is kernels/reference.h).
//
// Every block format is implemented once, for the ROWWISE direction of a
// [rows][cols] matrix. The columnwise copy of per-tensor FP8, NVFP4 and
// blockwise FP8 is the rowwise copy of W^T (FORMATS.md tables), which
// quantize.cc applies in one place; MXFP8 keeps its columnwise data in
// [M][K] order and quantizes 32x1 blocks in place.
#ifndef PARAMD_KERNELS_REFERENCE_INTERNAL_H_
#define PARAMD_KERNELS_REFERENCE_INTERNAL_H_

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/format.h"

namespace paramd {
namespace ref {
namespace internal {

inline uint32_t FloatBits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
inline float FloatFromBits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// FORMATS.md §0 constants, by bit pattern so that no compiler rounding is
// involved.
inline float Rcp448() { return FloatFromBits(0x3B124925u); }    // RN(1/448)
inline float Rcp57344() { return FloatFromBits(0x37924925u); }  // RN(1/57344)
inline float Rcp6() { return FloatFromBits(0x3E2AAAABu); }      // RN(1/6)
inline float Rcp2688() { return FloatFromBits(0x39C30C31u); }   // RN(1/2688)
inline float Bf16Max() { return FloatFromBits(0x7F7F0000u); }   // largest finite BF16

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// fp32 scale entries are little-endian (Layout::scale_elem_bytes == 4).
inline void StoreF32Le(float x, uint8_t* p) {
  const uint32_t b = FloatBits(x);
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(b >> (8 * i));
}
inline float LoadF32Le(const uint8_t* p) {
  uint32_t b = 0;
  for (int i = 0; i < 4; ++i) b |= static_cast<uint32_t>(p[i]) << (8 * i);
  return FloatFromBits(b);
}

// All 256 FP8 values of `type` (NaN codes hold a NaN), for the decode loops.
const float* Fp8ValueTable(Fp8Type type);

// Row-by-row access to the matrix a rowwise quantizer reads: W itself, or
// W^T for a columnwise copy. W^T's rows are gathered kPanel at a time into a
// small buffer instead of transposing the whole tensor: a fresh 64 MiB
// buffer costs more in page faults than the whole quantization (measured
// ~200 ms for 4096x4096 on the 2-core build machine). Cheapest when rows are read in
// increasing order. Not thread-safe (one per call).
class MatrixRows {
 public:
  // `w` is [w_rows][w_cols] and must outlive this object.
  MatrixRows(const float* w, int64_t w_rows, int64_t w_cols, bool transposed);
  int64_t rows() const { return transposed_ ? w_cols_ : w_rows_; }
  int64_t cols() const { return transposed_ ? w_rows_ : w_cols_; }
  // cols() values of row i, valid until the next Row() call.
  const float* Row(int64_t i) const;

 private:
  static constexpr int64_t kPanel = 16;  // one 64-byte line of W per row
  const float* w_;
  int64_t w_rows_, w_cols_;
  bool transposed_;
  mutable std::vector<float> panel_;  // kPanel rows of W^T, row pitch pitch_
  mutable int64_t panel_begin_ = -1;
  int64_t pitch_ = 0;  // w_rows_ + kPanel: avoids power-of-2 pitches
};

// The write side for dequantizers: rows of W, or of W^T scattered back into
// W's [w_rows][w_cols] order kPanel rows at a time. Rows must be written in
// increasing order; Finish() writes out the last panel.
class MatrixRowsOut {
 public:
  MatrixRowsOut(float* w, int64_t w_rows, int64_t w_cols, bool transposed);
  int64_t rows() const { return transposed_ ? w_cols_ : w_rows_; }
  int64_t cols() const { return transposed_ ? w_rows_ : w_cols_; }
  // Storage for row i (cols() floats), to be filled completely.
  float* Row(int64_t i);
  void Finish();

 private:
  static constexpr int64_t kPanel = 16;
  void FlushPanel();
  float* w_;
  int64_t w_rows_, w_cols_;
  bool transposed_;
  std::vector<float> panel_;
  int64_t panel_begin_ = -1;
  int64_t pitch_ = 0;
};

// A [rows][cols] matrix cut into block_rows x block_cols blocks; edge blocks
// hold only the real elements (D11). Block (bi, bj) has index bi*grid_cols()+bj.
struct BlockGrid {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t block_rows = 1;
  int64_t block_cols = 1;
  int64_t grid_rows() const { return CeilDiv(rows, block_rows); }
  int64_t grid_cols() const { return CeilDiv(cols, block_cols); }
  int64_t num_blocks() const { return grid_rows() * grid_cols(); }
};

// The grid's rows/cols equal the matrix's below.
// amax (§0: NaN ignored, Inf counts) of every block of `src`.
std::vector<float> BlockAmaxes(const MatrixRows& src, const BlockGrid& grid);

// out[i][j] = EncodeFp8(mul(src[i][j], enc[block(i,j)]), type); out is [rows][cols].
void EncodeFp8Blocks(const MatrixRows& src, const BlockGrid& grid, const std::vector<float>& enc,
                     Fp8Type type, uint8_t* out);
// out[i][j] = DecodeFp8(codes[i][j], type) * dec[block(i,j)] (one rounding, D15).
void DecodeFp8Blocks(const uint8_t* codes, const BlockGrid& grid, const std::vector<float>& dec,
                     Fp8Type type, MatrixRowsOut& out);
// FP4 codes EncodeE2M1(mul(src[i][j], enc[block(i,j)])) packed into
// out [rows][ceil(cols/2)], even column in the low nibble; an odd last
// column leaves the high nibble 0 (D11).
void EncodeFp4Blocks(const MatrixRows& src, const BlockGrid& grid, const std::vector<float>& enc,
                     uint8_t* out);
// out[i][j] = DecodeE2M1(nibble(i,j)) * dec[block(i,j)].
void DecodeFp4Blocks(const uint8_t* packed, const BlockGrid& grid, const std::vector<float>& dec,
                     MatrixRowsOut& out);

// Compact byte scales (MXFP8, NVFP4). Entry (r, c) of a buffer with row
// stride `scale_cols` describes the entry_rows x entry_cols elements from
// (r*entry_rows, c*entry_cols) on: rowwise 1 x 32 (MXFP8) or 1 x 16 (NVFP4),
// MXFP8 columnwise 32 x 1. Store writes each valid entry with the byte of
// the block holding its elements, so a 2D tile's byte repeats over every
// entry inside the tile (§3, §4); padding entries are left alone.
void StoreScaleBytes(const std::vector<uint8_t>& block_bytes, const BlockGrid& grid,
                     int64_t entry_rows, int64_t entry_cols, int64_t scale_cols, uint8_t* scales);
// The valid entries back, one per block of `entries` (the matrix cut into
// entry_rows x entry_cols blocks), each entry's own byte.
std::vector<uint8_t> LoadScaleBytes(const uint8_t* scales, const BlockGrid& entries,
                                    int64_t scale_cols);

// The per-format entry points. "Rowwise" ones quantize along the rows of a
// [rows][cols] matrix: W itself, or W^T when quantize.cc makes a columnwise
// copy from it.

// The matrix a quantizer reads, and the layout of the buffers it writes
// (the direction's layout; for W^T that equals the rowwise layout of W^T).
struct SourceMatrix {
  const MatrixRows& values;
  int64_t rows;  // values.rows()
  int64_t cols;  // values.cols()
  Layout layout;
};
// The encoded buffers of one direction, validated against `layout`; rows
// and cols are those of the matrix the quantizer read (W or W^T).
struct EncodedView {
  int64_t rows = 0;
  int64_t cols = 0;
  Layout layout;
  const uint8_t* data = nullptr;
  const uint8_t* scales = nullptr;
  float scale_inv = 1.0f;
  float amax = 0.0f;
};

// Quantizers: `q.data` and `q.scales` arrive sized to src.layout and
// zero-filled (D8); each fills them and q.scale_inv / q.amax and leaves the
// other fields alone. Dequantizers write every row of `out` (v.rows x
// v.cols) in increasing order.
// identity.cc: kIdentityBf16, kIdentityFp32.
void QuantizeIdentityRowwise(const SourceMatrix& src, const QuantSpec& spec,
                             const TensorScaling& scaling, QuantizedTensor& q);
void DequantizeIdentityRowwise(const EncodedView& v, const QuantSpec& spec, MatrixRowsOut& out);
// per_tensor.cc: kFp8Delayed, kFp8Current.
void QuantizePerTensorRowwise(const SourceMatrix& src, const QuantSpec& spec,
                              const TensorScaling& scaling, QuantizedTensor& q);
void DequantizePerTensorRowwise(const EncodedView& v, const QuantSpec& spec, MatrixRowsOut& out);
// mxfp8.cc: both directions on W itself.
void QuantizeMxfp8Rowwise(const SourceMatrix& src, const QuantSpec& spec,
                          const TensorScaling& scaling, QuantizedTensor& q);
void DequantizeMxfp8Rowwise(const EncodedView& v, const QuantSpec& spec, MatrixRowsOut& out);
void QuantizeMxfp8Columnwise(const SourceMatrix& src, const QuantSpec& spec,
                             const TensorScaling& scaling, QuantizedTensor& q);
void DequantizeMxfp8Columnwise(const EncodedView& v, const QuantSpec& spec, MatrixRowsOut& out);
// nvfp4.cc
void QuantizeNvfp4Rowwise(const SourceMatrix& src, const QuantSpec& spec,
                          const TensorScaling& scaling, QuantizedTensor& q);
void DequantizeNvfp4Rowwise(const EncodedView& v, const QuantSpec& spec, MatrixRowsOut& out);
// blockwise.cc: kFp8Block128x128, kFp8Block1x128.
void QuantizeBlockwiseRowwise(const SourceMatrix& src, const QuantSpec& spec,
                              const TensorScaling& scaling, QuantizedTensor& q);
void DequantizeBlockwiseRowwise(const EncodedView& v, const QuantSpec& spec, MatrixRowsOut& out);

}  // namespace internal
}  // namespace ref
}  // namespace paramd

#endif  // PARAMD_KERNELS_REFERENCE_INTERNAL_H_
