// File: server/coordinator/coordinator_state.h
//
// The coordinator's state file (hybrid-paramd --state_file,
// docs/ARCHITECTURE.md "A restarted coordinator"): what a coordinator that
// was killed needs to take its cluster back without restarting it: the
// cluster secret, the loaded model's manifest and plan, the committed
// version, every daemon's rank, address, incarnation and member secret,
// the trainers and observers, the optimizer config and the recovery epoch
// (rpc::CoordinatorState). The daemons keep serving meanwhile; a restarted
// coordinator reads this file, takes the daemons' heartbeats as before and
// asks every daemon which version it publishes (the committed version is
// then the lowest, never below the one in the file).
//
// The file is small (the manifest, whose only tensor data are the frozen
// buffers, at most --max_frozen_bytes) and holds secrets: it
// is written with mode 0600 to a fresh temporary name beside it (created
// with O_EXCL | O_NOFOLLOW: a symlink planted there is never followed),
// fsynced, renamed over the old one and the directory fsynced, so that a
// crash leaves the old file or the new one, never a torn one
// (common/file_util.h WriteFileAtomically).
//
// Threading: ReadStateFile / WriteStateFile block on the file system;
// StateWriter is thread-safe and MarkDirty never blocks.
#ifndef PARAMD_SERVER_COORDINATOR_COORDINATOR_STATE_H_
#define PARAMD_SERVER_COORDINATOR_COORDINATOR_STATE_H_

#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "proto/paramd.pb.h"

namespace paramd {

// nullopt when there is no file at `path` (a first start); DATA_LOSS for a
// file that does not parse, FAILED_PRECONDITION for one of another format.
absl::StatusOr<std::optional<rpc::CoordinatorState>> ReadStateFile(const std::string& path);

absl::Status WriteStateFile(const std::string& path, const rpc::CoordinatorState& state);

// Writes the state `make_state()` returns to `path` on a thread of its
// own whenever MarkDirty was called since the last write (several marks,
// one write), and once more at destruction.
class StateWriter {
 public:
  StateWriter(std::string path, std::function<rpc::CoordinatorState()> make_state);
  ~StateWriter();
  StateWriter(const StateWriter&) = delete;
  StateWriter& operator=(const StateWriter&) = delete;

  void MarkDirty();
  // Blocks until everything marked so far is written; the last write's status.
  absl::Status Flush();
  // Never blocks: `then` runs once everything marked so far is written (on
  // the writer's thread; at once on this one if it already is), or at
  // destruction. So that a change is acknowledged only once a restart would
  // find it (a load's reply), without holding a gRPC thread for the fsync.
  void WhenWritten(std::function<void()> then);

 private:
  void Run();

  const std::string path_;
  const std::function<rpc::CoordinatorState()> make_state_;
  absl::Mutex mu_;
  int64_t marked_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t written_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status last_ ABSL_GUARDED_BY(mu_);
  // WhenWritten's callbacks by the mark they wait for.
  std::vector<std::pair<int64_t, std::function<void()>>> waiting_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace paramd

#endif  // PARAMD_SERVER_COORDINATOR_COORDINATOR_STATE_H_
