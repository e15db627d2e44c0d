#include "format/convert.h"

#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/reference.h"

namespace paramd {

absl::StatusOr<Format> FormatFromProto(rpc::Format format) {
  const int v = static_cast<int>(format);
  if (v < 0 || v > static_cast<int>(Format::kFp8Block1x128)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown format ", v));
  }
  return static_cast<Format>(v);
}

rpc::Format FormatToProto(Format format) { return static_cast<rpc::Format>(format); }

absl::StatusOr<Direction> DirectionFromProto(rpc::Direction direction) {
  switch (direction) {
    case rpc::DIRECTION_ROWWISE:
      return Direction::kRowwise;
    case rpc::DIRECTION_COLUMNWISE:
      return Direction::kColumnwise;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown direction ", static_cast<int>(direction)));
  }
}

rpc::Direction DirectionToProto(Direction direction) {
  return direction == Direction::kRowwise ? rpc::DIRECTION_ROWWISE : rpc::DIRECTION_COLUMNWISE;
}

absl::StatusOr<QuantSpec> QuantSpecFromProto(const rpc::QuantSpec& p) {
  ASSIGN_OR_RETURN(Format format, FormatFromProto(p.format()));
  QuantSpec s = DefaultQuantSpec(format);
  if (p.fp8_type() != rpc::FP8_E4M3 && p.fp8_type() != rpc::FP8_E5M2) {
    return absl::InvalidArgumentError(absl::StrCat("unknown fp8_type ", p.fp8_type()));
  }
  s.fp8_type = p.fp8_type() == rpc::FP8_E5M2 ? Fp8Type::kE5M2 : Fp8Type::kE4M3;
  if (p.has_pow2_scales()) s.pow2_scales = p.pow2_scales();
  s.eps = p.eps();
  if (p.has_amax_history_len()) {
    if (p.amax_history_len() < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("amax_history_len must be >= 1, got ", p.amax_history_len()));
    }
    s.amax_history_len = p.amax_history_len();
  }
  if (p.amax_algo() != rpc::AMAX_ALGO_MAX && p.amax_algo() != rpc::AMAX_ALGO_MOST_RECENT) {
    return absl::InvalidArgumentError(absl::StrCat("unknown amax_algo ", p.amax_algo()));
  }
  s.amax_algo =
      p.amax_algo() == rpc::AMAX_ALGO_MOST_RECENT ? AmaxAlgo::kMostRecent : AmaxAlgo::kMax;
  s.margin = p.margin();
  if (p.has_two_d()) s.two_d = p.two_d();
  return s;
}

rpc::QuantSpec QuantSpecToProto(const QuantSpec& s) {
  rpc::QuantSpec p;
  p.set_format(FormatToProto(s.format));
  p.set_fp8_type(s.fp8_type == Fp8Type::kE5M2 ? rpc::FP8_E5M2 : rpc::FP8_E4M3);
  p.set_pow2_scales(s.pow2_scales);
  p.set_eps(s.eps);
  p.set_amax_history_len(s.amax_history_len);
  p.set_amax_algo(s.amax_algo == AmaxAlgo::kMostRecent ? rpc::AMAX_ALGO_MOST_RECENT
                                                       : rpc::AMAX_ALGO_MAX);
  p.set_margin(s.margin);
  p.set_two_d(s.two_d);
  return p;
}

absl::StatusOr<HybridSpec> HybridSpecFromProto(const rpc::HybridSpec& p) {
  HybridSpec s;
  ASSIGN_OR_RETURN(s.rowwise, QuantSpecFromProto(p.rowwise()));
  ASSIGN_OR_RETURN(s.columnwise, QuantSpecFromProto(p.columnwise()));
  switch (p.columnwise_source()) {
    case rpc::COLUMNWISE_SOURCE_ORIGINAL:
      s.columnwise_source = ColumnwiseSource::kOriginal;
      break;
    case rpc::COLUMNWISE_SOURCE_ROWWISE_DEQUANTIZED:
      s.columnwise_source = ColumnwiseSource::kRowwiseDequantized;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown columnwise_source ", p.columnwise_source()));
  }
  switch (p.source_dtype()) {
    case rpc::SOURCE_DTYPE_BF16:
      s.source_dtype = SourceDtype::kBf16;
      break;
    case rpc::SOURCE_DTYPE_FP32:
      s.source_dtype = SourceDtype::kFp32;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown source_dtype ", p.source_dtype()));
  }
  s.rowwise_usage = !p.has_rowwise_usage() || p.rowwise_usage();
  s.columnwise_usage = !p.has_columnwise_usage() || p.columnwise_usage();
  return s;
}

rpc::HybridSpec HybridSpecToProto(const HybridSpec& s) {
  rpc::HybridSpec p;
  *p.mutable_rowwise() = QuantSpecToProto(s.rowwise);
  *p.mutable_columnwise() = QuantSpecToProto(s.columnwise);
  p.set_columnwise_source(s.columnwise_source == ColumnwiseSource::kRowwiseDequantized
                              ? rpc::COLUMNWISE_SOURCE_ROWWISE_DEQUANTIZED
                              : rpc::COLUMNWISE_SOURCE_ORIGINAL);
  p.set_source_dtype(s.source_dtype == SourceDtype::kFp32 ? rpc::SOURCE_DTYPE_FP32
                                                          : rpc::SOURCE_DTYPE_BF16);
  p.set_rowwise_usage(s.rowwise_usage);
  p.set_columnwise_usage(s.columnwise_usage);
  return p;
}

rpc::Layout LayoutToProto(const Layout& l) {
  rpc::Layout p;
  p.set_data_rows(l.data_rows);
  p.set_data_row_bytes(l.data_row_bytes);
  p.set_transposed(l.transposed);
  p.set_scale_rows(l.scale_rows);
  p.set_scale_cols(l.scale_cols);
  p.set_scale_elem_bytes(l.scale_elem_bytes);
  return p;
}

Layout LayoutFromProto(const rpc::Layout& p) {
  Layout l;
  l.data_rows = p.data_rows();
  l.data_row_bytes = p.data_row_bytes();
  l.transposed = p.transposed();
  l.scale_rows = p.scale_rows();
  l.scale_cols = p.scale_cols();
  l.scale_elem_bytes = p.scale_elem_bytes();
  return l;
}

absl::StatusOr<int> DTypeSize(rpc::DType dtype) {
  switch (dtype) {
    case rpc::DTYPE_FP32:
      return 4;
    case rpc::DTYPE_BF16:
      return 2;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dtype must be DTYPE_FP32 or DTYPE_BF16, got ", static_cast<int>(dtype)));
  }
}

absl::Status DecodeValues(rpc::DType dtype, const std::string& bytes, std::vector<float>& out) {
  ASSIGN_OR_RETURN(int size, DTypeSize(dtype));
  if (bytes.size() % size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(bytes.size(), " bytes is not a whole number of ", size, "-byte elements"));
  }
  const size_t n = bytes.size() / size;
  const size_t base = out.size();
  out.resize(base + n);
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  if (size == 4) {
    std::memcpy(out.data() + base, p, n * 4);  // little-endian host (x86-64, aarch64)
  } else {
    for (size_t i = 0; i < n; ++i) {
      out[base + i] = ref::DecodeBf16(static_cast<uint16_t>(p[2 * i] | (p[2 * i + 1] << 8)));
    }
  }
  return absl::OkStatus();
}

}  // namespace paramd
