// File: kernels/cuda/optimizer_launch.h
//
// INTERNAL (detail layer): plain-old-data hyperparameters and batches of the
// optimizer kernels in optimizer.cu, and their raw launchers. Included by
// .cu files (nvcc) and by the host wrappers (optimizer.cc). No Abseil.
#ifndef PARAMD_KERNELS_CUDA_OPTIMIZER_LAUNCH_H_
#define PARAMD_KERNELS_CUDA_OPTIMIZER_LAUNCH_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace paramd {
namespace gpu {
namespace detail {

// AdamW (decoupled weight decay), folded on the host in float64 and rounded
// once to float (= server/step/optimizer.h FoldAdamW; the per-element operations
// of optimizer_math.cuh are those of server/step/optimizer.cc):
//   m = fma(beta1, m, (1 - beta1) * g)
//   v = fma(beta2, v, (1 - beta2) * (g * g))
//   p = fma(-step_size, m / fma(sqrt(v), rsqrt_bias2, eps), p * decay)
//   decay = 1 - lr * weight_decay
//   step_size = lr / (1 - beta1^t), rsqrt_bias2 = 1 / sqrt(1 - beta2^t)
struct AdamHyper {
  float decay = 1.0f;
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float eps = 1e-8f;
  float step_size = 0.0f;
  float rsqrt_bias2 = 1.0f;
};

// SGD with momentum (PyTorch semantics):
//   d = weight_decay != 0 ? fma(weight_decay, p, g) : g
//   buf = first_step ? d : momentum * buf + (1 - dampening) * d
//   d = nesterov ? d + momentum * buf : buf        (momentum != 0)
//   p = p - lr * d
struct SgdHyper {
  float lr = 0.0f;
  float momentum = 0.0f;
  float one_minus_dampening = 1.0f;
  float weight_decay = 0.0f;
  uint8_t nesterov = 0;
  uint8_t first_step = 0;
};

struct OptItem {
  float* param = nullptr;
  float* m = nullptr;  // AdamW exp_avg, or SGD momentum buffer (null: no momentum)
  float* v = nullptr;  // AdamW exp_avg_sq
  // Where the updated param / m / v go; equal to param / m / v: in place.
  // Out of place, a skipped step (grad_scale NaN) copies the inputs over.
  float* param_out = nullptr;
  float* m_out = nullptr;
  float* v_out = nullptr;
  const float* grad = nullptr;
  float* amax = nullptr;  // max-updated with amax of the updated param (nullable)
  int64_t count = 0;
  uint8_t round_bf16 = 0;  // amax over BF16-rounded values (D1)
  uint8_t vec = 0;         // every pointer 16-byte aligned
  int64_t chunk_begin = 0;
};

constexpr int kMaxOptItems = 192;
constexpr int64_t kOptChunk = 16384;  // elements per block

struct OptBatch {
  int num = 0;
  int64_t total_chunks = 0;
  AdamHyper adam;
  SgdHyper sgd;
  // Device scalar c (null: none): every gradient element is multiplied by c
  // (one float multiply, __fmul_rn) before the update: the global-norm clip
  // factor. c NaN: no update at all (params and moments unchanged, the amax
  // still taken): a step skipped for a non-finite gradient norm. Read once
  // per block, so it may be written by a kernel earlier on the stream.
  const float* grad_scale = nullptr;
  OptItem t[kMaxOptItems];
};

static_assert(sizeof(OptBatch) <= 32000, "kernel parameter limit");

// kind 0: AdamW, 1: SGD. `with_amax` = 0 skips the amax work entirely
// (benchmark baseline for "AdamW without amax").
cudaError_t LaunchOptimizer(const OptBatch& batch, int kind, int with_amax, cudaStream_t stream);

}  // namespace detail
}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_OPTIMIZER_LAUNCH_H_
