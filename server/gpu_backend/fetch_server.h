// File: server/gpu_backend/fetch_server.h
//
// The daemon's side of a GPU fetch (docs/ARCHITECTURE.md, "Device fetch
// through the daemon"): the device pieces of the
// requested (shard, direction) items of a published version, in the order
// of the fetch plan that both sides derive from the same request: for each
// item, its data buffer, its scale buffer (if the layout has one), then the
// scale_inv and amax scalars (4 bytes each). client/gpu_fetch/fetch.h
// receives exactly these pieces.
#ifndef PARAMD_SERVER_GPU_BACKEND_FETCH_SERVER_H_
#define PARAMD_SERVER_GPU_BACKEND_FETCH_SERVER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/format.h"
#include "server/gpu_backend/shard_store.h"
#include "transport/nccl_transport.h"

namespace paramd {
namespace gpu_backend {

struct FetchItem {
  int shard = 0;
  Direction direction = Direction::kRowwise;
};

// The pieces of `items` of `version`. NOT_FOUND for an unpublished version
// or a direction the shard does not publish.
absl::StatusOr<std::vector<DeviceBytes>> FetchPieces(const GpuShardStore& store, int64_t version,
                                                     absl::Span<const FetchItem> items);

// Sends `items` of `version` to `trainer` as one message (one NCCL group).
// With `per_item` each run of consecutive items of one shard is its own
// message (tag, tag+1, ...) sent after that shard's TensorReady event: the
// fetch of tensor i overlaps the quantization of tensor i+1 while a step is
// in flight.
// Without `per_item`, the one message waits (on the device) for `ready`
// when it is set, e.g. StepDone() of a step in flight: the control round
// trip then overlaps the step.
absl::Status ServeFetch(NcclTransport& transport, int trainer, uint64_t tag,
                        const GpuShardStore& store, int64_t version,
                        absl::Span<const FetchItem> items, bool per_item, absl::Time deadline,
                        cudaEvent_t ready = nullptr);

// Sends `items` of `version`, the step in flight (GpuShardStore::
// EnqueueStep of `version` has returned, FinishStep not yet), to `trainer`
// as ONE message (SendDevicePipelined: one header / clear-to-send exchange)
// whose pieces of item k leave once TensorReady(items[k].shard) has
// completed: the trainer receives tensor i while tensor i+1 is quantized.
// The same message as ServeFetch without `per_item`, so the trainer
// receives it the same way. Must not be called before that EnqueueStep
// returned (the events would stand for the previous step); may be called
// after the version was published (the events then have completed, or
// stand for a later step, which only delays the send: a later step writes
// the other slot). NOT_FOUND as FetchPieces.
absl::Status ServeFetchPipelined(NcclTransport& transport, int trainer, uint64_t tag,
                                 const GpuShardStore& store, int64_t version,
                                 absl::Span<const FetchItem> items, absl::Time deadline);

}  // namespace gpu_backend
}  // namespace paramd

#endif  // PARAMD_SERVER_GPU_BACKEND_FETCH_SERVER_H_
