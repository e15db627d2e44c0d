// File: server/gpu_backend/host_mirror.h
//
// Copies between a GpuShardStore's device state and a host ShardSet of the
// same shards: masters, optimizer moments, delayed-scaling state and the
// step count. The gpu backend keeps such a mirror for checkpoint writes,
// export and restore (daemon_backend.h, host_state()).
//
// Every copy here is synchronous (BlockingCopy). Threading: the caller owns
// the store's step thread for the whole call (no step may run beside it).
#ifndef PARAMD_SERVER_GPU_BACKEND_HOST_MIRROR_H_
#define PARAMD_SERVER_GPU_BACKEND_HOST_MIRROR_H_

#include <cstddef>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/format.h"
#include "server/gpu_backend/shard_store.h"
#include "server/step/shard_set.h"

namespace paramd {
namespace gpu_backend {

// A cudaMemcpy that has finished when it returns, in both directions. A
// plain cudaMemcpy from pageable host memory may return before the bytes
// reach the device (they are staged, then DMAed on the default stream), and
// the store's kernels run on a cudaStreamNonBlocking stream that does not
// wait for the default one: a step right after a load then quantized masters
// that still held what the memory held before (the previous model's, on a
// reused allocation). So a host-to-device copy is waited for.
absl::Status BlockingCopy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);

// The store's state -> `mirror`. `staged_masters` (one vector per shard) are
// the masters when they have not been uploaded yet (null once they have).
// Moments are copied as ShardSet holds them: once a step sized them, never
// for a frozen tensor, and not for SGD buffers waiting for their first
// momentum step. The mirror's skipped-step count is the caller's.
absl::Status DownloadToMirror(GpuShardStore& store, const std::vector<TensorDef>& tensors,
                              const std::vector<ShardDef>& shards, bool sgd,
                              const std::vector<std::vector<float>>* staged_masters,
                              ShardSet& mirror);

// `mirror` -> the store (after a restore wrote into it), step count
// included. SGD state with momentum in a store without momentum buffers
// allocates them (the caller re-reads the store's device bytes).
absl::Status UploadFromMirror(const ShardSet& mirror, const std::vector<TensorDef>& tensors,
                              const std::vector<ShardDef>& shards, bool sgd, GpuShardStore& store);

// One shard's part of a restore, straight into the store (the gpu
// backend's state sink, server/step/state_sink.h). Masters: `values` of the
// shard's element count (the caller checks).
absl::Status UploadShardMaster(GpuShardStore& store, int shard, absl::Span<const float> values);

// Moments `m` (AdamW m, SGD momentum) and `v`, each empty or of `n`
// values: copied, or the device buffer zeroed when empty. SGD momentum for a
// store without momentum buffers allocates them (zeroed) first.
absl::Status UploadShardMoments(GpuShardStore& store, int shard, size_t n, bool sgd,
                                absl::Span<const float> m, absl::Span<const float> v);

// Direction `d`'s delayed-scaling state of shard `shard` (its tensor's
// `spec` sizes the history); nothing for a direction without one.
absl::Status UploadShardDelayed(GpuShardStore& store, const HybridSpec& spec, int shard,
                                Direction d, const DelayedScalingState& state);

// Whether the next SGD momentum step must start the buffers from the
// gradient (ShardSet's unsized state): a non-frozen shard's momentum was
// restored empty (`momentum_zeroed`, by shard) into an existing buffer.
bool MomentumStartsFresh(GpuShardStore& store, const std::vector<bool>& momentum_zeroed);

}  // namespace gpu_backend
}  // namespace paramd

#endif  // PARAMD_SERVER_GPU_BACKEND_HOST_MIRROR_H_
