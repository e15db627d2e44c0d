// Per-tensor scalars: amax, source rounding (D1), compute_scale (§2), the
// delayed-scaling history (§1, D9) and the scaling handed to Quantize.
#include <algorithm>
#include <cfloat>
#include <cmath>

#include "kernels/reference.h"
#include "kernels/reference_internal.h"

namespace paramd {
namespace ref {

float Amax(absl::Span<const float> values) {
  if (values.empty()) return 0.0f;
  const int64_t n = static_cast<int64_t>(values.size());
  const internal::MatrixRows row(values.data(), 1, n, /*transposed=*/false);
  return internal::BlockAmaxes(row, {1, n, 1, n})[0];
}

std::vector<float> RoundToSource(absl::Span<const float> master, SourceDtype dtype) {
  std::vector<float> out(master.begin(), master.end());
  if (dtype == SourceDtype::kBf16) {
    for (float& x : out) x = DecodeBf16(EncodeBf16(x));
  }
  return out;
}

float ComputeScale(float amax, float fp8_max, bool pow2, float eps, float inf_value) {
  if (amax < eps) amax = eps;  // false for NaN
  if (std::isinf(amax) || std::isnan(amax) || amax == 0.0f) return 1.0f;
  float s = fp8_max / amax;
  if (std::isinf(s)) s = inf_value;
  // Round down to a power of two by clearing the mantissa (s is a positive
  // normal here: fp8_max / FLT_MAX is still normal).
  if (pow2) s = internal::FloatFromBits(internal::FloatBits(s) & 0xFF800000u);
  return s;
}

DelayedScalingState InitialDelayedState(const QuantSpec& spec) {
  DelayedScalingState state;
  state.amax_history.assign(std::max(spec.amax_history_len, 1), 0.0f);
  return state;
}

void DelayedRecordAmax(DelayedScalingState& state, float amax) {
  if (state.amax_history.empty()) state.amax_history.assign(1, 0.0f);
  state.amax_history[0] = std::fmax(state.amax_history[0], amax);
}

void DelayedUpdate(DelayedScalingState& state, float reduced_amax, const QuantSpec& spec) {
  std::vector<float>& h = state.amax_history;
  const size_t len = static_cast<size_t>(std::max(spec.amax_history_len, 1));
  // Growing appends zero "past" slots, which neither rule below can select.
  if (h.size() != len) h.resize(len, 0.0f);
  const float a = reduced_amax;
  if (a == 0.0f) return;  // D9 fused rule: no roll, scale unchanged
  float sel = a;
  if (spec.amax_algo == AmaxAlgo::kMax) {
    // Over all L slots before rolling: the oldest (slot 1) still counts.
    for (size_t i = 1; i < len; ++i) sel = std::fmax(sel, h[i]);
  }
  if (len > 1) {
    std::copy(h.begin() + 2, h.end(), h.begin() + 1);
    h[len - 1] = a;
  }
  h[0] = 0.0f;
  const float scaled_max = std::ldexp(Fp8Max(spec.fp8_type), -spec.margin);
  if (std::isfinite(sel) && sel > 0.0f) state.scale = scaled_max / sel;
  if (std::isinf(state.scale)) state.scale = FLT_MAX;
}

TensorScaling ScalingFromAmax(const QuantSpec& spec, float global_amax) {
  TensorScaling t;
  t.global_amax = global_amax;
  if (spec.format == Format::kFp8Current) {
    t.scale = ComputeScale(global_amax, Fp8Max(spec.fp8_type), spec.pow2_scales, spec.eps, FLT_MAX);
  }
  return t;
}

}  // namespace ref
}  // namespace paramd
