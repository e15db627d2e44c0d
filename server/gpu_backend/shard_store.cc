#include "server/gpu_backend/shard_store.h"

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

namespace paramd {
namespace gpu_backend {
namespace {

constexpr size_t kAlign = 256;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

bool PerTensorFp8(Format f) { return f == Format::kFp8Current || f == Format::kFp8Delayed; }

bool Uses(const HybridSpec& spec, int dir) {
  return dir == 0 ? spec.rowwise_usage : spec.columnwise_usage;
}

const QuantSpec& SpecOf(const HybridSpec& spec, int dir) {
  return dir == 0 ? spec.rowwise : spec.columnwise;
}

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

}  // namespace

GpuShardStore::GpuShardStore(std::vector<GpuShardDef> shards, const GpuStoreOptions& options)
    : shards_(std::move(shards)), options_(options) {}

GpuShardStore::~GpuShardStore() {
  DeviceGuard guard(options_.device);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  for (TensorState& t : tensors_) {
    if (t.ready != nullptr) cudaEventDestroy(t.ready);
  }
  for (cudaEvent_t e : events_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  for (void* p : allocations_) cudaFree(p);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::StatusOr<std::unique_ptr<GpuShardStore>> GpuShardStore::Create(
    std::vector<GpuShardDef> shards, const GpuStoreOptions& options) {
  for (const GpuShardDef& s : shards) {
    if (s.spec.columnwise_source != ColumnwiseSource::kOriginal) {
      return absl::UnimplementedError(absl::StrCat(
          s.name, ": columnwise_source rowwise_dequantized is not implemented on the GPU backend"));
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

absl::Status GpuShardStore::Allocate() {
  DeviceGuard guard(options_.device);
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
    for (float** p : {&t.master, &t.exp_avg, &t.exp_avg_sq, &t.grad}) {
      ASSIGN_OR_RETURN(void* mem, Alloc(count * sizeof(float)));
      *p = static_cast<float*>(mem);
    }
  }
  for (int i = 0; i < options_.push_staging_buffers; ++i) {
    ASSIGN_OR_RETURN(void* mem, Alloc(largest * options_.push_staging_element_bytes));
    staging_.push_back(mem);
  }
  // Small state: carved from one allocation.
  size_t small_bytes = AlignUp(n_shards * sizeof(float));  // packed amax
  for (size_t i = 0; i < n_shards; ++i) {
    for (int dir = 0; dir < 2; ++dir) {
      const QuantSpec& q = SpecOf(shards_[i].spec, dir);
      if (!Uses(shards_[i].spec, dir)) continue;
      if (PerTensorFp8(q.format)) small_bytes += AlignUp(sizeof(float));
      if (q.format == Format::kFp8Delayed) small_bytes += AlignUp(q.amax_history_len * 4);
    }
  }
  ASSIGN_OR_RETURN(void* small, Alloc(small_bytes));
  uint8_t* cursor = static_cast<uint8_t*>(small);
  auto carve = [&cursor](size_t bytes) {
    void* p = cursor;
    cursor += AlignUp(bytes);
    return p;
  };
  amax_ = static_cast<float*>(carve(n_shards * sizeof(float)));
  const float one = 1.0f;
  for (size_t i = 0; i < n_shards; ++i) {
    for (int dir = 0; dir < 2; ++dir) {
      const QuantSpec& q = SpecOf(shards_[i].spec, dir);
      if (!Uses(shards_[i].spec, dir)) continue;
      DirState& d = tensors_[i].dirs[dir];
      if (PerTensorFp8(q.format)) {
        d.scale = static_cast<float*>(carve(sizeof(float)));
        GPU_RETURN_IF_ERROR(
            cudaMemcpyAsync(d.scale, &one, sizeof(float), cudaMemcpyHostToDevice, stream_));
      }
      if (q.format == Format::kFp8Delayed) {
        d.history = static_cast<float*>(carve(q.amax_history_len * 4));
      }
    }
  }
  // Published buffers: one allocation per slot.
  for (Slot& slot : slots_) {
    slot.buffers.resize(n_shards);
    size_t bytes = 0;
    for (int pass = 0; pass < 2; ++pass) {
      uint8_t* p = nullptr;
      if (pass == 1) {
        ASSIGN_OR_RETURN(void* mem, Alloc(bytes));
        p = static_cast<uint8_t*>(mem);
      }
      size_t offset = 0;
      for (size_t i = 0; i < n_shards; ++i) {
        for (int dir = 0; dir < 2; ++dir) {
          if (!Uses(shards_[i].spec, dir)) continue;
          GpuPublishedDirection& out = slot.buffers[i][dir];
          ASSIGN_OR_RETURN(Layout layout,
                           ComputeLayout(SpecOf(shards_[i].spec, dir),
                                         static_cast<Direction>(dir), shards_[i].rows,
                                         shards_[i].cols));
          auto take = [&](size_t n) -> void* {
            void* at = p == nullptr ? nullptr : p + offset;
            offset += AlignUp(n);
            return at;
          };
          void* data = take(layout.data_bytes());
          void* scales = layout.scale_bytes() > 0 ? take(layout.scale_bytes()) : nullptr;
          void* scale_inv = take(sizeof(float));
          void* amax = take(sizeof(float));
          if (pass == 1) {
            out.present = true;
            out.layout = layout;
            out.data = data;
            out.scales = scales;
            out.scale_inv = static_cast<float*>(scale_inv);
            out.amax = static_cast<float*>(amax);
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
  DeviceGuard guard(options_.device);
  GPU_RETURN_IF_ERROR(LaunchAccumulate(tensors_[shard].grad, gradient, bf16,
                                       shards_[shard].rows * shards_[shard].cols, stream_));
  return absl::OkStatus();
}

absl::Status GpuShardStore::EnqueueStep(int64_t new_version, bool apply_optimizer,
                                        const DeviceAllReduce& all_reduce) {
  if (writing_slot_ >= 0) return absl::FailedPreconditionError("a step is in flight");
  DeviceGuard guard(options_.device);
  const int n = static_cast<int>(shards_.size());
  // Overwrite the older slot; readers of the newer one are untouched.
  const int slot = slots_[0].version <= slots_[1].version ? 0 : 1;
  slots_[slot].version = -1;
  writing_slot_ = slot;
  Slot& out = slots_[slot];

  GPU_RETURN_IF_ERROR(cudaEventRecord(events_[0], stream_));
  GPU_RETURN_IF_ERROR(cudaMemsetAsync(amax_, 0, n * sizeof(float), stream_));
  if (apply_optimizer) {
    gpu::AdamWHyper hyper = options_.adamw;
    hyper.step = ++optimizer_steps_;
    std::vector<gpu::OptimizerTensor> opt(n);
    for (int i = 0; i < n; ++i) {
      TensorState& t = tensors_[i];
      opt[i].param = t.master;
      opt[i].exp_avg = t.exp_avg;
      opt[i].exp_avg_sq = t.exp_avg_sq;
      opt[i].grad = t.grad;
      opt[i].count = shards_[i].rows * shards_[i].cols;
      opt[i].amax = amax_ + i;
      opt[i].amax_source = shards_[i].spec.source_dtype;
    }
    RETURN_IF_ERROR(gpu::AdamWStep(opt, hyper, stream_));
    for (int i = 0; i < n; ++i) {
      GPU_RETURN_IF_ERROR(cudaMemsetAsync(tensors_[i].grad, 0, opt[i].count * 4, stream_));
    }
  } else {
    std::vector<gpu::AmaxArgs> args(n);
    for (int i = 0; i < n; ++i) {
      args[i].source = tensors_[i].master;
      args[i].count = shards_[i].rows * shards_[i].cols;
      args[i].source_dtype = shards_[i].spec.source_dtype;
      args[i].amax = amax_ + i;
    }
    RETURN_IF_ERROR(gpu::ComputeAmax(args, stream_));
  }
  GPU_RETURN_IF_ERROR(cudaEventRecord(events_[1], stream_));
  if (all_reduce) RETURN_IF_ERROR(all_reduce(amax_, n, stream_));
  GPU_RETURN_IF_ERROR(cudaEventRecord(events_[2], stream_));

  std::vector<gpu::CurrentScalingArgs> current;
  for (int i = 0; i < n; ++i) {
    for (int dir = 0; dir < 2; ++dir) {
      const QuantSpec& q = SpecOf(shards_[i].spec, dir);
      if (!Uses(shards_[i].spec, dir) || q.format != Format::kFp8Current) continue;
      gpu::CurrentScalingArgs a;
      a.amax = amax_ + i;
      a.scale = tensors_[i].dirs[dir].scale;
      a.scale_inv = nullptr;  // the quantize kernel writes the published scale_inv
      a.spec = q;
      current.push_back(a);
    }
  }
  if (!current.empty()) RETURN_IF_ERROR(gpu::CurrentScalingUpdate(current, stream_));
  GPU_RETURN_IF_ERROR(cudaEventRecord(events_[3], stream_));

  std::vector<gpu::DelayedScalingArgs> delayed;
  for (int i = 0; i < n; ++i) {
    const GpuShardDef& s = shards_[i];
    TensorState& t = tensors_[i];
    gpu::QuantizeTensorArgs q;
    q.source = t.master;
    q.input_type = gpu::InputType::kFp32;
    q.rows = s.rows;
    q.cols = s.cols;
    q.spec = s.spec;
    for (int dir = 0; dir < 2; ++dir) {
      if (!Uses(s.spec, dir)) continue;
      const QuantSpec& spec = SpecOf(s.spec, dir);
      GpuPublishedDirection& pub = out.buffers[i][dir];
      gpu::DirectionScaling& scaling = dir == 0 ? q.rowwise_scaling : q.columnwise_scaling;
      gpu::DirectionBuffers& buffers = dir == 0 ? q.rowwise : q.columnwise;
      scaling.scale = t.dirs[dir].scale;
      scaling.global_amax = amax_ + i;
      buffers.data = pub.data;
      buffers.scales = pub.scales;
      buffers.scale_inv = PerTensorFp8(spec.format) ? pub.scale_inv : nullptr;
      if (!PerTensorFp8(spec.format)) {
        const float one = 1.0f;
        GPU_RETURN_IF_ERROR(
            cudaMemcpyAsync(pub.scale_inv, &one, 4, cudaMemcpyHostToDevice, stream_));
      }
      // Published amax: the tensor's global source amax (kOriginal source).
      GPU_RETURN_IF_ERROR(
          cudaMemcpyAsync(pub.amax, amax_ + i, 4, cudaMemcpyDeviceToDevice, stream_));
      if (spec.format == Format::kFp8Delayed) {
        gpu::DelayedScalingArgs d;
        d.history = t.dirs[dir].history;
        d.scale = t.dirs[dir].scale;
        d.scale_inv = nullptr;
        d.reduced_amax = amax_ + i;
        d.spec = spec;
        delayed.push_back(d);
      }
    }
    RETURN_IF_ERROR(gpu::QuantizeHybrid({q}, stream_));
    GPU_RETURN_IF_ERROR(cudaEventRecord(t.ready, stream_));
  }
  // Delayed scaling: this step's cast used the previous scale; now roll the
  // history and compute the next one (FORMATS.md §1 ordering).
  if (!delayed.empty()) RETURN_IF_ERROR(gpu::DelayedScalingUpdate(delayed, stream_));
  GPU_RETURN_IF_ERROR(cudaEventRecord(events_[4], stream_));
  pending_version_ = new_version;
  step_start_ = absl::Now();
  return absl::OkStatus();
}

absl::Status GpuShardStore::FinishStep(absl::Time deadline) {
  if (writing_slot_ < 0) return absl::FailedPreconditionError("no step in flight");
  DeviceGuard guard(options_.device);
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
  const int slot = writing_slot_;
  writing_slot_ = -1;
  if (!s.ok()) return s;
  float ms[4] = {0, 0, 0, 0};
  for (int i = 0; i < 4; ++i) {
    GPU_RETURN_IF_ERROR(cudaEventElapsedTime(&ms[i], events_[i], events_[i + 1]));
  }
  timings_.optimizer_ms = ms[0];
  timings_.all_reduce_ms = ms[1];
  timings_.scaling_ms = ms[2];
  timings_.quantize_ms = ms[3];
  timings_.total_ms = absl::ToDoubleMilliseconds(absl::Now() - step_start_);
  slots_[slot].version = pending_version_;
  return absl::OkStatus();
}

absl::Status GpuShardStore::Step(int64_t new_version, bool apply_optimizer,
                                 const DeviceAllReduce& all_reduce, absl::Time deadline) {
  const absl::Time start = absl::Now();
  RETURN_IF_ERROR(EnqueueStep(new_version, apply_optimizer, all_reduce));
  step_start_ = start;
  return FinishStep(deadline);
}

std::vector<int64_t> GpuShardStore::versions() const {
  std::vector<int64_t> v;
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
  for (int i = 0; i < 2; ++i) {
    const Slot& s = slots_[i];
    const bool in_flight = i == writing_slot_ && version == pending_version_;
    if ((s.version == version && version >= 0) || in_flight) {
      const GpuPublishedDirection& d = s.buffers[shard][static_cast<int>(direction)];
      if (!d.present) {
        return absl::NotFoundError(absl::StrCat(shards_[shard].name, " has no ",
                                                DirectionName(direction), " copy"));
      }
      return d;
    }
  }
  return absl::NotFoundError(absl::StrCat("version ", version, " is not published here"));
}

}  // namespace gpu_backend
}  // namespace paramd
