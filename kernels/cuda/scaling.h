// File: kernels/cuda/scaling.h
//
// Scaling updates on the device, with no host round trip (FORMATS.md §1, §2):
// current scaling turns a reduced amax into scale / scale_inv; delayed
// scaling rolls the amax history and computes the next scale (fused rule:
// amax == 0 leaves history and scale untouched, D9). Results equal
// ref::ComputeScale / ref::ScalingFromAmax / ref::DelayedUpdate bit for bit.
//
// All pointers are device pointers. Enqueue-only on `stream`; up to 256
// tensors per launch (more are split). InvalidArgument for bad arguments.
#ifndef PARAMD_KERNELS_CUDA_SCALING_H_
#define PARAMD_KERNELS_CUDA_SCALING_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/format.h"

namespace paramd {
namespace gpu {

struct CurrentScalingArgs {
  const float* amax = nullptr;  // the (globally reduced) amax of the source
  float* scale = nullptr;       // out: compute_scale(amax, fp8_max, pow2, eps, FLT_MAX)
  float* scale_inv = nullptr;   // out (nullable): rcp(scale)
  QuantSpec spec;               // fp8_type, pow2_scales, eps
};
absl::Status CurrentScalingUpdate(absl::Span<const CurrentScalingArgs> tensors,
                                  cudaStream_t stream);

struct DelayedScalingArgs {
  float* history = nullptr;    // [spec.amax_history_len] (>= 1); history[0] = this step's amax
  float* scale = nullptr;      // in: current scale, out: next scale
  float* scale_inv = nullptr;  // out (nullable): rcp(next scale)
  // The all-reduced amax; null means history[0] (single daemon).
  const float* reduced_amax = nullptr;
  QuantSpec spec;  // amax_history_len, amax_algo, margin, fp8_type
};
// History lengths up to 12288 slots.
absl::Status DelayedScalingUpdate(absl::Span<const DelayedScalingArgs> tensors,
                                  cudaStream_t stream);

}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_SCALING_H_
