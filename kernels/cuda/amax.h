// File: kernels/cuda/amax.h
//
// Multi-tensor amax on the GPU (FORMATS.md §0: NaN ignored, ±Inf counts) of
// each tensor's source values (D1: FP32 input optionally rounded to BF16
// first). Each result is max-updated into its own device float, so partial
// amaxes of many tensors (or of many shards of one tensor) land in one packed
// device vector that a single all-reduce(MAX) can then combine.
//
// Enqueues work on `stream` only; never synchronizes. Up to 256 tensors per
// launch (more are split). InvalidArgument for bad arguments (checked before
// any launch), Internal for CUDA errors.
#ifndef PARAMD_KERNELS_CUDA_AMAX_H_
#define PARAMD_KERNELS_CUDA_AMAX_H_

#include <cstdint>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/cuda/quantize.h"
#include "kernels/format.h"

namespace paramd {
namespace gpu {

struct AmaxArgs {
  const void* source = nullptr;  // `count` elements of `input_type`
  InputType input_type = InputType::kFp32;
  int64_t count = 0;
  SourceDtype source_dtype = SourceDtype::kBf16;
  // Max-updated: set it to 0 (or to a partial amax to combine with) first,
  // or pass zero_first = true.
  float* amax = nullptr;
};

// zero_first: set every output to 0 (cudaMemsetAsync) before the launch.
absl::Status ComputeAmax(absl::Span<const AmaxArgs> tensors, cudaStream_t stream,
                         bool zero_first = false);

}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_AMAX_H_
