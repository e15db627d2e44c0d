// §6 IdentityQuantizer: the source in [M][K] order as BF16 (RNE, NaN ->
// 0x7FFF) or FP32, little-endian, no scales.
#include "kernels/reference.h"
#include "kernels/reference_internal.h"

namespace paramd {
namespace ref {
namespace internal {

void QuantizeIdentityRowwise(const SourceMatrix& src, const QuantSpec& spec,
                             const TensorScaling& /*scaling*/, QuantizedTensor& q) {
  const bool fp32 = spec.format == Format::kIdentityFp32;
  for (int64_t i = 0; i < src.rows; ++i) {
    const float* row = src.values.Row(i);
    uint8_t* out = q.data.data() + i * src.layout.data_row_bytes;
    for (int64_t j = 0; j < src.cols; ++j) {
      if (fp32) {
        StoreF32Le(row[j], out + 4 * j);
      } else {
        const uint16_t b = EncodeBf16(row[j]);
        out[2 * j] = static_cast<uint8_t>(b);
        out[2 * j + 1] = static_cast<uint8_t>(b >> 8);
      }
    }
  }
}

void DequantizeIdentityRowwise(const EncodedView& v, const QuantSpec& spec, MatrixRowsOut& out) {
  const bool fp32 = spec.format == Format::kIdentityFp32;
  for (int64_t i = 0; i < v.rows; ++i) {
    const uint8_t* in = v.data + i * v.layout.data_row_bytes;
    float* row = out.Row(i);
    for (int64_t j = 0; j < v.cols; ++j) {
      row[j] = fp32 ? LoadF32Le(in + 4 * j)
                    : DecodeBf16(static_cast<uint16_t>(in[2 * j] | (in[2 * j + 1] << 8)));
    }
  }
}

}  // namespace internal
}  // namespace ref
}  // namespace paramd
