// Host side of quantize.h: validation, descriptors, batching.
#include "kernels/cuda/quantize.h"

#include <cfloat>
#include <cstdint>
#include <cstring>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/gpu_status.h"
#include "common/status_macros.h"
#include "kernels/cuda/device_tuning.h"
#include "kernels/cuda/quantize_internal.h"
#include "kernels/cuda/quantize_launch.h"

namespace paramd {
namespace gpu {
namespace {

using detail::DirDesc;
using detail::QuantizeBatch;
using detail::TensorDesc;

bool Aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; }

absl::Status FillDirection(const QuantizeTensorArgs& a, Direction dir, bool write, DirDesc& d) {
  const HybridSpec& h = a.spec;
  const QuantSpec& spec = dir == Direction::kRowwise ? h.rowwise : h.columnwise;
  const DirectionScaling& sc =
      dir == Direction::kRowwise ? a.rowwise_scaling : a.columnwise_scaling;
  const DirectionBuffers& b = dir == Direction::kRowwise ? a.rowwise : a.columnwise;
  ASSIGN_OR_RETURN(d.fmt, internal::KernelFormatOf(spec.format));
  ASSIGN_OR_RETURN(const Layout layout, ComputeLayout(spec, dir, a.rows, a.cols));
  const char* name = dir == Direction::kRowwise ? "rowwise" : "columnwise";
  d.e5m2 = spec.fp8_type == Fp8Type::kE5M2;
  d.pow2 = spec.pow2_scales;
  d.two_d = spec.two_d;
  d.eps = spec.eps;
  // §5: inf_value is the largest finite value of the source dtype.
  uint32_t bf16_max = 0x7F7F0000u;
  float bf16_max_f;
  std::memcpy(&bf16_max_f, &bf16_max, 4);
  d.inf_value = h.source_dtype == SourceDtype::kFp32 ? FLT_MAX : bf16_max_f;
  d.write = write;
  if (d.fmt == detail::kKFp8Tensor && sc.scale == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": per-tensor FP8 needs a device scale"));
  }
  if (d.fmt == detail::kKNvfp4 && sc.global_amax == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": NVFP4 needs a device global amax"));
  }
  d.scale = sc.scale;
  d.global_amax = sc.global_amax;
  d.scale_rows = layout.scale_rows;
  d.scale_cols = layout.scale_cols;
  if (!write) return absl::OkStatus();
  if (b.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": data buffer is null"));
  }
  if (layout.scale_bytes() > 0 && b.scales == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": ", FormatName(spec.format), " needs a scale buffer"));
  }
  // Natural alignment of the element types (BF16 / FP32 data, FP32 scales).
  const uintptr_t data_align = spec.format == Format::kIdentityBf16   ? 2
                               : spec.format == Format::kIdentityFp32 ? 4
                                                                      : 1;
  const uintptr_t scale_align = layout.scale_elem_bytes == 4 ? 4 : 1;
  if (!Aligned(b.data, data_align) || (b.scales != nullptr && !Aligned(b.scales, scale_align))) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": buffers must be aligned to their element size"));
  }
  d.data = b.data;
  d.scales = b.scales;
  d.scale_inv = b.scale_inv;
  d.amax = b.amax;
  // Vector stores: 16 along the stored dimension (K for [M][K] layouts, M for
  // transposed ones), 16-byte aligned buffers.
  const int64_t along = layout.transposed ? a.rows : a.cols;
  d.vec = along % 16 == 0 && Aligned(b.data, 16) && (b.scales == nullptr || Aligned(b.scales, 16));
  return absl::OkStatus();
}

}  // namespace

namespace internal {

absl::StatusOr<uint8_t> KernelFormatOf(Format f) {
  switch (f) {
    case Format::kIdentityBf16:
      return detail::kKBf16;
    case Format::kIdentityFp32:
      return detail::kKFp32;
    case Format::kFp8Delayed:
    case Format::kFp8Current:
      return detail::kKFp8Tensor;
    case Format::kMxfp8:
      return detail::kKMxfp8;
    case Format::kNvfp4:
      return detail::kKNvfp4;
    case Format::kFp8Block128x128:
      return detail::kKBlock2d;
    case Format::kFp8Block1x128:
      return detail::kKBlock1d;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown format ", static_cast<int>(f)));
}

absl::Status CheckShape(const void* source, int64_t rows, int64_t cols) {
  if (rows < 1 || cols < 1 || rows > (int64_t{1} << 31) || cols > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad shape [", rows, ", ", cols, "]: need 1 <= M, K <= 2^31"));
  }
  if (source == nullptr) return absl::InvalidArgumentError("source is null");
  return absl::OkStatus();
}

absl::StatusOr<detail::TensorDesc> MakeTensorDesc(const QuantizeTensorArgs& a, Mode mode) {
  RETURN_IF_ERROR(CheckShape(a.source, a.rows, a.cols));
  const HybridSpec& h = a.spec;
  TensorDesc t;
  t.src = a.source;
  t.rows = a.rows;
  t.cols = a.cols;
  t.src_bf16 = a.input_type == InputType::kBf16;
  if (!Aligned(a.source, t.src_bf16 ? 2 : 4)) {
    return absl::InvalidArgumentError("source must be aligned to its element size");
  }
  t.source_bf16 = h.source_dtype == SourceDtype::kBf16;
  t.round_bf16 = t.source_bf16 && !t.src_bf16;
  const int64_t vec_elems = t.src_bf16 ? 8 : 4;
  t.src_vec = a.cols % vec_elems == 0 && Aligned(a.source, 16);
  t.tiles_k = detail::CeilDivI(a.cols, detail::kTile);
  const bool deq = h.columnwise_source == ColumnwiseSource::kRowwiseDequantized;
  if (mode == Mode::kQuantize) {
    if (!h.rowwise_usage && !h.columnwise_usage) {
      return absl::InvalidArgumentError("neither rowwise nor columnwise usage is set");
    }
    t.col_from_row = h.columnwise_usage && deq;
    const bool need_row = h.rowwise_usage || t.col_from_row;
    if (need_row) RETURN_IF_ERROR(FillDirection(a, Direction::kRowwise, h.rowwise_usage, t.row));
    if (h.columnwise_usage) {
      RETURN_IF_ERROR(FillDirection(a, Direction::kColumnwise, true, t.col));
    }
  } else {  // kColumnwiseAmax: col.fmt stays kKNone, col.amax set by the caller
    t.col_from_row = deq;
    if (deq) RETURN_IF_ERROR(FillDirection(a, Direction::kRowwise, false, t.row));
  }
  return t;
}

absl::Status LaunchTensorDescs(absl::Span<const detail::TensorDesc> descs,
                               const detail::AdamHyper* adam, int variant, cudaStream_t stream,
                               const float* grad_scale) {
  if (variant == detail::kVariantDefault && adam != nullptr) {
    int device = 0;
    GPU_RETURN_IF_ERROR(cudaGetDevice(&device));
    variant = OnePassTuningFor(device).l2_prefetch ? detail::kVariantOnePassPrefetch1
                                                   : detail::kVariantOnePassPrefetch0;
  }
  auto batch = std::make_unique<QuantizeBatch>();
  batch->grad_scale = grad_scale;
  size_t i = 0;
  while (i < descs.size()) {
    batch->num = 0;
    batch->total_tiles = 0;
    if (adam != nullptr) batch->adam = *adam;
    for (; i < descs.size() && batch->num < detail::kMaxTensorsPerLaunch; ++i) {
      TensorDesc& t = batch->t[batch->num++];
      t = descs[i];
      t.tile_begin = batch->total_tiles;
      batch->total_tiles += detail::CeilDivI(t.rows, detail::kTile) * t.tiles_k;
    }
    GPU_RETURN_IF_ERROR(detail::LaunchQuantizeTiles(*batch, variant, stream));
  }
  return absl::OkStatus();
}

}  // namespace internal

absl::Status QuantizeHybrid(absl::Span<const QuantizeTensorArgs> tensors, cudaStream_t stream,
                            const QuantizeOptions& options) {
  std::vector<TensorDesc> descs;
  descs.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto d = internal::MakeTensorDesc(tensors[i], internal::Mode::kQuantize);
    if (!d.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", i, ": ", d.status().message()));
    }
    descs.push_back(*d);
  }
  return internal::LaunchTensorDescs(descs, nullptr, options.variant, stream);
}

absl::Status ColumnwiseSourceAmax(absl::Span<const QuantizeTensorArgs> tensors,
                                  absl::Span<float* const> amax_out, cudaStream_t stream) {
  if (amax_out.size() != tensors.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(tensors.size(), " tensors but ", amax_out.size(), " amax outputs"));
  }
  std::vector<TensorDesc> descs;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (amax_out[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", i, ": amax output is null"));
    }
    auto d = internal::MakeTensorDesc(tensors[i], internal::Mode::kColumnwiseAmax);
    if (!d.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", i, ": ", d.status().message()));
    }
    d->col.amax = amax_out[i];
    descs.push_back(*d);
  }
  return internal::LaunchTensorDescs(descs, nullptr, 0, stream);
}

}  // namespace gpu
}  // namespace paramd
