// File: server/step/grad_norm.h
//
// The global gradient norm^2 of a step, defined so that every layout (any
// number of daemons, any shard plan) and both backends get the same bits:
//
//   row sum     r(row) of a row of `cols` FP32 gradients: 256 lanes, lane l
//               adds g[k]^2 (float64, exact) for k = l, l + 256, ... in
//               order from 0.0; then a tree: for s = 128, 64, ..., 1 lane
//               l < s adds lane l + s. r = lane 0. (One 256-thread CUDA
//               block per row does exactly this: server/gpu_backend.)
//   block       rows [128 b, 128 b + 128) of a tensor (shard boundaries are
//               multiples of 128: sharding/plan.h): the float64 sum of its
//               row sums in row order, from 0.0. One slot per block.
//   global      the float64 sum of every slot in manifest order (tensor,
//               then block), from 0.0; frozen tensors have no slots.
//
// Across daemons the slots are gathered, not summed: each slot belongs to
// one daemon, its float64 bits travel as four 16-bit integers in floats
// (exact), the other daemons send 0, and one all-reduce MAX of 4 x slots
// floats (the amax all-reduce's transport) gives every daemon every slot.
//
// Pure functions; thread-safe.
#ifndef PARAMD_SERVER_STEP_GRAD_NORM_H_
#define PARAMD_SERVER_STEP_GRAD_NORM_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace paramd {

constexpr int kGradNormLanes = 256;
constexpr int64_t kGradNormBlockRows = 128;
constexpr int kGradNormFloatsPerSlot = 4;

// r(row) above.
double RowSumSq(const float* row, int64_t cols);

// Slot layout of a manifest: slot_begin[t] is tensor t's first slot
// (ceil(rows / 128) slots; none for frozen tensors), num_slots the total.
struct GradNormSlots {
  std::vector<int64_t> slot_begin;
  int64_t num_slots = 0;
};
// `rows[t]` and `frozen[t]` per manifest tensor.
GradNormSlots MakeGradNormSlots(const std::vector<int64_t>& rows, const std::vector<bool>& frozen);

// The slot's float64 as 4 exact floats (16 bits each, low first) and back.
void EncodeGradNormSlot(double value, float* out4);
double DecodeGradNormSlot(const float* in4);

// The global sum of an all-reduced vector of 4 x num_slots floats.
double SumGradNormSlots(absl::Span<const float> encoded);

}  // namespace paramd

#endif  // PARAMD_SERVER_STEP_GRAD_NORM_H_
