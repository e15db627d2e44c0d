// File: format/convert.h
//
// Conversions between the wire messages of proto/paramd.proto (package
// paramd::rpc) and the C++ vocabulary of kernels/format.h. Shared by server/,
// client/ and hpctl/ so that there is one mapping.
//
// Pure functions, thread-safe.
#ifndef PARAMD_FORMAT_CONVERT_H_
#define PARAMD_FORMAT_CONVERT_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/format.h"
#include "proto/paramd.pb.h"

namespace paramd {

// InvalidArgument for enum values outside kernels/format.h's enums.
absl::StatusOr<Format> FormatFromProto(rpc::Format format);
rpc::Format FormatToProto(Format format);
absl::StatusOr<Direction> DirectionFromProto(rpc::Direction direction);
rpc::Direction DirectionToProto(Direction direction);

// Absent optional fields take DefaultQuantSpec(format)'s values.
absl::StatusOr<QuantSpec> QuantSpecFromProto(const rpc::QuantSpec& spec);
// Sets every field (fully resolved).
rpc::QuantSpec QuantSpecToProto(const QuantSpec& spec);

absl::StatusOr<HybridSpec> HybridSpecFromProto(const rpc::HybridSpec& spec);
rpc::HybridSpec HybridSpecToProto(const HybridSpec& spec);

rpc::Layout LayoutToProto(const Layout& layout);
Layout LayoutFromProto(const rpc::Layout& layout);

// Bytes per element of a pushed dtype (4 or 2); InvalidArgument otherwise.
absl::StatusOr<int> DTypeSize(rpc::DType dtype);

// Appends `bytes` (little-endian FP32 or BF16 values, a whole number of
// elements) to `out` as floats. InvalidArgument for a bad dtype or a byte
// count that is not a multiple of the element size.
absl::Status DecodeValues(rpc::DType dtype, const std::string& bytes, std::vector<float>& out);

}  // namespace paramd

#endif  // PARAMD_FORMAT_CONVERT_H_
