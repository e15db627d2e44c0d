#include "server/backend/shard_backend.h"

#include <utility>

#include "absl/strings/str_cat.h"
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

// The cpu backend's capture: its ShardSet read in place on the keeper's
// thread (the daemon holds the next step until the copy is done).
class HostStateCapture : public StateCapture {
 public:
  explicit HostStateCapture(const ShardSet* set) : set_(set) {}
  absl::string_view kind() const override { return "host"; }
  bool reads_live_state() const override { return true; }
  absl::Status Copy(std::vector<std::array<std::vector<float>, 3>>& arrays) override {
    // Into the vectors `arrays` already has (a recycled snapshot's, of the
    // same sizes): copy-assignment reuses their memory.
    arrays.resize(set_->shards().size());
    for (size_t i = 0; i < set_->shards().size(); ++i) {
      std::array<std::vector<float>, 3>& a = arrays[i];
      absl::Span<const float> m = set_->master(static_cast<int>(i));
      a[0].assign(m.begin(), m.end());
      const OptimizerState& o = set_->optimizer_state(static_cast<int>(i));
      a[1] = o.m;
      a[2] = o.v;
    }
    return absl::OkStatus();
  }

 private:
  const ShardSet* const set_;
};

ShardBackendFactory& GpuFactory() {
  static ShardBackendFactory* factory = new ShardBackendFactory();
  return *factory;
}

}  // namespace

absl::StatusOr<CapturedState> ShardBackend::CaptureState() {
  const ShardSet* host = host_state();
  if (host == nullptr) {
    return absl::UnimplementedError(
        absl::StrCat("the ", name(), " backend has no host state to snapshot"));
  }
  CapturedState c;
  c.optimizer = host->optimizer();
  c.optimizer_steps = host->optimizer_steps();
  c.skipped_steps = host->skipped_steps();
  std::vector<bool> held(host->tensors().size(), false);
  for (const ShardDef& d : host->shards()) held[d.tensor] = true;
  c.delayed.resize(host->tensors().size());
  for (size_t t = 0; t < held.size(); ++t) {
    if (!held[t]) continue;
    c.delayed[t] = {host->delayed_state(static_cast<int>(t), Direction::kRowwise),
                    host->delayed_state(static_cast<int>(t), Direction::kColumnwise)};
  }
  c.arrays = std::make_unique<HostStateCapture>(host);
  return c;
}

bool RegisterGpuShardBackend(ShardBackendFactory factory) {
  GpuFactory() = std::move(factory);
  return true;
}

bool GpuShardBackendLinked() { return static_cast<bool>(GpuFactory()); }

absl::StatusOr<std::unique_ptr<ShardBackend>> CreateShardBackend(
    DaemonBackend kind, std::vector<TensorDef> tensors, std::vector<ShardDef> shards,
    const ShardBackendOptions& options) {
  if (kind == DaemonBackend::kGpu) {
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
