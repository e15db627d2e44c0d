// §6 IdentityQuantizer: the source in [M][K] order as BF16 (RNE, NaN ->
// 0x7FFF) or FP32, little-endian, no scales.
#include <cstring>

#include "kernels/reference.h"
#include "kernels/reference_internal.h"

namespace paramd {
namespace ref {
namespace internal {

void QuantizeIdentityRowwise(const SourceMatrix& src, const QuantSpec& spec,
                             const TensorScaling& /*scaling*/, QuantizedTensor& q) {
  const int64_t n = src.rows * src.cols;
  uint8_t* out = q.data.data();
  if (spec.format == Format::kIdentityFp32) {
    for (int64_t i = 0; i < n; ++i) StoreF32Le(src.values[i], out + 4 * i);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t b = EncodeBf16(src.values[i]);
    out[2 * i] = static_cast<uint8_t>(b);
    out[2 * i + 1] = static_cast<uint8_t>(b >> 8);
  }
}

void DequantizeIdentityRowwise(const EncodedView& v, const QuantSpec& spec, float* out) {
  const int64_t n = v.rows * v.cols;
  if (spec.format == Format::kIdentityFp32) {
    for (int64_t i = 0; i < n; ++i) out[i] = LoadF32Le(v.data + 4 * i);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    out[i] = DecodeBf16(static_cast<uint16_t>(v.data[2 * i] | (v.data[2 * i + 1] << 8)));
  }
}

}  // namespace internal
}  // namespace ref
}  // namespace paramd
