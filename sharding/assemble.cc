#include "sharding/assemble.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace paramd {
namespace sharding {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Which axis of a scale buffer runs along M, and how many rows of W one
// entry along it covers. Derived from FORMATS.md's layout tables.
struct ScaleAxis {
  enum Kind { kNone, kRows, kCols } kind = kNone;
  int64_t granularity = 1;
};

ScaleAxis ScaleAxisOf(Format format, Direction direction) {
  const bool row = direction == Direction::kRowwise;
  switch (format) {
    case Format::kMxfp8:  // [roundup(M,128)][..] / [roundup(M/32,4)][..]
      return {ScaleAxis::kRows, row ? 1 : 32};
    case Format::kNvfp4:  // [roundup(M,128)][..] / [roundup(K,128)][roundup(M/16,4)]
      return row ? ScaleAxis{ScaleAxis::kRows, 1} : ScaleAxis{ScaleAxis::kCols, 16};
    case Format::kFp8Block128x128:  // [ceil(M/128)][..] / [ceil(K/128)][roundup(M/128,4)]
      return {row ? ScaleAxis::kRows : ScaleAxis::kCols, 128};
    case Format::kFp8Block1x128:  // [ceil(K/128)][roundup(M,4)] / [ceil(M/128)][..]
      return row ? ScaleAxis{ScaleAxis::kCols, 1} : ScaleAxis{ScaleAxis::kRows, 128};
    default:
      return {};
  }
}

// Bytes that `rows` elements of W take along M in one row of a transposed
// data buffer (FP4 packs two per byte).
absl::StatusOr<int64_t> TransposedRowBytes(const QuantSpec& spec, Direction direction, int64_t rows,
                                           int64_t cols) {
  if (rows == 0) return 0;
  ASSIGN_OR_RETURN(Layout l, ComputeLayout(spec, direction, rows, cols));
  return l.data_row_bytes;
}

absl::Status CheckSize(absl::string_view what, size_t got, int64_t want) {
  if (static_cast<int64_t>(got) != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has ", got, " bytes, layout needs ", want));
  }
  return absl::OkStatus();
}

// Copies between a piece buffer and a full buffer; `into_full` picks the
// direction. Sizes are checked by the callers.
void Run(const Copy2D& c, const uint8_t* src, uint8_t* dst, bool into_full) {
  for (int64_t h = 0; h < c.height; ++h) {
    const int64_t p = c.piece_offset + h * c.piece_pitch;
    const int64_t f = c.full_offset + h * c.full_pitch;
    if (into_full) {
      std::memcpy(dst + f, src + p, c.width);
    } else {
      std::memcpy(dst + p, src + f, c.width);
    }
  }
}

absl::Status CheckBuffers(const PiecePlacement& pl, size_t piece_data, size_t piece_scales,
                          size_t full_data, size_t full_scales) {
  RETURN_IF_ERROR(CheckSize("piece data", piece_data, pl.piece.data_bytes()));
  RETURN_IF_ERROR(CheckSize("piece scales", piece_scales, pl.piece.scale_bytes()));
  RETURN_IF_ERROR(CheckSize("full data", full_data, pl.full.data_bytes()));
  return CheckSize("full scales", full_scales, pl.full.scale_bytes());
}

bool SameBits(float a, float b) {
  return absl::bit_cast<uint32_t>(a) == absl::bit_cast<uint32_t>(b);
}

}  // namespace

int64_t RequiredRowAlignment(const QuantSpec& spec, Direction direction) {
  const bool row = direction == Direction::kRowwise;
  switch (spec.format) {
    case Format::kMxfp8:
      return row && !spec.two_d ? 1 : 32;
    case Format::kNvfp4:
      return row && !spec.two_d ? 1 : 16;
    case Format::kFp8Block128x128:
      return 128;
    case Format::kFp8Block1x128:
      return row ? 1 : 128;
    default:
      return 1;
  }
}

absl::StatusOr<PiecePlacement> PlacePiece(const QuantSpec& spec, Direction direction, int64_t rows,
                                          int64_t cols, int64_t row_begin, int64_t row_end) {
  if (row_begin < 0 || row_end <= row_begin || row_end > rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows [", row_begin, ", ", row_end, ") are not a piece of ", rows, " rows"));
  }
  const int64_t align = RequiredRowAlignment(spec, direction);
  if (row_begin % align != 0 || (row_end % align != 0 && row_end != rows)) {
    return absl::InvalidArgumentError(
        absl::StrCat("piece rows [", row_begin, ", ", row_end, "): ", FormatName(spec.format), " ",
                     DirectionName(direction), " pieces must start and end at multiples of ", align,
                     " (or at the last row)"));
  }
  const int64_t m = row_end - row_begin;
  PiecePlacement pl;
  ASSIGN_OR_RETURN(pl.full, ComputeLayout(spec, direction, rows, cols));
  ASSIGN_OR_RETURN(pl.piece, ComputeLayout(spec, direction, m, cols));

  if (pl.full.transposed) {
    // [K][M-ish]: each of the K rows gets the piece's run at the piece's offset.
    ASSIGN_OR_RETURN(int64_t offset, TransposedRowBytes(spec, direction, row_begin, cols));
    pl.data = Copy2D{0,
                     pl.piece.data_row_bytes,
                     offset,
                     pl.full.data_row_bytes,
                     pl.piece.data_row_bytes,
                     pl.full.data_rows};
  } else {
    pl.data = Copy2D{0, 0, row_begin * pl.full.data_row_bytes, 0, pl.piece.data_bytes(), 1};
  }

  const ScaleAxis axis = ScaleAxisOf(spec.format, direction);
  const int64_t eb = pl.full.scale_elem_bytes;
  const int64_t valid = CeilDiv(m, axis.granularity);
  const int64_t first = row_begin / axis.granularity;
  if (axis.kind == ScaleAxis::kRows && pl.full.scale_bytes() > 0) {
    // Whole scale rows; the other extent depends on K only.
    const int64_t row_bytes = pl.full.scale_cols * eb;
    pl.scales = Copy2D{0, 0, first * row_bytes, 0, valid * row_bytes, 1};
  } else if (axis.kind == ScaleAxis::kCols && pl.full.scale_bytes() > 0) {
    pl.scales = Copy2D{0,          pl.piece.scale_cols * eb, first * eb, pl.full.scale_cols * eb,
                       valid * eb, pl.full.scale_rows};
  }
  // The layouts must agree with the table above (guards against a format
  // whose layout changes without this file following).
  const bool k_extent_ok =
      axis.kind == ScaleAxis::kNone ||
      (axis.kind == ScaleAxis::kRows ? pl.piece.scale_cols == pl.full.scale_cols
                                     : pl.piece.scale_rows == pl.full.scale_rows);
  if (!k_extent_ok ||
      pl.data.full_offset + (pl.data.height - 1) * pl.data.full_pitch + pl.data.width >
          pl.full.data_bytes()) {
    return absl::InternalError(absl::StrCat("layout of ", FormatName(spec.format), " ",
                                            DirectionName(direction), " not understood"));
  }
  return pl;
}

absl::Status CopyPieceIn(const PiecePlacement& placement, absl::Span<const uint8_t> piece_data,
                         absl::Span<const uint8_t> piece_scales, absl::Span<uint8_t> full_data,
                         absl::Span<uint8_t> full_scales) {
  RETURN_IF_ERROR(CheckBuffers(placement, piece_data.size(), piece_scales.size(), full_data.size(),
                               full_scales.size()));
  Run(placement.data, piece_data.data(), full_data.data(), /*into_full=*/true);
  Run(placement.scales, piece_scales.data(), full_scales.data(), /*into_full=*/true);
  return absl::OkStatus();
}

absl::Status CopyPieceOut(const PiecePlacement& placement, absl::Span<const uint8_t> full_data,
                          absl::Span<const uint8_t> full_scales, absl::Span<uint8_t> piece_data,
                          absl::Span<uint8_t> piece_scales) {
  RETURN_IF_ERROR(CheckBuffers(placement, piece_data.size(), piece_scales.size(), full_data.size(),
                               full_scales.size()));
  Run(placement.data, full_data.data(), piece_data.data(), /*into_full=*/false);
  Run(placement.scales, full_scales.data(), piece_scales.data(), /*into_full=*/false);
  return absl::OkStatus();
}

absl::StatusOr<QuantizedTensor> Assemble(const QuantSpec& spec,
                                         absl::Span<const QuantizedTensor> pieces) {
  if (pieces.empty()) return absl::InvalidArgumentError("no pieces to assemble");
  const QuantizedTensor& first = pieces.front();
  QuantizedTensor full;
  full.format = first.format;
  full.direction = first.direction;
  full.cols = first.cols;
  full.scale_inv = first.scale_inv;
  full.amax = 0.0f;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const QuantizedTensor& p = pieces[i];
    if (p.format != spec.format || p.direction != first.direction || p.cols != first.cols) {
      return absl::InvalidArgumentError(
          absl::StrCat("piece ", i, " is ", FormatName(p.format), " ", DirectionName(p.direction),
                       " with ", p.cols, " columns; expected ", FormatName(spec.format), " ",
                       DirectionName(first.direction), " with ", first.cols));
    }
    if (!SameBits(p.scale_inv, first.scale_inv) ||
        (spec.format == Format::kNvfp4 && !SameBits(p.amax, first.amax))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "piece ", i, " was quantized with other per-tensor numbers (scale_inv ", p.scale_inv,
          ", amax ", p.amax, ") than piece 0: the scaling must be agreed before quantizing"));
    }
    if (p.rows < 1) return absl::InvalidArgumentError(absl::StrCat("piece ", i, " is empty"));
    if (!std::isnan(p.amax) && !(p.amax <= full.amax)) full.amax = p.amax;
    full.rows += p.rows;
  }

  ASSIGN_OR_RETURN(Layout layout, ComputeLayout(spec, full.direction, full.rows, full.cols));
  full.data.assign(layout.data_bytes(), 0);
  full.scales.assign(layout.scale_bytes(), 0);
  int64_t row = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const QuantizedTensor& p = pieces[i];
    ASSIGN_OR_RETURN(PiecePlacement pl,
                     PlacePiece(spec, full.direction, full.rows, full.cols, row, row + p.rows));
    absl::Status s =
        CopyPieceIn(pl, p.data, p.scales, absl::MakeSpan(full.data), absl::MakeSpan(full.scales));
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("piece ", i, ": ", s.message()));
    row += p.rows;
  }
  return full;
}

absl::StatusOr<QuantizedTensor> Split(const QuantSpec& spec, const QuantizedTensor& full,
                                      int64_t row_begin, int64_t row_end) {
  if (full.format != spec.format) {
    return absl::InvalidArgumentError(absl::StrCat("tensor is ", FormatName(full.format),
                                                   ", spec says ", FormatName(spec.format)));
  }
  ASSIGN_OR_RETURN(PiecePlacement pl,
                   PlacePiece(spec, full.direction, full.rows, full.cols, row_begin, row_end));
  QuantizedTensor piece;
  piece.format = full.format;
  piece.direction = full.direction;
  piece.rows = row_end - row_begin;
  piece.cols = full.cols;
  piece.scale_inv = full.scale_inv;
  piece.amax = full.amax;
  piece.data.assign(pl.piece.data_bytes(), 0);
  piece.scales.assign(pl.piece.scale_bytes(), 0);
  RETURN_IF_ERROR(CopyPieceOut(pl, full.data, full.scales, absl::MakeSpan(piece.data),
                               absl::MakeSpan(piece.scales)));
  return piece;
}

}  // namespace sharding
}  // namespace paramd
