// File: server/daemon/parked_fetches.h
//
// The fetches parked on one daemon (waiting for a version not yet
// published), counted per client host so that one host cannot park more
// than its limit, and how many of them asked for FetchRequest.as_ready
// (the gpu backend's pipelined step copies its buckets to the host only
// while one waits: PipelinedStepHooks::host_readers).
//
// Threading: thread-safe; AsReadyParked is lock-free.
#ifndef PARAMD_SERVER_DAEMON_PARKED_FETCHES_H_
#define PARAMD_SERVER_DAEMON_PARKED_FETCHES_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace paramd {

class ParkedFetches {
 public:
  // At most `per_client` parked fetches per client host.
  explicit ParkedFetches(int64_t per_client) : per_client_(per_client) {}

  // False when `client` already has the limit parked (nothing counted).
  bool Park(const std::string& client, bool as_ready) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    int64_t& n = parked_[client];
    if (n >= per_client_) {
      if (n == 0) parked_.erase(client);
      return false;
    }
    ++n;
    if (as_ready) as_ready_.fetch_add(1);
    return true;
  }

  // Undoes one successful Park of the same arguments.
  void Unpark(const std::string& client, bool as_ready) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto it = parked_.find(client);
    if (it != parked_.end() && --it->second <= 0) parked_.erase(it);
    if (as_ready) as_ready_.fetch_sub(1);
  }

  bool AsReadyParked() const { return as_ready_.load() > 0; }

  // Client hosts with a fetch parked now.
  size_t clients() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return parked_.size();
  }

 private:
  const int64_t per_client_;
  mutable absl::Mutex mu_;
  std::map<std::string, int64_t> parked_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> as_ready_{0};
};

}  // namespace paramd

#endif  // PARAMD_SERVER_DAEMON_PARKED_FETCHES_H_
