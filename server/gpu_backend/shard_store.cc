#include "server/gpu_backend/shard_store.h"

#include <cmath>
#include <map>

#include <algorithm>
#include <array>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/gpu_status.h"
#include "common/status_macros.h"
#include "kernels/cuda/amax.h"
#include "kernels/cuda/quantize.h"
#include "kernels/cuda/scaling.h"
#include "server/gpu_backend/accumulate.h"
#include "server/gpu_backend/grad_norm.h"
#include "server/gpu_backend/spec_rules.h"

namespace paramd {
namespace gpu_backend {
namespace {

constexpr size_t kAlign = 256;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

using rules::Computed;
using rules::PerTensorFp8;
using rules::SpecOf;
using rules::Uses;

}  // namespace

GpuShardStore::GpuShardStore(std::vector<GpuShardDef> shards, const GpuStoreOptions& options)
    : shards_(std::move(shards)),
      options_(options),
      norm_on_(options.grad_norm),
      max_grad_norm_(options.max_grad_norm),
      skip_non_finite_(options.skip_non_finite),
      takes_non_finite_(options.grad_norm && options.skip_non_finite) {}

GpuShardStore::~GpuShardStore() {
  ScopedDevice guard(options_.device);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  for (TensorState& t : tensors_) {
    if (t.ready != nullptr) cudaEventDestroy(t.ready);
  }
  for (cudaEvent_t e : events_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  for (void* p : allocations_) cudaFree(p);
  if (norm_host_ != nullptr) cudaFreeHost(norm_host_);
  if (norm_done_ != nullptr) cudaEventDestroy(norm_done_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::StatusOr<std::unique_ptr<GpuShardStore>> GpuShardStore::Create(
    std::vector<GpuShardDef> shards, const GpuStoreOptions& options) {
  int max_tensor = -1;
  for (size_t i = 0; i < shards.size(); ++i) {
    const GpuShardDef& s = shards[i];
    max_tensor = std::max(max_tensor, s.tensor >= 0 ? s.tensor : static_cast<int>(i));
    if (options.num_tensors > 0 && s.tensor >= options.num_tensors) {
      return absl::InvalidArgumentError(absl::StrCat(s.name, ": tensor index ", s.tensor,
                                                     " outside num_tensors ", options.num_tensors));
    }
    for (int dir = 0; dir < 2; ++dir) {
      if (!Uses(s.spec, dir)) continue;
      absl::StatusOr<Layout> layout =
          ComputeLayout(SpecOf(s.spec, dir), static_cast<Direction>(dir), s.rows, s.cols);
      if (!layout.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(s.name, ": ", layout.status().message()));
      }
    }
  }
  std::unique_ptr<GpuShardStore> store(new GpuShardStore(std::move(shards), options));
  store->num_tensors_ = options.num_tensors > 0 ? options.num_tensors : max_tensor + 1;
  RETURN_IF_ERROR(store->Allocate());
  return store;
}

absl::StatusOr<void*> GpuShardStore::Alloc(size_t bytes) {
  void* p = nullptr;
  GPU_RETURN_IF_ERROR(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
  allocations_.push_back(p);
  device_bytes_ += static_cast<int64_t>(bytes);
  GPU_RETURN_IF_ERROR(cudaMemsetAsync(p, 0, bytes, stream_));
  return p;
}

absl::StatusOr<void*> GpuShardStore::AllocPublished(size_t bytes) {
  if (!options_.exportable_published || !ipc::VmmBuffer::Supported(options_.device)) {
    return Alloc(bytes);
  }
  ASSIGN_OR_RETURN(ipc::VmmBuffer b, ipc::VmmBuffer::Allocate(bytes, options_.device));
  void* p = b.data();
  device_bytes_ += static_cast<int64_t>(b.size());
  padding_bytes_ += static_cast<int64_t>(b.size() - bytes);
  exported_.push_back(std::make_unique<ipc::VmmBuffer>(std::move(b)));
  GPU_RETURN_IF_ERROR(cudaMemsetAsync(p, 0, bytes, stream_));
  return p;
}

absl::Status GpuShardStore::Allocate() {
  ScopedDevice guard(options_.device);
  GPU_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  for (cudaEvent_t& e : events_) GPU_RETURN_IF_ERROR(cudaEventCreate(&e));
  const size_t n_shards = shards_.size();
  tensors_.resize(n_shards);
  int64_t largest = 0;
  for (size_t i = 0; i < n_shards; ++i) {
    const int64_t count = shards_[i].rows * shards_[i].cols;
    parameters_ += count;
    largest = std::max(largest, count);
    TensorState& t = tensors_[i];
    GPU_RETURN_IF_ERROR(cudaEventCreateWithFlags(&t.ready, cudaEventDisableTiming));
    // Big buffers: one allocation each (cudaMalloc of > 2^31 elements is fine).
    // SGD keeps only the momentum buffer (none without momentum).
    const bool first_moment = !options_.sgd || options_.sgd_hyper.momentum != 0.0;
    for (float** p : {&t.master, &t.exp_avg, &t.exp_avg_sq, &t.grad}) {
      if (p == &t.exp_avg && !first_moment) continue;
      if (p == &t.exp_avg_sq && options_.sgd) continue;
      ASSIGN_OR_RETURN(void* mem, Alloc(count * sizeof(float)));
      *p = static_cast<float*>(mem);
    }
  }
  for (int i = 0; i < options_.push_staging_buffers; ++i) {
    ASSIGN_OR_RETURN(void* mem, Alloc(largest * options_.push_staging_element_bytes));
    staging_.push_back(mem);
  }
  host_staging_count_ = std::min(largest, std::max<int64_t>(options_.host_staging_floats, 1));
  if (largest > 0) {
    ASSIGN_OR_RETURN(void* mem, Alloc(host_staging_count_ * sizeof(float)));
    host_staging_ = static_cast<float*>(mem);
  }
  if (options_.grad_norm || options_.grad_norm_state) {
    // Row sums per non-frozen shard, the slot vector with its source table
    // (which rows make each slot of this daemon), the clip factor, and the
    // float64 sum in mapped page-locked memory (the kernel writes it there:
    // no copy on the stream).
    const int64_t slots = std::max<int64_t>(options_.norm_slots, 1);
    std::vector<NormSlotSource> table(slots);
    for (size_t i = 0; i < n_shards; ++i) {
      const GpuShardDef& d = shards_[i];
      if (d.frozen) continue;
      // 128-row blocks: server/step/grad_norm.h kGradNormBlockRows.
      if (d.norm_slot < 0 || d.norm_slot + (d.rows + 127) / 128 > options_.norm_slots) {
        return absl::InvalidArgumentError(
            absl::StrCat("gradient norm: shard ", d.name, " has no slots in the norm's vector"));
      }
      ASSIGN_OR_RETURN(void* mem, Alloc(d.rows * sizeof(double)));
      tensors_[i].row_sums = static_cast<double*>(mem);
      for (int64_t b = 0; b * 128 < d.rows; ++b) {
        table[d.norm_slot + b] = {tensors_[i].row_sums + 128 * b,
                                  static_cast<int32_t>(std::min<int64_t>(128, d.rows - 128 * b))};
      }
    }
    ASSIGN_OR_RETURN(void* vec, Alloc(4 * slots * sizeof(float)));
    norm_slots_ = static_cast<float*>(vec);
    ASSIGN_OR_RETURN(void* sources, Alloc(slots * sizeof(NormSlotSource)));
    norm_sources_ = static_cast<NormSlotSource*>(sources);
    // On stream_, after Alloc's zeroing of the table (stream-ordered there).
    GPU_RETURN_IF_ERROR(cudaMemcpyAsync(norm_sources_, table.data(), slots * sizeof(NormSlotSource),
                                        cudaMemcpyHostToDevice, stream_));
    GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    ASSIGN_OR_RETURN(void* factor, Alloc(sizeof(float)));
    clip_factor_ = static_cast<float*>(factor);
    ASSIGN_OR_RETURN(void* counter, Alloc(sizeof(unsigned int)));
    norm_counter_ = static_cast<unsigned int*>(counter);
    void* host = nullptr;
    GPU_RETURN_IF_ERROR(cudaHostAlloc(&host, sizeof(double), cudaHostAllocMapped));
    norm_host_ = static_cast<double*>(host);
    *norm_host_ = 0.0;
    void* device = nullptr;
    GPU_RETURN_IF_ERROR(cudaHostGetDevicePointer(&device, host, 0));
    norm_host_device_ = static_cast<double*>(device);
    GPU_RETURN_IF_ERROR(cudaEventCreate(&norm_done_));
  }
  // Small state: carved from one allocation.
  size_t small_bytes = AlignUp(amax_count() * sizeof(float));  // packed amax
  auto history_len = [](const QuantSpec& q) { return std::max(q.amax_history_len, 1); };
  for (size_t i = 0; i < n_shards; ++i) {
    for (int dir = 0; dir < 2; ++dir) {
      const QuantSpec& q = SpecOf(shards_[i].spec, dir);
      if (!Computed(shards_[i].spec, dir)) continue;
      if (PerTensorFp8(q.format)) small_bytes += AlignUp(sizeof(float));
      if (q.format == Format::kFp8Delayed && Uses(shards_[i].spec, dir)) {
        small_bytes += AlignUp(history_len(q) * 4);
      }
    }
  }
  ASSIGN_OR_RETURN(void* small, Alloc(small_bytes));
  uint8_t* cursor = static_cast<uint8_t*>(small);
  auto carve = [&cursor](size_t bytes) {
    void* p = cursor;
    cursor += AlignUp(bytes);
    return p;
  };
  amax_ = static_cast<float*>(carve(amax_count() * sizeof(float)));
  const float one = 1.0f;
  for (size_t i = 0; i < n_shards; ++i) {
    for (int dir = 0; dir < 2; ++dir) {
      const QuantSpec& q = SpecOf(shards_[i].spec, dir);
      if (!Computed(shards_[i].spec, dir)) continue;
      DirState& d = tensors_[i].dirs[dir];
      if (PerTensorFp8(q.format)) {
        d.scale = static_cast<float*>(carve(sizeof(float)));
        GPU_RETURN_IF_ERROR(
            cudaMemcpyAsync(d.scale, &one, sizeof(float), cudaMemcpyHostToDevice, stream_));
        GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));  // `one` is on this stack
      }
      if (q.format == Format::kFp8Delayed && Uses(shards_[i].spec, dir)) {
        d.history = static_cast<float*>(carve(history_len(q) * 4));
      }
    }
  }
  // Published buffers: one allocation per slot holding its data, scales
  // and (last) its scalars: each exportable allocation is rounded up to the
  // VMM granularity, so one per slot keeps that rounding to one granule.
  const size_t scalar_bytes = std::max<size_t>(n_shards, 1) * 2 * kScalarsPerDirection * 4;
  for (Slot& slot : slots_) {
    slot.buffers.resize(n_shards);
    size_t bytes = 0;
    uint8_t* p = nullptr;
    for (int pass = 0; pass < 2; ++pass) {
      if (pass == 1) {
        ASSIGN_OR_RETURN(void* mem, AllocPublished(bytes + scalar_bytes));
        p = static_cast<uint8_t*>(mem);
        slot.scalars = reinterpret_cast<float*>(p + bytes);
      }
      size_t offset = 0;
      for (size_t i = 0; i < n_shards; ++i) {
        for (int dir = 0; dir < 2; ++dir) {
          if (!Uses(shards_[i].spec, dir)) continue;
          GpuPublishedDirection& out = slot.buffers[i][dir];
          ASSIGN_OR_RETURN(Layout layout,
                           ComputeLayout(SpecOf(shards_[i].spec, dir), static_cast<Direction>(dir),
                                         shards_[i].rows, shards_[i].cols));
          auto take = [&](size_t n) -> void* {
            void* at = p == nullptr ? nullptr : p + offset;
            offset += AlignUp(n);
            return at;
          };
          void* data = take(layout.data_bytes());
          void* scales = layout.scale_bytes() > 0 ? take(layout.scale_bytes()) : nullptr;
          if (pass == 1) {
            float* scalars = slot.scalars + (2 * i + dir) * kScalarsPerDirection;
            out.present = true;
            out.layout = layout;
            out.data = data;
            out.scales = scales;
            out.scale_inv = scalars + kScalarInv;
            out.amax = scalars + kScalarAmax;
            out.scale = scalars + kScalarScale;
          }
        }
      }
      bytes = offset;
    }
  }
  GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status GpuShardStore::Accumulate(int shard, const void* gradient, bool bf16) {
  if (shard < 0 || shard >= static_cast<int>(shards_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("shard ", shard));
  }
  return AddPiece(shard, 0, gradient, bf16, shards_[shard].rows * shards_[shard].cols,
                  /*last_pusher=*/false);
}

int GpuShardStore::AmaxSlot(int i, int dir) const {
  const int t = shards_[i].tensor >= 0 ? shards_[i].tensor : i;
  return 2 * t + (dir == 1 && rules::Dequantized(shards_[i].spec) ? 1 : 0);
}

absl::Status GpuShardStore::CheckPiece(int shard, int64_t offset, int64_t count) const {
  if (shard < 0 || shard >= static_cast<int>(shards_.size()) || offset < 0 || count < 0 ||
      offset + count > shards_[shard].rows * shards_[shard].cols) {
    return absl::InvalidArgumentError(
        absl::StrCat("gradient piece [", offset, ", +", count, ") outside shard ", shard));
  }
  return absl::OkStatus();
}

absl::Status GpuShardStore::AccumulateHost(int shard, int64_t offset, const float* host_values,
                                           int64_t count, bool last_pusher) {
  RETURN_IF_ERROR(CheckPiece(shard, offset, count));
  if (count == 0) return absl::OkStatus();
  if (host_staging_ == nullptr) return absl::InternalError("store without upload staging");
  ScopedDevice guard(options_.device);
  // Pieces of whole rows when a row fits the staging buffer (the row sums
  // of the last pusher's add need whole rows), else of the buffer's size.
  const int64_t cols = shards_[shard].cols;
  const int64_t piece = cols <= host_staging_count_ && offset % cols == 0
                            ? host_staging_count_ / cols * cols
                            : host_staging_count_;
  for (int64_t done = 0; done < count; done += piece) {
    const int64_t n = std::min(piece, count - done);
    // Stream-ordered after the previous piece's add (same stream).
    GPU_RETURN_IF_ERROR(cudaMemcpyAsync(host_staging_, host_values + done, n * sizeof(float),
                                        cudaMemcpyHostToDevice, stream_));
    RETURN_IF_ERROR(AddPiece(shard, offset + done, host_staging_, /*bf16=*/false, n, last_pusher));
  }
  return absl::OkStatus();
}

absl::Status GpuShardStore::AddPiece(int shard, int64_t offset, const void* values, bool bf16,
                                     int64_t count, bool last_pusher) {
  RETURN_IF_ERROR(CheckPiece(shard, offset, count));
  if (count == 0) return absl::OkStatus();
  ScopedDevice guard(options_.device);
  TensorState& t = tensors_[shard];
  const int64_t cols = shards_[shard].cols;
  if (last_pusher && norm_on_ && t.row_sums != nullptr && offset % cols == 0 && count % cols == 0) {
    GPU_RETURN_IF_ERROR(LaunchRowSumSq(t.grad + offset, values, bf16, count / cols, cols,
                                       t.row_sums + offset / cols, stream_));
    t.fresh_rows += count / cols;
    t.grad_zero = false;
    return absl::OkStatus();
  }
  // Rows summed by an earlier add may change: the step sums them again.
  if (t.fresh_rows > 0) t.sums_stale = true;
  t.grad_zero = false;
  GPU_RETURN_IF_ERROR(LaunchAccumulate(t.grad + offset, values, bf16, count, stream_));
  return absl::OkStatus();
}

absl::Status GpuShardStore::SetOptimizerHyper(const gpu::AdamWHyper& adamw,
                                              const gpu::SgdHyper& sgd, bool grad_norm,
                                              float max_grad_norm, bool skip_non_finite) {
  if (grad_norm && norm_slots_ == nullptr) {
    return absl::FailedPreconditionError(
        "this store was created without the gradient norm's state (GpuStoreOptions::grad_norm)");
  }
  // SGD momentum turned on: the buffers, if this store has none yet (as
  // ShardSet, a first momentum step then starts them from the gradient;
  // buffers kept from an earlier momentum phase carry on). First: a
  // failed allocation changes nothing else.
  if (options_.sgd && sgd.momentum != 0.0) {
    ASSIGN_OR_RETURN(const bool allocated, AllocateMomentumBuffers());
    if (allocated) sgd_fresh_ = true;
  }
  const int64_t step = options_.adamw.step;
  const bool first = options_.sgd_hyper.first_step;
  options_.adamw = adamw;
  options_.sgd_hyper = sgd;
  options_.adamw.step = step;
  options_.sgd_hyper.first_step = first;
  norm_on_ = grad_norm;
  max_grad_norm_ = max_grad_norm;
  skip_non_finite_ = skip_non_finite;
  takes_non_finite_.store(grad_norm && skip_non_finite, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::StatusOr<bool> GpuShardStore::AllocateMomentumBuffers() {
  if (!options_.sgd) return false;
  ScopedDevice guard(options_.device);
  bool allocated = false;
  for (size_t i = 0; i < shards_.size(); ++i) {
    TensorState& t = tensors_[i];
    if (t.exp_avg != nullptr) continue;
    // Zeroed on stream_ (Alloc), before any step that reads it.
    const int64_t bytes = shards_[i].rows * shards_[i].cols * sizeof(float);
    ASSIGN_OR_RETURN(void* mem, Alloc(bytes));
    t.exp_avg = static_cast<float*>(mem);
    // A store that already ran bucketed steps has spares for the
    // out-of-place optimizer (EnsureSpares): the new buffer gets one too.
    if (spares_allocated_ && !shards_[i].frozen) {
      ASSIGN_OR_RETURN(void* spare, Alloc(bytes));
      t.spare_exp_avg = static_cast<float*>(spare);
    }
    allocated = true;
  }
  return allocated;
}

absl::Status GpuShardStore::EnqueueGradNorm(const DeviceAllReduce& all_reduce) {
  // server/step/grad_norm.h's order: row sums the last push did not take, the
  // slot vector (this daemon's block slots, 0 elsewhere) in one launch, one
  // all-reduce MAX of it, then one kernel for the float64 sum (into mapped
  // host memory) and the clip factor (a device scalar). Few launches: the
  // GPU waits for their enqueue.
  for (size_t i = 0; i < shards_.size(); ++i) {
    TensorState& t = tensors_[i];
    if (t.row_sums == nullptr) continue;
    if (t.fresh_rows != shards_[i].rows || t.sums_stale) {
      GPU_RETURN_IF_ERROR(LaunchRowSumSq(t.grad, nullptr, false, shards_[i].rows, shards_[i].cols,
                                         t.row_sums, stream_));
    }
    t.fresh_rows = 0;
    t.sums_stale = false;
  }
  if (!all_reduce) {
    // One daemon: the slots, their sum and the factor in one launch.
    GPU_RETURN_IF_ERROR(LaunchNormSlotsAndClipFactor(
        norm_sources_, options_.norm_slots, norm_slots_, norm_counter_, max_grad_norm_,
        skip_non_finite_, norm_host_device_, clip_factor_, stream_));
  } else {
    GPU_RETURN_IF_ERROR(
        LaunchEncodeNormSlots(norm_sources_, options_.norm_slots, norm_slots_, stream_));
    RETURN_IF_ERROR(all_reduce(norm_slots_, 4 * options_.norm_slots, stream_));
    GPU_RETURN_IF_ERROR(LaunchClipFactor(norm_slots_, options_.norm_slots, max_grad_norm_,
                                         skip_non_finite_, norm_host_device_, clip_factor_,
                                         stream_));
  }
  GPU_RETURN_IF_ERROR(cudaEventRecord(norm_done_, stream_));
  return absl::OkStatus();
}

absl::Status GpuShardStore::FinishStep(absl::Time deadline) {
  int slot;
  int64_t version;
  {
    absl::MutexLock lock(&meta_mu_);
    if (writing_slot_ < 0) return absl::FailedPreconditionError("no step in flight");
    slot = writing_slot_;
    version = pending_version_;
  }
  ScopedDevice guard(options_.device);
  absl::Status s;
  for (int spin = 0;; ++spin) {
    cudaError_t q = cudaEventQuery(events_[4]);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) {
      s = GPU_STATUS(q);
      break;
    }
    if (absl::Now() >= deadline) {
      s = absl::DeadlineExceededError("GPU step did not finish before its deadline");
      break;
    }
    if (spin < 1000) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(absl::Microseconds(50));
    }
  }
  float ms[4] = {0, 0, 0, 0};
  for (int i = 0; i < 4 && s.ok(); ++i) {
    s = GPU_STATUS(cudaEventElapsedTime(&ms[i], events_[i], events_[i + 1]));
  }
  absl::MutexLock lock(&meta_mu_);
  writing_slot_ = -1;
  pending_version_ = -1;
  if (!s.ok()) return s;
  timings_.optimizer_ms = ms[0];
  timings_.all_reduce_ms = ms[1];
  timings_.scaling_ms = ms[2];
  timings_.quantize_ms = ms[3];
  timings_.grad_norm_ms = 0;
  if (norm_in_step_) {
    float norm_ms = 0;
    if (cudaEventElapsedTime(&norm_ms, events_[0], norm_done_) == cudaSuccess) {
      timings_.grad_norm_ms = norm_ms;
    }
    // A skipped step (non-finite norm): the counters stay as before it.
    if (skip_non_finite_ && !std::isfinite(*norm_host_)) {
      --optimizer_steps_;
      sgd_fresh_ = fresh_before_step_;
    }
  }
  timings_.total_ms = absl::ToDoubleMilliseconds(absl::Now() - step_start_);
  slots_[slot].version = version;
  return absl::OkStatus();
}

absl::Status GpuShardStore::Step(int64_t new_version, bool apply_optimizer,
                                 const DeviceAllReduce& all_reduce, absl::Time deadline,
                                 bool update_delayed) {
  const absl::Time start = absl::Now();
  RETURN_IF_ERROR(EnqueueStep(new_version, apply_optimizer, all_reduce, update_delayed));
  step_start_ = start;
  return FinishStep(deadline);
}

absl::StatusOr<const float*> GpuShardStore::PublishedScalars(int64_t version) const {
  absl::MutexLock lock(&meta_mu_);
  for (const Slot& s : slots_) {
    if (s.version == version && version >= 0) return s.scalars;
  }
  return absl::NotFoundError(absl::StrCat("version ", version, " is not published here"));
}

std::vector<int64_t> GpuShardStore::versions() const {
  std::vector<int64_t> v;
  absl::MutexLock lock(&meta_mu_);
  for (const Slot& s : slots_) {
    if (s.version >= 0) v.push_back(s.version);
  }
  std::sort(v.begin(), v.end());
  return v;
}

absl::StatusOr<GpuPublishedDirection> GpuShardStore::Published(int64_t version, int shard,
                                                               Direction direction) const {
  if (shard < 0 || shard >= static_cast<int>(shards_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("shard ", shard));
  }
  absl::MutexLock lock(&meta_mu_);
  for (int i = 0; i < 2; ++i) {
    const Slot& s = slots_[i];
    const bool in_flight = i == writing_slot_ && version == pending_version_ && version >= 0;
    if ((s.version == version && version >= 0) || in_flight) {
      const GpuPublishedDirection& d = s.buffers[shard][static_cast<int>(direction)];
      if (!d.present) {
        return absl::NotFoundError(
            absl::StrCat(shards_[shard].name, " has no ", DirectionName(direction), " copy"));
      }
      return d;
    }
  }
  return absl::NotFoundError(absl::StrCat("version ", version, " is not published here"));
}

absl::StatusOr<int> GpuShardStore::SlotOf(int64_t version) const {
  absl::MutexLock lock(&meta_mu_);
  for (int i = 0; i < 2; ++i) {
    if (version >= 0 && slots_[i].version == version && i != writing_slot_) return i;
  }
  return absl::NotFoundError(absl::StrCat("version ", version, " is not published here"));
}

}  // namespace gpu_backend
}  // namespace paramd
