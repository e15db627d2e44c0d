// File: server/daemon/pusher_owners.h
//
// Which token owns which pusher id on one daemon. With a token file, a
// pusher id belongs to the token (auth::Authenticator::TokenIdentity, a
// digest) whose push under it first committed; a push of another token
// under that id is refused. The table is bounded, so a token cannot grow
// it without limit.
//
// Threading: thread-safe (its own lock, never held while calling out).
#ifndef PARAMD_SERVER_DAEMON_PUSHER_OWNERS_H_
#define PARAMD_SERVER_DAEMON_PUSHER_OWNERS_H_

#include <cstddef>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace paramd {

class PusherOwners {
 public:
  // At most `max_ids` ids are bound.
  explicit PusherOwners(size_t max_ids) : max_ids_(max_ids) {}

  // `bind` false (before a commit): PERMISSION_DENIED naming the id when
  // another token owns it, RESOURCE_EXHAUSTED when an unbound id would not
  // fit the table; nothing changes. `bind` true (after a commit): records
  // `identity` as the owner if the id has none. An empty identity (no
  // token) owns nothing and is always allowed.
  absl::Status Claim(const std::string& pusher, const std::string& identity, bool bind)
      ABSL_LOCKS_EXCLUDED(mu_);

  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const size_t max_ids_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::string> owner_of_ ABSL_GUARDED_BY(mu_);
};

}  // namespace paramd

#endif  // PARAMD_SERVER_DAEMON_PUSHER_OWNERS_H_
