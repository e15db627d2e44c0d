// Quantize / Dequantize: argument checks, dispatch on the format, and the
// one place where a columnwise copy is derived from a rowwise quantizer:
//   * identity: same bytes in both directions ([M][K], §6);
//   * per-tensor FP8, NVFP4, blockwise FP8: the columnwise copy IS the
//     rowwise copy of W^T (data [K][...], scales per the §1/§4/§5 tables);
//   * MXFP8: the rowwise copy of W^T with data and scales transposed back,
//     because §3 keeps the columnwise data in [M][K] order.
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
using internal::Transpose;

struct FormatImpl {
  void (*quantize)(const SourceMatrix&, const QuantSpec&, const TensorScaling&,
                   QuantizedTensor&);
  void (*dequantize)(const EncodedView&, const QuantSpec&, internal::MatrixRowsOut&);
};

absl::StatusOr<FormatImpl> ImplFor(Format format) {
  switch (format) {
    case Format::kIdentityBf16:
    case Format::kIdentityFp32:
      return FormatImpl{internal::QuantizeIdentityRowwise, internal::DequantizeIdentityRowwise};
    case Format::kFp8Delayed:
    case Format::kFp8Current:
      return FormatImpl{internal::QuantizePerTensorRowwise,
                        internal::DequantizePerTensorRowwise};
    case Format::kMxfp8:
      return FormatImpl{internal::QuantizeMxfp8Rowwise, internal::DequantizeMxfp8Rowwise};
    case Format::kNvfp4:
      return FormatImpl{internal::QuantizeNvfp4Rowwise, internal::DequantizeNvfp4Rowwise};
    case Format::kFp8Block128x128:
    case Format::kFp8Block1x128:
      return FormatImpl{internal::QuantizeBlockwiseRowwise,
                        internal::DequantizeBlockwiseRowwise};
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown format ", static_cast<int>(format)));
}

// Whether `direction` of `format` is computed from W^T rather than W.
bool FromTranspose(Format format, Direction direction) {
  return direction == Direction::kColumnwise && format != Format::kIdentityBf16 &&
         format != Format::kIdentityFp32;
}

std::vector<uint8_t> TransposedBytes(const std::vector<uint8_t>& in, int64_t rows,
                                     int64_t cols) {
  std::vector<uint8_t> out(in.size());
  Transpose(in.data(), rows, cols, out.data());
  return out;
}

}  // namespace

absl::StatusOr<QuantizedTensor> Quantize(absl::Span<const float> source, int64_t rows,
                                         int64_t cols, const QuantSpec& spec,
                                         Direction direction, const TensorScaling& scaling) {
  ASSIGN_OR_RETURN(const Layout layout, ComputeLayout(spec, direction, rows, cols));
  ASSIGN_OR_RETURN(const FormatImpl impl, ImplFor(spec.format));
  if (static_cast<int64_t>(source.size()) != rows * cols) {
    return absl::InvalidArgumentError(absl::StrCat(
        "source has ", source.size(), " values, shape [", rows, ", ", cols, "] needs ",
        rows * cols));
  }
  QuantizedTensor q;
  q.format = spec.format;
  q.direction = direction;
  q.rows = rows;
  q.cols = cols;
  q.data.assign(layout.data_bytes(), 0);  // D8: padding is 0
  q.scales.assign(layout.scale_bytes(), 0);
  const bool transposed = FromTranspose(spec.format, direction);
  const internal::MatrixRows values(source.data(), rows, cols, transposed);
  if (!transposed) {
    impl.quantize({values, rows, cols, layout}, spec, scaling, q);
    return q;
  }
  ASSIGN_OR_RETURN(const Layout t_layout, ComputeLayout(spec, Direction::kRowwise, cols, rows));
  impl.quantize({values, cols, rows, t_layout}, spec, scaling, q);
  if (spec.format == Format::kMxfp8) {
    // The buffers are the same sizes transposed: [K][M] data and
    // [roundup(K,128)][roundup(M/32,4)] scales (zero padding moves along).
    q.data = TransposedBytes(q.data, cols, rows);
    q.scales = TransposedBytes(q.scales, t_layout.scale_rows, t_layout.scale_cols);
  }
  return q;
}

absl::StatusOr<std::vector<float>> Dequantize(const QuantizedTensor& q, const QuantSpec& spec) {
  if (q.format != spec.format) {
    return absl::InvalidArgumentError(absl::StrCat("tensor is ", FormatName(q.format),
                                                   ", spec is ", FormatName(spec.format)));
  }
  ASSIGN_OR_RETURN(const Layout layout, ComputeLayout(spec, q.direction, q.rows, q.cols));
  ASSIGN_OR_RETURN(const FormatImpl impl, ImplFor(spec.format));
  if (static_cast<int64_t>(q.data.size()) != layout.data_bytes() ||
      static_cast<int64_t>(q.scales.size()) != layout.scale_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        FormatName(q.format), " ", DirectionName(q.direction), " [", q.rows, ", ", q.cols,
        "] needs ", layout.data_bytes(), " data and ", layout.scale_bytes(),
        " scale bytes, got ", q.data.size(), " and ", q.scales.size()));
  }
  std::vector<float> out(q.rows * q.cols);
  const bool transposed = FromTranspose(spec.format, q.direction);
  internal::MatrixRowsOut rows_out(out.data(), q.rows, q.cols, transposed);
  EncodedView v;
  v.rows = rows_out.rows();
  v.cols = rows_out.cols();
  v.data = q.data.data();
  v.scales = q.scales.data();
  v.scale_inv = q.scale_inv;
  v.amax = q.amax;
  v.layout = layout;
  std::vector<uint8_t> data_t, scales_t;
  if (transposed) {
    // Dequantize the rowwise form of W^T; MXFP8 first transposes its
    // buffers into that form.
    ASSIGN_OR_RETURN(v.layout, ComputeLayout(spec, Direction::kRowwise, v.rows, v.cols));
    if (spec.format == Format::kMxfp8) {
      data_t = TransposedBytes(q.data, q.rows, q.cols);
      scales_t = TransposedBytes(q.scales, layout.scale_rows, layout.scale_cols);
      v.data = data_t.data();
      v.scales = scales_t.data();
    }
  }
  impl.dequantize(v, spec, rows_out);
  rows_out.Finish();
  return out;
}

}  // namespace ref
}  // namespace paramd
