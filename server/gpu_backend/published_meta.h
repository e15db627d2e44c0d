// File: server/gpu_backend/published_meta.h
//
// The host description of what the gpu backend published for one shard
// (PublishedPiece without bytes, TensorScalingInfo), from the shard's device
// scalars and its tensor's reduced amaxes: the same metadata for a whole
// step (daemon_backend.cc Publish) and for each bucket of a pipelined step.
// DescribeShard is host code only; CopyBucketToHost copies from the device.
#ifndef PARAMD_SERVER_GPU_BACKEND_PUBLISHED_META_H_
#define PARAMD_SERVER_GPU_BACKEND_PUBLISHED_META_H_

#include <vector>

#include "absl/status/status.h"
#include "server/gpu_backend/shard_store.h"
#include "server/step/shard_set.h"
#include "server/step/step_pipeline.h"

namespace paramd {
namespace gpu_backend {

// Shard `i` (`d` of tensor `t`): `scalars` = its [direction][kScalarsPerDirection]
// floats (GpuShardStore::PublishedScalars + (2 * i) * kScalarsPerDirection),
// `amax` = the packed amax vector's two slots of its tensor (2 * d.tensor);
// `device[dir]` its published buffers (GpuShardStore::Published; only
// layout and presence are read). Appends its pieces (rowwise, then
// columnwise, the used ones) to `pieces` and sets `info` (held, scales and
// amaxes of both directions).
void DescribeShard(int i, const ShardDef& d, const TensorDef& t, const float* scalars,
                   const float* amax, const GpuPublishedDirection device[2],
                   TensorScalingInfo* info, std::vector<PublishedPiece>* pieces);

// Bucket `b` of `version` (in flight in `store`, its bucket event
// completed): its pieces of `out` (out->pieces[b.piece_begin, piece_end))
// get their metadata and, with `bytes`, their bytes from the device, and
// its tensors' TensorScalingInfo is set. Copies on `*stream` (created on
// first use; the caller destroys it). `tensors` / `shards` are the
// backend's (its shards in the store's order). Blocks until the copies are
// done.
absl::Status CopyBucketToHost(GpuShardStore& store, const std::vector<TensorDef>& tensors,
                              const std::vector<ShardDef>& shards, int64_t version,
                              const StepBucket& b, bool bytes, cudaStream_t* stream,
                              PublishedVersion* out);

}  // namespace gpu_backend
}  // namespace paramd

#endif  // PARAMD_SERVER_GPU_BACKEND_PUBLISHED_META_H_
