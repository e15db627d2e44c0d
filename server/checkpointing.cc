#include "server/checkpointing.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/snapshot/shard_set_adapter.h"

namespace paramd {
namespace {

class CheckpointableCpuDaemon : public checkpoint::CheckpointableDaemon {
 public:
  explicit CheckpointableCpuDaemon(Daemon* daemon) : daemon_(daemon) {}

  absl::Status WithState(
      int64_t version,
      const std::function<absl::Status(const checkpoint::DaemonStateView&)>& fn) override {
    return daemon_->WithStableState([&](const ShardSet& shards, const PublishedVersion& latest,
                                        const PublishedVersion*,
                                        int64_t model_generation) -> absl::Status {
      if (latest.version != version) return checkpoint::NotAtVersion(latest.version, version);
      checkpoint::DaemonStateView view = checkpoint::MakeDaemonStateView(shards, latest);
      view.model_generation = model_generation;
      return fn(view);
    });
  }

  absl::Status ReadRows(int64_t version, checkpoint::ExportValuesKind kind,
                        const std::string& tensor, int64_t row_begin, int64_t row_end,
                        absl::Span<float> out) override {
    return daemon_->WithStableState([&](const ShardSet& shards, const PublishedVersion& latest,
                                        const PublishedVersion* previous,
                                        int64_t /*model_generation*/) -> absl::Status {
      const PublishedVersion* v = nullptr;
      if (version == latest.version) v = &latest;
      if (previous != nullptr && version == previous->version) v = previous;
      if (kind == checkpoint::ExportValuesKind::kMaster && v != &latest) {
        // The masters exist only for the latest version.
        return absl::FailedPreconditionError(
            absl::StrCat("daemon is at version ", latest.version, ", not ", version));
      }
      if (v == nullptr) {
        return absl::NotFoundError(
            absl::StrCat("version ", version, " is no longer kept; latest is ", latest.version));
      }
      return checkpoint::ReadPublishedRows(shards, *v, kind, tensor, row_begin, row_end, out);
    });
  }

  int rank() const override { return daemon_->rank(); }

 private:
  Daemon* const daemon_;
};

class InProcessClusterView : public checkpoint::ClusterView {
 public:
  explicit InProcessClusterView(Coordinator* coordinator) : coordinator_(coordinator) {}
  absl::StatusOr<rpc::Manifest> GetManifest() override { return coordinator_->manifest(); }

 private:
  Coordinator* const coordinator_;
};

}  // namespace

std::unique_ptr<checkpoint::CheckpointableDaemon> NewCheckpointableDaemon(Daemon* daemon) {
  return std::make_unique<CheckpointableCpuDaemon>(daemon);
}

std::unique_ptr<checkpoint::ClusterView> NewInProcessClusterView(Coordinator* coordinator) {
  return std::make_unique<InProcessClusterView>(coordinator);
}

}  // namespace paramd
