// File: server/gpu_backend/shard_store.h
//
// The daemon's GPU backend (issue 5): every shard's FP32 master, AdamW
// moments and FP32 gradient accumulator live in device memory, and one step
// (DESIGN.md §3) is a few kernel launches on the store's stream with no
// host wait between them and one wait at the end:
//
//   AdamW (fused, writes each tensor's partial amax into one packed vector)
//   -> all-reduce MAX of that vector across daemons (a callback: NCCL's
//      AllReduceMaxDevice, or nothing with one daemon)
//   -> scaling update (current: scale from amax; delayed: after the cast)
//   -> quantize both directions into the buffers of version v+1
//   -> one wait (with a deadline), then the version is published.
//
// Two published versions are kept (double buffering): readers of version v
// are never torn by the step that writes v+1; a step writes into the slot of
// v-1. Quantization of tensor i records an event that a fetch of tensor i
// may wait on (TensorReady), so a trainer's fetch of tensor i overlaps the
// quantization of tensor i+1.
//
// Formats: every format of kernels/cuda/quantize.h with columnwise_source =
// kOriginal; kRowwiseDequantized is UNIMPLEMENTED here (it needs a second
// all-reduce; the CPU backend has it).
//
// Threading: not thread-safe; the daemon's step thread owns it. Published
// buffers of a version stay valid and unchanged until the step after next.
#ifndef PARAMD_SERVER_GPU_BACKEND_SHARD_STORE_H_
#define PARAMD_SERVER_GPU_BACKEND_SHARD_STORE_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/cuda/optimizer.h"
#include "kernels/format.h"

namespace paramd {
namespace gpu_backend {

// One shard (a whole tensor or a row range of it) held by this daemon.
struct GpuShardDef {
  std::string name;
  int64_t rows = 0;
  int64_t cols = 0;
  HybridSpec spec;
};

struct GpuStoreOptions {
  int device = 0;
  gpu::AdamWHyper adamw;  // `step` is advanced by the store
  // Gradient push staging: buffers of the largest shard's size, of
  // push_staging_element_bytes per element (2: BF16 pushes, 4: FP32;
  // pushes are pipelined over them). 0 buffers = none.
  int push_staging_buffers = 2;
  int push_staging_element_bytes = 2;
};

// Device pointers of one published direction of one shard.
struct GpuPublishedDirection {
  bool present = false;
  Layout layout;
  void* data = nullptr;
  void* scales = nullptr;     // null if layout.scale_bytes() == 0
  float* scale_inv = nullptr;  // per-tensor FP8 (device float)
  float* amax = nullptr;       // NVFP4 global amax / FP8 source amax (device float)
};

// Milliseconds of each phase of the last step, from CUDA events.
struct GpuStepTimings {
  double optimizer_ms = 0;
  double all_reduce_ms = 0;
  double scaling_ms = 0;
  double quantize_ms = 0;
  double total_ms = 0;  // first launch to the end of the wait
};

// All-reduce MAX of `count` device floats at `values`, ordered on `stream`
// (enqueue-only). Null: a single daemon.
using DeviceAllReduce =
    std::function<absl::Status(float* values, size_t count, cudaStream_t stream)>;

class GpuShardStore {
 public:
  // Allocates everything up front (masters zero; see master()).
  // INVALID_ARGUMENT for bad shapes/specs, UNIMPLEMENTED for
  // kRowwiseDequantized, RESOURCE_EXHAUSTED when the device is full.
  static absl::StatusOr<std::unique_ptr<GpuShardStore>> Create(std::vector<GpuShardDef> shards,
                                                               const GpuStoreOptions& options);
  ~GpuShardStore();

  int device() const { return options_.device; }
  cudaStream_t stream() const { return stream_; }
  const std::vector<GpuShardDef>& shards() const { return shards_; }

  // Device pointers, row-major [rows][cols] FP32.
  float* master(int shard) { return tensors_[shard].master; }
  float* grad(int shard) { return tensors_[shard].grad; }
  // Push staging buffer `i` (BF16, largest shard's size), or null.
  void* push_staging(int i) { return i < static_cast<int>(staging_.size()) ? staging_[i] : nullptr; }

  // grad(shard) += gradient (device, BF16 or FP32), enqueued on stream().
  absl::Status Accumulate(int shard, const void* gradient, bool bf16);

  // Runs one step producing `new_version` (see the file comment): AdamW on
  // the accumulated gradients when `apply_optimizer`, then quantization.
  // Waits once, until `deadline`. On error the version is not published
  // (the masters may have moved: the daemon reports the error and the
  // coordinator decides).
  absl::Status Step(int64_t new_version, bool apply_optimizer, const DeviceAllReduce& all_reduce,
                    absl::Time deadline);

  // Like Step but returns after enqueuing everything (no wait), so fetches
  // can start on TensorReady events; FinishStep waits and publishes.
  absl::Status EnqueueStep(int64_t new_version, bool apply_optimizer,
                           const DeviceAllReduce& all_reduce);
  absl::Status FinishStep(absl::Time deadline);

  // The published versions (at most two), newest last.
  std::vector<int64_t> versions() const;
  // Buffers of `version`'s shard/direction; NOT_FOUND for an unknown version.
  // The version of a step in flight (EnqueueStep) is found too: its bytes
  // are valid once TensorReady(shard) has completed.
  absl::StatusOr<GpuPublishedDirection> Published(int64_t version, int shard,
                                                  Direction direction) const;
  // Recorded when shard's quantization (of the version being stepped or the
  // latest) has been enqueued; a fetch waits on it on its own stream.
  cudaEvent_t TensorReady(int shard) const { return tensors_[shard].ready; }
  // Recorded at the end of the step in flight (or the last one).
  cudaEvent_t StepDone() const { return events_[4]; }

  const GpuStepTimings& last_timings() const { return timings_; }
  // Every device byte this store allocated (masters, moments, accumulators,
  // staging, published buffers and scaling state), and per parameter.
  int64_t device_bytes() const { return device_bytes_; }
  int64_t parameters() const { return parameters_; }
  double bytes_per_parameter() const {
    return parameters_ > 0 ? static_cast<double>(device_bytes_) / parameters_ : 0.0;
  }

 private:
  struct DirState {
    float* scale = nullptr;      // per-tensor FP8 multiplier
    float* history = nullptr;    // delayed scaling [amax_history_len]
  };
  struct TensorState {
    float* master = nullptr;
    float* exp_avg = nullptr;
    float* exp_avg_sq = nullptr;
    float* grad = nullptr;
    DirState dirs[2];
    cudaEvent_t ready = nullptr;
  };
  struct Slot {
    int64_t version = -1;
    // [shard][direction]
    std::vector<std::array<GpuPublishedDirection, 2>> buffers;
  };

  GpuShardStore(std::vector<GpuShardDef> shards, const GpuStoreOptions& options);
  absl::Status Allocate();
  absl::StatusOr<void*> Alloc(size_t bytes);

  std::vector<GpuShardDef> shards_;
  GpuStoreOptions options_;
  cudaStream_t stream_ = nullptr;
  std::vector<TensorState> tensors_;
  std::vector<void*> staging_;
  float* amax_ = nullptr;  // packed, one per shard
  Slot slots_[2];
  int writing_slot_ = -1;  // slot of the step in flight
  int64_t pending_version_ = -1;
  absl::Time step_start_;
  cudaEvent_t events_[5] = {};
  std::vector<void*> allocations_;
  int64_t device_bytes_ = 0;
  int64_t parameters_ = 0;
  int64_t optimizer_steps_ = 0;
  GpuStepTimings timings_;
};

}  // namespace gpu_backend
}  // namespace paramd

#endif  // PARAMD_SERVER_GPU_BACKEND_SHARD_STORE_H_
