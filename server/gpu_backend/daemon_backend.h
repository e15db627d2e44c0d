// File: server/gpu_backend/daemon_backend.h
//
// The daemon's gpu ShardBackend (server/shard_backend.h) over GpuShardStore.
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
//   - Step = GpuShardStore::Step (AdamW + partial amaxes, all-reduce MAX,
//     scaling update, quantize both directions) with the daemon's host
//     AllReduceMaxFn bridged in: the per-shard device amaxes are copied to
//     the host, packed per tensor ([tensor][direction], both directions
//     carry the tensor's source amax), all-reduced, unpacked and copied back
//     (one stream sync inside the step).
//   - The published device buffers of the new version are copied to the
//     host as a PublishedVersion, so the gRPC Fetch stream (host transport)
//     serves a gpu daemon unchanged.
// What it does not do (clear Status, never silent):
//   - columnwise_source = rowwise_dequantized: UNIMPLEMENTED (GpuShardStore).
//   - optimizer sgd: UNIMPLEMENTED (the store runs AdamW only).
//   - checkpoint write/restore and export: host_state() is null, the daemon
//     answers UNIMPLEMENTED; Step with update_delayed=false: UNIMPLEMENTED.
//   - a failed step is not transactional: the device masters may have moved,
//     so every later Step is FAILED_PRECONDITION until the model is loaded
//     again (LoadShards creates a new backend).
//   - mixing cpu and gpu daemons in one world (the all-reduce calls differ).
//   - serving fetches over NCCL from the device buffers (fetch_server.h) is
//     not wired into the daemon yet.
#ifndef PARAMD_SERVER_GPU_BACKEND_DAEMON_BACKEND_H_
#define PARAMD_SERVER_GPU_BACKEND_DAEMON_BACKEND_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "server/gpu_backend/shard_store.h"
#include "server/shard_backend.h"

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
