// §3 MXFP8 with TE's rounding (D3): one E8M0 scale per 1x32 block of a row
// (or per 32x32 tile with spec.two_d, written into every row of the tile).
#include <cmath>

#include "kernels/reference.h"
#include "kernels/reference_internal.h"

namespace paramd {
namespace ref {
namespace internal {
namespace {

constexpr int64_t kBlock = 32;

// enc = 2^(127-e), exact (TE's exp2f_rcp): e = 254 needs the fp32 subnormal
// 2^-127; 0xFF (NaN scale) gives NaN.
float E8M0Reciprocal(uint8_t e) {
  if (e == 0xFF) return std::nanf("");
  if (e == 254) return FloatFromBits(0x00400000u);
  return FloatFromBits(static_cast<uint32_t>(254 - e) << 23);
}

}  // namespace

void QuantizeMxfp8Rowwise(const SourceMatrix& src, const QuantSpec& spec,
                          const TensorScaling& /*scaling*/, QuantizedTensor& q) {
  const BlockGrid grid{src.rows, src.cols, spec.two_d ? kBlock : 1, kBlock};
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
  StoreRowScaleBytes(e, grid, src.layout.scale_cols, q.scales.data());  // R[i][j/32]
}

void DequantizeMxfp8Rowwise(const EncodedView& v, const QuantSpec& spec, MatrixRowsOut& out) {
  // x^ = value(q) * 2^(e-127), with e read from each row's own scale entry.
  const BlockGrid grid{v.rows, v.cols, 1, kBlock};
  const std::vector<uint8_t> e = LoadRowScaleBytes(v.scales, grid, v.layout.scale_cols);
  std::vector<float> dec(e.size());
  for (size_t b = 0; b < e.size(); ++b) dec[b] = DecodeE8M0(e[b]);
  DecodeFp8Blocks(v.data, grid, dec, spec.fp8_type, out);
}

}  // namespace internal
}  // namespace ref
}  // namespace paramd
