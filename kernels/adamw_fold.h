// File: kernels/adamw_fold.h
//
// The per-step AdamW constants, folded ONCE for the host optimizer
// (server/step/optimizer.cc) and the device one (kernels/cuda/optimizer.cc): the
// two must produce identical bits, so the formula lives here only.
//
// Folded in float64 and rounded once to float. Callers pass the options as
// doubles; the daemon's options are floats, widened exactly, so both sides
// see the same inputs:
//   decay = 1 - lr * weight_decay, step_size = lr / (1 - beta1^t),
//   rsqrt_bias2 = 1 / sqrt(1 - beta2^t).
// Per element (all float, fma = one rounding):
//   m = fma(beta1, m, one_minus_beta1 * g)
//   v = fma(beta2, v, one_minus_beta2 * (g * g))
//   w = fma(-step_size, m / fma(sqrt(v), rsqrt_bias2, eps), w * decay)
//
// Pure; thread-safe. Built with -ffp-contract=off (the double expressions
// below must not be contracted differently by different compilers).
#ifndef PARAMD_KERNELS_ADAMW_FOLD_H_
#define PARAMD_KERNELS_ADAMW_FOLD_H_

#include <cstdint>

namespace paramd {

struct AdamWConstants {
  float decay = 1.0f;
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float eps = 1e-8f;
  float step_size = 0.0f;
  float rsqrt_bias2 = 1.0f;
};

// Constants of 1-based step `step`.
AdamWConstants FoldAdamWConstants(double lr, double beta1, double beta2, double eps,
                                  double weight_decay, int64_t step);

}  // namespace paramd

#endif  // PARAMD_KERNELS_ADAMW_FOLD_H_
