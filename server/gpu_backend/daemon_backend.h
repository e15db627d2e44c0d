// File: server/gpu_backend/daemon_backend.h
//
// The daemon's gpu ShardBackend (server/backend/shard_backend.h) over GpuShardStore.
// Linking this library (alwayslink; only under --config=cuda) registers it,
// so `hybrid-paramd --backend=gpu|auto` can create it.
//
// What it does: the daemon's host-side contract is kept, and the state and
// the step move to the device.
//   - Loaded weights are written into host staging rows (load_master) and
//     uploaded before the first Step; the staging is then dropped.
//   - Pushed gradients are summed in FP32 on the host (exactly as the cpu
//     backend sums them) and uploaded into the device accumulators at the
//     start of an optimizer Step.
//   - Step = GpuShardStore::Step (AdamW or SGD + partial amaxes, all-reduce
//     MAX, scaling update, quantize both directions, both columnwise
//     sources) with the daemon's host AllReduceMaxFn bridged in: the packed
//     [tensor][direction] device amax vector is copied to the host,
//     all-reduced and copied back (one stream sync per all-reduce round).
//     The optimizer arithmetic is bit-identical to the cpu backend's
//     (server/step/optimizer.h), so a gpu daemon publishes the cpu daemon's bytes:
//     every config the cpu backend runs (lr schedule, global-norm clipping,
//     skip_step, per-tensor lr multiplier / weight decay / frozen, and
//     SetOptimizer between steps, SGD momentum turned on or off included),
//     the norm in server/step/grad_norm.h's order.
//   - Publish without a device-to-host copy of the data: Step returns the
//     version's metadata (pieces with layouts, scale_inv, amax, scales; data
//     and scales empty) after one small copy of the version's scalars;
//     host_bytes() copies a version's buffers to the host on its first host
//     request (gRPC Fetch, export) and shares that copy with later ones.
//     NCCL fetches read the device buffers (DeviceStoreOf + Published).
//     The host copy of a version is possible while the store holds it (the
//     two latest versions); a step waits for a running copy of the version
//     it overwrites.
//   - host_state(): a host ShardSet mirror (masters, moments, step count,
//     delayed scaling state) downloaded on demand for checkpoint write and
//     export; a restore writes into it and it is uploaded before the next
//     Step (as is any mirror handed out: one full upload after a
//     checkpoint). Step with update_delayed=false republishes a restored
//     version without a delayed-scaling update.
//   - StepPipelined (--pipelined_step): server/gpu_backend/pipelined_step.h
//     on the store, each bucket's gradients uploaded as the pushes deliver
//     them, each bucket's bytes copied to the host version (for as_ready
//     fetches) once its event completed; transactional until its commit
//     barrier (an abandoned attempt changes nothing).
// What it does not do (clear Status, never silent):
//   - a failed step is not transactional: the device masters may have moved,
//     so every later Step is FAILED_PRECONDITION until the model is loaded
//     again (LoadShards creates a new backend).
//   - mixing cpu and gpu daemons in one world (the all-reduce calls differ).
#ifndef PARAMD_SERVER_GPU_BACKEND_DAEMON_BACKEND_H_
#define PARAMD_SERVER_GPU_BACKEND_DAEMON_BACKEND_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "server/backend/shard_backend.h"
#include "server/gpu_backend/shard_store.h"

namespace paramd {
namespace gpu_backend {

// INVALID_ARGUMENT for bad shards, UNIMPLEMENTED as above,
// RESOURCE_EXHAUSTED when the device is full. Uses device 0.
absl::StatusOr<std::unique_ptr<ShardBackend>> CreateGpuShardBackend(
    std::vector<TensorDef> tensors, std::vector<ShardDef> shards,
    const ShardBackendOptions& options);

// The device store behind `backend` when it is the gpu backend, else null
// (cpu backend, null backend). Not owned: valid while `backend` lives. Used
// by the daemon to serve fetches over NCCL straight from the published
// device buffers (GpuShardStore::Published). Same threading rules as the
// store: reads of a published version may run beside the next Step.
GpuShardStore* DeviceStoreOf(ShardBackend* backend);

}  // namespace gpu_backend
}  // namespace paramd

#endif  // PARAMD_SERVER_GPU_BACKEND_DAEMON_BACKEND_H_
