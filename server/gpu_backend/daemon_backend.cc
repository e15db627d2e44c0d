#include "server/gpu_backend/daemon_backend.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/gpu_status.h"
#include "common/status_macros.h"
#include "server/gpu_backend/shard_store.h"

namespace paramd {
namespace gpu_backend {
namespace {

bool PerTensorFp8(Format f) { return f == Format::kFp8Current || f == Format::kFp8Delayed; }

absl::Status CopyToHost(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  GPU_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  GPU_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

class GpuShardBackend : public ShardBackend {
 public:
  GpuShardBackend(std::vector<TensorDef> tensors, std::vector<ShardDef> shards,
                  std::unique_ptr<GpuShardStore> store, absl::Duration step_timeout)
      : tensors_(std::move(tensors)),
        shards_(std::move(shards)),
        store_(std::move(store)),
        step_timeout_(step_timeout) {
    for (const ShardDef& d : shards_) {
      const size_t n = static_cast<size_t>(d.rows() * tensors_[d.tensor].cols);
      load_.emplace_back(n, 0.0f);
      grads_.emplace_back(n, 0.0f);
    }
  }

  absl::string_view name() const override { return "gpu"; }
  const std::vector<TensorDef>& tensors() const override { return tensors_; }
  const std::vector<ShardDef>& shards() const override { return shards_; }
  absl::Span<float> load_master(int i) override { return absl::MakeSpan(load_[i]); }
  absl::Span<float> gradient(int i) override { return absl::MakeSpan(grads_[i]); }
  ShardSet* host_state() override { return nullptr; }
  GpuShardStore* store() { return store_.get(); }

  absl::StatusOr<std::shared_ptr<const PublishedVersion>> Step(int64_t new_version,
                                                               bool apply_optimizer,
                                                               const AllReduceMaxFn& all_reduce,
                                                               bool update_delayed) override {
    if (!update_delayed) {
      return absl::UnimplementedError(
          "the gpu daemon backend cannot republish without a delayed-scaling update "
          "(checkpoint restore)");
    }
    if (!broken_.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "an earlier gpu step failed (", broken_.message(),
          "); the device state is undefined: load the model again"));
    }
    RETURN_IF_ERROR(Upload(apply_optimizer));
    const int num_tensors = static_cast<int>(tensors_.size());
    // Bridge: per-shard device amaxes <-> the daemon's host all-reduce over
    // the manifest-sized [tensor][direction] vector (same length on every
    // daemon).
    DeviceAllReduce bridge = [&](float* values, size_t count,
                                 cudaStream_t stream) -> absl::Status {
      std::vector<float> local(count);
      GPU_RETURN_IF_ERROR(cudaMemcpyAsync(local.data(), values, count * sizeof(float),
                                          cudaMemcpyDeviceToHost, stream));
      GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
      std::vector<float> packed(2 * num_tensors, 0.0f);
      for (size_t i = 0; i < count; ++i) {
        const int t = shards_[i].tensor;
        packed[2 * t] = std::max(packed[2 * t], local[i]);
        packed[2 * t + 1] = std::max(packed[2 * t + 1], local[i]);
      }
      absl::Status s = all_reduce(absl::MakeSpan(packed));
      if (!s.ok()) return absl::AbortedError(absl::StrCat("amax all-reduce failed: ", s.message()));
      for (size_t i = 0; i < count; ++i) {
        const int t = shards_[i].tensor;
        local[i] = std::max(packed[2 * t], packed[2 * t + 1]);
      }
      GPU_RETURN_IF_ERROR(cudaMemcpyAsync(values, local.data(), count * sizeof(float),
                                          cudaMemcpyHostToDevice, stream));
      GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
      return absl::OkStatus();
    };
    // Not transactional: the masters may have moved and the store may still
    // hold the failed step, so every later step is refused.
    absl::Status stepped =
        store_->Step(new_version, apply_optimizer, bridge, absl::Now() + step_timeout_);
    if (!stepped.ok()) {
      broken_ = stepped;
      return stepped;
    }
    if (apply_optimizer) {
      for (std::vector<float>& g : grads_) std::fill(g.begin(), g.end(), 0.0f);
    }
    return CopyPublished(new_version);
  }

 private:
  // Masters (once, after loading) and, for an optimizer step, the host
  // accumulators (the device accumulators are zero between steps).
  absl::Status Upload(bool apply_optimizer) {
    GPU_RETURN_IF_ERROR(cudaSetDevice(store_->device()));
    if (!masters_uploaded_) {
      for (size_t i = 0; i < shards_.size(); ++i) {
        RETURN_IF_ERROR(CopyToDevice(store_->master(static_cast<int>(i)), load_[i].data(),
                                     load_[i].size() * sizeof(float)));
      }
      masters_uploaded_ = true;
      load_ = std::vector<std::vector<float>>(shards_.size());  // staging no longer needed
    }
    if (apply_optimizer) {
      for (size_t i = 0; i < shards_.size(); ++i) {
        RETURN_IF_ERROR(CopyToDevice(store_->grad(static_cast<int>(i)), grads_[i].data(),
                                     grads_[i].size() * sizeof(float)));
      }
    }
    return absl::OkStatus();
  }

  // The device buffers of `version` as host pieces, in the cpu backend's
  // order (by shard, rowwise then columnwise).
  absl::StatusOr<std::shared_ptr<const PublishedVersion>> CopyPublished(int64_t version) {
    auto published = std::make_shared<PublishedVersion>();
    published->version = version;
    published->tensors.resize(tensors_.size());
    for (size_t i = 0; i < shards_.size(); ++i) {
      const ShardDef& d = shards_[i];
      const TensorDef& t = tensors_[d.tensor];
      TensorScalingInfo& info = published->tensors[d.tensor];
      info.held = true;
      for (int dir = 0; dir < 2; ++dir) {
        const bool used = dir == 0 ? t.spec.rowwise_usage : t.spec.columnwise_usage;
        if (!used) continue;
        const QuantSpec& qs = dir == 0 ? t.spec.rowwise : t.spec.columnwise;
        const Direction direction = dir == 0 ? Direction::kRowwise : Direction::kColumnwise;
        ASSIGN_OR_RETURN(GpuPublishedDirection pub,
                         store_->Published(version, static_cast<int>(i), direction));
        PublishedPiece p;
        p.shard = static_cast<int>(i);
        p.tensor = d.tensor;
        p.row_begin = d.row_begin;
        p.row_end = d.row_end;
        p.direction = direction;
        p.layout = pub.layout;
        p.q.format = qs.format;
        p.q.direction = direction;
        p.q.rows = d.rows();
        p.q.cols = t.cols;
        p.q.data.resize(pub.layout.data_bytes());
        RETURN_IF_ERROR(CopyToHost(p.q.data.data(), pub.data, p.q.data.size()));
        p.q.scales.resize(pub.layout.scale_bytes());
        if (pub.scales != nullptr) {
          RETURN_IF_ERROR(CopyToHost(p.q.scales.data(), pub.scales, p.q.scales.size()));
        }
        float amax = 0.0f;
        if (pub.amax != nullptr) RETURN_IF_ERROR(CopyToHost(&amax, pub.amax, sizeof(float)));
        if (PerTensorFp8(qs.format) && pub.scale_inv != nullptr) {
          RETURN_IF_ERROR(CopyToHost(&p.q.scale_inv, pub.scale_inv, sizeof(float)));
          // The store keeps the cast multiplier private; rcp(scale_inv) is
          // what GetStats reports (may differ from the exact multiplier by
          // one ulp).
          p.scale = p.q.scale_inv != 0.0f ? 1.0f / p.q.scale_inv : 1.0f;
        }
        if (PerTensorFp8(qs.format) || NeedsGlobalAmax(qs.format)) p.q.amax = amax;
        if (dir == 0) {
          info.rowwise_scale = p.scale;
          info.rowwise_amax = amax;
        } else {
          info.columnwise_scale = p.scale;
          info.columnwise_amax = amax;
        }
        published->pieces.push_back(std::move(p));
      }
    }
    return std::shared_ptr<const PublishedVersion>(std::move(published));
  }

  std::vector<TensorDef> tensors_;
  std::vector<ShardDef> shards_;
  std::unique_ptr<GpuShardStore> store_;
  absl::Duration step_timeout_;
  std::vector<std::vector<float>> load_;   // host staging until the first Step
  std::vector<std::vector<float>> grads_;  // host FP32 accumulators
  bool masters_uploaded_ = false;
  absl::Status broken_;  // the first failed Step; every later Step is refused
};

const bool kRegistered = RegisterGpuShardBackend(&CreateGpuShardBackend);

}  // namespace

absl::StatusOr<std::unique_ptr<ShardBackend>> CreateGpuShardBackend(
    std::vector<TensorDef> tensors, std::vector<ShardDef> shards,
    const ShardBackendOptions& options) {
  (void)kRegistered;
  RETURN_IF_ERROR(ValidateOptimizerOptions(options.optimizer));
  if (options.optimizer.kind != OptimizerKind::kAdamW) {
    return absl::UnimplementedError(
        absl::StrCat("the gpu daemon backend runs AdamW only, not ",
                     OptimizerName(options.optimizer.kind), " (use --backend=cpu)"));
  }
  std::vector<GpuShardDef> defs;
  for (const ShardDef& d : shards) {
    if (d.tensor < 0 || d.tensor >= static_cast<int>(tensors.size()) || d.row_begin < 0 ||
        d.row_end <= d.row_begin || d.row_end > tensors[d.tensor].rows) {
      return absl::InvalidArgumentError("gpu backend: shard outside its tensor");
    }
    const TensorDef& t = tensors[d.tensor];
    GpuShardDef g;
    g.name = absl::StrCat(t.name, "[", d.row_begin, ":", d.row_end, "]");
    g.rows = d.rows();
    g.cols = t.cols;
    g.spec = t.spec;
    defs.push_back(std::move(g));
  }
  GpuStoreOptions store_options;
  store_options.device = 0;
  store_options.adamw.lr = options.optimizer.lr;
  store_options.adamw.beta1 = options.optimizer.beta1;
  store_options.adamw.beta2 = options.optimizer.beta2;
  store_options.adamw.eps = options.optimizer.eps;
  store_options.adamw.weight_decay = options.optimizer.weight_decay;
  store_options.push_staging_buffers = 0;  // pushes arrive on the host
  ASSIGN_OR_RETURN(std::unique_ptr<GpuShardStore> store,
                   GpuShardStore::Create(std::move(defs), store_options));
  return std::unique_ptr<ShardBackend>(new GpuShardBackend(
      std::move(tensors), std::move(shards), std::move(store), options.step_timeout));
}

GpuShardStore* DeviceStoreOf(ShardBackend* backend) {
  auto* gpu = dynamic_cast<GpuShardBackend*>(backend);
  return gpu == nullptr ? nullptr : gpu->store();
}

}  // namespace gpu_backend
}  // namespace paramd
