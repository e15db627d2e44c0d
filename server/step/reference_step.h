// File: server/step/reference_step.h
//
// The daemon's step for ONE whole tensor on the CPU, written plainly
// from kernels/reference.h: what the daemons' sharded, all-reduced step must
// reproduce byte for byte. Test-only (//server/step:reference_step, testonly):
// unit tests of ShardSet and the multi-process tests compare against it.
//
// Pure; thread-compatible.
#ifndef PARAMD_SERVER_STEP_REFERENCE_STEP_H_
#define PARAMD_SERVER_STEP_REFERENCE_STEP_H_

#include <vector>

#include "absl/status/statusor.h"
#include "kernels/format.h"
#include "kernels/reference.h"

namespace paramd {

// Per-tensor state a reference run carries between versions.
struct ReferenceTensorState {
  DelayedScalingState rowwise;
  DelayedScalingState columnwise;
};

// Fresh state for `spec` (scale 1, zero histories).
ReferenceTensorState InitialReferenceState(const HybridSpec& spec);

// Quantizes the whole `master` [rows][cols] as version v would be
// published: scaling from the whole tensor's amaxes (current/NVFP4) or from
// `state`'s scales (delayed); then advances `state` (delayed: record the
// amax of the cast and update, FORMATS.md §1).
absl::StatusOr<ref::HybridResult> ReferencePublish(const std::vector<float>& master, int64_t rows,
                                                   int64_t cols, const HybridSpec& spec,
                                                   ReferenceTensorState& state);

}  // namespace paramd

#endif  // PARAMD_SERVER_STEP_REFERENCE_STEP_H_
