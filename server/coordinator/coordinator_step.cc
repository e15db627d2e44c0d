// File: server/coordinator/coordinator_step.cc
//
// The coordinator's versions (server/coordinator/coordinator.h): the admin Step,
// ReportVersion and the committed version, WaitForVersion and WatchVersion,
// SetOptimizerSchedule.

#include "server/coordinator/coordinator_internal.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "server/rpc/fan_out.h"
#include "server/step/optimizer_config.h"

namespace paramd {

using coordinator_internal::kTag;

grpc::ServerUnaryReactor* Coordinator::Impl::Step(grpc::CallbackServerContext* context,
                                                  const rpc::StepRequest* request,
                                                  rpc::StepResponse* response) {
  if (grpc::Status s =
          auth::Authorize(options_.authenticator.get(), *context, "/paramd.rpc.Coordinator/Step");
      !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  const int64_t from = request->version();
  std::vector<std::shared_ptr<rpc::Daemon::Stub>> stubs;
  {
    absl::MutexLock lock(&mu_);
    if (committed_ < 0) {
      return Done(context, absl::FailedPreconditionError("no model loaded"));
    }
    if (from != committed_) {
      return Done(context,
                  absl::FailedPreconditionError(absl::StrCat(
                      "step from version ", from, " but the committed version is ", committed_)));
    }
    absl::Status ready =
        table_.CheckAllReady(absl::StrCat("step from version ", from), absl::Now());
    if (!ready.ok()) return Done(context, ready);
    stubs = StubsLocked();
  }
  // The fan-out's outcome; the reactor finishes when it is known and (with
  // `wait`) version from+1 is committed.
  struct StepState {
    bool done = false;
    absl::Status status;
  };
  auto state = std::make_shared<StepState>();
  FanOut<rpc::DaemonStepRequest, rpc::DaemonStepResponse>(
      stubs, options_.load_timeout,
      [from](int, rpc::DaemonStepRequest* r) { r->set_version(from); },
      [](rpc::Daemon::Stub* stub, grpc::ClientContext* c, const rpc::DaemonStepRequest* req,
         rpc::DaemonStepResponse* resp, std::function<void(grpc::Status)> cb) {
        stub->async()->Step(c, req, resp, std::move(cb));
      },
      [this, state](auto& calls) {
        {
          absl::MutexLock lock(&mu_);
          state->done = true;
          state->status = FirstError(calls, "Step");
        }
        version_waiters_.WakeAll();
      });
  const bool wait = request->wait();
  return StartWaitingUnary(
      &version_waiters_, [this, state, wait, from, response]() -> std::optional<grpc::Status> {
        absl::MutexLock lock(&mu_);
        if (shut_down_) return Unavailable("coordinator shutting down");
        if (!state->done) {
          // A daemon that died (or stopped) mid-step never answers: its
          // lease ends the wait.
          absl::Status ready =
              table_.CheckAllReady(absl::StrCat("step from version ", from), absl::Now());
          if (!ready.ok()) return ToGrpcStatus(ready);
          return std::nullopt;
        }
        if (!state->status.ok()) return ToGrpcStatus(state->status);
        if (wait && committed_ < from + 1) return std::nullopt;
        response->set_committed_version(committed_);
        return grpc::Status::OK;
      });
}

grpc::ServerUnaryReactor* Coordinator::Impl::ReportVersion(grpc::CallbackServerContext* context,
                                                           const rpc::ReportVersionRequest* request,
                                                           rpc::ReportVersionResponse* response) {
  if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                       "/paramd.rpc.Coordinator/ReportVersion");
      !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  const int rank = request->daemon_rank();
  const int64_t version = request->published_version();
  struct Confirm {
    grpc::ClientContext context;
    rpc::GetStatsRequest request;
    rpc::GetStatsResponse response;
  };
  auto confirm = std::make_shared<Confirm>();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto finish = [reactor](const absl::Status& s) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  };
  std::shared_ptr<rpc::Daemon::Stub> stub;
  {
    absl::MutexLock lock(&mu_);
    if (rank < 0 || rank >= table_.size() || !table_.slot(rank).joined ||
        (!request->member_id().empty() &&
         request->member_id() != table_.slot(rank).member.member_id())) {
      return finish(absl::FailedPreconditionError(
          absl::StrCat("ReportVersion from unknown daemon rank ", rank)));
    }
    // A step that ended before a rewind reports a version of the old
    // epoch: not part of the recovered history.
    if (request->recovery_epoch() < recovery_epoch_) {
      response->set_committed_version(committed_);
      return finish(absl::OkStatus());
    }
    if (version < 0) {
      return finish(absl::InvalidArgumentError(absl::StrCat("ReportVersion of version ", version)));
    }
    if (version == table_.slot(rank).published) {
      response->set_committed_version(committed_);
      return finish(absl::OkStatus());
    }
    stub = stubs_[rank];  // held by the callback: a rejoin may replace it
  }
  confirm->context.set_deadline(absl::ToChronoTime(absl::Now() + options_.daemon_call_timeout));
  stub->async()->GetStats(
      &confirm->context, &confirm->request, &confirm->response,
      [this, confirm, stub, finish, rank, version, seconds = request->step_seconds(),
       epoch = request->recovery_epoch(), response](const grpc::Status& s) {
        bool advanced = false;
        absl::Status result;
        {
          absl::MutexLock lock(&mu_);
          const rpc::DaemonStats& stats = confirm->response.stats();
          if (!s.ok()) {
            result = absl::UnavailableError(absl::StrCat("cannot confirm version ", version,
                                                         " with daemon rank ", rank, ": ",
                                                         s.error_message()));
          } else if (stats.rank() != rank || stats.published_version() < version ||
                     // Backwards (a rewind): only to what it publishes now.
                     (version < table_.slot(rank).published &&
                      stats.published_version() != version)) {
            result = absl::FailedPreconditionError(
                absl::StrCat("daemon rank ", rank, " has not published version ", version,
                             " (it publishes ", stats.published_version(), "); report refused"));
          } else if (epoch >= recovery_epoch_) {
            table_.slot(rank).published = version;
            table_.slot(rank).last_step_seconds = seconds;
            if (!recovering_) advanced = RecomputeCommittedLocked();
          }
          response->set_committed_version(committed_);
        }
        if (advanced) {
          version_waiters_.WakeAll();
          if (options_.on_commit) options_.on_commit(committed_version());
        }
        finish(result);
      });
  return reactor;  // finished by the confirmation's callback
}

bool Coordinator::Impl::RecomputeCommittedLocked() {
  if (!table_.all_joined() || manifest_.tensors_size() == 0) return false;
  int64_t v = table_.slot(0).published;
  for (int r = 0; r < table_.size(); ++r) v = std::min(v, table_.slot(r).published);
  if (v <= committed_) return false;
  const int64_t before = committed_;
  committed_ = v;
  StateChangedLocked();
  const std::string line = absl::StrCat("committed version ", v);
  const int every = std::max(1, options_.log_every_versions);
  // The first version of a load, and every Nth, at INFO.
  if (before < 0 || v / every != before / every) {
    LogInfo(kTag, line);
  } else {
    VLog(1, kTag, line);
  }
  return true;
}

grpc::ServerUnaryReactor* Coordinator::Impl::WaitForVersion(
    grpc::CallbackServerContext* context, const rpc::WaitForVersionRequest* request,
    rpc::WaitForVersionResponse* response) {
  if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                       "/paramd.rpc.Coordinator/WaitForVersion");
      !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  const int64_t min_version = request->min_version();
  int64_t known_epoch;
  {
    absl::MutexLock lock(&mu_);
    known_epoch = request->has_recovery_epoch() ? request->recovery_epoch() : recovery_epoch_;
  }
  return StartWaitingUnary(
      &version_waiters_,
      [this, min_version, known_epoch, response]() -> std::optional<grpc::Status> {
        absl::MutexLock lock(&mu_);
        if (shut_down_) return Unavailable("coordinator shutting down");
        response->set_recovery_epoch(recovery_epoch_);
        if (recovery_epoch_ > known_epoch && !recovering_) {
          // The cluster went back to an earlier version meanwhile.
          response->set_committed_version(committed_);
          response->set_rewound_to_version(recovery_.rewound_to_version());
          return grpc::Status::OK;
        }
        if (committed_ < min_version || committed_ < 0) return std::nullopt;
        response->set_committed_version(committed_);
        return grpc::Status::OK;
      });
}

grpc::ServerUnaryReactor* Coordinator::Impl::SetOptimizerSchedule(
    grpc::CallbackServerContext* context, const rpc::SetOptimizerScheduleRequest* request,
    rpc::SetOptimizerScheduleResponse* response) {
  if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                       "/paramd.rpc.Coordinator/SetOptimizerSchedule");
      !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  recipe::OptimizerConfig proto;
  std::vector<std::shared_ptr<rpc::Daemon::Stub>> stubs;
  {
    absl::MutexLock lock(&mu_);
    proto = OptimizerToProto(optimizer_);
    if (manifest_.tensors_size() > 0) stubs = StubsLocked();
  }
  *proto.mutable_schedule() = request->schedule();
  if (request->has_lr()) proto.set_lr(request->lr());
  absl::StatusOr<OptimizerOptions> next = OptimizerFromProto(proto);
  if (!next.ok()) return Done(context, next.status());
  proto = OptimizerToProto(*next);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  FanOut<rpc::SetOptimizerRequest, rpc::SetOptimizerResponse>(
      stubs, options_.daemon_call_timeout,
      [&proto](int, rpc::SetOptimizerRequest* r) { *r->mutable_optimizer() = proto; },
      [](rpc::Daemon::Stub* stub, grpc::ClientContext* c, const rpc::SetOptimizerRequest* req,
         rpc::SetOptimizerResponse* resp, std::function<void(grpc::Status)> cb) {
        stub->async()->SetOptimizer(c, req, resp, std::move(cb));
      },
      [this, reactor, response, next = *next, proto](auto& calls) {
        absl::Status s = FirstError(calls, "SetOptimizer");
        if (s.ok()) {
          absl::MutexLock lock(&mu_);
          optimizer_ = next;
          StateChangedLocked();
          if (manifest_.tensors_size() > 0) *manifest_.mutable_optimizer_config() = proto;
          *response->mutable_optimizer() = proto;
          Log(kTag, absl::StrCat("optimizer schedule changed: ", DescribeOptimizer(next)));
        } else {
          s = absl::FailedPreconditionError(s.message());
        }
        reactor->Finish(ToGrpcStatus(s));
      });
  return reactor;
}

// Sends the committed version whenever it advances, until cancelled.
class WatchReactor : public WaitingWriter<rpc::VersionEvent> {
 public:
  // `known_epoch`: the recovery epoch the watcher last saw.
  WatchReactor(Coordinator::Impl* coordinator, int64_t min_version, int64_t known_epoch)
      : WaitingWriter(coordinator->version_waiters()),
        coordinator_(coordinator),
        min_version_(min_version),
        known_epoch_(known_epoch) {}

 private:
  void PumpLocked() override {
    RegisterLocked();
    if (coordinator_->shut_down()) {
      UnregisterLocked();
      FinishLocked(grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator shutting down"));
      return;
    }
    const int64_t v = coordinator_->committed_version();
    int64_t epoch, rewound_to;
    coordinator_->RecoveryEpoch(&epoch, &rewound_to);
    // A completed recovery is reported once, with the version it went back
    // to (committed_version may be below the last one sent).
    const bool rewound = epoch > known_epoch_ && v >= 0;
    if (!rewound && (v < 0 || v < min_version_ || v == last_sent_)) return;
    UnregisterLocked();
    last_sent_ = v;
    known_epoch_ = epoch;
    event_.set_committed_version(v);
    event_.set_recovery_epoch(epoch);
    if (rewound) {
      event_.set_rewound_to_version(rewound_to);
    } else {
      event_.clear_rewound_to_version();
    }
    WriteLocked(&event_);
  }

  Coordinator::Impl* const coordinator_;
  const int64_t min_version_;
  rpc::VersionEvent event_ ABSL_GUARDED_BY(mu_);
  int64_t last_sent_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t known_epoch_ ABSL_GUARDED_BY(mu_);
};

grpc::ServerWriteReactor<rpc::VersionEvent>* Coordinator::Impl::WatchVersion(
    grpc::CallbackServerContext* context, const rpc::WatchVersionRequest* request) {
  if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                       "/paramd.rpc.Coordinator/WatchVersion");
      !s.ok()) {
    return auth::RefusedWriter<rpc::VersionEvent>(s);
  }
  int64_t epoch, rewound_to;
  RecoveryEpoch(&epoch, &rewound_to);
  auto* reactor = new WatchReactor(
      this, request->min_version(),
      request->has_recovery_epoch() ? std::min(request->recovery_epoch(), epoch) : epoch);
  reactor->Begin();
  return reactor;
}

}  // namespace paramd
