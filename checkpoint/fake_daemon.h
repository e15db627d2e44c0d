// File: checkpoint/fake_daemon.h (testonly)
//
// A CheckpointableDaemon without a model: it holds pieces of the fake model
// of test_util.h whose values are those of model seed = its version (so a
// checkpoint of version v must equal FakeRows(v, ...), and "stepping" is
// SetVersion). Plus a ClusterView over a fixed paramd manifest. Used by the
// service tests and by the multi-process checkpoint tests.
#ifndef PARAMD_CHECKPOINT_FAKE_DAEMON_H_
#define PARAMD_CHECKPOINT_FAKE_DAEMON_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "checkpoint/daemon_state.h"
#include "checkpoint/service.h"
#include "proto/paramd.pb.h"

namespace paramd {
namespace checkpoint {
namespace testing {

class FakeDaemon : public CheckpointableDaemon {
 public:
  FakeDaemon(std::vector<TensorInfo> tensors, std::vector<PieceInfo> pieces, int64_t version);

  // "Steps" to `version` (waits for a running WithState).
  void SetVersion(int64_t version);
  int64_t version() const;
  // Sleeps this long inside WithState before calling fn (a slow disk; lets
  // tests kill a daemon in the middle of writing).
  void set_write_delay(absl::Duration delay);
  // The model generation WithState reports (default 0: none recorded); a
  // load of another model is a new one.
  void set_model_generation(int64_t generation);

  absl::Status WithState(int64_t version,
                         const std::function<absl::Status(const DaemonStateView&)>& fn) override;
  absl::Status ReadRows(int64_t version, ExportValuesKind kind, const std::string& tensor,
                        int64_t row_begin, int64_t row_end, absl::Span<float> out) override;

 private:
  struct Piece {
    PieceInfo info;
    int64_t cols = 0;
    std::vector<float> master, exp_avg, exp_avg_sq;
  };
  void Generate() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::vector<TensorInfo> tensors_;
  mutable absl::Mutex mu_;
  int64_t version_ ABSL_GUARDED_BY(mu_);
  absl::Duration write_delay_ ABSL_GUARDED_BY(mu_);
  int64_t model_generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Piece> pieces_ ABSL_GUARDED_BY(mu_);
};

// A paramd manifest of `tensors` cut by `plan` over daemons at `addresses`,
// committed at `version` (spec: default HybridSpec).
rpc::Manifest FakeClusterManifest(const std::vector<TensorInfo>& tensors,
                                  const std::vector<std::vector<PieceInfo>>& plan,
                                  const std::vector<std::string>& addresses, int64_t version);

// A ClusterView returning a manifest the test can change.
class FakeClusterView : public ClusterView {
 public:
  explicit FakeClusterView(rpc::Manifest manifest) : manifest_(std::move(manifest)) {}
  absl::StatusOr<rpc::Manifest> GetManifest() override;
  void SetCommittedVersion(int64_t version);
  void SetModelGeneration(int64_t generation);
  // Called at the start of every GetManifest (e.g. to move a daemon on).
  void set_on_get(std::function<void()> on_get);

 private:
  absl::Mutex mu_;
  rpc::Manifest manifest_ ABSL_GUARDED_BY(mu_);
  std::function<void()> on_get_ ABSL_GUARDED_BY(mu_);
};

}  // namespace testing
}  // namespace checkpoint
}  // namespace paramd

#endif  // PARAMD_CHECKPOINT_FAKE_DAEMON_H_
