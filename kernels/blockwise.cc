// §5 FP8 blockwise (DeepSeek style, D5): one fp32 scale_inv per 128x128 tile
// (kFp8Block128x128) or per 1x128 block of a row (kFp8Block1x128), in the
// GEMM-ready layouts: 2D entry [mb][kb]; 1D entry [kb][i] (transposed order).
#include <cfloat>

#include "kernels/reference.h"
#include "kernels/reference_internal.h"

namespace paramd {
namespace ref {
namespace internal {
namespace {

constexpr int64_t kBlock = 128;

BlockGrid GridFor(const QuantSpec& spec, int64_t rows, int64_t cols) {
  return {rows, cols, spec.format == Format::kFp8Block128x128 ? kBlock : 1, kBlock};
}

// Offset (in entries) of block (bi, bj)'s scale_inv in the scale buffer.
int64_t ScaleEntry(const QuantSpec& spec, int64_t scale_cols, int64_t bi, int64_t bj) {
  return spec.format == Format::kFp8Block128x128 ? bi * scale_cols + bj : bj * scale_cols + bi;
}

}  // namespace

void QuantizeBlockwiseRowwise(const SourceMatrix& src, const QuantSpec& spec,
                              const TensorScaling& /*scaling*/, QuantizedTensor& q) {
  const BlockGrid grid = GridFor(spec, src.rows, src.cols);
  const std::vector<float> amax = BlockAmaxes(src.values, grid);
  // inf_value is the largest finite value of the source dtype (§5).
  const float inf_value = spec.source_dtype == SourceDtype::kFp32 ? FLT_MAX : Bf16Max();
  std::vector<float> scale(amax.size());
  for (size_t b = 0; b < amax.size(); ++b) {
    // Inf/NaN amax -> 1 (D5) is part of compute_scale.
    scale[b] = ComputeScale(amax[b], Fp8Max(spec.fp8_type), spec.pow2_scales, spec.eps, inf_value);
  }
  EncodeFp8Blocks(src.values, grid, scale, spec.fp8_type, q.data.data());
  const int64_t gc = grid.grid_cols();
  for (int64_t bi = 0; bi < grid.grid_rows(); ++bi) {
    for (int64_t bj = 0; bj < gc; ++bj) {
      const int64_t entry = ScaleEntry(spec, src.layout.scale_cols, bi, bj);
      StoreF32Le(1.0f / scale[bi * gc + bj], q.scales.data() + 4 * entry);
    }
  }
}

void DequantizeBlockwiseRowwise(const EncodedView& v, const QuantSpec& spec, MatrixRowsOut& out) {
  // D15: value(q) * scale_inv, one rounding.
  const BlockGrid grid = GridFor(spec, v.rows, v.cols);
  const int64_t gc = grid.grid_cols();
  std::vector<float> scale_inv(grid.num_blocks());
  for (int64_t bi = 0; bi < grid.grid_rows(); ++bi) {
    for (int64_t bj = 0; bj < gc; ++bj) {
      const int64_t entry = ScaleEntry(spec, v.layout.scale_cols, bi, bj);
      scale_inv[bi * gc + bj] = LoadF32Le(v.scales + 4 * entry);
    }
  }
  DecodeFp8Blocks(v.data, grid, scale_inv, spec.fp8_type, out);
}

}  // namespace internal
}  // namespace ref
}  // namespace paramd
