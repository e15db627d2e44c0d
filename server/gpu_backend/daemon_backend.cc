#include "server/gpu_backend/daemon_backend.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <utility>

#include <cuda_runtime_api.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/gpu_status.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "server/gpu_backend/host_copies.h"
#include "server/gpu_backend/host_mirror.h"
#include "server/gpu_backend/pipelined_step.h"
#include "server/gpu_backend/published_meta.h"
#include "server/gpu_backend/shard_store.h"
#include "server/gpu_backend/spec_rules.h"
#include "server/gpu_backend/state_capture.h"
#include "server/step/grad_norm.h"
#include "server/step/step_scaling.h"
#include "transport/nccl_transport.h"

namespace paramd {
namespace gpu_backend {
namespace {

using rules::SecondRound;
using rules::SpecOf;
using rules::Uses;

// Test hooks (tests/gpu_integration/daemon_overlap_test.cc; the daemons
// under test are separate hybrid-paramd processes, and no flag should offer
// these): the integer value of environment variable `name`, or -1.
int64_t TestHookFromEnv(const char* name) {
  const char* v = std::getenv(name);
  int64_t value = -1;
  if (v == nullptr || !absl::SimpleAtoi(v, &value)) return -1;
  LogWarning("gpu", absl::StrCat("gpu backend: test hook ", name, "=", value));
  return value;
}

// A host function on the store's stream: holds the stream for *ms.
void CUDART_CB HoldStream(void* ms) {
  absl::SleepFor(absl::Milliseconds(*static_cast<const int64_t*>(ms)));
}

// The store's optimizer numbers of a config, widened exactly to double (the
// device fold then equals server FoldAdamW).
gpu::AdamWHyper AdamWHyperOf(const OptimizerOptions& o) {
  gpu::AdamWHyper h;
  h.lr = o.lr;
  h.beta1 = o.beta1;
  h.beta2 = o.beta2;
  h.eps = o.eps;
  h.weight_decay = o.weight_decay;
  return h;
}
gpu::SgdHyper SgdHyperOf(const OptimizerOptions& o) {
  gpu::SgdHyper h;
  h.lr = o.lr;
  h.momentum = o.momentum;
  h.dampening = 0.0;
  h.weight_decay = o.weight_decay;
  h.nesterov = false;
  return h;
}

class GpuShardBackend : public ShardBackend {
 public:
  GpuShardBackend(std::vector<TensorDef> tensors, std::vector<ShardDef> shards,
                  std::shared_ptr<GpuShardStore> store, const ShardBackendOptions& options)
      : tensors_(std::move(tensors)),
        shards_(std::move(shards)),
        store_(std::move(store)),
        copies_(
            std::make_shared<HostCopies>(store_, TestHookFromEnv("PARAMD_GPU_HOST_COPY_DELAY_MS"))),
        snapshot_spare_(DeviceSnapshotSpare::Create(store_)),
        optimizer_(options.optimizer),
        step_timeout_(options.step_timeout) {
    for (const ShardDef& d : shards_) {
      const size_t n = static_cast<size_t>(d.rows() * tensors_[d.tensor].cols);
      load_.emplace_back(n, 0.0f);
      grads_.emplace_back(n, 0.0f);
    }
    // The accumulators are uploaded every optimizer step: page-locked, the
    // copy runs at DMA speed (best effort: pageable if registration fails).
    ScopedDevice guard(store_->device());
    for (std::vector<float>& g : grads_) {
      if (!g.empty() && cudaHostRegister(g.data(), g.size() * sizeof(float),
                                         cudaHostRegisterDefault) == cudaSuccess) {
        registered_.push_back(g.data());
      } else {
        cudaGetLastError();  // clear the sticky-free error of a failed registration
      }
    }
    NoteDeviceBytes();
  }
  ~GpuShardBackend() override {
    ScopedDevice guard(store_->device());
    for (void* p : registered_) cudaHostUnregister(p);
    if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
  }

  absl::string_view name() const override { return "gpu"; }
  const std::vector<TensorDef>& tensors() const override { return tensors_; }
  const std::vector<ShardDef>& shards() const override { return shards_; }
  absl::Span<float> load_master(int i) override {
    load_handed_out_ = true;
    return absl::MakeSpan(load_[i]);
  }
  absl::Span<float> gradient(int i) override {
    host_grads_used_ = true;
    return absl::MakeSpan(grads_[i]);
  }
  absl::Status AccumulateGradient(int i, int64_t offset, absl::Span<const float> values,
                                  bool last_pusher) override {
    if (!broken_.ok()) return absl::FailedPreconditionError("an earlier gpu step failed");
    device_grads_used_ = true;
    return AccumulateInPieces(i, offset, values.data(), static_cast<int64_t>(values.size()),
                              last_pusher);
  }
  BackendMemory memory() const override {
    BackendMemory m;
    m.parameters = store_->parameters();  // fixed at Create
    m.device_bytes =
        device_bytes_.load(std::memory_order_relaxed) + snapshot_spare_->device_bytes();
    return m;
  }
  GpuShardStore* store() { return store_.get(); }

  void set_step_enqueued(StepEnqueuedFn fn) override { step_enqueued_ = std::move(fn); }

  void set_data_plane(Transport* transport, absl::Duration timeout) override {
    data_plane_known_ = true;
    transport_ = transport;
    collective_timeout_ = timeout;
  }

  HostBytesFn host_bytes() override {
    std::shared_ptr<HostCopies> copies = copies_;
    return
        [copies](const std::shared_ptr<const PublishedVersion>& meta) { return copies->Get(meta); };
  }

  // As ShardSet::SetOptimizer: any config of the same kind, for the next
  // steps (the store takes the new numbers and turns the norm on or off).
  absl::Status SetOptimizer(const OptimizerOptions& optimizer) override {
    RETURN_IF_ERROR(ValidateOptimizerOptions(optimizer));
    if (optimizer.kind != optimizer_.kind) {
      return absl::InvalidArgumentError(absl::StrCat("the loaded model steps with ",
                                                     OptimizerName(optimizer_.kind), ", not ",
                                                     OptimizerName(optimizer.kind)));
    }
    // SGD momentum turned on allocates the store's buffers (once).
    absl::Status set = store_->SetOptimizerHyper(
        AdamWHyperOf(optimizer), SgdHyperOf(optimizer), optimizer.needs_grad_norm(),
        optimizer.max_grad_norm, optimizer.non_finite == NonFinitePolicy::kSkipStep);
    NoteDeviceBytes();
    RETURN_IF_ERROR(set);
    optimizer_ = optimizer;
    if (mirror_ != nullptr) RETURN_IF_ERROR(mirror_->SetOptimizer(optimizer));
    return absl::OkStatus();
  }

  // A host ShardSet mirroring the device state (masters, moments, step
  // count, delayed scaling), downloaded now. The caller may change it
  // (restore): it is uploaded again before the next Step.
  ShardSet* host_state() override {
    absl::Status s = DownloadMirror();
    if (!s.ok()) {
      LogError("gpu", absl::StrCat("gpu backend: host state download failed: ", s.ToString()));
      return nullptr;
    }
    mirror_dirty_ = true;
    return mirror_.get();
  }

  // A restore writes straight into the store: one host-to-device copy of
  // the saved state, no host mirror (DeviceSink below).
  ShardStateSink* state_sink() override { return &sink_; }

  // The arrays through the device spare (state_capture.h); the small state
  // read here (a few scalars per FP8-delayed direction).
  absl::StatusOr<CapturedState> CaptureState() override {
    if (!broken_.ok()) return absl::FailedPreconditionError("an earlier gpu step failed");
    // A mirror handed out and not uploaded yet is the newest state.
    if (mirror_dirty_ || !masters_uploaded_) return ShardBackend::CaptureState();
    ScopedDevice guard(store_->device());
    CapturedState c;
    c.optimizer = optimizer_;
    c.optimizer_steps = store_->optimizer_steps();
    c.skipped_steps = report_.skipped_steps;
    c.delayed.resize(tensors_.size());
    for (size_t i = 0; i < shards_.size(); ++i) {
      const HybridSpec& spec = tensors_[shards_[i].tensor].spec;
      auto& delayed = c.delayed[shards_[i].tensor];
      for (int dir = 0; dir < 2; ++dir) {
        delayed[dir] = step_scaling::InitialDelayed(SpecOf(spec, dir));
        float* history = store_->history(static_cast<int>(i), dir);
        if (history == nullptr) continue;
        RETURN_IF_ERROR(BlockingCopy(delayed[dir].amax_history.data(), history,
                                     delayed[dir].amax_history.size() * sizeof(float),
                                     cudaMemcpyDeviceToHost));
        RETURN_IF_ERROR(BlockingCopy(&delayed[dir].scale, store_->scale(static_cast<int>(i), dir),
                                     sizeof(float), cudaMemcpyDeviceToHost));
      }
    }
    ASSIGN_OR_RETURN(c.arrays, snapshot_spare_->Capture());
    return c;
  }

  absl::StatusOr<std::shared_ptr<const PublishedVersion>> Step(int64_t new_version,
                                                               bool apply_optimizer,
                                                               const AllReduceMaxFn& all_reduce,
                                                               bool update_delayed) override {
    if (!broken_.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("an earlier gpu step failed (", broken_.message(),
                       "); the device state is undefined: load the model again"));
    }
    // A snapshot's spare copy reads the masters and moments: host writes
    // into them (a mirror's upload) wait for it here, the step's device
    // work on the device.
    if (mirror_dirty_ || !masters_uploaded_) RETURN_IF_ERROR(snapshot_spare_->WaitHost());
    absl::Status uploaded = Upload(apply_optimizer);
    NoteDeviceBytes();
    RETURN_IF_ERROR(uploaded);
    RETURN_IF_ERROR(snapshot_spare_->OrderBefore(store_->stream()));
    if (apply_optimizer && step_delay_ms_ > 0) {
      GPU_RETURN_IF_ERROR(
          cudaLaunchHostFunc(store_->stream(), HoldStream, const_cast<int64_t*>(&step_delay_ms_)));
    }
    const DeviceAllReduce bridge = Bridge(all_reduce);
    // The step rewrites the older of two held versions: no host copy of it
    // may run meanwhile.
    const std::vector<int64_t> held = store_->versions();
    if (held.size() == 2) copies_->Retire(held[0]);
    // Not transactional: the masters may have moved and the store may still
    // hold the failed step, so every later step is refused.
    const absl::Time deadline = absl::Now() + step_timeout_;
    const int64_t step = store_->optimizer_steps() + 1;
    if (apply_optimizer) store_->set_step_lr(ScheduledLr(optimizer_, step));
    absl::Status stepped;
    if (NcclTransport* nccl = DeviceAllReduceTransport()) {
      if (!logged_device_all_reduce_) {
        logged_device_all_reduce_ = true;
        LogInfo("gpu", absl::StrCat("gpu backend: amax all-reduce on the device over NCCL (",
                                    nccl->world_size(), " daemons)"));
      }
      // The packed device vector all-reduced in place on the store's stream;
      // one wait at the end that watches the NCCL communicators (a dead
      // peer aborts them: an error, never a hang).
      std::vector<int> group(nccl->world_size());
      std::iota(group.begin(), group.end(), 0);
      const absl::Time collective_deadline = absl::Now() + collective_timeout_;
      DeviceAllReduce device = [&](float* values, size_t count,
                                   cudaStream_t stream) -> absl::Status {
        return nccl->AllReduceMaxDevice(group, values, count, stream, collective_deadline);
      };
      stepped = store_->EnqueueStep(new_version, apply_optimizer, device, update_delayed);
      if (stepped.ok()) {
        if (step_enqueued_) step_enqueued_(new_version);
        stepped = nccl->WaitStream(store_->stream(), std::min(deadline, collective_deadline));
        absl::Status finished = store_->FinishStep(deadline);
        if (stepped.ok()) stepped = finished;
      }
    } else {
      // A single daemon reduces nothing; otherwise the host bridge.
      const bool single = data_plane_known_ && transport_ == nullptr;
      stepped = store_->EnqueueStep(new_version, apply_optimizer,
                                    single ? DeviceAllReduce() : bridge, update_delayed);
      if (stepped.ok()) {
        if (step_enqueued_) step_enqueued_(new_version);
        stepped = store_->FinishStep(deadline);
      }
    }
    if (stepped.ok() && new_version == fail_step_) {
      stepped = absl::InternalError(absl::StrCat("injected failure of the step to version ",
                                                 new_version, " (PARAMD_GPU_FAIL_STEP)"));
    }
    if (stepped.ok() && apply_optimizer) UpdateReport(step);
    report_.optimizer_steps = store_->optimizer_steps();
    if (stepped.ok()) stepped = Publish(new_version);
    if (!stepped.ok()) {
      broken_ = stepped;
      return stepped;
    }
    // A republish without optimizer and delayed update leaves the state as is.
    if (apply_optimizer || update_delayed) ++generation_;
    if (apply_optimizer) {
      if (host_grads_used_) {
        for (std::vector<float>& g : grads_) std::fill(g.begin(), g.end(), 0.0f);
      }
      host_grads_used_ = device_grads_used_ = false;
    }
    return published_;
  }

  // The pipelined step (ShardBackend::StepPipelined; pipelined_step.h):
  // each bucket's gradients uploaded as the daemon's pushes deliver them;
  // while hooks.host_readers says someone reads, each bucket's bytes
  // copied to the host pieces of `out` before it is announced (the
  // daemon's as_ready fetches stream host bytes); `out` itself published
  // (with every bucket's metadata). Transactional until its commit barrier.
  absl::StatusOr<std::shared_ptr<const PublishedVersion>> StepPipelined(
      int64_t new_version, const AllReduceMaxFn& all_reduce, bool update_delayed,
      const std::vector<StepBucket>& buckets, const PipelinedStepHooks& hooks,
      std::shared_ptr<PublishedVersion> out) override {
    if (!broken_.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("an earlier gpu step failed (", broken_.message(),
                       "); the device state is undefined: load the model again"));
    }
    if (out == nullptr) {
      out = NewPipelinedVersion(new_version, buckets, static_cast<int>(tensors_.size()));
    }
    // The buckets' work runs on more streams than the store's: a snapshot's
    // spare copy (a few ms) is waited for on the host.
    RETURN_IF_ERROR(snapshot_spare_->WaitHost());
    absl::Status uploaded = Upload(/*apply_optimizer=*/false);
    NoteDeviceBytes();
    RETURN_IF_ERROR(uploaded);
    GpuPipelineSetup setup;
    setup.buckets = buckets;
    for (const StepBucket& b : buckets) {
      bool round2 = false;
      for (int t = b.tensor_begin; t < b.tensor_end; ++t) round2 |= SecondRound(tensors_[t].spec);
      setup.second_round.push_back(round2 ? 1 : 0);
    }
    setup.deadline = absl::Now() + step_timeout_;
    setup.update_delayed = update_delayed;
    std::vector<int> group;
    const absl::Time collective_deadline = absl::Now() + collective_timeout_;
    if (NcclTransport* nccl = DeviceAllReduceTransport()) {
      group.resize(nccl->world_size());
      std::iota(group.begin(), group.end(), 0);
      setup.all_reduce = [&, nccl](float* values, size_t count, cudaStream_t stream) {
        return nccl->AllReduceMaxDevice(group, values, count, stream, collective_deadline);
      };
      setup.wait_stream = [&, nccl](cudaStream_t stream, absl::Time deadline) {
        return nccl->WaitStream(stream, std::min(deadline, collective_deadline));
      };
    } else if (!(data_plane_known_ && transport_ == nullptr)) {
      setup.all_reduce = Bridge(all_reduce);
    }
    const std::vector<int64_t> held = store_->versions();
    if (held.size() == 2) copies_->Retire(held[0]);
    const int64_t step = store_->optimizer_steps() + 1;
    store_->set_step_lr(ScheduledLr(optimizer_, step));
    std::vector<BucketGradients> kept;  // uploads read them until the step ends
    GpuBucketHooks gpu_hooks;
    gpu_hooks.await_bucket = [&](const StepBucket& b) -> absl::Status {
      if (!hooks.await_bucket) return absl::OkStatus();
      BucketGradients g;
      RETURN_IF_ERROR(hooks.await_bucket(b, &g));
      return UploadBucket(b, std::move(g), &kept);
    };
    gpu_hooks.check_bucket = hooks.check_bucket;
    gpu_hooks.before_commit = hooks.before_commit;
    absl::Status copy_error;  // the announcer's, read after the step
    // Buckets [0, copied) are on the host. Announced buckets are checked
    // ones, in order: a bucket skipped while nobody read is copied before a
    // later one is announced.
    int copied = 0;
    gpu_hooks.on_bucket_ready = [&](int b) {
      if (!copy_error.ok() || (hooks.host_readers && !hooks.host_readers())) return;
      for (; copied <= b; ++copied) {
        absl::Status s = CopyBucketToHost(*store_, tensors_, shards_, new_version, buckets[copied],
                                          /*bytes=*/true, &copy_stream_, out.get());
        if (!s.ok()) {
          copy_error = s;  // not announced: its fetches end with the step's error
          return;
        }
      }
      if (hooks.on_bucket_ready) hooks.on_bucket_ready(b);
    };
    gpu_hooks.enqueued = [&] {
      if (step_enqueued_) step_enqueued_(new_version);
    };
    bool committed = false;
    absl::Status s =
        RunGpuPipelinedStep(*store_, new_version, setup, gpu_hooks, scratch_, &committed);
    NoteDeviceBytes();
    if (s.ok() && !copy_error.ok()) s = copy_error;
    if (s.ok() && new_version == fail_step_) {
      s = absl::InternalError(absl::StrCat("injected failure of the step to version ", new_version,
                                           " (PARAMD_GPU_FAIL_STEP)"));
    }
    if (!committed) return s;  // nothing changed: the step may run again
    // The buckets nobody read: their metadata (whole-version host readers
    // copy their bytes on demand, HostCopies).
    for (int b = copied; s.ok() && b < static_cast<int>(buckets.size()); ++b) {
      s = CopyBucketToHost(*store_, tensors_, shards_, new_version, buckets[b], /*bytes=*/false,
                           &copy_stream_, out.get());
    }
    if (s.ok()) UpdateReport(step);
    report_.optimizer_steps = store_->optimizer_steps();
    if (s.ok()) s = PublishPipelined(new_version, out);
    if (!s.ok()) {
      broken_ = s;
      return s;
    }
    ++generation_;
    host_grads_used_ = device_grads_used_ = false;
    return published_;
  }

 private:
  // Bridge: the packed [tensor][direction] device amaxes <-> the daemon's
  // host all-reduce (same length on every daemon).
  static DeviceAllReduce Bridge(const AllReduceMaxFn& all_reduce) {
    return [all_reduce](float* values, size_t count, cudaStream_t stream) -> absl::Status {
      std::vector<float> host(count);
      GPU_RETURN_IF_ERROR(cudaMemcpyAsync(host.data(), values, count * sizeof(float),
                                          cudaMemcpyDeviceToHost, stream));
      GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
      absl::Status s = all_reduce(absl::MakeSpan(host));
      if (!s.ok()) return absl::AbortedError(absl::StrCat("amax all-reduce failed: ", s.message()));
      GPU_RETURN_IF_ERROR(cudaMemcpyAsync(values, host.data(), count * sizeof(float),
                                          cudaMemcpyHostToDevice, stream));
      GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
      return absl::OkStatus();
    };
  }

  // As ShardSet::Step's report (same functions of the same float64 sum),
  // after optimizer step `step` finished.
  void UpdateReport(int64_t step) {
    if (optimizer_.needs_grad_norm()) {
      const double sum_sq = store_->last_norm_sum_sq();
      report_.grad_norm = std::sqrt(sum_sq);
      report_.clip_factor = ClipFactor(optimizer_, sum_sq);
      if (!std::isfinite(sum_sq) && optimizer_.non_finite == NonFinitePolicy::kSkipStep) {
        ++report_.skipped_steps;
        return;
      }
    }
    report_.lr = ScheduledLr(optimizer_, step);
  }

  // A bucket's gradients (per shard of the bucket, or none: the device
  // accumulators hold them) copied over the device accumulators on the
  // store's stream; `kept` holds the host rows until the step ends.
  absl::Status UploadBucket(const StepBucket& b, BucketGradients g,
                            std::vector<BucketGradients>* kept) {
    if (g.empty()) return absl::OkStatus();
    if (g.size() != b.shards.size()) {
      return absl::InternalError("pipelined step: gradients for the wrong number of shards");
    }
    ScopedDevice guard(store_->device());
    for (size_t k = 0; k < g.size(); ++k) {
      const int i = b.shards[k];
      if (g[k].size() != Count(i)) {
        return absl::InternalError("pipelined step: gradient of the wrong size");
      }
      GPU_RETURN_IF_ERROR(cudaMemcpyAsync(store_->grad(i), g[k].data(), g[k].size() * 4,
                                          cudaMemcpyHostToDevice, store_->stream()));
    }
    kept->push_back(std::move(g));
    return absl::OkStatus();
  }

  // `out` (every bucket copied by CopyBucketToHost) is the published
  // version: with its report, registered with copies_ (which hands `out`
  // itself to host readers: it carries its bytes).
  absl::Status PublishPipelined(int64_t version, const std::shared_ptr<PublishedVersion>& out) {
    out->report = report_;
    std::vector<GpuPublishedDirection> device;
    for (const PublishedPiece& p : out->pieces) {
      ASSIGN_OR_RETURN(GpuPublishedDirection d, store_->Published(version, p.shard, p.direction));
      device.push_back(d);
    }
    published_ = out;
    copies_->Add(out, std::move(device));
    return absl::OkStatus();
  }

  // The NCCL transport of a world of daemons on distinct GPUs, or null (host
  // bridge or single daemon).
  NcclTransport* DeviceAllReduceTransport() const {
    if (transport_ == nullptr) return nullptr;
    NcclTransport* nccl = AsNcclTransport(transport_);
    if (nccl == nullptr || nccl->device() != store_->device()) return nullptr;
    for (int peer = 0; peer < nccl->world_size(); ++peer) {
      if (peer != nccl->rank() && !nccl->UsesNccl(peer)) return nullptr;
    }
    return nccl;
  }

  size_t Count(int i) const {
    return static_cast<size_t>(shards_[i].rows() * tensors_[shards_[i].tensor].cols);
  }
  bool Sgd() const { return optimizer_.kind == OptimizerKind::kSgd; }

  // memory() is read from any thread (GetStats): the store's count, which
  // is fixed from its Create on (the upload staging is allocated with it).
  void NoteDeviceBytes() { device_bytes_.store(store_->device_bytes(), std::memory_order_relaxed); }

  // Host FP32 values added to shard `i`'s device accumulator from element
  // `offset` on, through the store's fixed upload staging (4 MiB pieces:
  // a whole-tensor push never costs 4 bytes per parameter of staging).
  absl::Status AccumulateInPieces(int i, int64_t offset, const float* values, int64_t count,
                                  bool last_pusher = false) {
    // Checked whole first: a bad piece adds nothing.
    if (i < 0 || i >= static_cast<int>(shards_.size()) || offset < 0 || count < 0 ||
        offset + count > static_cast<int64_t>(Count(i))) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradient piece [", offset, ", +", count, ") outside shard ", i));
    }
    return store_->AccumulateHost(i, offset, values, count, last_pusher);
  }

  // Masters (once, after loading, or after the host mirror was handed out)
  // and, for an optimizer step, the host accumulators (the device
  // accumulators are zero between steps).
  absl::Status Upload(bool apply_optimizer) {
    GPU_RETURN_IF_ERROR(cudaSetDevice(store_->device()));
    RETURN_IF_ERROR(UploadPendingMasters());
    // Host accumulators (written through gradient()): copied over the zero
    // device ones, or added after device pushes (AccumulateGradient).
    if (apply_optimizer && host_grads_used_) {
      for (size_t i = 0; i < shards_.size(); ++i) {
        // (A same-GPU push writes the device accumulator directly.)
        if (device_grads_used_ || !store_->grad_zero(static_cast<int>(i))) {
          RETURN_IF_ERROR(AccumulateInPieces(static_cast<int>(i), 0, grads_[i].data(),
                                             static_cast<int64_t>(grads_[i].size())));
        } else {
          RETURN_IF_ERROR(BlockingCopy(store_->grad(static_cast<int>(i)), grads_[i].data(),
                                       grads_[i].size() * sizeof(float), cudaMemcpyHostToDevice));
          store_->note_grad_written(static_cast<int>(i));
        }
      }
    }
    return absl::OkStatus();
  }

  // A mirror handed out, or the staged masters (zeros when load_master()
  // was never handed out), onto the device: from then on the device holds
  // the newest state.
  absl::Status UploadPendingMasters() {
    if (mirror_dirty_) {
      RETURN_IF_ERROR(UploadMirror());
      mirror_dirty_ = false;
      masters_uploaded_ = true;
      load_ = std::vector<std::vector<float>>(shards_.size());
    }
    if (!masters_uploaded_) {
      for (size_t i = 0; i < shards_.size(); ++i) {
        float* master = store_->master(static_cast<int>(i));
        const size_t bytes = load_[i].size() * sizeof(float);
        if (load_handed_out_) {
          RETURN_IF_ERROR(BlockingCopy(master, load_[i].data(), bytes, cudaMemcpyHostToDevice));
        } else {
          GPU_RETURN_IF_ERROR(cudaMemset(master, 0, bytes));
        }
      }
      GPU_RETURN_IF_ERROR(cudaDeviceSynchronize());
      masters_uploaded_ = true;
      load_ = std::vector<std::vector<float>>(shards_.size());  // staging no longer needed
    }
    return absl::OkStatus();
  }

  // Before a restore writes into the store: no snapshot copy still reads
  // it, it holds the newest state, and the mirror no longer matches it.
  absl::Status BeforeDirectWrite() {
    if (!broken_.ok()) return absl::FailedPreconditionError("an earlier gpu step failed");
    RETURN_IF_ERROR(snapshot_spare_->WaitHost());
    ScopedDevice guard(store_->device());
    RETURN_IF_ERROR(UploadPendingMasters());
    mirror_generation_ = -1;
    return absl::OkStatus();
  }

  // ShardStateSink over the store (server/step/state_sink.h): each call
  // copies its part of the saved state to the device at once.
  class DeviceSink final : public ShardStateSink {
   public:
    explicit DeviceSink(GpuShardBackend& backend) : b_(backend) {}
    const std::vector<TensorDef>& tensors() const override { return b_.tensors_; }
    const std::vector<ShardDef>& shards() const override { return b_.shards_; }
    const OptimizerOptions& optimizer() const override { return b_.optimizer_; }
    absl::Status RestoreOptimizer(const OptimizerOptions& optimizer) override {
      return b_.SetOptimizer(optimizer);
    }
    absl::Status RestoreMaster(int shard, absl::Span<const float> values) override {
      RETURN_IF_ERROR(CheckShard(shard, values, /*may_be_empty=*/false));
      RETURN_IF_ERROR(b_.BeforeDirectWrite());
      return UploadShardMaster(*b_.store_, shard, values);
    }
    absl::Status RestoreOptimizerState(int shard, absl::Span<const float> m,
                                       absl::Span<const float> v) override {
      RETURN_IF_ERROR(CheckShard(shard, m, /*may_be_empty=*/true));
      RETURN_IF_ERROR(CheckShard(shard, v, /*may_be_empty=*/true));
      RETURN_IF_ERROR(b_.BeforeDirectWrite());
      const size_t n = b_.Count(shard);
      absl::Status s = UploadShardMoments(*b_.store_, shard, n, b_.Sgd(), m, v);
      b_.NoteDeviceBytes();  // SGD momentum buffers may have been allocated
      RETURN_IF_ERROR(s);
      b_.momentum_zeroed_[shard] = m.size() != n;
      return absl::OkStatus();
    }
    absl::Status RestoreDelayedState(int tensor, Direction d, DelayedScalingState state) override {
      RETURN_IF_ERROR(b_.BeforeDirectWrite());
      for (size_t i = 0; i < b_.shards_.size(); ++i) {
        if (b_.shards_[i].tensor != tensor) continue;
        RETURN_IF_ERROR(UploadShardDelayed(*b_.store_, b_.tensors_[tensor].spec,
                                           static_cast<int>(i), d, state));
      }
      return absl::OkStatus();
    }
    absl::Status RestoreStepCounts(int64_t optimizer_steps, int64_t skipped_steps) override {
      RETURN_IF_ERROR(b_.BeforeDirectWrite());
      const int64_t steps = optimizer_steps >= 0 ? optimizer_steps : b_.store_->optimizer_steps();
      b_.store_->set_optimizer_steps(
          steps, b_.Sgd() && MomentumStartsFresh(*b_.store_, b_.momentum_zeroed_));
      b_.report_.optimizer_steps = steps;
      if (skipped_steps >= 0) b_.report_.skipped_steps = skipped_steps;
      return absl::OkStatus();
    }

   private:
    // INVALID_ARGUMENT unless `shard` is one of ours and `values` has its
    // element count (or, `may_be_empty`, none).
    absl::Status CheckShard(int shard, absl::Span<const float> values, bool may_be_empty) const {
      if (shard < 0 || shard >= static_cast<int>(b_.shards_.size())) {
        return absl::InvalidArgumentError(
            absl::StrCat("restore of shard ", shard, " of ", b_.shards_.size()));
      }
      const size_t n = b_.Count(shard);
      if (values.size() != n && !(may_be_empty && values.empty())) {
        return absl::InvalidArgumentError(
            absl::StrCat("restore of ", values.size(), " values into shard ", shard, " of ", n));
      }
      return absl::OkStatus();
    }

    GpuShardBackend& b_;
  };

  // Device -> mirror_ (created on first use), unless it is already current.
  absl::Status DownloadMirror() {
    if (mirror_ == nullptr) {
      ASSIGN_OR_RETURN(mirror_, ShardSet::Create(tensors_, shards_, optimizer_));
      mirror_generation_ = -1;
    }
    // Handed out and not uploaded yet: the mirror is the newest state.
    if (mirror_dirty_ || mirror_generation_ == generation_) return absl::OkStatus();
    RETURN_IF_ERROR(DownloadToMirror(*store_, tensors_, shards_, Sgd(),
                                     masters_uploaded_ ? nullptr : &load_, *mirror_));
    mirror_->SetSkippedSteps(report_.skipped_steps);
    mirror_generation_ = generation_;
    return absl::OkStatus();
  }

  // mirror_ -> device (after a restore wrote into it).
  absl::Status UploadMirror() {
    absl::Status s = UploadFromMirror(*mirror_, tensors_, shards_, Sgd(), *store_);
    NoteDeviceBytes();  // momentum buffers may have been allocated
    RETURN_IF_ERROR(s);
    report_.optimizer_steps = mirror_->optimizer_steps();
    report_.skipped_steps = mirror_->skipped_steps();
    mirror_generation_ = generation_;  // equal until a step moves the device on
    return absl::OkStatus();
  }

  // The metadata of `version` (pieces with layouts and scalars, no bytes:
  // host_bytes() copies those on demand), in the cpu backend's order (by
  // shard, rowwise then columnwise), registered with copies_.
  absl::Status Publish(int64_t version) {
    ScopedDevice guard(store_->device());
    ASSIGN_OR_RETURN(const float* device_scalars, store_->PublishedScalars(version));
    std::vector<float> scalars(store_->published_scalars_count());
    RETURN_IF_ERROR(BlockingCopy(scalars.data(), device_scalars, scalars.size() * sizeof(float),
                                 cudaMemcpyDeviceToHost));
    std::vector<float> amax(store_->amax_count());
    RETURN_IF_ERROR(BlockingCopy(amax.data(), store_->amax_vector(), amax.size() * sizeof(float),
                                 cudaMemcpyDeviceToHost));
    auto published = std::make_shared<PublishedVersion>();
    std::vector<GpuPublishedDirection> device;
    published->version = version;
    published->report = report_;
    published->tensors.resize(tensors_.size());
    for (size_t i = 0; i < shards_.size(); ++i) {
      const ShardDef& d = shards_[i];
      GpuPublishedDirection dirs[2];
      for (int dir = 0; dir < 2; ++dir) {
        if (!Uses(tensors_[d.tensor].spec, dir)) continue;
        ASSIGN_OR_RETURN(dirs[dir], store_->Published(version, static_cast<int>(i),
                                                      static_cast<Direction>(dir)));
        device.push_back(dirs[dir]);
      }
      DescribeShard(static_cast<int>(i), d, tensors_[d.tensor],
                    scalars.data() + 2 * i * GpuShardStore::kScalarsPerDirection,
                    amax.data() + 2 * d.tensor, dirs, &published->tensors[d.tensor],
                    &published->pieces);
    }
    published_ = published;
    copies_->Add(std::move(published), std::move(device));
    return absl::OkStatus();
  }

  std::vector<TensorDef> tensors_;
  std::vector<ShardDef> shards_;
  std::shared_ptr<GpuShardStore> store_;
  std::shared_ptr<HostCopies> copies_;
  std::shared_ptr<DeviceSnapshotSpare> snapshot_spare_;  // CaptureState
  OptimizerOptions optimizer_;
  StepReport report_;  // of the latest published version
  absl::Duration step_timeout_;
  std::vector<std::vector<float>> load_;   // host staging until the first Step
  std::vector<std::vector<float>> grads_;  // host FP32 accumulators
  std::vector<void*> registered_;          // grads_ buffers page-locked for CUDA
  // Since the last optimizer step: gradient() was handed out (grads_ may
  // hold pushes) / AccumulateGradient added pushes on the device.
  bool host_grads_used_ = false;
  bool device_grads_used_ = false;
  bool masters_uploaded_ = false;
  bool load_handed_out_ = false;  // load_master() was called: load_ may hold weights
  // By shard: a restore wrote empty momentum (DeviceSink; the next SGD
  // momentum step starts the buffers from the gradient).
  std::vector<bool> momentum_zeroed_ = std::vector<bool>(shards_.size());
  DeviceSink sink_{*this};
  absl::Status broken_;  // the first failed Step; every later Step is refused
  std::shared_ptr<const PublishedVersion> published_;  // the last Step's
  // Host mirror for checkpoints/export/restore (host_state()).
  std::unique_ptr<ShardSet> mirror_;
  bool mirror_dirty_ = false;  // handed out: upload before the next Step
  int64_t generation_ = 0;     // successful Steps so far
  // ShardBackend::set_data_plane.
  bool data_plane_known_ = false;
  Transport* transport_ = nullptr;
  absl::Duration collective_timeout_ = absl::Seconds(60);
  StepEnqueuedFn step_enqueued_;          // ShardBackend::set_step_enqueued
  std::atomic<int64_t> device_bytes_{0};  // NoteDeviceBytes
  // Test hooks (TestHookFromEnv). PARAMD_GPU_FAIL_STEP=<v>: the step to
  // version v fails after its device work completed, as a device fault
  // found at the end would. PARAMD_GPU_STEP_DELAY_MS=<n>: every optimizer
  // step's device work starts n ms late (the stream is held), so that
  // fetches meet a step in flight whatever the model's size.
  // PARAMD_GPU_HOST_COPY_DELAY_MS=<n> (HostCopies): every copy of a version
  // to the host takes n ms longer. -1: off.
  const int64_t fail_step_ = TestHookFromEnv("PARAMD_GPU_FAIL_STEP");
  const int64_t step_delay_ms_ = TestHookFromEnv("PARAMD_GPU_STEP_DELAY_MS");
  bool logged_device_all_reduce_ = false;
  int64_t mirror_generation_ = -1;
  GpuPipelineScratch scratch_;          // StepPipelined's
  cudaStream_t copy_stream_ = nullptr;  // StepPipelined's host copies
};

const bool kRegistered = RegisterGpuShardBackend(&CreateGpuShardBackend);

}  // namespace

absl::StatusOr<std::unique_ptr<ShardBackend>> CreateGpuShardBackend(
    std::vector<TensorDef> tensors, std::vector<ShardDef> shards,
    const ShardBackendOptions& options) {
  (void)kRegistered;
  RETURN_IF_ERROR(ValidateOptimizerOptions(options.optimizer));
  // The norm's state is allocated whenever the shards allow it (128-row
  // aligned), so a later SetOptimizer may turn clipping or skip_step on.
  const bool norm = options.optimizer.needs_grad_norm();
  bool norm_state = true;
  GradNormSlots slots;
  {
    std::vector<int64_t> rows;
    std::vector<bool> frozen;
    for (const TensorDef& t : tensors) {
      rows.push_back(t.rows);
      frozen.push_back(t.optimizer.frozen);
    }
    slots = MakeGradNormSlots(rows, frozen);
  }
  std::vector<GpuShardDef> defs;
  bool second_round = false;
  for (const TensorDef& t : tensors) second_round |= SecondRound(t.spec);
  for (const ShardDef& d : shards) {
    if (d.tensor < 0 || d.tensor >= static_cast<int>(tensors.size()) || d.row_begin < 0 ||
        d.row_end <= d.row_begin || d.row_end > tensors[d.tensor].rows) {
      return absl::InvalidArgumentError("gpu backend: shard outside its tensor");
    }
    const TensorDef& t = tensors[d.tensor];
    GpuShardDef g;
    g.name = absl::StrCat(t.name, "[", d.row_begin, ":", d.row_end, "]");
    g.tensor = d.tensor;
    g.rows = d.rows();
    g.cols = t.cols;
    g.spec = t.spec;
    g.lr_multiplier = t.optimizer.lr_multiplier;
    g.weight_decay = t.optimizer.weight_decay.value_or(-1.0f);
    g.frozen = t.optimizer.frozen;
    if (!g.frozen) {
      if (d.row_begin % kGradNormBlockRows != 0) {
        if (norm) {
          return absl::InvalidArgumentError(
              absl::StrCat("gradient norm: shard of ", t.name, " starts at row ", d.row_begin,
                           ", not a multiple of ", kGradNormBlockRows));
        }
        norm_state = false;
      } else {
        g.norm_slot = slots.slot_begin[d.tensor] + d.row_begin / kGradNormBlockRows;
      }
    }
    defs.push_back(std::move(g));
  }
  const OptimizerOptions& o = options.optimizer;
  GpuStoreOptions store_options;
  store_options.device = 0;
  store_options.num_tensors = static_cast<int>(tensors.size());
  store_options.second_round = second_round;
  store_options.sgd = o.kind == OptimizerKind::kSgd;
  store_options.adamw = AdamWHyperOf(o);
  store_options.sgd_hyper = SgdHyperOf(o);
  store_options.push_staging_buffers = 0;  // pushes arrive on the host
  store_options.grad_norm = norm;
  store_options.grad_norm_state = norm_state;
  store_options.norm_slots = slots.num_slots;
  store_options.max_grad_norm = o.max_grad_norm;
  store_options.skip_non_finite = o.non_finite == NonFinitePolicy::kSkipStep;
  ASSIGN_OR_RETURN(std::unique_ptr<GpuShardStore> store,
                   GpuShardStore::Create(std::move(defs), store_options));
  return std::unique_ptr<ShardBackend>(
      new GpuShardBackend(std::move(tensors), std::move(shards),
                          std::shared_ptr<GpuShardStore>(std::move(store)), options));
}

GpuShardStore* DeviceStoreOf(ShardBackend* backend) {
  auto* gpu = dynamic_cast<GpuShardBackend*>(backend);
  return gpu == nullptr ? nullptr : gpu->store();
}

}  // namespace gpu_backend
}  // namespace paramd
