#include "server/daemon/pusher_owners.h"

#include "absl/strings/str_cat.h"
#include "common/names.h"

namespace paramd {

absl::Status PusherOwners::Claim(const std::string& pusher, const std::string& identity,
                                 bool bind) {
  if (identity.empty()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  auto it = owner_of_.find(pusher);
  if (it == owner_of_.end()) {
    // Only a committed push binds (its id passed the push checks' bound): a
    // refused one leaves the table as it was.
    if (bind) {
      owner_of_.emplace(pusher, identity);
      return absl::OkStatus();
    }
    if (owner_of_.size() >= max_ids_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "this daemon has bound ", owner_of_.size(),
          " pusher ids to tokens, its limit: push under an id this token pushed before"));
    }
    return absl::OkStatus();
  }
  if (it->second == identity) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("pusher_id ", QuoteForMessage(pusher),
                   " belongs to another token: each trainer token pushes under its own pusher ids "
                   "(its JoinResponse.member_id); nothing was applied"));
}

size_t PusherOwners::size() const {
  absl::MutexLock lock(&mu_);
  return owner_of_.size();
}

}  // namespace paramd
