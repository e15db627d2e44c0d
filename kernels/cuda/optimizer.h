// File: kernels/cuda/optimizer.h
//
// Fused multi-tensor optimizer steps on the GPU over FP32 master weights,
// moments and an FP32 gradient accumulator (all device pointers, updated in
// place). Each step also max-updates every tensor's amax slot with the amax
// of its updated weights rounded to the source dtype (D1), in the same pass:
// the packed partial-amax vector the daemons all-reduce (MAX) before the
// scaling update.
//
// AdamWStepAndQuantize goes further for tensors whose scales are known before
// the step (per-tensor FP8 with delayed scaling, MXFP8, FP8 blocks, identity):
// the updated weights are quantized into both directions in the same pass,
// exactly as QuantizeHybrid would quantize them afterwards.
//
// Enqueue-only on `stream`; InvalidArgument for bad arguments (checked
// before any launch); Internal for CUDA errors. Not thread-safe per tensor.
#ifndef PARAMD_KERNELS_CUDA_OPTIMIZER_H_
#define PARAMD_KERNELS_CUDA_OPTIMIZER_H_

#include <cstdint>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/cuda/quantize.h"
#include "kernels/format.h"

namespace paramd {
namespace gpu {

struct OptimizerTensor {
  float* param = nullptr;
  float* exp_avg = nullptr;     // AdamW m; SGD momentum buffer (null: no momentum)
  float* exp_avg_sq = nullptr;  // AdamW v
  const float* grad = nullptr;
  int64_t count = 0;
  float* amax = nullptr;  // nullable; max-updated with amax(round(param_new))
  SourceDtype amax_source = SourceDtype::kBf16;
  // Out of place (AdamWStep / SgdStep only): the updated param and moments
  // are written here and param / exp_avg / exp_avg_sq are only read (null:
  // in place). Same bits as in place; a skipped step (grad_scale NaN) copies
  // the inputs unchanged. Set all the tensor's buffers or none (a null
  // exp_avg_out with a non-null exp_avg updates that moment in place).
  float* param_out = nullptr;
  float* exp_avg_out = nullptr;
  float* exp_avg_sq_out = nullptr;
};

struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  int64_t step = 1;  // 1-based step number t (bias corrections 1 - beta^t)
  // Device scalar c (null: none): gradients are multiplied by c (float)
  // before the update, as server/step/optimizer.cc ApplyOptimizerStep does with
  // StepHyper::grad_scale; c NaN skips the update (params and moments
  // unchanged, amax still taken). The global-norm clip factor, written by
  // a kernel earlier on `stream` (server/gpu_backend/grad_norm.cu).
  const float* grad_scale = nullptr;
};

struct SgdHyper {
  double lr = 1e-2;
  double momentum = 0.9;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool first_step = false;            // momentum buffer is initialised with d on the first step
  const float* grad_scale = nullptr;  // as AdamWHyper::grad_scale
};

// `with_amax` = false skips the amax (benchmark baseline).
absl::Status AdamWStep(absl::Span<const OptimizerTensor> tensors, const AdamWHyper& hyper,
                       cudaStream_t stream, bool with_amax = true);
absl::Status SgdStep(absl::Span<const OptimizerTensor> tensors, const SgdHyper& hyper,
                     cudaStream_t stream, bool with_amax = true);

// AdamW fused with quantization (hyper.grad_scale as in AdamWStep: a NaN
// factor quantizes the unchanged masters). quant.source / input_type are
// ignored (the updated FP32 param is the input, rows * cols == opt.count); amax recording
// goes through quant.rowwise.amax / columnwise.amax (e.g. delayed-scaling
// history[0]); opt.amax is ignored. Formats whose scaling depends on this
// step's amax (kFp8Current, kNvfp4) are refused.
struct AdamWQuantizeArgs {
  OptimizerTensor opt;
  QuantizeTensorArgs quant;
};
// `options` picks a kernel variant (benchmarks only).
absl::Status AdamWStepAndQuantize(absl::Span<const AdamWQuantizeArgs> tensors,
                                  const AdamWHyper& hyper, cudaStream_t stream,
                                  const QuantizeOptions& options = {});

}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_OPTIMIZER_H_
