#include "server/daemon/data_plane_worlds.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace paramd {

absl::StatusOr<std::string> DataPlaneWorlds::OpenNext(int64_t epoch, bool* opened) {
  *opened = false;
  absl::MutexLock lock(&mu_);
  if (pending_ != nullptr && pending_epoch_ == epoch && !claimed_) return pending_->address();
  if (current_) current_->Shutdown();
  pending_.reset();  // claimed by a Recover of an attempt the coordinator gave up on
  ASSIGN_OR_RETURN(pending_, open_());
  pending_epoch_ = epoch;
  claimed_ = false;
  *opened = true;
  return pending_->address();
}

absl::StatusOr<std::unique_ptr<DaemonDataPlane>> DataPlaneWorlds::SwitchToNext(
    const rpc::RecoverRequest& request, int rank) {
  absl::MutexLock lock(&mu_);
  if (pending_ == nullptr || pending_epoch_ != request.epoch()) {
    return absl::FailedPreconditionError(
        absl::StrCat("Recover for epoch ", request.epoch(), " without its PrepareRecovery"));
  }
  // A Recover of an attempt that a later PrepareRecovery replaced names an
  // endpoint this daemon has closed.
  const auto own = request.data_plane().address_book().find(rank);
  if (own != request.data_plane().address_book().end() && own->second != pending_->address()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Recover for epoch ", request.epoch(), " names data-plane endpoint ", own->second,
        " of an earlier attempt; this daemon's is ", pending_->address()));
  }
  std::unique_ptr<DaemonDataPlane> old = std::move(current_);
  current_ = std::move(pending_);
  return old;
}

}  // namespace paramd
