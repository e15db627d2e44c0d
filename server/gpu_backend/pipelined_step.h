// File: server/gpu_backend/pipelined_step.h
//
// The pipelined step (server/step/step_pipeline.h, `hybrid-paramd
// --pipelined_step`) on a GpuShardStore: bucket b's gradients are taken
// (hooks.await_bucket) and its optimizer, amax all-reduce, scaling and
// quantization enqueued on the store's stream while the gradients of b+1
// may still be arriving; each bucket's end is a CUDA event (its readers
// queue behind it, hooks.on_bucket_enqueued) and, once the event has
// completed, the bucket is announced (hooks.on_bucket_ready, from a thread
// of this step).
//
// The rules are the cpu pipeline's (server/step/step_pipeline.cc):
//   - one amax all-reduce per bucket over the bucket's run of the packed
//     [tensor][direction] vector (a second one where a tensor of the
//     bucket needs it), plus a commit barrier; every all-reduce carries one
//     extra "abandon" float, so a daemon whose await / check / before_commit
//     failed makes every daemon leave at the same call, and none commits;
//     before the step's first all-reduce an abandoning daemon just leaves;
//   - with the gradient norm on (clipping, skip_step) every bucket is
//     awaited first, then the norm (its one all-reduce carries the abandon
//     slot), then the buckets are stepped;
//   - transactional until the commit (GpuShardStore::BeginBuckets): an
//     abandoned or failed attempt leaves masters, moments, counters and
//     delayed-scaling state as they were, and the step can run again.
// On the device the abandon float of all-reduce k is read (a small copy
// and a wait) before all-reduce k+1 is enqueued, so that no daemon enqueues
// a collective the others will not make; the GPU meanwhile runs the
// quantization of bucket k and the optimizer of bucket k+1.
//
// Equal bytes: the published version, masters and moments equal the
// store's whole step (GpuShardStore::Step) for the same gradients
// (//server/gpu_backend:gpu_pipelined_step_test).
//
// Threading: RunGpuPipelinedStep runs on the store's step thread and
// blocks until the step is published, abandoned or failed. Hooks are
// called on that thread except on_bucket_ready (the step's announcer
// thread, in bucket order, never after the call returned).
#ifndef PARAMD_SERVER_GPU_BACKEND_PIPELINED_STEP_H_
#define PARAMD_SERVER_GPU_BACKEND_PIPELINED_STEP_H_

#include <cstdint>
#include <functional>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/gpu_backend/shard_store.h"
#include "server/step/step_pipeline.h"

namespace paramd {
namespace gpu_backend {

struct GpuBucketHooks {
  // Blocks until the bucket's gradients are complete, then enqueues them
  // into the store's grad() of the bucket's shards on the store's stream
  // (replacing what is there, or adding). An error abandons the step (as
  // PipelinedStepHooks::await_bucket). Null: the accumulators hold them.
  std::function<absl::Status(const StepBucket& bucket)> await_bucket;
  // PipelinedStepHooks::check_bucket / before_commit.
  std::function<absl::Status()> check_bucket;
  std::function<absl::Status()> before_commit;
  // Bucket `b`'s work is enqueued; `ready` completes when its bytes are
  // in the in-flight slot (GpuShardStore::Published of the new version).
  // They are a version only if the step returns OK. Must not block.
  std::function<void(int b, cudaEvent_t ready)> on_bucket_enqueued;
  // `ready` of bucket b completed and the bucket passed check_bucket.
  // Must not touch the store's step (Published reads are fine).
  std::function<void(int b)> on_bucket_ready;
  // After the commit barrier, before the wait for the end of the step.
  std::function<void()> enqueued;
};

struct GpuPipelineSetup {
  // PlanStepBuckets of the manifest; shards are the store's indices (the
  // backend's shards are the store's, in the same order).
  std::vector<StepBucket> buckets;
  // Per bucket: a tensor of the bucket needs the second amax round
  // (rules::SecondRound over the manifest's tensors of the bucket).
  std::vector<char> second_round;
  // All-reduce MAX across daemons (NCCL or the host bridge); null: one
  // daemon (nothing is reduced, nothing can be abandoned by another).
  DeviceAllReduce all_reduce;
  // Waits for the store's stream (NCCL: watches the communicators); null:
  // polls with the deadline.
  std::function<absl::Status(cudaStream_t, absl::Time)> wait_stream;
  absl::Time deadline = absl::InfiniteFuture();
  bool update_delayed = true;
};

// Device scratch of the pipelined step's all-reduces (the reduced run plus
// its abandon float), the abandon float's page-locked host copy and the
// bucket events. Kept by the caller across steps (no allocation per step);
// one step at a time. Not thread-safe.
class GpuPipelineScratch {
 public:
  GpuPipelineScratch() = default;
  ~GpuPipelineScratch();
  GpuPipelineScratch(const GpuPipelineScratch&) = delete;
  GpuPipelineScratch& operator=(const GpuPipelineScratch&) = delete;

  // At least `floats` device floats and `buckets` bucket events on
  // `device` (synchronises `stream` before freeing a smaller buffer).
  absl::Status Reserve(int device, size_t floats, int buckets, cudaStream_t stream);
  float* values() { return values_; }
  float* flag_host() { return flag_host_; }
  cudaEvent_t flag_event() { return flag_event_; }
  cudaEvent_t bucket_event(int b) { return events_[b]; }

 private:
  int device_ = -1;
  float* values_ = nullptr;
  size_t capacity_ = 0;
  float* flag_host_ = nullptr;
  cudaEvent_t flag_event_ = nullptr;
  std::vector<cudaEvent_t> events_;
};

// One pipelined optimizer step of `store` to `new_version`. OK: published
// (FinishStep done). IsStepAbandoned: nothing happened (run it again).
// Other errors before the commit barrier: nothing happened either
// (`*committed` false); after it (`*committed` true): the store's step
// failed as GpuShardStore::FinishStep fails.
absl::Status RunGpuPipelinedStep(GpuShardStore& store, int64_t new_version,
                                 const GpuPipelineSetup& setup, const GpuBucketHooks& hooks,
                                 GpuPipelineScratch& scratch, bool* committed);

}  // namespace gpu_backend
}  // namespace paramd

#endif  // PARAMD_SERVER_GPU_BACKEND_PIPELINED_STEP_H_
