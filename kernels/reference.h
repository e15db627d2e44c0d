// File: kernels/reference.h
//
// The CPU reference of every format in docs/FORMATS.md. This is the
// definition the GPU kernels are tested against byte for byte, and what the
// daemons run on machines without a GPU (host data plane, CI, demo).
//
// All functions are pure and thread-safe (no shared state). Besides their
// results they allocate only small scratch: one value per block and, for
// copies quantized from W^T, a 16-row panel of W^T. Inputs are row-major
// FP32 [rows][cols]. "Source" means the values the quantizer reads (D1:
// master rounded to SourceDtype); callers that start from a master call
// RoundToSource first. Nothing is flushed to zero (D6).
#ifndef PARAMD_KERNELS_REFERENCE_H_
#define PARAMD_KERNELS_REFERENCE_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/format.h"

namespace paramd {
namespace ref {

// ---- Element codecs (FORMATS.md §0, D6, D7, D14) ----
uint8_t EncodeE4M3(float x);  // enc8 satfinite, RNE, canonical NaN 0x7F
uint8_t EncodeE5M2(float x);  // enc8 satfinite (Inf -> max), NaN 0x7F
float DecodeE4M3(uint8_t code);
float DecodeE5M2(uint8_t code);
uint8_t EncodeFp8(float x, Fp8Type type);
float DecodeFp8(uint8_t code, Fp8Type type);
float Fp8Max(Fp8Type type);      // 448 or 57344
uint8_t EncodeE2M1(float x);     // 4-bit code in the low nibble; NaN -> 0x7, -0 -> 0x8
float DecodeE2M1(uint8_t code);  // reads the low nibble only
float DecodeE8M0(uint8_t code);  // 2^(e-127); 0xFF -> NaN
// §3 e8m0(v), TE ceiling rule: the smallest e with 2^(e-127) >= v, clamped
// to [0, 254]; Inf -> 0xFE, NaN -> 0xFF. v is an amax times a positive
// constant; its sign bit is ignored.
uint8_t E8M0FromScaledAmax(float v);
uint16_t EncodeBf16(float x);  // RNE, NaN -> 0x7FFF
float DecodeBf16(uint16_t bits);

// ---- Scalars ----
// max |x| ignoring NaN; Inf participates; empty -> 0.
float Amax(absl::Span<const float> values);
// D1: RNE to BF16 and back (kBf16), or a copy (kFp32).
std::vector<float> RoundToSource(absl::Span<const float> master, SourceDtype dtype);
// §2 compute_scale.
float ComputeScale(float amax, float fp8_max, bool pow2, float eps, float inf_value);
// A fresh §1 state: scale 1, max(spec.amax_history_len, 1) zeros. (Added.)
DelayedScalingState InitialDelayedState(const QuantSpec& spec);
// §1 cast side: max-update history[0] with the amax of a cast (NaN ignored;
// an empty history becomes one slot).
void DelayedRecordAmax(DelayedScalingState& state, float amax);
// §1 update (fused rule, D9). `reduced_amax` = history[0] after the
// all-reduce (callers that do not reduce pass state.amax_history[0]).
// The history is first resized to max(spec.amax_history_len, 1) (new slots 0).
void DelayedUpdate(DelayedScalingState& state, float reduced_amax, const QuantSpec& spec);
// TensorScaling for current-scaling FP8 / NVFP4 from a (globally reduced)
// amax of the source: global_amax = amax always; scale = §2 compute_scale
// (inf_value FLT_MAX) for kFp8Current, else 1. Delayed scaling's scale is
// DelayedScalingState::scale, not this.
TensorScaling ScalingFromAmax(const QuantSpec& spec, float global_amax);

// ---- Quantize / dequantize one direction ----
// `source` is [rows][cols]. `scaling` supplies the per-tensor scale (FP8
// delayed/current: q = enc8(x * scaling.scale)) or the global amax A
// (NVFP4); it is ignored by the other formats, whose scales are per block.
// The result's data/scales follow ComputeLayout(spec, direction, rows, cols)
// exactly, padding zeroed (D8, D11). Scalars: scale_inv = rcp(scale) for
// per-tensor FP8 (else 1); amax = amax(source) for per-tensor FP8, A for
// NVFP4, else 0. spec.fp8_type selects E4M3/E5M2 for every FP8 format;
// spec.source_dtype only matters to blockwise FP8 (§5 inf_value).
// InvalidArgument: bad shape, source.size() != rows*cols, unknown format.
absl::StatusOr<QuantizedTensor> Quantize(absl::Span<const float> source, int64_t rows, int64_t cols,
                                         const QuantSpec& spec, Direction direction,
                                         const TensorScaling& scaling);
// Back to FP32 [rows][cols] in W's order whatever the direction (D15:
// value(q) * scale_inv in one rounding; MXFP8 value(q) * 2^(e-127); NVFP4
// e2m1(q) * ((value(sd) * A) * RN(1/2688)), D4). Each element uses the scale
// entry its layout assigns it (for 2D tiles, its own row's copy). NaN codes
// give NaN. InvalidArgument if q.format != spec.format or the buffer sizes do
// not match ComputeLayout.
absl::StatusOr<std::vector<float>> Dequantize(const QuantizedTensor& q, const QuantSpec& spec);

// ---- Hybrid (§6) ----
struct HybridResult {
  std::optional<QuantizedTensor> rowwise;
  std::optional<QuantizedTensor> columnwise;
};
// Scaling inputs of one hybrid quantization: one TensorScaling per direction.
// For kRowwiseDequantized, `columnwise` must have been derived from the
// dequantized rowwise values (see ColumnwiseSourceValues).
struct HybridScaling {
  TensorScaling rowwise;
  TensorScaling columnwise;
};
// Produces the directions the spec's usage flags ask for, from the master
// (rounded to spec.source_dtype inside; the children's QuantSpec::source_dtype
// is overwritten with it). With kRowwiseDequantized the columnwise copy is
// quantized from Dequantize(rowwise) rounded to source_dtype (D2); a
// temporary rowwise copy, made with scaling.rowwise, is used and dropped if
// rowwise usage is off. Nothing here touches delayed-scaling state: callers
// record the published results' amax, so the temporary copy records none
// (D16). InvalidArgument: bad shape or master.size() != rows*cols.
absl::StatusOr<HybridResult> QuantizeHybrid(absl::Span<const float> master, int64_t rows,
                                            int64_t cols, const HybridSpec& spec,
                                            const HybridScaling& scaling);
// The values the columnwise quantizer reads (source, or dequantized rowwise
// rounded to source_dtype): used to compute the columnwise amax.
absl::StatusOr<std::vector<float>> ColumnwiseSourceValues(absl::Span<const float> master,
                                                          int64_t rows, int64_t cols,
                                                          const HybridSpec& spec,
                                                          const TensorScaling& rowwise_scaling);

}  // namespace ref
}  // namespace paramd

#endif  // PARAMD_KERNELS_REFERENCE_H_
