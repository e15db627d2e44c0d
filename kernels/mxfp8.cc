// §3 MXFP8 with TE's rounding (D3): one E8M0 scale per 1x32 block of a row
// (rowwise) or 32x1 block of a column (columnwise), or per 32x32 tile with
// spec.two_d. Both directions quantize W in place: the columnwise data
// stays [M][K]; only the compact scale buffers differ in shape.
#include <cmath>

#include "kernels/reference.h"
#include "kernels/reference_internal.h"

namespace paramd {
namespace ref {
namespace internal {
namespace {

constexpr int64_t kBlock = 32;

// What one compact scale entry covers: R[i][j/32] rowwise, C[i/32][j]
// columnwise. 1D blocks are exactly these; 2D tiles are 32x32.
struct Extent {
  int64_t rows, cols;
};
Extent EntryExtent(Direction d) {
  return d == Direction::kRowwise ? Extent{1, kBlock} : Extent{kBlock, 1};
}

// enc = 2^(127-e), exact (TE's exp2f_rcp): e = 254 needs the fp32 subnormal
// 2^-127; 0xFF (NaN scale) gives NaN.
float E8M0Reciprocal(uint8_t e) {
  if (e == 0xFF) return std::nanf("");
  if (e == 254) return FloatFromBits(0x00400000u);
  return FloatFromBits(static_cast<uint32_t>(254 - e) << 23);
}

void Quantize(const SourceMatrix& src, const QuantSpec& spec, Direction d, QuantizedTensor& q) {
  const Extent entry = EntryExtent(d);
  const BlockGrid grid{src.rows, src.cols, spec.two_d ? kBlock : entry.rows,
                       spec.two_d ? kBlock : entry.cols};
  const std::vector<float> amax = BlockAmaxes(src.values, grid);
  // v = mul(amax, RN(1/fp8_max)): a multiply, not a division (§3).
  const float rcp_max = spec.fp8_type == Fp8Type::kE5M2 ? Rcp57344() : Rcp448();
  std::vector<uint8_t> e(amax.size());
  std::vector<float> enc(amax.size());
  for (size_t b = 0; b < amax.size(); ++b) {
    e[b] = E8M0FromScaledAmax(amax[b] * rcp_max);
    enc[b] = E8M0Reciprocal(e[b]);
  }
  EncodeFp8Blocks(src.values, grid, enc, spec.fp8_type, q.data.data());
  StoreScaleBytes(e, grid, entry.rows, entry.cols, src.layout.scale_cols, q.scales.data());
}

void Dequantize(const EncodedView& v, const QuantSpec& spec, Direction d, MatrixRowsOut& out) {
  // x^ = value(q) * 2^(e-127), e read from each element's own scale entry.
  const Extent entry = EntryExtent(d);
  const BlockGrid entries{v.rows, v.cols, entry.rows, entry.cols};
  const std::vector<uint8_t> e = LoadScaleBytes(v.scales, entries, v.layout.scale_cols);
  std::vector<float> dec(e.size());
  for (size_t b = 0; b < e.size(); ++b) dec[b] = DecodeE8M0(e[b]);
  DecodeFp8Blocks(v.data, entries, dec, spec.fp8_type, out);
}

}  // namespace

void QuantizeMxfp8Rowwise(const SourceMatrix& src, const QuantSpec& spec,
                          const TensorScaling& /*scaling*/, QuantizedTensor& q) {
  Quantize(src, spec, Direction::kRowwise, q);
}
void DequantizeMxfp8Rowwise(const EncodedView& v, const QuantSpec& spec, MatrixRowsOut& out) {
  Dequantize(v, spec, Direction::kRowwise, out);
}
void QuantizeMxfp8Columnwise(const SourceMatrix& src, const QuantSpec& spec,
                             const TensorScaling& /*scaling*/, QuantizedTensor& q) {
  Quantize(src, spec, Direction::kColumnwise, q);
}
void DequantizeMxfp8Columnwise(const EncodedView& v, const QuantSpec& spec, MatrixRowsOut& out) {
  Dequantize(v, spec, Direction::kColumnwise, out);
}

}  // namespace internal
}  // namespace ref
}  // namespace paramd
