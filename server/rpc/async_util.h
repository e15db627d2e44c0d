// File: server/rpc/async_util.h
//
// Small pieces for callback-API gRPC servers that must wait for a state
// change without blocking a gRPC thread (Fetch of a version not yet
// published, WaitForVersion, WatchVersion, Join with wait_for_world, ...):
//
//   * WaitList: callbacks registered until the next WakeAll().
//   * WaitingReactor<R>: base for reactors that wait on a WaitList, with the
//     reference counting that keeps a woken reactor alive.
//   * StartWaitingUnary(): a unary reactor that re-checks a condition on
//     every wake and finishes when it holds, or when the call is cancelled
//     (its deadline passed: the client sees DEADLINE_EXCEEDED).
//   * Log(): an INFO line through common/log.h (spdlog); new code calls
//     LogInfo/LogWarning/LogError/VLog from there.
//
// Thread-safe unless noted.
#ifndef PARAMD_SERVER_RPC_ASYNC_UTIL_H_
#define PARAMD_SERVER_RPC_ASYNC_UTIL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "grpcpp/grpcpp.h"

namespace paramd {

class WaitList {
 public:
  using Id = uint64_t;

  // Registers `wake`, run once by the next WakeAll() (from the thread that
  // calls WakeAll, outside any lock of this list).
  Id Add(std::function<void()> wake);
  // Unregisters; true if `wake` had not been taken by a WakeAll yet (it will
  // then never run).
  bool Remove(Id id);
  // Runs and unregisters every callback registered before this call.
  void WakeAll();

 private:
  absl::Mutex mu_;
  Id next_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<Id, std::function<void()>> waiters_ ABSL_GUARDED_BY(mu_);
};

// Base of a reactor (grpc::ServerUnaryReactor, ServerWriteReactor<T>, ...)
// that waits on a WaitList. Lifetime: one reference held by gRPC (dropped
// in OnDone) and one per registration in the list (dropped when the wake
// has run or the registration is removed), so a wake never touches a
// deleted reactor. Derived classes guard their state with mu_, implement
// OnWakeLocked(), and wrap every entry point that may Finish() in a
// ScopedRef so that an OnDone run inline cannot delete the reactor while
// mu_ is held.
template <class Reactor>
class WaitingReactor : public Reactor {
 public:
  void OnDone() override { Unref(); }

 protected:
  explicit WaitingReactor(WaitList* list) : list_(list) {}

  class ScopedRef {
   public:
    explicit ScopedRef(WaitingReactor* r) : r_(r) { r_->refs_.fetch_add(1); }
    ~ScopedRef() { r_->Unref(); }

   private:
    WaitingReactor* r_;
  };

  // Registers for the next WakeAll (at most one registration at a time).
  void RegisterLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (registered_) return;
    refs_.fetch_add(1);
    registered_ = true;
    id_ = list_->Add([this] { Wake(); });
  }
  // Drops the registration, if any, so that no wake follows.
  void UnregisterLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (registered_ && list_->Remove(id_)) {
      registered_ = false;
      refs_.fetch_sub(1);  // never the last: the caller holds a reference
    }
  }
  // Called with mu_ held after a wake (not after Finish() was called by
  // this class's users: they check their own finished flag).
  virtual void OnWakeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;

  absl::Mutex mu_;

 private:
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }
  void Wake() {
    {
      absl::MutexLock lock(&mu_);
      registered_ = false;
      OnWakeLocked();
    }
    Unref();
  }

  WaitList* const list_;
  std::atomic<int> refs_{1};
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  WaitList::Id id_ ABSL_GUARDED_BY(mu_) = 0;
};

// A server-streaming reactor that writes when its state allows and waits on
// a WaitList otherwise. Derived classes implement PumpLocked(): write the
// next message (WriteLocked), finish (FinishLocked), or RegisterLocked() and
// return to wait for the next wake. It is called on Begin(), after every
// completed write and on every wake, never while a write is pending or
// after the call finished or was cancelled.
template <class Response>
class WaitingWriter : public WaitingReactor<grpc::ServerWriteReactor<Response>> {
  using Base = WaitingReactor<grpc::ServerWriteReactor<Response>>;

 public:
  void Begin() {
    typename Base::ScopedRef ref(this);
    absl::MutexLock lock(&this->mu_);
    PumpLocked();
  }

  void OnWriteDone(bool ok) override {
    typename Base::ScopedRef ref(this);
    absl::MutexLock lock(&this->mu_);
    writing_ = false;
    if (finished_) return;
    if (!ok || cancelled_) {
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "stream broken or cancelled"));
      return;
    }
    OnWrittenLocked();
    PumpLocked();
  }

  void OnCancel() override {
    typename Base::ScopedRef ref(this);
    absl::MutexLock lock(&this->mu_);
    cancelled_ = true;
    this->UnregisterLocked();
    if (!finished_ && !writing_) {
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
    }
  }

 protected:
  explicit WaitingWriter(WaitList* list) : Base(list) {}

  virtual void PumpLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(this->mu_) = 0;
  // After a write completed successfully, before the next PumpLocked().
  virtual void OnWrittenLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(this->mu_) {}

  void WriteLocked(const Response* response) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this->mu_) {
    writing_ = true;
    this->StartWrite(response);
  }
  void FinishLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this->mu_) {
    finished_ = true;
    this->Finish(std::move(status));
  }

 private:
  void OnWakeLocked() override {
    if (!finished_ && !cancelled_ && !writing_) PumpLocked();
  }

  bool writing_ = false;
  bool finished_ = false;
  bool cancelled_ = false;
};

// Returns a reactor for a unary call. `poll` is called at once and after
// every WakeAll of `list` until it returns a status, which finishes the call
// (it fills the response itself before returning OK). If the call is
// cancelled first (deadline, client gone), it finishes with CANCELLED, which
// the client sees as DEADLINE_EXCEEDED when its deadline passed. `poll` runs
// on gRPC or WakeAll threads, never concurrently with itself, and never
// after the call finished. `list` must outlive the call. `on_cancel`, if
// set, runs once when the call is cancelled before `poll` finished it (on a
// gRPC thread, with the same locks held as `poll`), so that a caller can
// undo what the waiting call stood for (a Join that held a lease).
grpc::ServerUnaryReactor* StartWaitingUnary(WaitList* list,
                                            std::function<std::optional<grpc::Status>()> poll,
                                            std::function<void()> on_cancel = nullptr);

// LogInfo(tag, message) (common/log.h).
void Log(absl::string_view tag, absl::string_view message);

}  // namespace paramd

#endif  // PARAMD_SERVER_RPC_ASYNC_UTIL_H_
