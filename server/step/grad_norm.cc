#include "server/step/grad_norm.h"

#include <cstring>

namespace paramd {

double RowSumSq(const float* row, int64_t cols) {
  double lane[kGradNormLanes];
  for (int l = 0; l < kGradNormLanes; ++l) {
    double s = 0.0;
    for (int64_t k = l; k < cols; k += kGradNormLanes) {
      const double g = row[k];
      s += g * g;  // exact: a float squared fits a double
    }
    lane[l] = s;
  }
  for (int s = kGradNormLanes / 2; s >= 1; s /= 2) {
    for (int l = 0; l < s; ++l) lane[l] += lane[l + s];
  }
  return lane[0];
}

GradNormSlots MakeGradNormSlots(const std::vector<int64_t>& rows, const std::vector<bool>& frozen) {
  GradNormSlots s;
  for (size_t t = 0; t < rows.size(); ++t) {
    s.slot_begin.push_back(s.num_slots);
    if (!frozen[t]) s.num_slots += (rows[t] + kGradNormBlockRows - 1) / kGradNormBlockRows;
  }
  return s;
}

void EncodeGradNormSlot(double value, float* out4) {
  uint64_t bits;
  std::memcpy(&bits, &value, 8);
  for (int k = 0; k < kGradNormFloatsPerSlot; ++k) {
    out4[k] = static_cast<float>((bits >> (16 * k)) & 0xFFFFu);
  }
}

double DecodeGradNormSlot(const float* in4) {
  uint64_t bits = 0;
  for (int k = 0; k < kGradNormFloatsPerSlot; ++k) {
    bits |= static_cast<uint64_t>(in4[k]) << (16 * k);
  }
  double v;
  std::memcpy(&v, &bits, 8);
  return v;
}

double SumGradNormSlots(absl::Span<const float> encoded) {
  double sum = 0.0;
  for (size_t i = 0; i + kGradNormFloatsPerSlot <= encoded.size(); i += kGradNormFloatsPerSlot) {
    sum += DecodeGradNormSlot(encoded.data() + i);
  }
  return sum;
}

}  // namespace paramd
