// File: kernels/cuda/dequantize.h
//
// GPU dequantization of one published direction back to [M][K] FP32 or BF16
// (FORMATS.md D15; NVFP4 decodes with A * RN(1/2688), D4). FP32 output equals
// ref::Dequantize bit for bit; BF16 output is that value rounded RNE (NaN ->
// 0x7FFF). Device pointers; enqueue-only on `stream`. InvalidArgument for bad
// arguments. Not on the daemon's hot path (one launch per tensor).
#ifndef PARAMD_KERNELS_CUDA_DEQUANTIZE_H_
#define PARAMD_KERNELS_CUDA_DEQUANTIZE_H_

#include <cstdint>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/format.h"

namespace paramd {
namespace gpu {

enum class OutputType : uint8_t { kFp32 = 0, kBf16 = 1 };

struct DequantizeArgs {
  QuantSpec spec;
  Direction direction = Direction::kRowwise;
  int64_t rows = 0;  // logical M, K of the source
  int64_t cols = 0;
  const void* data = nullptr;  // ComputeLayout(spec, direction, rows, cols)
  const void* scales = nullptr;
  const float* scale_inv = nullptr;    // per-tensor FP8 (QuantizedTensor::scale_inv)
  const float* global_amax = nullptr;  // NVFP4 (QuantizedTensor::amax = A)
  void* out = nullptr;                 // rows * cols elements of `output_type`
  OutputType output_type = OutputType::kFp32;
};

absl::Status Dequantize(absl::Span<const DequantizeArgs> tensors, cudaStream_t stream);

}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_DEQUANTIZE_H_
