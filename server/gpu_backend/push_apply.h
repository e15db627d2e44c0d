// File: server/gpu_backend/push_apply.h
//
// The device side of a gradient push that is already in device memory (a
// device channel's staging, server/gpu_backend/device_channel.cc, or a
// same-GPU trainer's mapped buffer, server/gpu_backend/ipc_export.cc): the
// NaN/Inf check and the adds into the store's FP32 accumulators, the same
// kernels and element order for both (so both equal a host push, bit for
// bit).
#ifndef PARAMD_SERVER_GPU_BACKEND_PUSH_APPLY_H_
#define PARAMD_SERVER_GPU_BACKEND_PUSH_APPLY_H_

#include <cstdint>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "server/gpu_backend/shard_store.h"

namespace paramd {
namespace gpu_backend {

// `count` values (BF16 when `bf16`, else FP32) at device pointer `source`,
// added into shard `shard`'s accumulator from element `offset` on.
struct DevicePushSource {
  int shard = 0;
  int64_t offset = 0;
  int64_t count = 0;
  bool bf16 = false;
  const void* source = nullptr;
};

// INVALID_ARGUMENT if any value of `pieces` is NaN or infinite (reads only).
// `flag` is a device uint32 of the caller's; waits for `stream` once.
absl::Status CheckPushFinite(absl::Span<const DevicePushSource> pieces, uint32_t* flag,
                             cudaStream_t stream);

// The whole device side of a push whose pieces were not checked yet (the
// same-GPU in-place push): pieces into an accumulator that is still zero
// (GpuShardStore::grad_zero when called) are written by one pass that
// also checks them (push_write.h); the others are checked, then added. On
// a NaN/Inf (INVALID_ARGUMENT) the written ranges are zeroed again and
// nothing is added. Runs on the store's stream and returns once the work
// is done (the sources may be reused then). `flag` is a device uint32 of
// the caller's. Under the daemon's push lock (no other add meanwhile).
// `refuse_non_finite` false (the store's policy takes NaN/Inf: SKIP_STEP)
// applies such a push as it is (the step then skips).
absl::Status ApplyCheckedPush(GpuShardStore& store, absl::Span<const DevicePushSource> pieces,
                              uint32_t* flag, bool refuse_non_finite);

// Enqueues the adds of `pieces`, in order, on the store's stream (its
// device current). Every piece is checked against its shard first: a
// refusal (INVALID_ARGUMENT) adds nothing. The sources must stay valid until
// the store's stream has passed the adds. `last_pusher` (the push that
// completes the version): whole-row pieces take the gradient norm's row
// sums in their add (GpuShardStore::AddPiece), so the step does not read
// those gradients again.
absl::Status EnqueuePushAdds(GpuShardStore& store, absl::Span<const DevicePushSource> pieces,
                             bool last_pusher = false);

}  // namespace gpu_backend
}  // namespace paramd

#endif  // PARAMD_SERVER_GPU_BACKEND_PUSH_APPLY_H_
