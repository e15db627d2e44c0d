// File: kernels/cuda/quantize_internal.h
//
// INTERNAL host helpers shared by quantize.cc and optimizer.cc (the fused
// optimizer + quantize entry point builds the same tile descriptors).
#ifndef PARAMD_KERNELS_CUDA_QUANTIZE_INTERNAL_H_
#define PARAMD_KERNELS_CUDA_QUANTIZE_INTERNAL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/cuda/quantize.h"
#include "kernels/cuda/quantize_launch.h"
#include "kernels/format.h"

namespace paramd {
namespace gpu {
namespace internal {

enum class Mode { kQuantize, kColumnwiseAmax };

absl::StatusOr<uint8_t> KernelFormatOf(Format f);
absl::Status CheckShape(const void* source, int64_t rows, int64_t cols);
// Validated descriptor of one tensor (tile_begin is filled at launch).
absl::StatusOr<detail::TensorDesc> MakeTensorDesc(const QuantizeTensorArgs& a, Mode mode);
// Cuts `descs` into launches of at most kMaxTensorsPerLaunch tensors.
// `grad_scale`: QuantizeBatch::grad_scale of the fused AdamW load.
absl::Status LaunchTensorDescs(absl::Span<const detail::TensorDesc> descs,
                               const detail::AdamHyper* adam, int variant, cudaStream_t stream,
                               const float* grad_scale = nullptr);

}  // namespace internal
}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_QUANTIZE_INTERNAL_H_
