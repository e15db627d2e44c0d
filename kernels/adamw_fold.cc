// File: kernels/adamw_fold.cc
#include "kernels/adamw_fold.h"

#include <cmath>

namespace paramd {

AdamWConstants FoldAdamWConstants(double lr, double beta1, double beta2, double eps,
                                  double weight_decay, int64_t step) {
  const double t = static_cast<double>(step);
  AdamWConstants c;
  c.decay = static_cast<float>(1.0 - lr * weight_decay);
  c.beta1 = static_cast<float>(beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  c.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, t)));
  c.rsqrt_bias2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, t)));
  return c;
}

}  // namespace paramd
