// File: server/gpu_backend/spec_rules.h
//
// Which directions of a HybridSpec the gpu backend computes, publishes and
// all-reduces (the same rules as server/step/shard_set.cc), shared by the store's
// whole and bucketed steps (shard_store.cc, shard_store_step.cc) and the
// pipelined step's metadata (pipelined_step.cc). Header only; no state.
#ifndef PARAMD_SERVER_GPU_BACKEND_SPEC_RULES_H_
#define PARAMD_SERVER_GPU_BACKEND_SPEC_RULES_H_

#include "kernels/format.h"

namespace paramd {
namespace gpu_backend {
namespace rules {

inline bool PerTensorFp8(Format f) { return f == Format::kFp8Current || f == Format::kFp8Delayed; }

// Direction `dir` (0 rowwise, 1 columnwise) is published.
inline bool Uses(const HybridSpec& spec, int dir) {
  return dir == 0 ? spec.rowwise_usage : spec.columnwise_usage;
}

inline const QuantSpec& SpecOf(const HybridSpec& spec, int dir) {
  return dir == 0 ? spec.rowwise : spec.columnwise;
}

inline bool Dequantized(const HybridSpec& s) {
  return s.columnwise_source == ColumnwiseSource::kRowwiseDequantized;
}

// Whether direction `dir` is quantized at all: published, or (rowwise) the
// temporary source of a rowwise_dequantized columnwise copy (D16).
inline bool Computed(const HybridSpec& s, int dir) {
  return Uses(s, dir) || (dir == 0 && s.columnwise_usage && Dequantized(s));
}

// A rowwise_dequantized columnwise copy that needs a global amax takes it
// over the dequantized rowwise values, in round 1 when the rowwise scale is
// local, else in round 2.
inline bool ColumnwiseSourceAmaxNeeded(const HybridSpec& s) {
  return s.columnwise_usage && Dequantized(s) && NeedsGlobalAmax(s.columnwise.format);
}

// Whether a tensor's quantization can run inside its AdamW step: every
// direction computed takes its scale from before the step (not the new
// master's amax: no FP8 current, no NVFP4) and reads the master itself.
inline bool OnePassFormats(const HybridSpec& s) {
  if (Dequantized(s)) return false;
  for (int dir = 0; dir < 2; ++dir) {
    if (!Computed(s, dir)) continue;
    const Format f = SpecOf(s, dir).format;
    if (f == Format::kFp8Current || f == Format::kNvfp4) return false;
  }
  return true;
}

// The columnwise-source amax needs the global rowwise scale: a second
// all-reduce round.
inline bool SecondRound(const HybridSpec& s) {
  return ColumnwiseSourceAmaxNeeded(s) && NeedsGlobalAmax(s.rowwise.format) &&
         s.rowwise.format != Format::kFp8Delayed;
}

// Whether a direction's global amax is reduced (and so reported in
// TensorScalingInfo; 0 otherwise).
inline bool NeedsReduce(const HybridSpec& s, int dir) {
  return Computed(s, dir) && NeedsGlobalAmax(SpecOf(s, dir).format);
}

}  // namespace rules
}  // namespace gpu_backend
}  // namespace paramd

#endif  // PARAMD_SERVER_GPU_BACKEND_SPEC_RULES_H_
