// File: server/daemon/daemon_step.cc
//
// The daemon's step (server/daemon/daemon.h, server/step/shard_set.h): when it starts
// (every expected push, or the admin Step), the whole and the pipelined step on
// the worker, and SetOptimizer between steps.

#include "server/daemon/daemon_internal.h"

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "common/telemetry.h"
#include "server/step/optimizer_config.h"

namespace paramd {

using daemon_internal::kTag;

grpc::ServerUnaryReactor* Daemon::Impl::Step(grpc::CallbackServerContext* context,
                                             const rpc::DaemonStepRequest* request,
                                             rpc::DaemonStepResponse* response) {
  if (grpc::Status s =
          auth::Authorize(options_.authenticator.get(), *context, "/paramd.rpc.Daemon/Step");
      !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  const int64_t from = request->version();
  if (absl::Status s = CheckDaemonStepRequest(*request); !s.ok()) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  {
    absl::MutexLock lock(&mu_);
    absl::Status s = StartAdminStepLocked(from);
    if (!s.ok()) {
      grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
      reactor->Finish(ToGrpcStatus(s));
      return reactor;
    }
  }
  return StartWaitingUnary(
      &publish_waiters_, [this, from, response]() -> std::optional<grpc::Status> {
        absl::MutexLock lock(&mu_);
        if (latest_ && latest_->version > from) {
          response->set_published_version(latest_->version);
          return grpc::Status::OK;
        }
        if (shut_down_) {
          return grpc::Status(grpc::StatusCode::UNAVAILABLE, "daemon shutting down");
        }
        if (!stepping_ && failed_step_from_ == from) {
          return ToGrpcStatus(last_step_error_);
        }
        return std::nullopt;
      });
}

grpc::ServerUnaryReactor* Daemon::Impl::SetOptimizer(grpc::CallbackServerContext* context,
                                                     const rpc::SetOptimizerRequest* request,
                                                     rpc::SetOptimizerResponse* /*response*/) {
  if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                       "/paramd.rpc.Daemon/SetOptimizer");
      !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<OptimizerOptions> o = OptimizerFromProto(request->optimizer());
  if (!o.ok()) {
    reactor->Finish(ToGrpcStatus(o.status()));
    return reactor;
  }
  worker_.Post([this, o = *o, reactor] {
    absl::Status s;
    {
      // Under mu_: pushes read the config while they add (CommitPush).
      absl::MutexLock lock(&mu_);
      s = shards_ == nullptr ? absl::FailedPreconditionError("no model loaded on this daemon")
                             : shards_->SetOptimizer(o);
    }
    Log(kTag, s.ok() ? absl::StrCat("optimizer now ", DescribeOptimizer(o))
                     : absl::StrCat("SetOptimizer refused: ", s.ToString()));
    reactor->Finish(ToGrpcStatus(s));
  });
  return reactor;
}

void Daemon::Impl::MaybeStartStepLocked() {
  if (!latest_ || stepping_ || expected_pushers_ <= 0 ||
      static_cast<int>(pushers_.size()) < expected_pushers_) {
    return;
  }
  stepping_ = true;
  stepping_from_ = latest_->version;
  const int64_t from = stepping_from_;
  if (pipeline_attempt_) {  // the running pipelined step commits now
    push_pipeline_->Wake();
    return;
  }
  worker_.Post([this, from] { RunStep(from, /*apply_optimizer=*/true); });
}

absl::Status Daemon::Impl::StartAdminStepLocked(int64_t from) {
  if (!latest_) return absl::FailedPreconditionError("no model published on this daemon yet");
  if (stepping_ && stepping_from_ == from) return absl::OkStatus();  // already running
  if (from < latest_->version) return absl::OkStatus();  // already done: reported at once
  if (from > latest_->version) {
    return absl::OutOfRangeError(
        absl::StrCat("step from version ", from, ": this daemon is at version ", latest_->version));
  }
  if (stepping_) return absl::FailedPreconditionError("another step is running");
  stepping_ = true;
  stepping_from_ = from;
  worker_.Post([this, from] { RunStep(from, /*apply_optimizer=*/true); });
  return absl::OkStatus();
}

void Daemon::Impl::OfferIpcVersions(int64_t generation, ShardBackend* backend) {
  int64_t latest = -1, previous = -1;
  {
    absl::MutexLock lock(&mu_);
    latest = latest_ ? latest_->version : -1;
    previous = previous_ ? previous_->version : -1;
  }
  ipc_->Published(generation, backend, latest, previous);
}

void Daemon::Impl::RunStep(int64_t from, bool apply_optimizer, bool update_delayed) {
  snapshots_->BeforeStep();  // a snapshot reading the live state is copied first
  AllReduceMaxFn all_reduce;
  ShardBackend* shards;
  bool shutting_down;
  std::pair<int64_t, int64_t> retire{-1, -1};  // (generation, version) rewritten
  bool pipelined;
  {
    absl::MutexLock lock(&mu_);
    pipelined = apply_optimizer && push_pipeline_ != nullptr;
    // A pipelined step posted again after it gave the worker up, whose
    // version was stepped meanwhile (an admin step).
    if (pipelined && (!latest_ || latest_->version != from)) return;
    all_reduce = all_reduce_;
    shards = shards_.get();
    shards->set_data_plane(data_plane_transport_, options_.step_timeout);
    shards->set_step_enqueued([this](int64_t version) { OnStepEnqueued(version); });
    // The gpu backend rewrites the device slot of the version before
    // `from` (it keeps two): device sends of it that already started
    // finish first, later ones are refused (ServeDeviceFetch). Sends of
    // `from` itself run beside the step; there is no whole-step lock.
    overwriting_version_ = previous_ ? previous_->version : -1;
    auto unpinned = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return shut_down_ || fetch_pins_.count(overwriting_version_) == 0;
    };
    mu_.Await(absl::Condition(&unpinned));
    shutting_down = shut_down_;
    retire = {generation_, overwriting_version_};
  }
  // Same-GPU sessions (server/ipc/): the step waits while a live session
  // pins the version whose buffers it rewrites.
  if (!shutting_down && !ipc_->RetireForStep(retire.first, retire.second).ok()) {
    shutting_down = true;
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<std::shared_ptr<const PublishedVersion>> result;
  if (shutting_down) {
    // Sends may still read the slot: never rewrite it under them.
    result = absl::UnavailableError("daemon shutting down");
  } else if (!all_reduce) {
    result = absl::FailedPreconditionError("data plane not open");
  } else if (pipelined) {
    result = StepPipelined(shards, from, all_reduce, update_delayed);
  } else {
    result = shards->Step(from + 1, apply_optimizer, all_reduce, update_delayed);
  }
  shards->set_step_enqueued(nullptr);
  if (pipelined && IsStepAbandoned(result.status())) {  // nothing happened
    {
      absl::MutexLock lock(&mu_);
      overwriting_version_ = -1;
    }
    ipc_->EndRetire(retire.first, retire.second);
    OfferIpcVersions(retire.first, shards);
    return;
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  {
    absl::MutexLock lock(&mu_);
    stepping_ = false;
    overwriting_version_ = -1;
    in_flight_version_ = -1;
    in_flight_host_ = InFlightHost();
    if (pipelined) pipeline_attempt_ = false;
    if (result.ok()) {
      previous_ = apply_optimizer ? latest_ : nullptr;
      latest_ = *result;
      pushers_.clear();
      if (push_pipeline_ != nullptr && apply_optimizer) push_pipeline_->Published(from);
      last_step_seconds_ = seconds;
      if (apply_optimizer) {
        ++steps_;
        telemetry::ObserveStep(seconds);
      }
    } else {
      failed_step_from_ = from;
      last_step_error_ = result.status();
    }
  }
  ipc_->EndRetire(retire.first, retire.second);
  OfferIpcVersions(retire.first, shards);
  publish_waiters_.WakeAll();
  if (!result.ok()) {
    LogError(kTag,
             absl::StrCat("step from version ", from, " failed: ", result.status().ToString()));
    return;
  }
  ReportVersion(from + 1, seconds);
  if (apply_optimizer && update_delayed) snapshots_->AfterPublish(*shards, **result);
}

absl::StatusOr<std::shared_ptr<const PublishedVersion>> Daemon::Impl::StepPipelined(
    ShardBackend* shards, int64_t from, const AllReduceMaxFn& all_reduce, bool update_delayed) {
  std::shared_ptr<PushPipeline> pipeline;
  {
    absl::MutexLock lock(&mu_);
    pipeline = push_pipeline_;
  }
  const std::vector<StepBucket> buckets =
      PlanStepBuckets(shards->tensors(), shards->shards(), options_.step_bucket_elements);
  const std::function<bool()> yield = [this] { return worker_.HasPending(); };
  for (;;) {
    // Sized before fetches can see it (InFlightPart).
    std::shared_ptr<PublishedVersion> out =
        NewPipelinedVersion(from + 1, buckets, static_cast<int>(shards->tensors().size()));
    {
      absl::MutexLock lock(&mu_);
      // Once every push is counted (stepping_), only committed ones count.
      pipeline->BeginAttempt(from, stepping_);
      in_flight_host_ = InFlightHost();
      in_flight_host_.out = out;
    }
    PipelinedStepHooks hooks;
    hooks.await_bucket = [&](const StepBucket& b, BucketGradients* g) {
      return pipeline->AwaitBucket(b, g, absl::InfiniteFuture(), yield);
    };
    hooks.check_bucket = [&] { return pipeline->CheckUsed(); };
    hooks.on_bucket_ready = [&](int b) {
      {
        absl::MutexLock lock(&mu_);
        in_flight_host_.ready_tensor_end = buckets[b].tensor_end;
        in_flight_host_.ready_pieces = buckets[b].piece_end;
      }
      publish_waiters_.WakeAll();
    };
    hooks.before_commit = [&] { return pipeline->AwaitCommit(absl::InfiniteFuture(), yield); };
    hooks.host_readers = [this] { return parked_.AsReadyParked(); };
    absl::StatusOr<std::shared_ptr<const PublishedVersion>> result =
        shards->StepPipelined(from + 1, all_reduce, update_delayed, buckets, hooks, out);
    pipeline->EndAttempt();
    if (!IsStepAbandoned(result.status())) return result;
    bool again = false;
    const char* next = "waits for the next push";
    {
      absl::MutexLock lock(&mu_);
      in_flight_host_ = InFlightHost();  // as_ready fetches of it: ABORTED
      if (shut_down_) {
        pipeline_attempt_ = false;
      } else if (worker_.HasPending()) {
        worker_.Post([this, from] { RunStep(from, /*apply_optimizer=*/true); });
        next = "runs again after the worker's other work";
      } else if (stepping_ || pipeline->CanProgress(from)) {
        again = true;
        next = "runs again";
      } else {
        pipeline_attempt_ = false;  // the next push to begin starts one
      }
    }
    // Waiting for a pusher that has not begun is the usual case; anything
    // else (a failed push, queued work) is worth a line.
    const std::string line =
        absl::StrCat("step from version ", from, ": ", result.status().message(), "; ", next);
    if (!absl::StrContains(line, "not begun")) {
      LogInfo(kTag, line);
    } else {
      LogDebug(kTag, line);
    }
    publish_waiters_.WakeAll();
    if (!again) return result;
  }
}

void Daemon::Impl::OnStepEnqueued(int64_t version) {
  {
    absl::MutexLock lock(&mu_);
    in_flight_version_ = version;
  }
  publish_waiters_.WakeAll();
}

}  // namespace paramd
