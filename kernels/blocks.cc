// The block loops every scaled format shares: block amaxes, and encoding /
// decoding each element with its block's multiplier. Loops run row by row
// and block by block so that no division happens per element.
#include <algorithm>
#include <cmath>

#include "kernels/reference.h"
#include "kernels/reference_internal.h"

namespace paramd {
namespace ref {
namespace internal {
namespace {

// Calls fn(i, j0, j1, block) for every row i and every block column range
// [j0, j1) of that row, where `block` indexes the grid.
template <typename Fn>
void ForEachRowSegment(const BlockGrid& g, Fn fn) {
  const int64_t gc = g.grid_cols();
  for (int64_t i = 0; i < g.rows; ++i) {
    const int64_t block_row = (i / g.block_rows) * gc;
    for (int64_t bj = 0; bj < gc; ++bj) {
      const int64_t j0 = bj * g.block_cols;
      fn(i, j0, std::min(j0 + g.block_cols, g.cols), block_row + bj);
    }
  }
}

}  // namespace

MatrixRows::MatrixRows(const float* w, int64_t w_rows, int64_t w_cols, bool transposed)
    : w_(w), w_rows_(w_rows), w_cols_(w_cols), transposed_(transposed) {
  if (transposed_) {
    pitch_ = w_rows_ + kPanel;
    panel_.resize(std::min(kPanel, w_cols_) * pitch_);  // never more rows than W^T has
  }
}

const float* MatrixRows::Row(int64_t i) const {
  if (!transposed_) return w_ + i * w_cols_;
  const int64_t begin = i - i % kPanel;
  if (begin != panel_begin_) {
    // Row k of the panel is column begin + k of W.
    const int64_t n = std::min(kPanel, w_cols_ - begin);
    for (int64_t r = 0; r < w_rows_; ++r) {
      const float* from = w_ + r * w_cols_ + begin;
      for (int64_t k = 0; k < n; ++k) panel_[k * pitch_ + r] = from[k];
    }
    panel_begin_ = begin;
  }
  return panel_.data() + (i - begin) * pitch_;
}

MatrixRowsOut::MatrixRowsOut(float* w, int64_t w_rows, int64_t w_cols, bool transposed)
    : w_(w), w_rows_(w_rows), w_cols_(w_cols), transposed_(transposed) {
  if (transposed_) {
    pitch_ = w_rows_ + kPanel;
    panel_.resize(std::min(kPanel, w_cols_) * pitch_);  // never more rows than W^T has
  }
}

float* MatrixRowsOut::Row(int64_t i) {
  if (!transposed_) return w_ + i * w_cols_;
  const int64_t begin = i - i % kPanel;
  if (begin != panel_begin_) {
    FlushPanel();
    panel_begin_ = begin;
  }
  return panel_.data() + (i - begin) * pitch_;
}

void MatrixRowsOut::Finish() { FlushPanel(); }

void MatrixRowsOut::FlushPanel() {
  if (!transposed_ || panel_begin_ < 0) return;
  const int64_t n = std::min(kPanel, w_cols_ - panel_begin_);
  for (int64_t r = 0; r < w_rows_; ++r) {
    float* to = w_ + r * w_cols_ + panel_begin_;
    for (int64_t k = 0; k < n; ++k) to[k] = panel_[k * pitch_ + r];
  }
  panel_begin_ = -1;
}

std::vector<float> BlockAmaxes(const MatrixRows& src, const BlockGrid& grid) {
  std::vector<float> amax(grid.num_blocks(), 0.0f);
  ForEachRowSegment(grid, [&](int64_t i, int64_t j0, int64_t j1, int64_t b) {
    const float* row = src.Row(i);
    float m = amax[b];
    for (int64_t j = j0; j < j1; ++j) {
      const float a = std::fabs(row[j]);
      if (a > m) m = a;  // false for NaN: NaN is ignored (§0)
    }
    amax[b] = m;
  });
  return amax;
}

void EncodeFp8Blocks(const MatrixRows& src, const BlockGrid& grid, const std::vector<float>& enc,
                     Fp8Type type, uint8_t* out) {
  ForEachRowSegment(grid, [&](int64_t i, int64_t j0, int64_t j1, int64_t b) {
    const float s = enc[b];
    const float* row = src.Row(i);
    uint8_t* q = out + i * grid.cols;
    for (int64_t j = j0; j < j1; ++j) q[j] = EncodeFp8(row[j] * s, type);
  });
}

void DecodeFp8Blocks(const uint8_t* codes, const BlockGrid& grid, const std::vector<float>& dec,
                     Fp8Type type, MatrixRowsOut& out) {
  const float* value = Fp8ValueTable(type);
  ForEachRowSegment(grid, [&](int64_t i, int64_t j0, int64_t j1, int64_t b) {
    const float d = dec[b];
    const uint8_t* q = codes + i * grid.cols;
    float* x = out.Row(i);
    for (int64_t j = j0; j < j1; ++j) x[j] = value[q[j]] * d;
  });
}

void EncodeFp4Blocks(const MatrixRows& src, const BlockGrid& grid, const std::vector<float>& enc,
                     uint8_t* out) {
  const int64_t row_bytes = CeilDiv(grid.cols, 2);
  ForEachRowSegment(grid, [&](int64_t i, int64_t j0, int64_t j1, int64_t b) {
    const float s = enc[b];
    const float* row = src.Row(i);
    uint8_t* q = out + i * row_bytes;
    for (int64_t j = j0; j < j1; ++j) {
      const uint8_t code = EncodeE2M1(row[j] * s);
      // Even index in the low nibble; writing the low nibble first clears a
      // possible odd tail's high nibble (D11).
      q[j >> 1] = (j & 1) ? static_cast<uint8_t>(q[j >> 1] | (code << 4)) : code;
    }
  });
}

void DecodeFp4Blocks(const uint8_t* packed, const BlockGrid& grid, const std::vector<float>& dec,
                     MatrixRowsOut& out) {
  const int64_t row_bytes = CeilDiv(grid.cols, 2);
  float value[16];
  for (int c = 0; c < 16; ++c) value[c] = DecodeE2M1(static_cast<uint8_t>(c));
  ForEachRowSegment(grid, [&](int64_t i, int64_t j0, int64_t j1, int64_t b) {
    const float d = dec[b];
    const uint8_t* q = packed + i * row_bytes;
    float* x = out.Row(i);
    for (int64_t j = j0; j < j1; ++j) x[j] = value[(q[j >> 1] >> ((j & 1) * 4)) & 0xF] * d;
  });
}

void StoreScaleBytes(const std::vector<uint8_t>& block_bytes, const BlockGrid& grid,
                     int64_t entry_rows, int64_t entry_cols, int64_t scale_cols, uint8_t* scales) {
  const int64_t gc = grid.grid_cols();
  for (int64_t r = 0; r * entry_rows < grid.rows; ++r) {
    const uint8_t* block_row = &block_bytes[(r * entry_rows / grid.block_rows) * gc];
    for (int64_t c = 0; c * entry_cols < grid.cols; ++c) {
      scales[r * scale_cols + c] = block_row[c * entry_cols / grid.block_cols];
    }
  }
}

std::vector<uint8_t> LoadScaleBytes(const uint8_t* scales, const BlockGrid& entries,
                                    int64_t scale_cols) {
  const int64_t gc = entries.grid_cols();
  std::vector<uint8_t> bytes(entries.num_blocks());
  for (int64_t r = 0; r < entries.grid_rows(); ++r) {
    std::copy(scales + r * scale_cols, scales + r * scale_cols + gc, &bytes[r * gc]);
  }
  return bytes;
}

}  // namespace internal
}  // namespace ref
}  // namespace paramd
