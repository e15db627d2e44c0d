// GpuShardStore's step (server/gpu_backend/shard_store.h): the whole step
// (EnqueueStep) and the bucketed one (BeginBuckets ... CommitBuckets) are
// the same stages over a list of shards (every shard, or one bucket's), so
// both publish the same bytes by construction.
#include <algorithm>
#include <map>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/gpu_status.h"
#include "common/status_macros.h"
#include "kernels/cuda/amax.h"
#include "kernels/cuda/quantize.h"
#include "kernels/cuda/scaling.h"
#include "server/gpu_backend/shard_store.h"
#include "server/gpu_backend/spec_rules.h"

namespace paramd {
namespace gpu_backend {

using rules::ColumnwiseSourceAmaxNeeded;
using rules::Computed;
using rules::OnePassFormats;
using rules::PerTensorFp8;
using rules::SecondRound;
using rules::SpecOf;
using rules::Uses;

gpu::QuantizeTensorArgs GpuShardStore::QuantArgs(int slot, int i, const float* source) const {
  const GpuShardDef& s = shards_[i];
  const TensorState& t = tensors_[i];
  gpu::QuantizeTensorArgs q;
  q.source = source;
  q.input_type = gpu::InputType::kFp32;
  q.rows = s.rows;
  q.cols = s.cols;
  q.spec = s.spec;
  for (int dir = 0; dir < 2; ++dir) {
    if (!Computed(s.spec, dir)) continue;
    gpu::DirectionScaling& scaling = dir == 0 ? q.rowwise_scaling : q.columnwise_scaling;
    scaling.scale = t.dirs[dir].scale;
    scaling.global_amax = amax_ + AmaxSlot(i, dir);
    if (!Uses(s.spec, dir)) continue;
    const GpuPublishedDirection& pub = slots_[slot].buffers[i][dir];
    gpu::DirectionBuffers& buffers = dir == 0 ? q.rowwise : q.columnwise;
    buffers.data = pub.data;
    buffers.scales = pub.scales;
    buffers.scale_inv = PerTensorFp8(SpecOf(s.spec, dir).format) ? pub.scale_inv : nullptr;
  }
  return q;
}

absl::Status GpuShardStore::EnqueueOptimizer(absl::Span<const int> shards, bool one_pass,
                                             bool out_of_place, bool sgd_first_step,
                                             const std::vector<gpu::QuantizeTensorArgs>& quant,
                                             std::vector<char>& quantized) {
  // Shards grouped by (lr multiplier, weight decay): one launch per group,
  // with server/step/optimizer.cc TensorStepHyper's numbers (the float64
  // product of the schedule's lr and the multiplier). Frozen shards are
  // not updated: their amax only (and the per-tensor quantize).
  struct Group {
    std::vector<gpu::OptimizerTensor> opt;
    std::vector<gpu::AdamWQuantizeArgs> fused;
  };
  std::map<std::pair<float, float>, Group> groups;
  std::vector<gpu::AmaxArgs> frozen;
  const float default_wd = static_cast<float>(options_.sgd ? options_.sgd_hyper.weight_decay
                                                           : options_.adamw.weight_decay);
  for (int i : shards) {
    TensorState& t = tensors_[i];
    const GpuShardDef& d = shards_[i];
    const int64_t count = d.rows * d.cols;
    if (d.frozen) {
      gpu::AmaxArgs a;
      a.source = t.master;
      a.count = count;
      a.source_dtype = d.spec.source_dtype;
      a.amax = amax_ + AmaxSlot(i, 0);
      frozen.push_back(a);
      continue;
    }
    gpu::OptimizerTensor o;
    o.param = t.master;
    // SGD with momentum off: plain SGD (a buffer kept from an earlier
    // momentum phase is left as it is, as ShardSet leaves its state).
    const bool momentum = MomentumStep();
    o.exp_avg = momentum ? t.exp_avg : nullptr;
    o.exp_avg_sq = t.exp_avg_sq;
    if (out_of_place) {
      o.param_out = t.spare_master;
      o.exp_avg_out = momentum ? t.spare_exp_avg : nullptr;
      o.exp_avg_sq_out = t.spare_exp_avg_sq;
    }
    o.grad = t.grad;
    o.count = count;
    o.amax = amax_ + AmaxSlot(i, 0);
    o.amax_source = d.spec.source_dtype;
    Group& g = groups[{d.lr_multiplier, d.weight_decay >= 0.0f ? d.weight_decay : default_wd}];
    if (!one_pass) {
      g.opt.push_back(o);
      continue;
    }
    // Update, amax (into the slot AdamWStep would max-update: the amax of
    // the source-rounded new master, what each direction quantizes) and
    // both directions in one pass.
    quantized[i] = 1;
    if (count == 0) continue;
    gpu::AdamWQuantizeArgs a;
    a.opt = o;
    a.quant = quant[i];
    if (Uses(d.spec, 0)) a.quant.rowwise.amax = amax_ + AmaxSlot(i, 0);
    if (Uses(d.spec, 1)) a.quant.columnwise.amax = amax_ + AmaxSlot(i, 0);
    g.fused.push_back(a);
  }
  const float* scale = norm_in_step_ ? clip_factor_ : nullptr;
  const double base =
      step_lr_ >= 0.0 ? step_lr_ : (options_.sgd ? options_.sgd_hyper.lr : options_.adamw.lr);
  for (const auto& [key, g] : groups) {
    const double lr = base * static_cast<double>(key.first);
    if (options_.sgd) {
      gpu::SgdHyper hyper = options_.sgd_hyper;
      hyper.lr = lr;
      hyper.weight_decay = key.second;
      hyper.first_step = sgd_first_step;
      hyper.grad_scale = scale;
      RETURN_IF_ERROR(gpu::SgdStep(g.opt, hyper, stream_));
      continue;
    }
    gpu::AdamWHyper hyper = options_.adamw;
    hyper.lr = lr;
    hyper.weight_decay = key.second;
    hyper.step = optimizer_steps_;
    hyper.grad_scale = scale;
    if (one_pass) {
      if (!g.fused.empty()) RETURN_IF_ERROR(gpu::AdamWStepAndQuantize(g.fused, hyper, stream_));
    } else {
      RETURN_IF_ERROR(gpu::AdamWStep(g.opt, hyper, stream_));
    }
  }
  if (!frozen.empty()) RETURN_IF_ERROR(gpu::ComputeAmax(frozen, stream_));
  return absl::OkStatus();
}

absl::Status GpuShardStore::EnqueueColumnwiseSourceAmax(
    absl::Span<const int> shards, const std::vector<gpu::QuantizeTensorArgs>& quant,
    bool second_round) {
  std::vector<gpu::QuantizeTensorArgs> args;
  std::vector<float*> outs;
  for (int i : shards) {
    const HybridSpec& spec = shards_[i].spec;
    if (!ColumnwiseSourceAmaxNeeded(spec) || SecondRound(spec) != second_round) continue;
    args.push_back(quant[i]);
    outs.push_back(amax_ + AmaxSlot(i, 1));
  }
  if (args.empty()) return absl::OkStatus();
  return gpu::ColumnwiseSourceAmax(args, outs, stream_);
}

absl::Status GpuShardStore::EnqueueCurrentScaling(absl::Span<const int> shards, int round) {
  std::vector<gpu::CurrentScalingArgs> current;
  for (int i : shards) {
    for (int dir = 0; dir < 2; ++dir) {
      const QuantSpec& q = SpecOf(shards_[i].spec, dir);
      if (!Computed(shards_[i].spec, dir) || q.format != Format::kFp8Current) continue;
      const int r = dir == 1 && SecondRound(shards_[i].spec) ? 2 : 1;
      if (r != round) continue;
      gpu::CurrentScalingArgs a;
      a.amax = amax_ + AmaxSlot(i, dir);
      a.scale = tensors_[i].dirs[dir].scale;
      a.scale_inv = nullptr;  // the quantize kernel writes the published scale_inv
      a.spec = q;
      current.push_back(a);
    }
  }
  if (current.empty()) return absl::OkStatus();
  return gpu::CurrentScalingUpdate(current, stream_);
}

absl::Status GpuShardStore::EnqueueReduceAndScaling(
    absl::Span<const int> shards, const std::vector<gpu::QuantizeTensorArgs>& quant, float* amax,
    size_t amax_count, bool second_round, const DeviceAllReduce& all_reduce, bool record_events) {
  RETURN_IF_ERROR(EnqueueColumnwiseSourceAmax(shards, quant, false));
  if (record_events) GPU_RETURN_IF_ERROR(cudaEventRecord(events_[1], stream_));
  if (all_reduce) RETURN_IF_ERROR(all_reduce(amax, amax_count, stream_));
  if (record_events) GPU_RETURN_IF_ERROR(cudaEventRecord(events_[2], stream_));
  RETURN_IF_ERROR(EnqueueCurrentScaling(shards, 1));
  if (second_round) {
    RETURN_IF_ERROR(EnqueueColumnwiseSourceAmax(shards, quant, true));
    if (all_reduce) RETURN_IF_ERROR(all_reduce(amax, amax_count, stream_));
    RETURN_IF_ERROR(EnqueueCurrentScaling(shards, 2));
  }
  if (record_events) GPU_RETURN_IF_ERROR(cudaEventRecord(events_[3], stream_));
  return absl::OkStatus();
}

absl::Status GpuShardStore::EnqueueQuantize(int slot, absl::Span<const int> shards,
                                            const std::vector<gpu::QuantizeTensorArgs>& quant,
                                            const std::vector<char>& quantized, bool update_delayed,
                                            std::vector<gpu::DelayedScalingArgs>* delayed) {
  const Slot& out = slots_[slot];
  for (int i : shards) {
    const GpuShardDef& s = shards_[i];
    TensorState& t = tensors_[i];
    for (int dir = 0; dir < 2; ++dir) {
      if (!Uses(s.spec, dir)) continue;
      const QuantSpec& spec = SpecOf(s.spec, dir);
      const GpuPublishedDirection& pub = out.buffers[i][dir];
      if (!PerTensorFp8(spec.format)) {
        const float one = 1.0f;
        GPU_RETURN_IF_ERROR(
            cudaMemcpyAsync(pub.scale_inv, &one, 4, cudaMemcpyHostToDevice, stream_));
      } else {
        // The multiplier of this cast (delayed: before the update that
        // follows every quantization).
        GPU_RETURN_IF_ERROR(
            cudaMemcpyAsync(pub.scale, t.dirs[dir].scale, 4, cudaMemcpyDeviceToDevice, stream_));
      }
      // Published amax: the tensor's global amax of this direction's source.
      GPU_RETURN_IF_ERROR(cudaMemcpyAsync(pub.amax, amax_ + AmaxSlot(i, dir), 4,
                                          cudaMemcpyDeviceToDevice, stream_));
      if (spec.format == Format::kFp8Delayed && update_delayed) {
        gpu::DelayedScalingArgs d;
        d.history = t.dirs[dir].history;
        d.scale = t.dirs[dir].scale;
        d.scale_inv = nullptr;
        d.reduced_amax = amax_ + AmaxSlot(i, dir);
        d.spec = spec;
        delayed->push_back(d);
      }
    }
    if (!quantized[i]) RETURN_IF_ERROR(gpu::QuantizeHybrid({quant[i]}, stream_));
    GPU_RETURN_IF_ERROR(cudaEventRecord(t.ready, stream_));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> GpuShardStore::ClaimSlot(int64_t new_version) {
  absl::MutexLock lock(&meta_mu_);
  if (writing_slot_ >= 0) return absl::FailedPreconditionError("a step is in flight");
  // Overwrite the older slot; readers of the newer one are untouched.
  const int slot = slots_[0].version <= slots_[1].version ? 0 : 1;
  slots_[slot].version = -1;
  writing_slot_ = slot;
  pending_version_ = new_version;
  return slot;
}

void GpuShardStore::ReleaseSlot() {
  // Nothing in flight: the slot stays unpublished (its bytes may be part
  // written) and Published() must not hand it out as the new version.
  absl::MutexLock lock(&meta_mu_);
  writing_slot_ = -1;
  pending_version_ = -1;
}

absl::Status GpuShardStore::EnqueueStep(int64_t new_version, bool apply_optimizer,
                                        const DeviceAllReduce& all_reduce, bool update_delayed) {
  if (buckets_.active) return absl::FailedPreconditionError("a bucketed step is in flight");
  ASSIGN_OR_RETURN(const int slot, ClaimSlot(new_version));
  absl::Status s = EnqueueInto(slot, apply_optimizer, all_reduce, update_delayed);
  if (!s.ok()) ReleaseSlot();
  return s;
}

absl::Status GpuShardStore::EnqueueInto(int slot, bool apply_optimizer,
                                        const DeviceAllReduce& all_reduce, bool update_delayed) {
  ScopedDevice guard(options_.device);
  const int n = static_cast<int>(shards_.size());
  std::vector<int> all(n);
  std::iota(all.begin(), all.end(), 0);

  GPU_RETURN_IF_ERROR(cudaEventRecord(events_[0], stream_));
  // The gradient norm first: the device runs it while this thread builds
  // the step's arguments (it needs only the row sums).
  norm_in_step_ = apply_optimizer && norm_on_;
  if (norm_in_step_) RETURN_IF_ERROR(EnqueueGradNorm(all_reduce));
  GPU_RETURN_IF_ERROR(cudaMemsetAsync(amax_, 0, amax_count() * sizeof(float), stream_));
  // The quantize arguments of every shard (buffers of the slot), also used
  // for the columnwise-source amaxes of rowwise_dequantized copies.
  std::vector<gpu::QuantizeTensorArgs> quant(n);
  for (int i = 0; i < n; ++i) quant[i] = QuantArgs(slot, i, tensors_[i].master);
  bool one_pass = apply_optimizer && !options_.sgd && options_.one_pass_step;
  for (int i = 0; i < n && one_pass; ++i) one_pass = OnePassFormats(shards_[i].spec);
  // Shards the one pass quantized (the per-tensor quantize below skips them).
  std::vector<char> quantized(n, 0);
  // Source amaxes (max-updated: shards of one tensor share its slot).
  if (apply_optimizer) {
    // The next version's pushes start new row sums (norm on or off).
    for (TensorState& t : tensors_) {
      t.fresh_rows = 0;
      t.sums_stale = false;
    }
    fresh_before_step_ = sgd_fresh_;
    ++optimizer_steps_;
    const bool first_step = optimizer_steps_ == 1 || sgd_fresh_;
    RETURN_IF_ERROR(
        EnqueueOptimizer(all, one_pass, /*out_of_place=*/false, first_step, quant, quantized));
    if (one_pass) ++one_pass_steps_;
    // Only a momentum step starts the buffers (a plain SGD step leaves them
    // as they are, as ShardSet leaves an unsized state).
    if (MomentumStep()) sgd_fresh_ = false;
    for (int i = 0; i < n; ++i) {
      GPU_RETURN_IF_ERROR(
          cudaMemsetAsync(tensors_[i].grad, 0, shards_[i].rows * shards_[i].cols * 4, stream_));
      tensors_[i].grad_zero = true;
    }
  } else {
    std::vector<gpu::AmaxArgs> args(n);
    for (int i = 0; i < n; ++i) {
      args[i].source = tensors_[i].master;
      args[i].count = shards_[i].rows * shards_[i].cols;
      args[i].source_dtype = shards_[i].spec.source_dtype;
      args[i].amax = amax_ + AmaxSlot(i, 0);
    }
    RETURN_IF_ERROR(gpu::ComputeAmax(args, stream_));
  }
  // By manifest (options), so that every daemon makes the same all-reduce
  // calls whatever it holds.
  bool second_round = options_.second_round;
  for (const GpuShardDef& s : shards_) second_round |= SecondRound(s.spec);
  RETURN_IF_ERROR(EnqueueReduceAndScaling(all, quant, amax_, amax_count(), second_round, all_reduce,
                                          /*record_events=*/true));
  std::vector<gpu::DelayedScalingArgs> delayed;
  RETURN_IF_ERROR(EnqueueQuantize(slot, all, quant, quantized, update_delayed, &delayed));
  // Delayed scaling: this step's cast used the previous scale; now roll the
  // history and compute the next one (FORMATS.md §1 ordering).
  if (!delayed.empty()) RETURN_IF_ERROR(gpu::DelayedScalingUpdate(delayed, stream_));
  GPU_RETURN_IF_ERROR(cudaEventRecord(events_[4], stream_));
  step_start_ = absl::Now();
  return absl::OkStatus();
}

// ---- Bucketed steps ----

absl::Status GpuShardStore::EnsureSpares() {
  if (spares_allocated_) return absl::OkStatus();
  for (size_t i = 0; i < shards_.size(); ++i) {
    TensorState& t = tensors_[i];
    if (shards_[i].frozen) continue;
    const int64_t bytes = shards_[i].rows * shards_[i].cols * sizeof(float);
    ASSIGN_OR_RETURN(void* m, Alloc(bytes));
    t.spare_master = static_cast<float*>(m);
    if (t.exp_avg != nullptr) {
      ASSIGN_OR_RETURN(void* a, Alloc(bytes));
      t.spare_exp_avg = static_cast<float*>(a);
    }
    if (t.exp_avg_sq != nullptr) {
      ASSIGN_OR_RETURN(void* v, Alloc(bytes));
      t.spare_exp_avg_sq = static_cast<float*>(v);
    }
  }
  spares_allocated_ = true;
  return absl::OkStatus();
}

absl::Status GpuShardStore::BeginBuckets(int64_t new_version) {
  if (buckets_.active) return absl::FailedPreconditionError("a bucketed step is in flight");
  ScopedDevice guard(options_.device);
  RETURN_IF_ERROR(EnsureSpares());
  ASSIGN_OR_RETURN(const int slot, ClaimSlot(new_version));
  buckets_ = BucketState();
  buckets_.active = true;
  buckets_.slot = slot;
  buckets_.steps_before = optimizer_steps_;
  fresh_before_step_ = sgd_fresh_;
  const int n = static_cast<int>(shards_.size());
  buckets_.quant.resize(n);
  for (int i = 0; i < n; ++i) {
    // Non-frozen shards quantize their new masters, written to the spares.
    const TensorState& t = tensors_[i];
    buckets_.quant[i] = QuantArgs(slot, i, shards_[i].frozen ? t.master : t.spare_master);
  }
  buckets_.quantized.assign(n, 0);
  for (TensorState& t : tensors_) {
    t.fresh_rows = 0;
    t.sums_stale = false;
  }
  ++optimizer_steps_;
  buckets_.sgd_first_step = optimizer_steps_ == 1 || sgd_fresh_;
  if (MomentumStep()) sgd_fresh_ = false;
  norm_in_step_ = norm_on_;
  absl::Status s = [&]() -> absl::Status {
    GPU_RETURN_IF_ERROR(cudaEventRecord(events_[0], stream_));
    GPU_RETURN_IF_ERROR(cudaMemsetAsync(amax_, 0, amax_count() * sizeof(float), stream_));
    return absl::OkStatus();
  }();
  if (!s.ok()) AbandonBuckets();
  return s;
}

absl::Status GpuShardStore::EnqueueBucketNorm(const DeviceAllReduce& all_reduce) {
  if (!buckets_.active) return absl::FailedPreconditionError("no bucketed step");
  if (!norm_in_step_) return absl::OkStatus();
  ScopedDevice guard(options_.device);
  RETURN_IF_ERROR(EnqueueGradNorm(all_reduce));
  buckets_.norm_done = true;
  return absl::OkStatus();
}

absl::Status GpuShardStore::EnqueueBucket(absl::Span<const int> shards, int tensor_begin,
                                          int tensor_end, bool second_round,
                                          const DeviceAllReduce& all_reduce, bool update_delayed) {
  if (!buckets_.active) return absl::FailedPreconditionError("no bucketed step");
  if (norm_in_step_ && !buckets_.norm_done) {
    return absl::FailedPreconditionError("the gradient norm is on: EnqueueBucketNorm first");
  }
  if (tensor_begin < 0 || tensor_end < tensor_begin || tensor_end > num_tensors_) {
    return absl::InvalidArgumentError(absl::StrCat("bucket tensors [", tensor_begin, ", ",
                                                   tensor_end, ") outside the store's ",
                                                   num_tensors_));
  }
  for (int i : shards) {
    const int t = shards_[i].tensor >= 0 ? shards_[i].tensor : i;
    if (i < 0 || i >= static_cast<int>(shards_.size()) || t < tensor_begin || t >= tensor_end) {
      return absl::InvalidArgumentError(absl::StrCat("shard ", i, " is not in the bucket"));
    }
  }
  ScopedDevice guard(options_.device);
  RETURN_IF_ERROR(EnqueueOptimizer(shards, /*one_pass=*/false, /*out_of_place=*/true,
                                   buckets_.sgd_first_step, buckets_.quant, buckets_.quantized));
  // The bucket's [tensor][direction] amaxes: one contiguous run of the
  // packed vector (buckets are runs of manifest tensors).
  RETURN_IF_ERROR(EnqueueReduceAndScaling(shards, buckets_.quant, amax_ + 2 * tensor_begin,
                                          2 * static_cast<size_t>(tensor_end - tensor_begin),
                                          second_round, all_reduce, /*record_events=*/false));
  return EnqueueQuantize(buckets_.slot, shards, buckets_.quant, buckets_.quantized, update_delayed,
                         &buckets_.delayed);
}

absl::Status GpuShardStore::CommitBuckets() {
  if (!buckets_.active) return absl::FailedPreconditionError("no bucketed step");
  ScopedDevice guard(options_.device);
  absl::Status s = [&]() -> absl::Status {
    for (int k = 1; k <= 3; ++k) GPU_RETURN_IF_ERROR(cudaEventRecord(events_[k], stream_));
    if (!buckets_.delayed.empty()) {
      RETURN_IF_ERROR(gpu::DelayedScalingUpdate(buckets_.delayed, stream_));
    }
    for (size_t i = 0; i < shards_.size(); ++i) {
      GPU_RETURN_IF_ERROR(
          cudaMemsetAsync(tensors_[i].grad, 0, shards_[i].rows * shards_[i].cols * 4, stream_));
      tensors_[i].grad_zero = true;
    }
    GPU_RETURN_IF_ERROR(cudaEventRecord(events_[4], stream_));
    return absl::OkStatus();
  }();
  // The spares hold the new state (the kernels behind on the stream write
  // them; whatever reads the state next is ordered after them there).
  for (size_t i = 0; i < shards_.size(); ++i) {
    TensorState& t = tensors_[i];
    if (shards_[i].frozen) continue;
    std::swap(t.master, t.spare_master);
    // (Momentum off: the buffer was not written and stays as it is.)
    if (MomentumStep()) std::swap(t.exp_avg, t.spare_exp_avg);
    std::swap(t.exp_avg_sq, t.spare_exp_avg_sq);
  }
  buckets_ = BucketState();
  step_start_ = absl::Now();
  // A failed enqueue here leaves a step FinishStep cannot vouch for.
  if (!s.ok()) ReleaseSlot();
  return s;
}

void GpuShardStore::AbandonBuckets() {
  if (!buckets_.active) return;
  optimizer_steps_ = buckets_.steps_before;
  sgd_fresh_ = fresh_before_step_;
  buckets_ = BucketState();
  ReleaseSlot();
}

}  // namespace gpu_backend
}  // namespace paramd
