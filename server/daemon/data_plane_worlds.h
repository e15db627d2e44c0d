// File: server/daemon/data_plane_worlds.h
//
// A daemon's data-plane worlds: the one it steps in now, and the endpoint
// of the next one that a recovery opens (PrepareRecovery) until Recover
// connects it. The same epoch asked again (a retried PrepareRecovery)
// gives the same endpoint, unless a Recover has claimed it: then the
// coordinator is on its next attempt and gets a new endpoint.
//
// Threading: current() is replaced only by the join thread (OpenFirst,
// before any step) and by Recover on the daemon's worker (SwitchToNext), so
// the worker may use it without a lock; everything else is thread-safe.
#ifndef PARAMD_SERVER_DAEMON_DATA_PLANE_WORLDS_H_
#define PARAMD_SERVER_DAEMON_DATA_PLANE_WORLDS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "proto/paramd.pb.h"
#include "server/daemon/data_plane.h"

namespace paramd {

class DataPlaneWorlds {
 public:
  using OpenFn = std::function<absl::StatusOr<std::unique_ptr<DaemonDataPlane>>()>;

  // `open` opens one endpoint (every world's, the first and each
  // recovery's, with the same options).
  explicit DataPlaneWorlds(OpenFn open) : open_(std::move(open)) {}

  // The join thread: opens the first world's endpoint (with the same
  // `open` as every later one).
  absl::Status OpenFirst() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::StatusOr<std::unique_ptr<DaemonDataPlane>> plane = open_();
    if (!plane.ok()) return plane.status();
    absl::MutexLock lock(&mu_);
    current_ = *std::move(plane);
    return absl::OkStatus();
  }

  // The world this daemon steps in (null before the join opened it).
  DaemonDataPlane* current() const { return current_.get(); }

  // Leaves the current world (a step blocked in its all-reduce fails now).
  void ShutdownCurrent() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (current_) current_->Shutdown();
  }

  // PrepareRecovery of `epoch`: leaves the current world and opens the
  // next one's endpoint; its address. `*opened`: a new endpoint was opened
  // (false: the same epoch asked again, its endpoint as before).
  absl::StatusOr<std::string> OpenNext(int64_t epoch, bool* opened) ABSL_LOCKS_EXCLUDED(mu_);

  // A Recover of `epoch` arrived: a PrepareRecovery of that epoch from now
  // on is the coordinator's next attempt.
  void Claim(int64_t epoch) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (pending_ != nullptr && pending_epoch_ == epoch) claimed_ = true;
  }

  // The worker, in Recover of `epoch` as rank `rank`: the next world becomes
  // the current one; returns the old one (for the caller to destroy when
  // it is done with it). FAILED_PRECONDITION, nothing changed, without a
  // PrepareRecovery of `epoch` or when the request names another attempt's
  // endpoint for this rank.
  absl::StatusOr<std::unique_ptr<DaemonDataPlane>> SwitchToNext(const rpc::RecoverRequest& request,
                                                                int rank) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const OpenFn open_;
  mutable absl::Mutex mu_;
  std::unique_ptr<DaemonDataPlane> current_;
  std::unique_ptr<DaemonDataPlane> pending_ ABSL_GUARDED_BY(mu_);
  int64_t pending_epoch_ ABSL_GUARDED_BY(mu_) = -1;
  bool claimed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace paramd

#endif  // PARAMD_SERVER_DAEMON_DATA_PLANE_WORLDS_H_
