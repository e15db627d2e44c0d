// Quantize / Dequantize: argument checks, dispatch on format and direction,
// and the one place where a columnwise copy is derived from a rowwise
// quantizer:
//   * per-tensor FP8, NVFP4, blockwise FP8: the columnwise copy IS the
//     rowwise copy of W^T (data [K][...], scales per the §1/§4/§5 tables);
//   * identity: the same bytes in both directions ([M][K], §6);
//   * MXFP8: columnwise data stays [M][K] (§3); mxfp8.cc quantizes 32x1
//     blocks in place.
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/reference.h"
#include "kernels/reference_internal.h"

namespace paramd {
namespace ref {
namespace {

using internal::EncodedView;
using internal::SourceMatrix;

struct FormatImpl {
  void (*quantize)(const SourceMatrix&, const QuantSpec&, const TensorScaling&, QuantizedTensor&);
  void (*dequantize)(const EncodedView&, const QuantSpec&, internal::MatrixRowsOut&);
};

absl::StatusOr<FormatImpl> ImplFor(Format format, Direction direction) {
  switch (format) {
    case Format::kIdentityBf16:
    case Format::kIdentityFp32:
      return FormatImpl{internal::QuantizeIdentityRowwise, internal::DequantizeIdentityRowwise};
    case Format::kFp8Delayed:
    case Format::kFp8Current:
      return FormatImpl{internal::QuantizePerTensorRowwise, internal::DequantizePerTensorRowwise};
    case Format::kMxfp8:
      if (direction == Direction::kColumnwise) {
        return FormatImpl{internal::QuantizeMxfp8Columnwise, internal::DequantizeMxfp8Columnwise};
      }
      return FormatImpl{internal::QuantizeMxfp8Rowwise, internal::DequantizeMxfp8Rowwise};
    case Format::kNvfp4:
      return FormatImpl{internal::QuantizeNvfp4Rowwise, internal::DequantizeNvfp4Rowwise};
    case Format::kFp8Block128x128:
    case Format::kFp8Block1x128:
      return FormatImpl{internal::QuantizeBlockwiseRowwise, internal::DequantizeBlockwiseRowwise};
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown format ", static_cast<int>(format)));
}

// Whether `direction` of `format` is the rowwise copy of W^T.
bool FromTranspose(Format format, Direction direction) {
  return direction == Direction::kColumnwise && format != Format::kIdentityBf16 &&
         format != Format::kIdentityFp32 && format != Format::kMxfp8;
}

}  // namespace

absl::StatusOr<QuantizedTensor> Quantize(absl::Span<const float> source, int64_t rows, int64_t cols,
                                         const QuantSpec& spec, Direction direction,
                                         const TensorScaling& scaling) {
  ASSIGN_OR_RETURN(const Layout layout, ComputeLayout(spec, direction, rows, cols));
  ASSIGN_OR_RETURN(const FormatImpl impl, ImplFor(spec.format, direction));
  if (static_cast<int64_t>(source.size()) != rows * cols) {
    return absl::InvalidArgumentError(absl::StrCat("source has ", source.size(), " values, shape [",
                                                   rows, ", ", cols, "] needs ", rows * cols));
  }
  QuantizedTensor q;
  q.format = spec.format;
  q.direction = direction;
  q.rows = rows;
  q.cols = cols;
  q.data.assign(layout.data_bytes(), 0);  // D8: padding is 0
  q.scales.assign(layout.scale_bytes(), 0);
  // For a copy made from W^T, `layout` is also the rowwise layout of W^T.
  const internal::MatrixRows values(source.data(), rows, cols,
                                    FromTranspose(spec.format, direction));
  impl.quantize({values, values.rows(), values.cols(), layout}, spec, scaling, q);
  return q;
}

absl::StatusOr<std::vector<float>> Dequantize(const QuantizedTensor& q, const QuantSpec& spec) {
  if (q.format != spec.format) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor is ", FormatName(q.format), ", spec is ", FormatName(spec.format)));
  }
  ASSIGN_OR_RETURN(const Layout layout, ComputeLayout(spec, q.direction, q.rows, q.cols));
  ASSIGN_OR_RETURN(const FormatImpl impl, ImplFor(spec.format, q.direction));
  if (static_cast<int64_t>(q.data.size()) != layout.data_bytes() ||
      static_cast<int64_t>(q.scales.size()) != layout.scale_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat(FormatName(q.format), " ", DirectionName(q.direction), " [", q.rows, ", ",
                     q.cols, "] needs ", layout.data_bytes(), " data and ", layout.scale_bytes(),
                     " scale bytes, got ", q.data.size(), " and ", q.scales.size()));
  }
  std::vector<float> out(q.rows * q.cols);
  internal::MatrixRowsOut rows_out(out.data(), q.rows, q.cols,
                                   FromTranspose(spec.format, q.direction));
  EncodedView v;
  v.rows = rows_out.rows();
  v.cols = rows_out.cols();
  v.layout = layout;
  v.data = q.data.data();
  v.scales = q.scales.data();
  v.scale_inv = q.scale_inv;
  v.amax = q.amax;
  impl.dequantize(v, spec, rows_out);
  rows_out.Finish();
  return out;
}

}  // namespace ref
}  // namespace paramd
