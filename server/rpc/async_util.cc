#include "server/rpc/async_util.h"

#include <cstdio>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace paramd {

WaitList::Id WaitList::Add(std::function<void()> wake) {
  absl::MutexLock lock(&mu_);
  const Id id = next_++;
  waiters_.emplace(id, std::move(wake));
  return id;
}

bool WaitList::Remove(Id id) {
  absl::MutexLock lock(&mu_);
  return waiters_.erase(id) > 0;
}

void WaitList::WakeAll() {
  std::map<Id, std::function<void()>> waiters;
  {
    absl::MutexLock lock(&mu_);
    waiters.swap(waiters_);
  }
  for (auto& [id, wake] : waiters) wake();
}

namespace {

class WaitingUnary : public WaitingReactor<grpc::ServerUnaryReactor> {
 public:
  WaitingUnary(WaitList* list, std::function<std::optional<grpc::Status>()> poll,
               std::function<void()> on_cancel)
      : WaitingReactor(list), poll_(std::move(poll)), on_cancel_(std::move(on_cancel)) {}

  void Begin() {
    ScopedRef ref(this);
    absl::MutexLock lock(&mu_);
    TryLocked();
  }

  void OnCancel() override {
    ScopedRef ref(this);
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    UnregisterLocked();
    finished_ = true;
    if (on_cancel_) on_cancel_();
    Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled while waiting"));
  }

 private:
  void OnWakeLocked() override {
    if (!finished_) TryLocked();
  }

  // Registers before polling so that a change between the poll and the
  // registration still wakes us.
  void TryLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    RegisterLocked();
    std::optional<grpc::Status> status = poll_();
    if (!status.has_value()) return;
    UnregisterLocked();
    finished_ = true;
    Finish(*status);
  }

  const std::function<std::optional<grpc::Status>()> poll_;
  const std::function<void()> on_cancel_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

grpc::ServerUnaryReactor* StartWaitingUnary(WaitList* list,
                                            std::function<std::optional<grpc::Status>()> poll,
                                            std::function<void()> on_cancel) {
  auto* reactor = new WaitingUnary(list, std::move(poll), std::move(on_cancel));
  reactor->Begin();
  return reactor;
}

void Log(absl::string_view tag, absl::string_view message) { LogInfo(tag, message); }

}  // namespace paramd
