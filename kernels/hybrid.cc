// §6 hybrid quantization (D1, D2, D16): two independent directions from one
// master, with the columnwise copy read either from the source or from the
// rowwise copy dequantized back to the source dtype.
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/reference.h"

namespace paramd {
namespace ref {
namespace {

// The child specs see the hybrid's source dtype (blockwise inf_value, §5).
QuantSpec WithSource(QuantSpec spec, SourceDtype dtype) {
  spec.source_dtype = dtype;
  return spec;
}

absl::Status CheckShape(absl::Span<const float> master, int64_t rows, int64_t cols) {
  if (rows < 1 || cols < 1 || static_cast<int64_t>(master.size()) != rows * cols) {
    return absl::InvalidArgumentError(
        absl::StrCat("master has ", master.size(), " values for shape [", rows, ", ", cols, "]"));
  }
  return absl::OkStatus();
}

// D2: Dequantize(rowwise) rounded to the source dtype. `rowwise` is the
// published rowwise copy, or null: then a temporary one is quantized here
// and dropped; nothing records its amax (D16).
absl::StatusOr<std::vector<float>> DequantizedRowwise(const std::vector<float>& source,
                                                      int64_t rows, int64_t cols,
                                                      const HybridSpec& spec,
                                                      const TensorScaling& rowwise_scaling,
                                                      const QuantizedTensor* rowwise) {
  const QuantSpec row_spec = WithSource(spec.rowwise, spec.source_dtype);
  QuantizedTensor temporary;
  if (rowwise == nullptr) {
    ASSIGN_OR_RETURN(temporary,
                     Quantize(source, rows, cols, row_spec, Direction::kRowwise, rowwise_scaling));
    rowwise = &temporary;
  }
  ASSIGN_OR_RETURN(std::vector<float> values, Dequantize(*rowwise, row_spec));
  return RoundToSource(values, spec.source_dtype);
}

}  // namespace

absl::StatusOr<HybridResult> QuantizeHybrid(absl::Span<const float> master, int64_t rows,
                                            int64_t cols, const HybridSpec& spec,
                                            const HybridScaling& scaling) {
  RETURN_IF_ERROR(CheckShape(master, rows, cols));
  const std::vector<float> source = RoundToSource(master, spec.source_dtype);
  HybridResult result;
  if (spec.rowwise_usage) {
    ASSIGN_OR_RETURN(result.rowwise,
                     Quantize(source, rows, cols, WithSource(spec.rowwise, spec.source_dtype),
                              Direction::kRowwise, scaling.rowwise));
  }
  if (spec.columnwise_usage) {
    const QuantSpec col_spec = WithSource(spec.columnwise, spec.source_dtype);
    if (spec.columnwise_source == ColumnwiseSource::kOriginal) {
      ASSIGN_OR_RETURN(result.columnwise, Quantize(source, rows, cols, col_spec,
                                                   Direction::kColumnwise, scaling.columnwise));
    } else {
      ASSIGN_OR_RETURN(std::vector<float> col_source,
                       DequantizedRowwise(source, rows, cols, spec, scaling.rowwise,
                                          result.rowwise ? &*result.rowwise : nullptr));
      ASSIGN_OR_RETURN(result.columnwise, Quantize(col_source, rows, cols, col_spec,
                                                   Direction::kColumnwise, scaling.columnwise));
    }
  }
  return result;
}

absl::StatusOr<std::vector<float>> ColumnwiseSourceValues(absl::Span<const float> master,
                                                          int64_t rows, int64_t cols,
                                                          const HybridSpec& spec,
                                                          const TensorScaling& rowwise_scaling) {
  RETURN_IF_ERROR(CheckShape(master, rows, cols));
  std::vector<float> source = RoundToSource(master, spec.source_dtype);
  if (spec.columnwise_source == ColumnwiseSource::kOriginal) return source;
  return DequantizedRowwise(source, rows, cols, spec, rowwise_scaling, nullptr);
}

}  // namespace ref
}  // namespace paramd
