#include "server/step/optimizer.h"

#include <algorithm>
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
  if (!(o.max_grad_norm >= 0) || !std::isfinite(o.max_grad_norm)) {
    return bad("max_grad_norm", o.max_grad_norm);
  }
  const LrSchedule& s = o.schedule;
  if (s.warmup_steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer: bad schedule.warmup_steps ", s.warmup_steps));
  }
  if (s.decay != LrDecay::kConstant && s.decay_steps <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer: schedule.decay_steps must be > 0 with a LINEAR or COSINE decay, got ",
        s.decay_steps));
  }
  if (!(s.min_lr >= 0 && s.min_lr <= o.lr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer: schedule.min_lr ", s.min_lr, " must be in [0, lr = ", o.lr, "]"));
  }
  return absl::OkStatus();
}

double ScheduledLr(const OptimizerOptions& o, int64_t step) {
  const double lr = o.lr;
  const LrSchedule& s = o.schedule;
  if (step <= s.warmup_steps) {
    return lr * static_cast<double>(step) / static_cast<double>(s.warmup_steps);
  }
  if (s.decay == LrDecay::kConstant) return lr;
  const double floor = s.min_lr;
  const double p = std::min(
      1.0, static_cast<double>(step - s.warmup_steps) / static_cast<double>(s.decay_steps));
  if (s.decay == LrDecay::kLinear) return lr - (lr - floor) * p;
  return floor + (lr - floor) * (1.0 + std::cos(M_PI * p)) / 2.0;
}

StepHyper TensorStepHyper(const OptimizerOptions& o, const TensorOptimizer& t, int64_t step,
                          float grad_scale) {
  StepHyper h;
  h.lr = ScheduledLr(o, step) * static_cast<double>(t.lr_multiplier);
  h.weight_decay = t.weight_decay.value_or(o.weight_decay);
  h.grad_scale = grad_scale;
  return h;
}

float ClipFactor(const OptimizerOptions& o, double sum_sq) {
  if (!(o.max_grad_norm > 0) || !std::isfinite(sum_sq)) return 1.0f;
  const double factor = static_cast<double>(o.max_grad_norm) / (std::sqrt(sum_sq) + 1e-6);
  return factor < 1.0 ? static_cast<float>(factor) : 1.0f;
}

AdamWConstants FoldAdamW(const OptimizerOptions& o, int64_t step) {
  return FoldAdamWConstants(o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, step);
}

AdamWConstants FoldAdamW(const OptimizerOptions& o, const StepHyper& h, int64_t step) {
  return FoldAdamWConstants(h.lr, o.beta1, o.beta2, o.eps, h.weight_decay, step);
}

void ApplyOptimizer(const OptimizerOptions& o, int64_t step, absl::Span<float> w,
                    absl::Span<const float> g, OptimizerState& state) {
  StepHyper h;
  h.lr = o.lr;
  h.weight_decay = o.weight_decay;
  ApplyOptimizerStep(o, h, step, w, g, state);
}

void ApplyOptimizerStep(const OptimizerOptions& o, const StepHyper& h, int64_t step,
                        absl::Span<float> w, absl::Span<const float> grad, OptimizerState& state) {
  const size_t n = w.size();
  // The clip factor is one float multiply per element, as the device
  // kernels apply it (identity at 1, so it is skipped there).
  const float scale = h.grad_scale;
  const bool scaled = scale != 1.0f;
  auto g = [&](size_t i) { return scaled ? grad[i] * scale : grad[i]; };
  if (o.kind == OptimizerKind::kAdamW) {
    if (state.m.size() != n) state.m.assign(n, 0.0f);
    if (state.v.size() != n) state.v.assign(n, 0.0f);
    const AdamWConstants c = FoldAdamW(o, h, step);
    float* m = state.m.data();
    float* v = state.v.data();
    for (size_t i = 0; i < n; ++i) {
      // Same operations, in the same order, as dev::AdamWElement.
      const float gi = g(i);
      m[i] = std::fma(c.beta1, m[i], c.one_minus_beta1 * gi);
      v[i] = std::fma(c.beta2, v[i], c.one_minus_beta2 * (gi * gi));
      const float denom = std::fma(std::sqrt(v[i]), c.rsqrt_bias2, c.eps);
      const float update = m[i] / denom;
      w[i] = std::fma(-c.step_size, update, w[i] * c.decay);
    }
    return;
  }
  // SGD (+ momentum), as dev::SgdElement. Weight decay 0 must not touch w:
  // 0 * Inf would turn an Inf master into NaN.
  const float lr = static_cast<float>(h.lr);
  const float wd = h.weight_decay;
  const bool decays = wd != 0.0f;
  if (o.momentum == 0.0f) {
    for (size_t i = 0; i < n; ++i) {
      const float d = decays ? std::fma(wd, w[i], g(i)) : g(i);
      w[i] = std::fma(-lr, d, w[i]);
    }
    return;
  }
  const bool first = state.m.size() != n || step <= 1;
  if (state.m.size() != n) state.m.assign(n, 0.0f);
  float* buf = state.m.data();
  for (size_t i = 0; i < n; ++i) {
    const float d = decays ? std::fma(wd, w[i], g(i)) : g(i);
    buf[i] = first ? d : std::fma(o.momentum, buf[i], d);
    w[i] = std::fma(-lr, buf[i], w[i]);
  }
}

}  // namespace paramd
