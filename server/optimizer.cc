#include "server/optimizer.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace paramd {

absl::StatusOr<OptimizerKind> ParseOptimizerKind(absl::string_view name) {
  if (name == "adamw") return OptimizerKind::kAdamW;
  if (name == "sgd") return OptimizerKind::kSgd;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown optimizer \"", name, "\" (want adamw or sgd)"));
}

absl::string_view OptimizerName(OptimizerKind kind) {
  return kind == OptimizerKind::kAdamW ? "adamw" : "sgd";
}

absl::Status ValidateOptimizerOptions(const OptimizerOptions& o) {
  auto bad = [](absl::string_view what, float v) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer: bad ", what, " ", v));
  };
  if (!std::isfinite(o.lr) || o.lr < 0) return bad("lr", o.lr);
  if (!(o.beta1 >= 0 && o.beta1 < 1)) return bad("beta1", o.beta1);
  if (!(o.beta2 >= 0 && o.beta2 < 1)) return bad("beta2", o.beta2);
  if (!(o.eps > 0) || !std::isfinite(o.eps)) return bad("eps", o.eps);
  if (!std::isfinite(o.weight_decay) || o.weight_decay < 0) {
    return bad("weight_decay", o.weight_decay);
  }
  if (!(o.momentum >= 0 && o.momentum < 1)) return bad("momentum", o.momentum);
  return absl::OkStatus();
}

AdamWConstants FoldAdamW(const OptimizerOptions& o, int64_t step) {
  return FoldAdamWConstants(o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, step);
}

void ApplyOptimizer(const OptimizerOptions& o, int64_t step, absl::Span<float> w,
                    absl::Span<const float> g, OptimizerState& state) {
  const size_t n = w.size();
  if (o.kind == OptimizerKind::kAdamW) {
    if (state.m.size() != n) state.m.assign(n, 0.0f);
    if (state.v.size() != n) state.v.assign(n, 0.0f);
    const AdamWConstants c = FoldAdamW(o, step);
    float* m = state.m.data();
    float* v = state.v.data();
    for (size_t i = 0; i < n; ++i) {
      // Same operations, in the same order, as dev::AdamWElement.
      m[i] = std::fma(c.beta1, m[i], c.one_minus_beta1 * g[i]);
      v[i] = std::fma(c.beta2, v[i], c.one_minus_beta2 * (g[i] * g[i]));
      const float denom = std::fma(std::sqrt(v[i]), c.rsqrt_bias2, c.eps);
      const float update = m[i] / denom;
      w[i] = std::fma(-c.step_size, update, w[i] * c.decay);
    }
    return;
  }
  // SGD (+ momentum), as dev::SgdElement. Weight decay 0 must not touch w:
  // 0 * Inf would turn an Inf master into NaN.
  const bool decays = o.weight_decay != 0.0f;
  if (o.momentum == 0.0f) {
    for (size_t i = 0; i < n; ++i) {
      const float d = decays ? std::fma(o.weight_decay, w[i], g[i]) : g[i];
      w[i] = std::fma(-o.lr, d, w[i]);
    }
    return;
  }
  const bool first = state.m.size() != n || step <= 1;
  if (state.m.size() != n) state.m.assign(n, 0.0f);
  float* buf = state.m.data();
  for (size_t i = 0; i < n; ++i) {
    const float d = decays ? std::fma(o.weight_decay, w[i], g[i]) : g[i];
    buf[i] = first ? d : std::fma(o.momentum, buf[i], d);
    w[i] = std::fma(-o.lr, buf[i], w[i]);
  }
}

}  // namespace paramd
