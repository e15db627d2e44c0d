#include "server/step/fp8_health.h"

#include <algorithm>

namespace paramd {

std::optional<CodeCounts> CountCodes(const QuantizedTensor& q, Fp8Type fp8_type,
                                     int64_t max_samples) {
  const int64_t elements = q.rows * q.cols;
  if (q.data.empty() || elements <= 0 || max_samples <= 0) return std::nullopt;
  // Magnitude mask and largest finite magnitude code of each element type.
  bool fp4 = false;
  uint8_t mask = 0x7F;
  uint8_t max_code = 0;
  switch (q.format) {
    case Format::kFp8Delayed:
    case Format::kFp8Current:
    case Format::kMxfp8:
    case Format::kFp8Block128x128:
    case Format::kFp8Block1x128:
      // E4M3: S.1111.110 = 448 (S.1111.111 is NaN); E5M2: S.11110.11 = 57344.
      max_code = fp8_type == Fp8Type::kE4M3 ? 0x7E : 0x7B;
      break;
    case Format::kNvfp4:
      fp4 = true;  // E2M1, two per byte (low nibble first): S.11.1 = 6
      mask = 0x7;
      max_code = 0x7;
      break;
    default:
      return std::nullopt;
  }
  const int64_t available =
      std::min<int64_t>(elements, fp4 ? static_cast<int64_t>(q.data.size()) * 2
                                      : static_cast<int64_t>(q.data.size()));
  const int64_t stride = std::max<int64_t>(1, available / max_samples);
  CodeCounts c;
  for (int64_t i = 0; i < available && c.sampled < max_samples; i += stride) {
    uint8_t code = fp4 ? static_cast<uint8_t>(q.data[i / 2] >> ((i % 2) * 4)) : q.data[i];
    code &= mask;
    ++c.sampled;
    if (code == max_code) ++c.saturated;
    if (code == 0) ++c.zero;
  }
  return c;
}

}  // namespace paramd
