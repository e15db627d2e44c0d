#include "kernels/cuda/amax.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/gpu_status.h"
#include "kernels/cuda/misc_launch.h"

namespace paramd {
namespace gpu {

absl::Status ComputeAmax(absl::Span<const AmaxArgs> tensors, cudaStream_t stream, bool zero_first) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const AmaxArgs& a = tensors[i];
    if (a.count < 0 || (a.count > 0 && a.source == nullptr) || a.amax == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("amax tensor ", i, ": need count >= 0, a source and an output"));
    }
  }
  if (zero_first) {
    for (const AmaxArgs& a : tensors)
      GPU_RETURN_IF_ERROR(cudaMemsetAsync(a.amax, 0, sizeof(float), stream));
  }
  auto batch = std::make_unique<detail::AmaxBatch>();
  size_t i = 0;
  while (i < tensors.size()) {
    batch->num = 0;
    batch->total_chunks = 0;
    for (; i < tensors.size() && batch->num < detail::kMaxAmaxItems; ++i) {
      const AmaxArgs& a = tensors[i];
      if (a.count == 0) continue;
      detail::AmaxItem& t = batch->t[batch->num++];
      t.src = a.source;
      t.count = a.count;
      t.out = a.amax;
      t.src_bf16 = a.input_type == InputType::kBf16;
      t.round_bf16 = !t.src_bf16 && a.source_dtype == SourceDtype::kBf16;
      t.vec = (reinterpret_cast<uintptr_t>(a.source) & 15) == 0;
      t.chunk_begin = batch->total_chunks;
      batch->total_chunks += (a.count + detail::kAmaxChunk - 1) / detail::kAmaxChunk;
    }
    GPU_RETURN_IF_ERROR(detail::LaunchAmax(*batch, stream));
  }
  return absl::OkStatus();
}

namespace {

int Log2Of(int v) {
  int l = 0;
  while ((1 << l) < v) ++l;
  return l;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool ValidBlockDim(int v) { return v == 1 || v == 16 || v == 32 || v == 128; }

}  // namespace

AmaxBlockShape AmaxBlockShapeOf(const QuantSpec& spec, Direction direction) {
  const bool row = direction == Direction::kRowwise;
  switch (spec.format) {
    case Format::kMxfp8:
      if (spec.two_d) return {32, 32};
      return row ? AmaxBlockShape{1, 32} : AmaxBlockShape{32, 1};
    case Format::kNvfp4:
      if (spec.two_d) return {16, 16};
      return row ? AmaxBlockShape{1, 16} : AmaxBlockShape{16, 1};
    case Format::kFp8Block128x128:
      return {128, 128};
    case Format::kFp8Block1x128:
      return row ? AmaxBlockShape{1, 128} : AmaxBlockShape{128, 1};
    default:
      return {};
  }
}

int64_t NumBlockAmaxes(int64_t rows, int64_t cols, AmaxBlockShape shape) {
  if (shape.per_tensor()) return 1;
  return CeilDiv(rows, shape.block_rows) * CeilDiv(cols, shape.block_cols);
}

int64_t PackBlockAmaxOffsets(absl::Span<BlockAmaxArgs> tensors) {
  int64_t next = 0;
  for (BlockAmaxArgs& a : tensors) {
    a.offset = next;
    next += NumBlockAmaxes(a.rows, a.cols, a.blocks);
  }
  return next;
}

absl::Status ComputeBlockAmax(absl::Span<const BlockAmaxArgs> tensors, float* out, int64_t out_size,
                              cudaStream_t stream) {
  if (out == nullptr && !tensors.empty())
    return absl::InvalidArgumentError("block amax: out is null");
  std::vector<std::pair<int64_t, int64_t>> ranges;  // [begin, end) in out
  ranges.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const BlockAmaxArgs& a = tensors[i];
    const AmaxBlockShape b = a.blocks;
    if (a.rows < 1 || a.cols < 1 || a.rows > (int64_t{1} << 31) || a.cols > (int64_t{1} << 31) ||
        a.source == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("block amax tensor ", i, ": need 1 <= rows, cols <= 2^31 and a source"));
    }
    if (!b.per_tensor() && (!ValidBlockDim(b.block_rows) || !ValidBlockDim(b.block_cols) ||
                            (b.block_rows == 1 && b.block_cols == 1))) {
      return absl::InvalidArgumentError(absl::StrCat("block amax tensor ", i, ": bad block shape ",
                                                     b.block_rows, "x", b.block_cols));
    }
    const uintptr_t align = a.input_type == InputType::kBf16 ? 2 : 4;
    if ((reinterpret_cast<uintptr_t>(a.source) & (align - 1)) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("block amax tensor ", i, ": source not aligned to its element size"));
    }
    const int64_t n = NumBlockAmaxes(a.rows, a.cols, b);
    if (a.offset < 0 || a.offset > out_size - n) {
      return absl::InvalidArgumentError(absl::StrCat("block amax tensor ", i, ": blocks [",
                                                     a.offset, ", ", a.offset + n,
                                                     ") outside out (", out_size, " floats)"));
    }
    ranges.emplace_back(a.offset, a.offset + n);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      return absl::InvalidArgumentError("block amax: output ranges of two tensors overlap");
    }
  }
  auto batch = std::make_unique<detail::BlockAmaxBatch>();
  size_t i = 0;
  while (i < tensors.size()) {
    batch->num = 0;
    batch->total_tiles = 0;
    for (; i < tensors.size() && batch->num < detail::kMaxBlockAmaxItems; ++i) {
      const BlockAmaxArgs& a = tensors[i];
      detail::BlockAmaxItem& t = batch->t[batch->num++];
      t.src = a.source;
      t.rows = a.rows;
      t.cols = a.cols;
      t.out = out + a.offset;
      t.src_bf16 = a.input_type == InputType::kBf16;
      t.round_bf16 = !t.src_bf16 && a.source_dtype == SourceDtype::kBf16;
      const uintptr_t vec_align = t.src_bf16 ? 8 : 16;
      t.vec = a.cols % 4 == 0 && (reinterpret_cast<uintptr_t>(a.source) & (vec_align - 1)) == 0;
      t.per_tensor = a.blocks.per_tensor();
      t.bm_log2 = static_cast<uint8_t>(t.per_tensor ? 7 : Log2Of(a.blocks.block_rows));
      t.bk_log2 = static_cast<uint8_t>(t.per_tensor ? 7 : Log2Of(a.blocks.block_cols));
      t.grid_cols = t.per_tensor ? 1 : CeilDiv(a.cols, a.blocks.block_cols);
      t.tiles_k = CeilDiv(a.cols, 128);
      t.tile_begin = batch->total_tiles;
      batch->total_tiles += CeilDiv(a.rows, 128) * t.tiles_k;
    }
    GPU_RETURN_IF_ERROR(detail::LaunchBlockAmax(*batch, stream));
  }
  return absl::OkStatus();
}

}  // namespace gpu
}  // namespace paramd
