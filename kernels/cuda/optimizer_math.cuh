// File: kernels/cuda/optimizer_math.cuh
//
// The per-element optimizer updates, shared by the optimizer kernels and the
// fused optimizer+quantize tile kernel so that both produce the same bits.
// Every operation is an explicit intrinsic: no compiler contraction choice
// can make the two kernels differ. server/step/optimizer.cc (the host optimizer)
// performs the same operations in the same order (std::fma where these use
// __fmaf_rn), so host and device produce identical bits for the same folded
// constants (kernels/cuda/optimizer.cc FoldAdam = server FoldAdamW).
#ifndef PARAMD_KERNELS_CUDA_OPTIMIZER_MATH_CUH_
#define PARAMD_KERNELS_CUDA_OPTIMIZER_MATH_CUH_

#include <cuda_runtime.h>

#include "kernels/cuda/optimizer_launch.h"

namespace paramd {
namespace gpu {
namespace dev {

__device__ __forceinline__ void AdamWElement(float& p, float& m, float& v, float g,
                                             const detail::AdamHyper& h) {
  m = __fmaf_rn(h.beta1, m, __fmul_rn(h.one_minus_beta1, g));
  v = __fmaf_rn(h.beta2, v, __fmul_rn(h.one_minus_beta2, __fmul_rn(g, g)));
  const float denom = __fmaf_rn(__fsqrt_rn(v), h.rsqrt_bias2, h.eps);
  const float update = __fdiv_rn(m, denom);
  p = __fmaf_rn(-h.step_size, update, __fmul_rn(p, h.decay));
}

__device__ __forceinline__ void SgdElement(float& p, float& buf, float g, bool has_momentum,
                                           const detail::SgdHyper& h) {
  // Weight decay 0 leaves d = g: 0 * Inf would turn an Inf master into NaN
  // (as server/step/optimizer.cc).
  float d = h.weight_decay != 0.0f ? __fmaf_rn(h.weight_decay, p, g) : g;
  if (has_momentum) {
    buf = h.first_step ? d : __fmaf_rn(h.momentum, buf, __fmul_rn(h.one_minus_dampening, d));
    d = h.nesterov ? __fmaf_rn(h.momentum, buf, d) : buf;
  }
  p = __fmaf_rn(-h.lr, d, p);
}

}  // namespace dev
}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_OPTIMIZER_MATH_CUH_
