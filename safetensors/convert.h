// File: safetensors/convert.h
//
// Element conversions between safetensors dtypes and FP32, for code that
// loads weights (FP32 masters) or writes them (BF16 export). BF16 and FP8
// go through the CPU reference codecs of kernels/reference.h, so there is
// one definition of each rounding in the project.
//
// Pure functions, thread-safe.
#ifndef PARAMD_SAFETENSORS_CONVERT_H_
#define PARAMD_SAFETENSORS_CONVERT_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "safetensors/safetensors.h"

namespace paramd {
namespace safetensors {

// F64, F32, F16, BF16, F8_E4M3 and F8_E5M2 convert to FP32.
bool ConvertsToFloat(Dtype dtype);

// Decodes little-endian `bytes` of `dtype` into `out`, which must hold
// exactly bytes.size() / DtypeSize(dtype) values. F64 is rounded to nearest
// even; the others are exact. InvalidArgument for another dtype or a size
// mismatch.
absl::Status DecodeToFloat(Dtype dtype, absl::Span<const uint8_t> bytes, absl::Span<float> out);

// The whole of `tensor` (from `file`) as FP32, row-major.
absl::StatusOr<std::vector<float>> ReadTensorAsFloat(const SafetensorsFile& file,
                                                     const TensorInfo& tensor);

// FP32 -> little-endian BF16 (RNE, canonical NaN: ref::EncodeBf16) or F32
// bytes, appended to `out`.
void AppendBf16(absl::Span<const float> values, std::vector<uint8_t>& out);
void AppendF32(absl::Span<const float> values, std::vector<uint8_t>& out);

}  // namespace safetensors
}  // namespace paramd

#endif  // PARAMD_SAFETENSORS_CONVERT_H_
