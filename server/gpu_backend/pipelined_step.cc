#include "server/gpu_backend/pipelined_step.h"

#include <algorithm>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/gpu_status.h"
#include "common/status_macros.h"

namespace paramd {
namespace gpu_backend {
namespace {

// Polls `event` until it completed, `give_up` passed or `stop` turned true.
absl::Status PollEvent(cudaEvent_t event, absl::Time give_up,
                       const std::function<bool()>& stop = nullptr) {
  for (int spin = 0;; ++spin) {
    const cudaError_t q = cudaEventQuery(event);
    if (q == cudaSuccess) return absl::OkStatus();
    if (q != cudaErrorNotReady) return GPU_STATUS(q);
    if (stop && stop()) return absl::CancelledError("stopped");
    if (absl::Now() >= give_up) {
      return absl::DeadlineExceededError("pipelined GPU step did not finish before its deadline");
    }
    if (spin < 200) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(absl::Microseconds(20));
    }
  }
}

// Announces buckets (GpuBucketHooks::on_bucket_ready) once their events
// completed, in the order they were added, on a thread of its own, so the
// step thread never waits for a bucket to tell its readers.
class Announcer {
 public:
  Announcer(GpuPipelineScratch& scratch, int device, std::function<void(int)> ready)
      : scratch_(scratch), device_(device), ready_(std::move(ready)) {
    if (ready_) thread_ = std::thread([this] { Loop(); });
  }
  ~Announcer() { Stop(); }

  void Add(int b) {
    absl::MutexLock lock(&mu_);
    added_.push_back(b);
  }
  // Every bucket added has been announced (their events completed: the
  // step is finished); then the thread ends.
  absl::Status Finish() {
    {
      absl::MutexLock lock(&mu_);
      no_more_ = true;
    }
    if (thread_.joinable()) thread_.join();
    absl::MutexLock lock(&mu_);
    return error_;
  }
  // No more announcements (the step ends without publishing).
  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Loop() {
    cudaSetDevice(device_);
    for (size_t next = 0;; ++next) {
      int b;
      {
        absl::MutexLock lock(&mu_);
        auto can_go = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stop_ || no_more_ || next < added_.size();
        };
        mu_.Await(absl::Condition(&can_go));
        if (stop_ || next >= added_.size()) return;
        b = added_[next];
      }
      auto stopped = [this] {
        absl::MutexLock lock(&mu_);
        return stop_;
      };
      absl::Status s = PollEvent(scratch_.bucket_event(b), absl::InfiniteFuture(), stopped);
      if (absl::IsCancelled(s)) return;
      if (!s.ok()) {
        absl::MutexLock lock(&mu_);
        error_ = s;
        return;
      }
      ready_(b);
    }
  }

  GpuPipelineScratch& scratch_;
  const int device_;
  const std::function<void(int)> ready_;
  absl::Mutex mu_;
  std::vector<int> added_ ABSL_GUARDED_BY(mu_);
  bool no_more_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// The step's all-reduces with the abandon float appended (the cpu
// pipeline's ReduceWithAbandon on the device). Before each call the
// previous call's float is read (the wait that keeps every daemon's
// collectives aligned: a daemon that left after call k makes no call k+1).
class AbandonReduce {
 public:
  AbandonReduce(const GpuPipelineSetup& setup, GpuPipelineScratch& scratch, cudaStream_t stream)
      : setup_(setup), scratch_(scratch), stream_(stream) {}

  // `values` (null: `count` zeros) all-reduced with this daemon's `local`
  // reason to leave (OK: none). Returns the transport's error, `local`,
  // or (from the previous call's float) another daemon's abandon.
  absl::Status Run(float* values, size_t count, const absl::Status& local) {
    RETURN_IF_ERROR(CheckPrevious());
    RETURN_IF_ERROR(scratch_.Reserve(-1, count + 1, 0, stream_));
    float* buf = scratch_.values();
    if (values != nullptr && count > 0) {
      GPU_RETURN_IF_ERROR(
          cudaMemcpyAsync(buf, values, count * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    } else if (count > 0) {
      GPU_RETURN_IF_ERROR(cudaMemsetAsync(buf, 0, count * sizeof(float), stream_));
    }
    // 0x01010101 is a positive float (2.4e-38): MAX keeps any daemon's.
    GPU_RETURN_IF_ERROR(cudaMemsetAsync(buf + count, local.ok() ? 0 : 1, sizeof(float), stream_));
    absl::Status s = setup_.all_reduce(buf, count + 1, stream_);
    if (!s.ok()) return absl::AbortedError(absl::StrCat("amax all-reduce failed: ", s.message()));
    if (values != nullptr && count > 0) {
      GPU_RETURN_IF_ERROR(
          cudaMemcpyAsync(values, buf, count * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    }
    GPU_RETURN_IF_ERROR(cudaMemcpyAsync(scratch_.flag_host(), buf + count, sizeof(float),
                                        cudaMemcpyDeviceToHost, stream_));
    GPU_RETURN_IF_ERROR(cudaEventRecord(scratch_.flag_event(), stream_));
    pending_ = true;
    return local;
  }

  // Waits for the last call's abandon float: StepAbandonedError if set.
  absl::Status CheckPrevious() {
    if (!pending_) return absl::OkStatus();
    pending_ = false;
    if (setup_.wait_stream) {
      RETURN_IF_ERROR(setup_.wait_stream(stream_, setup_.deadline));
    } else {
      RETURN_IF_ERROR(PollEvent(scratch_.flag_event(), setup_.deadline));
    }
    if (*scratch_.flag_host() > 0.0f) return StepAbandonedError("another daemon left it");
    return absl::OkStatus();
  }

 private:
  const GpuPipelineSetup& setup_;
  GpuPipelineScratch& scratch_;
  const cudaStream_t stream_;
  bool pending_ = false;
};

}  // namespace

GpuPipelineScratch::~GpuPipelineScratch() {
  if (device_ < 0) return;
  ScopedDevice guard(device_);
  if (values_ != nullptr) cudaFree(values_);
  if (flag_host_ != nullptr) cudaFreeHost(flag_host_);
  if (flag_event_ != nullptr) cudaEventDestroy(flag_event_);
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
}

absl::Status GpuPipelineScratch::Reserve(int device, size_t floats, int buckets,
                                         cudaStream_t stream) {
  if (device >= 0) device_ = device;
  if (device_ < 0) return absl::InternalError("pipeline scratch without a device");
  ScopedDevice guard(device_);
  if (flag_host_ == nullptr) {
    void* p = nullptr;
    GPU_RETURN_IF_ERROR(cudaHostAlloc(&p, sizeof(float), cudaHostAllocDefault));
    flag_host_ = static_cast<float*>(p);
    GPU_RETURN_IF_ERROR(cudaEventCreateWithFlags(&flag_event_, cudaEventDisableTiming));
  }
  if (floats > capacity_) {
    if (values_ != nullptr) {
      GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
      GPU_RETURN_IF_ERROR(cudaFree(values_));
      values_ = nullptr;
      capacity_ = 0;
    }
    const size_t n = std::max<size_t>(floats, 1024);
    void* p = nullptr;
    GPU_RETURN_IF_ERROR(cudaMalloc(&p, n * sizeof(float)));
    values_ = static_cast<float*>(p);
    capacity_ = n;
  }
  while (static_cast<int>(events_.size()) < buckets) {
    cudaEvent_t e = nullptr;
    GPU_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    events_.push_back(e);
  }
  return absl::OkStatus();
}

absl::Status RunGpuPipelinedStep(GpuShardStore& store, int64_t new_version,
                                 const GpuPipelineSetup& setup, const GpuBucketHooks& hooks,
                                 GpuPipelineScratch& scratch, bool* committed) {
  *committed = false;
  const std::vector<StepBucket>& buckets = setup.buckets;
  const int nb = static_cast<int>(buckets.size());
  if (static_cast<int>(setup.second_round.size()) != nb) {
    return absl::InternalError("pipelined step: second_round per bucket missing");
  }
  ScopedDevice guard(store.device());
  const cudaStream_t stream = store.stream();
  RETURN_IF_ERROR(scratch.Reserve(store.device(), 1, nb, stream));
  RETURN_IF_ERROR(store.BeginBuckets(new_version));
  Announcer announcer(scratch, store.device(), hooks.on_bucket_ready);
  auto leave = [&](absl::Status s) {
    announcer.Stop();
    store.AbandonBuckets();
    return s;
  };
  AbandonReduce reduce(setup, scratch, stream);
  const bool several = static_cast<bool>(setup.all_reduce);
  // The store's own all-reduce calls (this daemon has no reason to leave).
  DeviceAllReduce device_reduce;
  if (several) {
    device_reduce = [&](float* values, size_t count, cudaStream_t) {
      return reduce.Run(values, count, absl::OkStatus());
    };
  }
  auto await = [&](int b) -> absl::Status {
    return hooks.await_bucket ? hooks.await_bucket(buckets[b]) : absl::OkStatus();
  };
  // This daemon leaves at a call whose count is `count`: the others make
  // that call too, then see its abandon float.
  auto leave_at = [&](size_t count, const absl::Status& local) {
    return leave(several ? reduce.Run(nullptr, count, local) : local);
  };

  // Clipping / skip_step: every bucket first, then the norm.
  std::vector<bool> awaited(nb, false);
  if (store.grad_norm_on()) {
    absl::Status local;
    for (int b = 0; b < nb && local.ok(); ++b) {
      local = await(b);
      awaited[b] = true;
    }
    if (IsStepAbandoned(local)) return leave(local);  // before any all-reduce
    DeviceAllReduce norm_reduce;
    if (several) {
      norm_reduce = [&](float* values, size_t count, cudaStream_t) {
        return reduce.Run(values, count, local);
      };
    } else if (!local.ok()) {
      return leave(local);
    }
    absl::Status s = store.EnqueueBucketNorm(norm_reduce);
    if (!s.ok()) return leave(s);
  }

  absl::Status pending;  // check_bucket's abandon, carried by the next all-reduce
  for (int b = 0; b < nb; ++b) {
    const StepBucket& bucket = buckets[b];
    const absl::Status local = !pending.ok() ? pending : awaited[b] ? absl::OkStatus() : await(b);
    // Before the step's first all-reduce an abandoning daemon just leaves.
    if (b == 0 && !awaited[b] && IsStepAbandoned(local)) return leave(local);
    if (!local.ok()) {
      return leave_at(2 * static_cast<size_t>(bucket.tensor_end - bucket.tensor_begin), local);
    }
    absl::Status s =
        store.EnqueueBucket(bucket.shards, bucket.tensor_begin, bucket.tensor_end,
                            setup.second_round[b] != 0, device_reduce, setup.update_delayed);
    if (s.ok()) s = GPU_STATUS(cudaEventRecord(scratch.bucket_event(b), stream));
    if (!s.ok()) return leave(s);
    if (hooks.check_bucket) pending = hooks.check_bucket();
    if (!pending.ok()) continue;
    if (hooks.on_bucket_enqueued) hooks.on_bucket_enqueued(b, scratch.bucket_event(b));
    announcer.Add(b);
  }

  // Commit barrier: every daemon commits, or none.
  const absl::Status local = !pending.ok()         ? pending
                             : hooks.before_commit ? hooks.before_commit()
                                                   : absl::OkStatus();
  if (several) {
    absl::Status s = reduce.Run(nullptr, 0, local);
    if (s.ok()) s = reduce.CheckPrevious();
    if (!s.ok()) return leave(s);
  } else if (!local.ok()) {
    return leave(local);
  }
  *committed = true;
  absl::Status s = store.CommitBuckets();
  if (!s.ok()) {
    announcer.Stop();
    return s;
  }
  if (hooks.enqueued) hooks.enqueued();
  absl::Status waited =
      setup.wait_stream ? setup.wait_stream(stream, setup.deadline) : absl::OkStatus();
  absl::Status finished = store.FinishStep(setup.deadline);
  if (!waited.ok() || !finished.ok()) {
    announcer.Stop();
    return waited.ok() ? finished : waited;
  }
  return announcer.Finish();
}

}  // namespace gpu_backend
}  // namespace paramd
