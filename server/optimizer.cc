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

void ApplyOptimizer(const OptimizerOptions& o, int64_t step, absl::Span<float> w,
                    absl::Span<const float> g, OptimizerState& state) {
  const size_t n = w.size();
  if (o.kind == OptimizerKind::kAdamW) {
    if (state.m.size() != n) state.m.assign(n, 0.0f);
    if (state.v.size() != n) state.v.assign(n, 0.0f);
    const float decay = 1.0f - o.lr * o.weight_decay;
    const float bc1 = 1.0f - std::pow(o.beta1, static_cast<float>(step));
    const float bc2_sqrt = std::sqrt(1.0f - std::pow(o.beta2, static_cast<float>(step)));
    const float step_size = o.lr / bc1;
    float* m = state.m.data();
    float* v = state.v.data();
    for (size_t i = 0; i < n; ++i) {
      w[i] *= decay;
      m[i] = o.beta1 * m[i] + (1.0f - o.beta1) * g[i];
      v[i] = o.beta2 * v[i] + (1.0f - o.beta2) * g[i] * g[i];
      const float denom = std::sqrt(v[i]) / bc2_sqrt + o.eps;
      w[i] -= step_size * (m[i] / denom);
    }
    return;
  }
  // SGD (+ momentum). Weight decay 0 must not touch w: 0 * Inf would turn
  // an Inf master into NaN.
  const bool decays = o.weight_decay != 0.0f;
  if (o.momentum == 0.0f) {
    for (size_t i = 0; i < n; ++i) {
      const float d = decays ? g[i] + o.weight_decay * w[i] : g[i];
      w[i] -= o.lr * d;
    }
    return;
  }
  const bool first = state.m.size() != n || step <= 1;
  if (state.m.size() != n) state.m.assign(n, 0.0f);
  float* buf = state.m.data();
  for (size_t i = 0; i < n; ++i) {
    const float d = decays ? g[i] + o.weight_decay * w[i] : g[i];
    buf[i] = first ? d : o.momentum * buf[i] + d;
    w[i] -= o.lr * buf[i];
  }
}

}  // namespace paramd
