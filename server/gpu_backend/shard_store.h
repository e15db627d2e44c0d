// File: server/gpu_backend/shard_store.h
//
// The daemon's GPU backend: every shard's FP32 master, AdamW moments and
// FP32 gradient accumulator live in device memory, and one step
// (server/step/shard_set.h's on the CPU) is a few kernel launches on the store's
// stream with no host wait between them and one wait at the end:
//
//   [the global gradient norm when clipping or skip_step: row sums (taken
//    in the last pusher's add, else here), 128-row block slots, one
//    all-reduce MAX of the slots, the clip factor as a device scalar (one
//    daemon: slots, sum and factor in one launch); server/step/grad_norm.h's
//    order, so the cpu backend's float64 bits]
//   -> AdamW or SGD (fused, gradients times the clip factor, a NaN factor
//   skipping the update; per-tensor lr multiplier and weight decay, frozen
//   tensors not updated; max-updates each tensor's partial source amax in
//   one packed [tensor][direction] device vector)
//   -> columnwise-source amax of rowwise_dequantized copies whose rowwise
//      scale is local (delayed, block formats)
//   -> all-reduce MAX of that vector across daemons (a callback: NCCL's
//      AllReduceMaxDevice, the host bridge, or nothing with one daemon)
//   -> scaling update (current: scale from amax; delayed: after the cast)
//   -> [rowwise_dequantized from an FP8-current/NVFP4 rowwise copy: the
//      columnwise-source amax with the global rowwise scale, and a second
//      all-reduce of the same vector (MAX is idempotent on the reduced
//      slots)]
//   -> quantize both directions into the buffers of version v+1
//   -> one wait (with a deadline), then the version is published.
//
// The packed amax vector has 2 * num_tensors floats, slot 2t = tensor t's
// source amax, slot 2t+1 = its rowwise_dequantized columnwise-source amax
// (0 otherwise): every daemon of a world has the same length whatever it
// holds, so the vector is all-reduced as is.
//
// Two published versions are kept (double buffering): readers of version v
// are never torn by the step that writes v+1; a step writes into the slot of
// v-1. Quantization of tensor i records an event that a fetch of tensor i
// may wait on (TensorReady), so a trainer's fetch of tensor i overlaps the
// quantization of tensor i+1.
//
// Formats: every format of kernels/cuda/quantize.h, both columnwise
// sources. Optimizers: AdamW, SGD (+ momentum), bit-identical to
// server/step/optimizer.cc.
//
// Threading: one thread (the daemon's step thread) calls everything but
// Published(), PublishedScalars(), versions() and TensorReady(), which any
// thread may call at any time (the slot metadata they read is guarded by a
// small mutex, never held across device work). Published buffers of a
// version stay valid and unchanged until the step after next; keeping a
// reader's version from being overwritten by that step is the caller's job
// (the daemon pins fetched versions, server/daemon/daemon_device.cc).
#ifndef PARAMD_SERVER_GPU_BACKEND_SHARD_STORE_H_
#define PARAMD_SERVER_GPU_BACKEND_SHARD_STORE_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/scoped_device.h"
#include "ipc/cuda_vmm.h"
#include "kernels/cuda/optimizer.h"
#include "kernels/cuda/scaling.h"
#include "kernels/format.h"
#include "server/gpu_backend/grad_norm.h"

namespace paramd {
namespace gpu_backend {

// One shard (a whole tensor or a row range of it) held by this daemon.
struct GpuShardDef {
  std::string name;
  int64_t rows = 0;
  int64_t cols = 0;
  HybridSpec spec;
  // Manifest index of the shard's tensor (its amax slots); -1: the shard
  // index (a store of whole, distinct tensors).
  int tensor = -1;
  // The tensor's optimizer overrides (recipe rule): lr multiplier, weight
  // decay (< 0: the options'), frozen (never updated, not in the norm).
  float lr_multiplier = 1.0f;
  float weight_decay = -1.0f;
  bool frozen = false;
  // Its first gradient-norm slot (server/step/grad_norm.h; -1: none).
  int64_t norm_slot = -1;
};

struct GpuStoreOptions {
  int device = 0;
  // Length of the packed amax vector / 2 (the manifest's tensor count, equal
  // on every daemon); 0: 1 + the largest GpuShardDef::tensor (or shards).
  int num_tensors = 0;
  // Whether any tensor of the manifest needs the second all-reduce round
  // (rowwise_dequantized from FP8-current/NVFP4); ORed with the store's own
  // shards. Every daemon of a world must make the same calls.
  bool second_round = false;
  bool sgd = false;       // SGD (sgd_hyper) instead of AdamW
  gpu::AdamWHyper adamw;  // `step` is advanced by the store
  // `first_step` is set by the store. momentum == 0: no momentum buffer.
  gpu::SgdHyper sgd_hyper;
  // Gradient push staging: buffers of the largest shard's size, of
  // push_staging_element_bytes per element (2: BF16 pushes, 4: FP32;
  // pushes are pipelined over them). 0 buffers = none.
  int push_staging_buffers = 2;
  int push_staging_element_bytes = 2;
  // AccumulateHost's upload buffer (device FP32), allocated with the store
  // (min(this, the largest shard's elements)): host values are uploaded and
  // added that many at a time, so no step or push allocates device memory
  // and device_bytes() is fixed from Create on.
  int64_t host_staging_floats = int64_t{1} << 20;  // 4 MiB
  // AdamW steps of a store whose every format takes its scale from before
  // the step (FP8 delayed, MXFP8, FP8 blocks, identity) run as one pass
  // over the masters (gpu::AdamWStepAndQuantize: update, amax and both
  // directions from one read; 30 instead of 34 B/param moved for FP8 row +
  // col). Byte-identical to the two-kernel path; false forces that path.
  bool one_pass_step = true;
  // Allocate the published buffers of both slots and their scalars as
  // exportable device memory (CUDA VMM with POSIX-fd handles; server/ipc/
  // cuda_vmm.h), so same-GPU trainers can map them (exported_regions());
  // falls back to cudaMalloc where the device has no such handles.
  bool exportable_published = true;
  // grad_norm: every optimizer step takes the global gradient norm over
  // norm_slots slots (server/step/grad_norm.h; the manifest's count, equal on
  // every daemon, 0 when every tensor is frozen), all-reduced with the
  // amax's DeviceAllReduce before the optimizer, and clips by
  // max_grad_norm (> 0) / skips a non-finite step (skip_non_finite) inside
  // the optimizer kernels.
  bool grad_norm = false;
  // The norm's buffers without running it yet (SetOptimizerHyper may turn
  // it on later); implied by grad_norm. Non-frozen shards need norm_slot.
  bool grad_norm_state = false;
  int64_t norm_slots = 0;
  float max_grad_norm = 0.0f;
  bool skip_non_finite = false;
};

using ::paramd::ScopedDevice;  // common/scoped_device.h

// Device pointers of one published direction of one shard.
struct GpuPublishedDirection {
  bool present = false;
  Layout layout;
  void* data = nullptr;
  void* scales = nullptr;      // null if layout.scale_bytes() == 0
  float* scale_inv = nullptr;  // per-tensor FP8 (device float)
  float* amax = nullptr;       // NVFP4 global amax / FP8 source amax (device float)
  float* scale = nullptr;      // per-tensor FP8: the multiplier of this cast (device float)
};

// Milliseconds of each phase of the last step, from CUDA events.
struct GpuStepTimings {
  double optimizer_ms = 0;
  double all_reduce_ms = 0;
  double scaling_ms = 0;
  double quantize_ms = 0;
  double total_ms = 0;  // first launch to the end of the wait
  // Of optimizer_ms: the gradient norm (row sums not taken at the last
  // push, block slots, their all-reduce, the clip factor); 0 without.
  double grad_norm_ms = 0;
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
  // Optimizer state: AdamW m / v; SGD momentum buffer in exp_avg (null
  // without momentum; exp_avg_sq null for SGD).
  float* exp_avg(int shard) { return tensors_[shard].exp_avg; }
  float* exp_avg_sq(int shard) { return tensors_[shard].exp_avg_sq; }
  // Per-tensor FP8 multiplier of direction `dir` (0 rowwise, 1 columnwise)
  // that the next cast uses (null unless per-tensor FP8), and the delayed
  // amax history [max(amax_history_len, 1)] (null unless FP8 delayed;
  // history[0] newest, as DelayedScalingState::amax_history).
  float* scale(int shard, int dir) { return tensors_[shard].dirs[dir].scale; }
  float* history(int shard, int dir) { return tensors_[shard].dirs[dir].history; }
  // Optimizer steps applied so far (AdamW bias correction / SGD first step);
  // settable for a restore. `sgd_buffers_fresh`: the next SGD step starts
  // the momentum buffers from the gradient (as a first step).
  int64_t optimizer_steps() const { return optimizer_steps_; }
  // Optimizer steps that ran as the one pass (GpuStoreOptions::one_pass_step).
  int64_t one_pass_steps() const { return one_pass_steps_; }
  void set_optimizer_steps(int64_t steps, bool sgd_buffers_fresh) {
    optimizer_steps_ = steps;
    sgd_fresh_ = sgd_buffers_fresh;
  }
  // Whether the SGD momentum buffers hold nothing yet (the next momentum
  // step starts them from the gradient): ShardSet's unsized state.
  bool sgd_buffers_fresh() const { return sgd_fresh_; }
  // SGD: allocates (zeroed) the momentum buffers of the shards that have
  // none; true if it allocated any (they are then fresh: the caller says
  // so with set_optimizer_steps, or SetOptimizerHyper does). Between steps
  // only.
  absl::StatusOr<bool> AllocateMomentumBuffers();
  // Whether the optimizer steps use the first moment (AdamW, or SGD with
  // momentum on).
  bool MomentumStep() const { return !options_.sgd || options_.sgd_hyper.momentum != 0.0; }
  // Whether shard's accumulator is still all zero: nothing was added since
  // the store was created or the last optimizer step zeroed it (a first
  // pusher may then write instead of add, push_apply.h). Whoever writes
  // grad() directly calls note_grad_written. Step thread / push lock.
  bool grad_zero(int shard) const { return tensors_[shard].grad_zero; }
  void note_grad_written(int shard) { tensors_[shard].grad_zero = false; }
  // Push staging buffer `i` (BF16, largest shard's size), or null.
  void* push_staging(int i) {
    return i < static_cast<int>(staging_.size()) ? staging_[i] : nullptr;
  }

  // grad(shard) += gradient (device, BF16 or FP32), enqueued on stream().
  absl::Status Accumulate(int shard, const void* gradient, bool bf16);
  // grad(shard)[offset, offset + count) += host_values (host FP32): copied
  // to the store's fixed device staging buffer (host_staging_floats, in
  // pieces of whole rows where a row fits) and added, both on stream()
  // (the host buffer may be reused on return; the step that follows on
  // stream() sees the sum; each upload waits for the previous piece's add
  // on the stream). Bit-identical to a host FP32 add. `last_pusher` (the
  // push completing the version) with the norm on and whole rows: the
  // rows' norm sums are taken in the same kernel as the add (grad_norm.h
  // LaunchRowSumSq), so the step needs no pass of its own over them.
  absl::Status AccumulateHost(int shard, int64_t offset, const float* host_values, int64_t count,
                              bool last_pusher = false);
  // grad(shard)[offset, offset + count) += values (device memory on this
  // store's device, BF16 or FP32; 16-byte aligned for BF16), enqueued on
  // stream() (values must stay valid until the work ran there): the device
  // push's add, with the same `last_pusher` row sums as AccumulateHost.
  absl::Status AddPiece(int shard, int64_t offset, const void* values, bool bf16, int64_t count,
                        bool last_pusher);
  // New hyperparameters for the next optimizer steps (AdamW / SGD numbers;
  // the step count and first_step stay the store's) and the gradient norm
  // on or off with its clip bound and skip policy. FAILED_PRECONDITION to
  // turn the norm on in a store without its state. SGD momentum may turn
  // on (the buffers are allocated then, if there are none: the next step
  // starts them from the gradient) or off (plain SGD steps; the buffers
  // stay, unchanged, for a later momentum phase), as ShardSet. Between
  // steps only.
  absl::Status SetOptimizerHyper(const gpu::AdamWHyper& adamw, const gpu::SgdHyper& sgd,
                                 bool grad_norm, float max_grad_norm, bool skip_non_finite);
  // Whether the next step takes a non-finite gradient and skips (the norm
  // on with skip_non_finite: non_finite SKIP_STEP), so pushes must not
  // refuse NaN/Inf. Any thread (a push's check may run beside
  // SetOptimizerHyper; it then sees the old or the new policy).
  bool takes_non_finite() const { return takes_non_finite_.load(std::memory_order_relaxed); }
  // The base lr (schedule) of the next optimizer step; < 0: options' lr.
  void set_step_lr(double lr) { step_lr_ = lr; }
  // After FinishStep of an optimizer step with the norm on: its float64
  // sum of squares (NaN/Inf: the step was skipped if skip_non_finite, and
  // optimizer_steps() did not advance).
  double last_norm_sum_sq() const { return norm_host_ != nullptr ? *norm_host_ : 0.0; }

  // Runs one step producing `new_version` (see the file comment): AdamW on
  // the accumulated gradients when `apply_optimizer`, then quantization.
  // Waits once, until `deadline`. On error the version is not published
  // (the masters may have moved: the daemon reports the error and the
  // coordinator decides). `update_delayed` false leaves the delayed
  // scaling state (history, next scale) as it is (republishing a restored
  // version, as ShardSet::Step).
  absl::Status Step(int64_t new_version, bool apply_optimizer, const DeviceAllReduce& all_reduce,
                    absl::Time deadline, bool update_delayed = true);

  // Like Step but returns after enqueuing everything (no wait), so fetches
  // can start on TensorReady events; FinishStep waits and publishes. From
  // the start of EnqueueStep the older slot's version is no longer found
  // (Published: NOT_FOUND); the new version is found (in flight) from then
  // until FinishStep, and published after it succeeds. On an error of
  // either, nothing is in flight and the new version is not published.
  absl::Status EnqueueStep(int64_t new_version, bool apply_optimizer,
                           const DeviceAllReduce& all_reduce, bool update_delayed = true);
  absl::Status FinishStep(absl::Time deadline);

  // ---- A step bucket by bucket (server/gpu_backend/pipelined_step.h) ----
  // An optimizer step producing `new_version` enqueued in buckets of
  // consecutive manifest tensors, so that a bucket's work can start while
  // the gradients of later ones still arrive:
  //   BeginBuckets, [EnqueueBucketNorm with the norm on, once every
  //   gradient is in grad()], EnqueueBucket per bucket in manifest order,
  //   then CommitBuckets + FinishStep, or AbandonBuckets.
  // The same stages as EnqueueStep restricted to each bucket's shards, so
  // the same bytes (the one-pass kernel is not used: it updates in place).
  // Transactional until CommitBuckets: the optimizer writes the new masters
  // and moments into spare buffers (allocated by the first BeginBuckets:
  // +4 B/param for the master and +4 per moment), the delayed-scaling
  // update waits for the commit, and AbandonBuckets leaves the masters,
  // moments, counters and scaling state as before BeginBuckets (the
  // accumulators too: CommitBuckets zeroes them). From BeginBuckets the
  // older slot's version is gone (as EnqueueStep) and the new one is found
  // in flight; after an abandon it is not found.
  absl::Status BeginBuckets(int64_t new_version);
  absl::Status EnqueueBucketNorm(const DeviceAllReduce& all_reduce);
  // `shards`: this store's shards of manifest tensors [tensor_begin,
  // tensor_end); `second_round`: whether any of those tensors needs the
  // second all-reduce round (by manifest: every daemon makes the same
  // calls). `all_reduce` gets the bucket's run of the packed amax vector
  // (2 * (tensor_end - tensor_begin) floats). Records TensorReady of each
  // shard after its quantization.
  absl::Status EnqueueBucket(absl::Span<const int> shards, int tensor_begin, int tensor_end,
                             bool second_round, const DeviceAllReduce& all_reduce,
                             bool update_delayed);
  // Makes the buckets' state the store's (pointer swaps; the delayed-scaling
  // update and the accumulators' zeroing are enqueued) and marks the end of
  // the step for FinishStep. last_timings(): optimizer_ms is the bucketed
  // part whole, all_reduce_ms / scaling_ms / quantize_ms 0.
  absl::Status CommitBuckets();
  // Drops the bucketed step (no-op when none); the work already enqueued
  // may still run, writing only spares, amaxes and the unpublished slot.
  void AbandonBuckets();
  bool buckets_active() const { return buckets_.active; }
  // Whether optimizer steps take the global gradient norm (clipping or
  // skip_step; SetOptimizerHyper).
  bool grad_norm_on() const { return norm_on_; }

  // The published versions (at most two), newest last.
  std::vector<int64_t> versions() const;
  // Buffers of `version`'s shard/direction; NOT_FOUND for an unknown version.
  // The version of a step in flight (EnqueueStep) is found too: its bytes
  // are valid once TensorReady(shard) has completed.
  absl::StatusOr<GpuPublishedDirection> Published(int64_t version, int shard,
                                                  Direction direction) const;
  // The double-buffer slot (0 or 1) holding published `version` (not one
  // in flight); its buffers' pointers are fixed after Create, so a reader
  // may keep them per slot. NOT_FOUND as Published.
  absl::StatusOr<int> SlotOf(int64_t version) const;
  // The scalars of every published direction of `version` in one device
  // array, [shard][direction][kScalarsPerDirection] floats at kScalarInv,
  // kScalarAmax, kScalarScale (what Published()'s scale_inv / amax / scale
  // point to): one copy fetches them all. NOT_FOUND as Published.
  static constexpr int kScalarsPerDirection = 4;
  static constexpr int kScalarInv = 0;
  static constexpr int kScalarAmax = 1;
  static constexpr int kScalarScale = 2;
  absl::StatusOr<const float*> PublishedScalars(int64_t version) const;
  size_t published_scalars_count() const { return shards_.size() * 2 * kScalarsPerDirection; }
  // The packed [tensor][direction] amax vector of the last step (valid until
  // the next step starts), and its length.
  const float* amax_vector() const { return amax_; }
  size_t amax_count() const { return 2 * static_cast<size_t>(num_tensors_ > 0 ? num_tensors_ : 1); }

  // Recorded when shard's quantization (of the version being stepped or the
  // latest) has been enqueued; a fetch waits on it on its own stream. Every
  // step records it again: wait on it for the step in flight only after
  // EnqueueStep returned (a wait issued earlier stands for the previous
  // record, i.e. the previous step's quantization).
  cudaEvent_t TensorReady(int shard) const { return tensors_[shard].ready; }
  // Recorded at the end of the step in flight (or the last one).
  cudaEvent_t StepDone() const { return events_[4]; }

  // The exportable allocations holding the published buffers (one per
  // slot: its data, scales and scalars), fixed after Create; empty when not
  // exportable. Every pointer Published() returns lies inside one of them.
  const std::vector<std::unique_ptr<ipc::VmmBuffer>>& exported_regions() const { return exported_; }

  const GpuStepTimings& last_timings() const { return timings_; }
  // Every device byte this store allocated (masters, moments, accumulators,
  // staging, published buffers and scaling state), and per parameter; fixed
  // after Create (nothing allocates later). Exportable allocations count
  // their size rounded up to the VMM granularity (2 MiB on an H200): that
  // rounding, at most one granule per slot, is published_padding_bytes().
  int64_t device_bytes() const { return device_bytes_; }
  int64_t published_padding_bytes() const { return padding_bytes_; }
  int64_t host_staging_bytes() const { return host_staging_count_ * 4; }
  int64_t parameters() const { return parameters_; }
  double bytes_per_parameter() const {
    return parameters_ > 0 ? static_cast<double>(device_bytes_) / parameters_ : 0.0;
  }

 private:
  struct DirState {
    float* scale = nullptr;    // per-tensor FP8 multiplier
    float* history = nullptr;  // delayed scaling [amax_history_len]
  };
  struct TensorState {
    float* master = nullptr;
    float* exp_avg = nullptr;
    float* exp_avg_sq = nullptr;
    // Bucketed steps write the new state here (null until EnsureSpares).
    float* spare_master = nullptr;
    float* spare_exp_avg = nullptr;
    float* spare_exp_avg_sq = nullptr;
    float* grad = nullptr;
    double* row_sums = nullptr;  // [rows] gradient norm row sums (norm on)
    bool grad_zero = true;       // grad_zero()
    int64_t fresh_rows = 0;      // rows whose row_sums the last push took
    bool sums_stale = false;     // a plain add came after some of them
    DirState dirs[2];
    cudaEvent_t ready = nullptr;
  };
  struct Slot {
    int64_t version = -1;      // guarded by meta_mu_
    float* scalars = nullptr;  // [shard][direction][kScalarsPerDirection]
    // [shard][direction]
    std::vector<std::array<GpuPublishedDirection, 2>> buffers;
  };

  // A bucketed step in progress (BeginBuckets .. CommitBuckets).
  struct BucketState {
    bool active = false;
    bool norm_done = false;
    int slot = -1;
    int64_t steps_before = 0;
    bool sgd_first_step = false;
    std::vector<gpu::QuantizeTensorArgs> quant;  // per shard, from the spares
    std::vector<char> quantized;
    std::vector<gpu::DelayedScalingArgs> delayed;  // enqueued at the commit
  };

  GpuShardStore(std::vector<GpuShardDef> shards, const GpuStoreOptions& options);
  absl::Status Allocate();
  // The older slot for `new_version` (in flight from now on) / none again.
  absl::StatusOr<int> ClaimSlot(int64_t new_version);
  void ReleaseSlot();
  // EnqueueStep's work after the slot was claimed.
  absl::Status EnqueueInto(int slot, bool apply_optimizer, const DeviceAllReduce& all_reduce,
                           bool update_delayed);
  // EnqueueInto's gradient norm (options_.grad_norm): clip_factor_
  // holds the factor once it ran on stream_.
  absl::Status EnqueueGradNorm(const DeviceAllReduce& all_reduce);
  // The stages of a step over `shards` (shard_store_step.cc). The quantize
  // arguments of shard i into `slot`'s buffers from `source`:
  gpu::QuantizeTensorArgs QuantArgs(int slot, int i, const float* source) const;
  // Optimizer launches (`out_of_place`: into the spares); `quantized[i]`
  // set for the shards the one pass (gpu::AdamWStepAndQuantize) quantized.
  absl::Status EnqueueOptimizer(absl::Span<const int> shards, bool one_pass, bool out_of_place,
                                bool sgd_first_step,
                                const std::vector<gpu::QuantizeTensorArgs>& quant,
                                std::vector<char>& quantized);
  absl::Status EnqueueColumnwiseSourceAmax(absl::Span<const int> shards,
                                           const std::vector<gpu::QuantizeTensorArgs>& quant,
                                           bool second_round);
  absl::Status EnqueueCurrentScaling(absl::Span<const int> shards, int round);
  // Columnwise-source amaxes, the all-reduce of amax[0, amax_count), current
  // scaling, and the second round when `second_round`.
  absl::Status EnqueueReduceAndScaling(absl::Span<const int> shards,
                                       const std::vector<gpu::QuantizeTensorArgs>& quant,
                                       float* amax, size_t amax_count, bool second_round,
                                       const DeviceAllReduce& all_reduce, bool record_events);
  // Published scalars and quantization of `shards`, TensorReady recorded;
  // their delayed-scaling updates appended to `delayed`.
  absl::Status EnqueueQuantize(int slot, absl::Span<const int> shards,
                               const std::vector<gpu::QuantizeTensorArgs>& quant,
                               const std::vector<char>& quantized, bool update_delayed,
                               std::vector<gpu::DelayedScalingArgs>* delayed);
  absl::Status EnsureSpares();
  // INVALID_ARGUMENT unless [offset, offset + count) lies in shard's elements.
  absl::Status CheckPiece(int shard, int64_t offset, int64_t count) const;
  // Index in amax_ of shard `i`'s direction `dir` amax.
  int AmaxSlot(int i, int dir) const;
  absl::StatusOr<void*> Alloc(size_t bytes);
  // Alloc for published buffers: exportable when possible.
  absl::StatusOr<void*> AllocPublished(size_t bytes);

  std::vector<GpuShardDef> shards_;
  GpuStoreOptions options_;
  cudaStream_t stream_ = nullptr;
  std::vector<TensorState> tensors_;
  std::vector<void*> staging_;
  float* host_staging_ = nullptr;  // AccumulateHost's device buffer (in allocations_)
  int64_t host_staging_count_ = 0;
  float* amax_ = nullptr;  // packed [tensor][direction]
  int num_tensors_ = 0;
  // Slot metadata read by other threads (Published & co.); buffers and
  // scalars pointers are fixed after Allocate and read without it.
  mutable absl::Mutex meta_mu_;
  Slot slots_[2];
  int writing_slot_ ABSL_GUARDED_BY(meta_mu_) = -1;  // slot of the step in flight
  int64_t pending_version_ ABSL_GUARDED_BY(meta_mu_) = -1;
  absl::Time step_start_;
  cudaEvent_t events_[5] = {};
  std::vector<void*> allocations_;
  std::vector<std::unique_ptr<ipc::VmmBuffer>> exported_;
  int64_t device_bytes_ = 0;
  int64_t padding_bytes_ = 0;
  int64_t parameters_ = 0;
  int64_t optimizer_steps_ = 0;
  int64_t one_pass_steps_ = 0;
  bool sgd_fresh_ = false;
  GpuStepTimings timings_;
  double step_lr_ = -1.0;
  // Gradient norm (its state allocated; norm_on_: it runs): the slots, the float64 sum and
  // the clip factor on the device, the sum's page-locked host copy, and
  // the step's state to undo when it is skipped.
  bool norm_on_ = false;
  float max_grad_norm_ = 0.0f;
  bool skip_non_finite_ = false;
  float* norm_slots_ = nullptr;
  NormSlotSource* norm_sources_ = nullptr;  // [max(norm_slots, 1)]
  float* clip_factor_ = nullptr;
  unsigned int* norm_counter_ = nullptr;  // LaunchNormSlotsAndClipFactor's
  double* norm_host_ = nullptr;           // mapped page-locked
  double* norm_host_device_ = nullptr;    // its device address
  cudaEvent_t norm_done_ = nullptr;
  bool norm_in_step_ = false;
  std::atomic<bool> takes_non_finite_{false};  // norm_on_ && skip_non_finite_
  bool fresh_before_step_ = false;
  bool spares_allocated_ = false;
  BucketState buckets_;
};

}  // namespace gpu_backend
}  // namespace paramd

#endif  // PARAMD_SERVER_GPU_BACKEND_SHARD_STORE_H_
