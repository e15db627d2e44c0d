// File: kernels/cuda/quantize.h
//
// GPU quantization of [M, K] weights into every format and direction of
// docs/FORMATS.md. The bytes written equal ref::QuantizeHybrid /
// ref::Quantize (kernels/reference.h) exactly, scales and padding included;
// each direction's buffers follow ComputeLayout(spec, direction, M, K).
//
// One launch handles up to kMaxTensorsPerLaunch tensors (larger spans are cut
// into several launches); both directions of a tensor are produced from one
// read of its input. All pointers are device pointers; nothing here
// allocates, synchronizes or copies to the host: every call only enqueues
// work on `stream` and returns. Errors: InvalidArgument for bad shapes,
// missing buffers or unsupported combinations (checked on the host before
// anything is launched); Internal / ResourceExhausted for CUDA errors.
// Thread-compatible: calls from several threads need distinct streams or
// external ordering, like any CUDA launch.
#ifndef PARAMD_KERNELS_CUDA_QUANTIZE_H_
#define PARAMD_KERNELS_CUDA_QUANTIZE_H_

#include <cstdint>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/format.h"

namespace paramd {
namespace gpu {

// Element type of a GPU input tensor.
enum class InputType : uint8_t { kFp32 = 0, kBf16 = 1 };

// Device buffers of one direction, laid out as ComputeLayout(spec, dir, M, K).
struct DirectionBuffers {
  void* data = nullptr;    // Layout::data_bytes() bytes
  void* scales = nullptr;  // Layout::scale_bytes() bytes; required iff > 0
  // Per-tensor FP8 only (optional): receives rcp(scale) = QuantizedTensor::scale_inv.
  float* scale_inv = nullptr;
  // Optional: max-updated (never lowered) with the amax of what this direction
  // quantized (QuantizedTensor::amax for per-tensor FP8; point it at a
  // delayed-scaling history[0] to record the cast, §1). Initialise it.
  float* amax = nullptr;
};

// Per-tensor scaling inputs of one direction, on the device.
struct DirectionScaling {
  const float* scale = nullptr;        // per-tensor FP8 (delayed or current): required
  const float* global_amax = nullptr;  // NVFP4: the global amax A, required
};

// One tensor of a QuantizeHybrid call.
struct QuantizeTensorArgs {
  const void* source = nullptr;  // [rows][cols] row-major, `input_type` elements
  InputType input_type = InputType::kFp32;
  int64_t rows = 0;
  int64_t cols = 0;
  // Formats, usages, columnwise_source and source_dtype (D1: the input is
  // rounded to spec.source_dtype on read; BF16 input is already exact).
  HybridSpec spec;
  DirectionScaling rowwise_scaling;
  DirectionScaling columnwise_scaling;
  DirectionBuffers rowwise;     // used iff spec.rowwise_usage
  DirectionBuffers columnwise;  // used iff spec.columnwise_usage
};

// Kernel variant (benchmarks only; the default is what the library uses).
struct QuantizeOptions {
  int variant = 0;  // detail::QuantizeVariant
};

// Quantizes every tensor in the directions its spec's usages ask for. With
// columnwise_source = kRowwiseDequantized the columnwise copy is made from
// the dequantized rowwise values in the same pass (a temporary rowwise copy
// when rowwise usage is off: it needs rowwise_scaling but writes nothing and
// records no amax, D16).
absl::Status QuantizeHybrid(absl::Span<const QuantizeTensorArgs> tensors, cudaStream_t stream,
                            const QuantizeOptions& options = {});

// For tensors with columnwise_source = kRowwiseDequantized: max-updates
// `amax_out[i]` with amax(ref::ColumnwiseSourceValues(tensor i)), i.e. of the
// dequantized rowwise values rounded to the source dtype, without writing any
// quantized output (what current scaling / NVFP4 need before the columnwise
// quantization). Tensors with kOriginal get the amax of their source.
// Buffers in `tensors` are ignored; rowwise_scaling is required.
absl::Status ColumnwiseSourceAmax(absl::Span<const QuantizeTensorArgs> tensors,
                                  absl::Span<float* const> amax_out, cudaStream_t stream);

}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_QUANTIZE_H_
