// File: kernels/format.h
//
// The vocabulary shared by every part of hybrid-paramd that touches quantized
// weights: the formats of docs/FORMATS.md, a tensor's hybrid spec, the
// exact byte layout of each published buffer, and the per-tensor scaling
// parameters that must be agreed across daemons before quantizing.
//
// Pure host code, no allocation beyond what the returned values own.
// Thread-safe (no shared state).
#ifndef PARAMD_KERNELS_FORMAT_H_
#define PARAMD_KERNELS_FORMAT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace paramd {

// One published encoding of a weight. FORMATS.md section numbers in brackets.
enum class Format : uint8_t {
  kIdentityBf16 = 0,     // BF16 passthrough, [M][K]                      (§6)
  kIdentityFp32 = 1,     // FP32 passthrough, [M][K]                      (§6)
  kFp8Delayed = 2,       // FP8 per-tensor, delayed scaling               (§1)
  kFp8Current = 3,       // FP8 per-tensor, current scaling               (§2)
  kMxfp8 = 4,            // E8M0 per 32 elements (1x32 / 32x1, or 32x32)  (§3)
  kNvfp4 = 5,            // E2M1 + UE4M3 per 16 (16x16 2D, or 1x16/16x1)  (§4)
  kFp8Block128x128 = 6,  // FP8 with fp32 scale per 128x128 tile          (§5)
  kFp8Block1x128 = 7,    // FP8 with fp32 scale per 1x128 along direction (§5)
};

enum class Direction : uint8_t { kRowwise = 0, kColumnwise = 1 };

// Element type of the FP8 formats. Weights use E4M3 (D10); E5M2 is accepted
// for MXFP8 and per-tensor FP8 experiments.
enum class Fp8Type : uint8_t { kE4M3 = 0, kE5M2 = 1 };

enum class AmaxAlgo : uint8_t { kMax = 0, kMostRecent = 1 };

// D1: what the quantizer reads. kBf16 = master rounded RNE to BF16 (TE
// bit-compatible, default); kFp32 = the master itself.
enum class SourceDtype : uint8_t { kBf16 = 0, kFp32 = 1 };

// §6 / D2: where the columnwise copy comes from.
enum class ColumnwiseSource : uint8_t { kOriginal = 0, kRowwiseDequantized = 1 };

// How one direction is encoded. Fields that do not apply to `format` are
// ignored. Use DefaultQuantSpec(format) to get FORMATS.md's defaults.
struct QuantSpec {
  Format format = Format::kIdentityBf16;
  Fp8Type fp8_type = Fp8Type::kE4M3;
  // Current scaling: default false. Blockwise: default true (D10).
  bool pow2_scales = false;
  float eps = 0.0f;
  // Delayed scaling (§1).
  int amax_history_len = 1024;
  AmaxAlgo amax_algo = AmaxAlgo::kMax;
  int margin = 0;
  // MXFP8: 32x32 tiles (off by default). NVFP4: 16x16 tiles (on by default).
  bool two_d = false;
  // The dtype the quantizer's input was rounded to (D1). Only FP8 blockwise
  // reads it: it picks compute_scale's inf_value (§5: FLT_MAX for kFp32,
  // 0x7F7F0000 for kBf16). Must equal HybridSpec::source_dtype;
  // ref::QuantizeHybrid overwrites it with that value. (Added field.)
  SourceDtype source_dtype = SourceDtype::kBf16;
};

QuantSpec DefaultQuantSpec(Format format);

// A tensor's published encodings (§6). Either usage may be off, in which
// case that direction is neither computed nor published.
struct HybridSpec {
  QuantSpec rowwise = DefaultQuantSpec(Format::kIdentityBf16);
  QuantSpec columnwise = DefaultQuantSpec(Format::kIdentityBf16);
  ColumnwiseSource columnwise_source = ColumnwiseSource::kOriginal;
  SourceDtype source_dtype = SourceDtype::kBf16;
  bool rowwise_usage = true;
  bool columnwise_usage = true;
};

// Byte layout of one direction of one logical [M, K] weight, exactly as
// FORMATS.md's tables give it (compact scale layouts, D12). "Data" and
// "scale" are the two buffers a trainer fetches; per-tensor FP8 and NVFP4
// also carry scalars (see QuantizedTensor).
struct Layout {
  // Data buffer: data_rows x data_row_bytes bytes, row-major. For
  // transposed directions (per-tensor/blockwise FP8 and NVFP4 columnwise)
  // data_rows = K; otherwise data_rows = M. FP4 packs two codes per byte
  // (even index in the low nibble, D11 pads an odd count with 0).
  int64_t data_rows = 0;
  int64_t data_row_bytes = 0;
  bool transposed = false;
  // Scale buffer: scale_rows x scale_cols entries of scale_elem_bytes each
  // (1 = E8M0/UE4M3 byte, 4 = little-endian fp32; 0 = no scale buffer).
  // Padding entries are 0 (D8).
  int64_t scale_rows = 0;
  int64_t scale_cols = 0;
  int scale_elem_bytes = 0;

  int64_t data_bytes() const { return data_rows * data_row_bytes; }
  int64_t scale_bytes() const { return scale_rows * scale_cols * scale_elem_bytes; }
};

// InvalidArgument for M or K < 1, M*K > 2^48, or an unknown format or
// direction. Identity copies keep [M][K] in both directions; see
// FORMATS.md §1-§6 for the others.
absl::StatusOr<Layout> ComputeLayout(const QuantSpec& spec, Direction direction, int64_t rows,
                                     int64_t cols);

// One published direction of one tensor (or of one shard of it).
struct QuantizedTensor {
  Format format = Format::kIdentityBf16;
  Direction direction = Direction::kRowwise;
  int64_t rows = 0;             // logical M of the source
  int64_t cols = 0;             // logical K of the source
  std::vector<uint8_t> data;    // Layout::data_bytes()
  std::vector<uint8_t> scales;  // Layout::scale_bytes()
  // Per-tensor FP8: rcp(scale). 1 for other formats.
  float scale_inv = 1.0f;
  // NVFP4: the global amax A of this direction (§4). Per-tensor FP8: the
  // amax of the source that was quantized (what delayed scaling records).
  float amax = 0.0f;
};

// Per-tensor numbers that must be the same on every daemon holding a piece
// of the tensor; computed from globally reduced amaxes before quantizing.
struct TensorScaling {
  float scale = 1.0f;        // per-tensor FP8: the multiplier (scale_inv = rcp)
  float global_amax = 0.0f;  // NVFP4: A
};

// Delayed-scaling state of one direction of one tensor (§1).
struct DelayedScalingState {
  float scale = 1.0f;
  std::vector<float> amax_history;  // length amax_history_len, zeros at start
};

absl::string_view FormatName(Format format);
absl::StatusOr<Format> ParseFormatName(absl::string_view name);
absl::string_view DirectionName(Direction direction);

// Whether a format keeps per-tensor state (amax) that must be all-reduced.
bool NeedsGlobalAmax(Format format);

}  // namespace paramd

#endif  // PARAMD_KERNELS_FORMAT_H_
