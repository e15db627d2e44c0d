#include "kernels/cuda/dequantize.h"

#include "absl/strings/str_cat.h"
#include "common/gpu_status.h"
#include "common/status_macros.h"
#include "kernels/cuda/misc_launch.h"
#include "kernels/cuda/quantize_internal.h"

namespace paramd {
namespace gpu {

absl::Status Dequantize(absl::Span<const DequantizeArgs> tensors, cudaStream_t stream) {
  std::vector<detail::DequantItem> items;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const DequantizeArgs& a = tensors[i];
    RETURN_IF_ERROR(internal::CheckShape(a.data, a.rows, a.cols));
    ASSIGN_OR_RETURN(const Layout layout, ComputeLayout(a.spec, a.direction, a.rows, a.cols));
    detail::DequantItem t;
    ASSIGN_OR_RETURN(t.fmt, internal::KernelFormatOf(a.spec.format));
    if (a.out == nullptr || (layout.scale_bytes() > 0 && a.scales == nullptr) ||
        (t.fmt == detail::kKFp8Tensor && a.scale_inv == nullptr) ||
        (t.fmt == detail::kKNvfp4 && a.global_amax == nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dequantize tensor ", i, " (", FormatName(a.spec.format),
          "): needs out, scales where the layout has them, scale_inv (FP8 per-tensor), "
          "global_amax (NVFP4)"));
    }
    t.columnwise = a.direction == Direction::kColumnwise;
    t.e5m2 = a.spec.fp8_type == Fp8Type::kE5M2;
    t.out_bf16 = a.output_type == OutputType::kBf16;
    t.rows = a.rows;
    t.cols = a.cols;
    t.data = a.data;
    t.scales = a.scales;
    t.scale_cols = layout.scale_cols;
    t.scale_inv = a.scale_inv;
    t.global_amax = a.global_amax;
    t.out = a.out;
    items.push_back(t);
  }
  for (const detail::DequantItem& t : items)
    GPU_RETURN_IF_ERROR(detail::LaunchDequantize(t, stream));
  return absl::OkStatus();
}

}  // namespace gpu
}  // namespace paramd
