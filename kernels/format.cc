#include "kernels/format.h"

#include <array>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace paramd {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

// The rowwise layout of an [rows][cols] matrix, row by row from FORMATS.md's
// tables (D11: ceil() block counts, then the table's padding).
absl::StatusOr<Layout> RowwiseLayout(const QuantSpec& spec, int64_t rows, int64_t cols) {
  Layout l;
  l.data_rows = rows;
  switch (spec.format) {
    case Format::kIdentityBf16:
      l.data_row_bytes = cols * 2;
      return l;
    case Format::kIdentityFp32:
      l.data_row_bytes = cols * 4;
      return l;
    case Format::kFp8Delayed:
    case Format::kFp8Current:
      // One fp32 scale_inv travels as QuantizedTensor::scale_inv, not as a buffer.
      l.data_row_bytes = cols;
      return l;
    case Format::kMxfp8:  // §3: [roundup(M,128)][roundup(K/32,4)] E8M0
      l.data_row_bytes = cols;
      l.scale_rows = RoundUp(rows, 128);
      l.scale_cols = RoundUp(CeilDiv(cols, 32), 4);
      l.scale_elem_bytes = 1;
      return l;
    case Format::kNvfp4:  // §4: [M][K/2] packed, [roundup(M,128)][roundup(K/16,4)] UE4M3
      l.data_row_bytes = CeilDiv(cols, 2);
      l.scale_rows = RoundUp(rows, 128);
      l.scale_cols = RoundUp(CeilDiv(cols, 16), 4);
      l.scale_elem_bytes = 1;
      return l;
    case Format::kFp8Block128x128:  // §5: [ceil(M/128)][roundup(ceil(K/128),4)] fp32
      l.data_row_bytes = cols;
      l.scale_rows = CeilDiv(rows, 128);
      l.scale_cols = RoundUp(CeilDiv(cols, 128), 4);
      l.scale_elem_bytes = 4;
      return l;
    case Format::kFp8Block1x128:  // §5: [ceil(K/128)][roundup(M,4)] fp32, transposed order
      l.data_row_bytes = cols;
      l.scale_rows = CeilDiv(cols, 128);
      l.scale_cols = RoundUp(rows, 4);
      l.scale_elem_bytes = 4;
      return l;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown format ", static_cast<int>(spec.format)));
}

constexpr std::array<std::pair<Format, absl::string_view>, 8> kFormatNames = {{
    {Format::kIdentityBf16, "identity_bf16"},
    {Format::kIdentityFp32, "identity_fp32"},
    {Format::kFp8Delayed, "fp8_delayed"},
    {Format::kFp8Current, "fp8_current"},
    {Format::kMxfp8, "mxfp8"},
    {Format::kNvfp4, "nvfp4"},
    {Format::kFp8Block128x128, "fp8_block128x128"},
    {Format::kFp8Block1x128, "fp8_block1x128"},
}};

}  // namespace

QuantSpec DefaultQuantSpec(Format format) {
  QuantSpec spec;  // E4M3, L = 1024, algo max, margin 0, eps 0, BF16 source
  spec.format = format;
  switch (format) {
    case Format::kNvfp4:
      spec.two_d = true;  // D10: weights use 16x16 tiles
      break;
    case Format::kFp8Block128x128:
    case Format::kFp8Block1x128:
      spec.pow2_scales = true;  // D10 / §5
      break;
    default:
      break;
  }
  return spec;
}

absl::StatusOr<Layout> ComputeLayout(const QuantSpec& spec, Direction direction, int64_t rows,
                                     int64_t cols) {
  // The element bound keeps every byte count (at most 4 per element plus
  // small paddings) far from int64 overflow.
  constexpr int64_t kMaxElements = int64_t{1} << 48;
  if (rows < 1 || cols < 1 || rows > kMaxElements / cols) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad shape [", rows, ", ", cols, "]: need M, K >= 1 and M*K <= 2^48"));
  }
  if (direction == Direction::kRowwise) return RowwiseLayout(spec, rows, cols);
  if (direction != Direction::kColumnwise) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown direction ", static_cast<int>(direction)));
  }
  switch (spec.format) {
    case Format::kIdentityBf16:
    case Format::kIdentityFp32:
      // §6: identity keeps the [M][K] orientation in both directions.
      return RowwiseLayout(spec, rows, cols);
    case Format::kMxfp8: {
      // §3: data stays [M][K]; scales [roundup(M/32,4)][roundup(K,128)]. That
      // is the rowwise layout of W^T with both buffers transposed back.
      ASSIGN_OR_RETURN(Layout l, RowwiseLayout(spec, cols, rows));
      std::swap(l.scale_rows, l.scale_cols);
      l.data_rows = rows;
      l.data_row_bytes = cols;
      return l;
    }
    default: {
      // Per-tensor FP8, NVFP4 and blockwise FP8 publish the columnwise copy
      // as the rowwise layout of W^T ([K][M], §1/§4/§5 tables).
      ASSIGN_OR_RETURN(Layout l, RowwiseLayout(spec, cols, rows));
      l.transposed = true;
      return l;
    }
  }
}

absl::string_view FormatName(Format format) {
  for (const auto& [f, name] : kFormatNames) {
    if (f == format) return name;
  }
  return "unknown";
}

absl::StatusOr<Format> ParseFormatName(absl::string_view name) {
  for (const auto& [f, n] : kFormatNames) {
    if (n == name) return f;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown format name '", name, "'"));
}

absl::string_view DirectionName(Direction direction) {
  switch (direction) {
    case Direction::kRowwise:
      return "rowwise";
    case Direction::kColumnwise:
      return "columnwise";
  }
  return "unknown";
}

bool NeedsGlobalAmax(Format format) {
  // Per-tensor FP8 shares one scale and NVFP4 one global A across all pieces
  // of a tensor; every other format's scales are local to a block.
  return format == Format::kFp8Delayed || format == Format::kFp8Current || format == Format::kNvfp4;
}

}  // namespace paramd
