#include "server/shard_backend.h"

#include <utility>

#include "common/status_macros.h"

namespace paramd {
namespace {

// The cpu backend: ShardSet as is.
class CpuShardBackend : public ShardBackend {
 public:
  explicit CpuShardBackend(std::unique_ptr<ShardSet> set) : set_(std::move(set)) {}

  absl::string_view name() const override { return "cpu"; }
  const std::vector<TensorDef>& tensors() const override { return set_->tensors(); }
  const std::vector<ShardDef>& shards() const override { return set_->shards(); }
  absl::Span<float> load_master(int i) override { return set_->master(i); }
  absl::Span<float> gradient(int i) override { return set_->gradient(i); }
  absl::Status AccumulateGradient(int i, int64_t offset, absl::Span<const float> values,
                                  bool last_pusher) override {
    return set_->AccumulateGradient(i, offset, values, last_pusher);
  }
  absl::Status SetOptimizer(const OptimizerOptions& optimizer) override {
    return set_->SetOptimizer(optimizer);
  }
  absl::StatusOr<std::shared_ptr<const PublishedVersion>> Step(int64_t new_version,
                                                               bool apply_optimizer,
                                                               const AllReduceMaxFn& all_reduce,
                                                               bool update_delayed) override {
    return set_->Step(new_version, apply_optimizer, all_reduce, update_delayed);
  }
  absl::StatusOr<std::shared_ptr<const PublishedVersion>> StepPipelined(
      int64_t new_version, const AllReduceMaxFn& all_reduce, bool update_delayed,
      const std::vector<StepBucket>& buckets, const PipelinedStepHooks& hooks,
      std::shared_ptr<PublishedVersion> out) override {
    return RunPipelinedStep(*set_, new_version, /*apply_optimizer=*/true, all_reduce,
                            update_delayed, buckets, hooks, std::move(out));
  }
  ShardSet* host_state() override { return set_.get(); }

 private:
  std::unique_ptr<ShardSet> set_;
};

ShardBackendFactory& GpuFactory() {
  static ShardBackendFactory* factory = new ShardBackendFactory();
  return *factory;
}

}  // namespace

bool RegisterGpuShardBackend(ShardBackendFactory factory) {
  GpuFactory() = std::move(factory);
  return true;
}

bool GpuShardBackendLinked() { return static_cast<bool>(GpuFactory()); }

absl::StatusOr<std::unique_ptr<ShardBackend>> CreateShardBackend(
    gpu_backend::DaemonBackend kind, std::vector<TensorDef> tensors, std::vector<ShardDef> shards,
    const ShardBackendOptions& options) {
  if (kind == gpu_backend::DaemonBackend::kGpu) {
    if (!GpuShardBackendLinked()) {
      return absl::FailedPreconditionError(
          "the gpu daemon backend is not linked into this binary (build with --config=cuda)");
    }
    return GpuFactory()(std::move(tensors), std::move(shards), options);
  }
  ASSIGN_OR_RETURN(std::unique_ptr<ShardSet> set,
                   ShardSet::Create(std::move(tensors), std::move(shards), options.optimizer));
  return std::unique_ptr<ShardBackend>(new CpuShardBackend(std::move(set)));
}

}  // namespace paramd
