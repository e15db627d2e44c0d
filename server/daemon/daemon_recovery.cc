// File: server/daemon/daemon_recovery.cc
//
// The daemon's side of a recovery (server/coordinator/recovery.h is the coordinator's):
// PrepareRecovery, Recover, the buddy snapshot copies (PutSnapshot,
// GetSnapshot), and the stable state checkpoints and exports read
// (WithStableState).

#include "server/daemon/daemon_internal.h"

#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace paramd {

using daemon_internal::kTag;

namespace {

// Test hook (tests/recovery_test.cc; no flag offers it): with
// PARAMD_TEST_RECOVER_FREEZE_MS=<n> the whole process stops for n ms when a
// Recover arrives, as a daemon that a loaded machine does not schedule: the
// kernel still accepts connections to its new data-plane endpoint, but
// nothing answers them, so a peer's first data-plane call times out.
void FreezeOnRecoverForTest() {
  static const int64_t ms = [] {
    const char* v = std::getenv("PARAMD_TEST_RECOVER_FREEZE_MS");
    int64_t value = 0;
    if (v == nullptr || !absl::SimpleAtoi(v, &value) || value <= 0) return int64_t{0};
    LogWarning(kTag, absl::StrCat("test hook PARAMD_TEST_RECOVER_FREEZE_MS=", value));
    return value;
  }();
  if (ms <= 0) return;
  const pid_t self = getpid();
  const pid_t waker = fork();
  if (waker == 0) {
    // Async-signal-safe calls only (the parent has threads). The second
    // SIGCONT covers a parent that stopped only after the first.
    struct timespec t = {static_cast<time_t>(ms / 1000), static_cast<long>(ms % 1000) * 1000000};
    nanosleep(&t, nullptr);
    kill(self, SIGCONT);
    t = {0, 100 * 1000000};
    nanosleep(&t, nullptr);
    kill(self, SIGCONT);
    _exit(0);
  }
  if (waker < 0) return;
  kill(self, SIGSTOP);
  waitpid(waker, nullptr, 0);
}

}  // namespace

grpc::ServerUnaryReactor* Daemon::Impl::PrepareRecovery(grpc::CallbackServerContext* context,
                                                        const rpc::PrepareRecoveryRequest* request,
                                                        rpc::PrepareRecoveryResponse* response) {
  if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                       "/paramd.rpc.Daemon/PrepareRecovery");
      !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  absl::StatusOr<std::string> address = OpenNextWorld(request->epoch());
  if (address.ok()) response->set_data_plane_address(*address);
  for (rpc::SnapshotHeld& h : snapshots_->HoldForRecovery()) {
    *response->add_snapshots() = std::move(h);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(address.status()));
  return reactor;
}

grpc::ServerUnaryReactor* Daemon::Impl::Recover(grpc::CallbackServerContext* context,
                                                const rpc::RecoverRequest* request,
                                                rpc::RecoverResponse* response) {
  if (grpc::Status s =
          auth::Authorize(options_.authenticator.get(), *context, "/paramd.rpc.Daemon/Recover");
      !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  FreezeOnRecoverForTest();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  std::shared_ptr<const ModelView> view;
  if (request->load().manifest().tensors_size() > 0) {
    // The same checks as a LoadShards (names, shapes, paths), before
    // anything changes.
    if (absl::Status s = CheckLoadShardsRequest(request->load(), options_.limits); !s.ok()) {
      reactor->Finish(ToGrpcStatus(s));
      return reactor;
    }
    absl::StatusOr<ModelView> v;
    {
      absl::MutexLock lock(&mu_);
      v = MakeModelView(request->load().manifest(), request->load().daemon_rank(), ++generation_);
    }
    if (!v.ok()) {
      reactor->Finish(ToGrpcStatus(v.status()));
      return reactor;
    }
    view = std::make_shared<const ModelView>(*std::move(v));
  }
  worlds_.Claim(request->epoch());
  worker_.Post([this, request = *request, view, reactor, response] {
    absl::StatusOr<int64_t> v = RecoverOnWorker(request, view, response->mutable_phases());
    if (v.ok()) response->set_published_version(*v);
    if (!v.ok()) LogError(kTag, absl::StrCat("recovery failed: ", v.status().ToString()));
    reactor->Finish(ToGrpcStatus(v.status()));
  });
  return reactor;
}

absl::StatusOr<std::string> Daemon::Impl::OpenNextWorld(int64_t epoch) {
  {
    absl::MutexLock lock(&mu_);
    recovering_ = true;
  }
  bool opened = false;
  ASSIGN_OR_RETURN(std::string address, worlds_.OpenNext(epoch, &opened));
  if (opened) {
    Log(kTag,
        absl::StrCat("recovery ", epoch, ": left the data-plane world; next endpoint ", address));
  }
  return address;
}

absl::StatusOr<int64_t> Daemon::Impl::RecoverOnWorker(const rpc::RecoverRequest& request,
                                                      const std::shared_ptr<const ModelView>& view,
                                                      rpc::RecoveryPhases* phases) {
  const int rank = request.load().daemon_rank();
  const absl::Time connecting = absl::Now();
  ASSIGN_OR_RETURN(std::unique_ptr<DaemonDataPlane> old, worlds_.SwitchToNext(request, rank));
  DaemonDataPlane* const plane = worlds_.current();
  // From here on a failure leaves the new world: a peer waiting in the
  // republishing all-reduce for this daemon fails now, not at its step
  // timeout, and the coordinator's next attempt finds every worker free.
  struct LeaveOnFailure {
    DaemonDataPlane* plane;
    bool succeeded = false;
    ~LeaveOnFailure() {
      if (!succeeded) plane->Shutdown();
    }
  } leave{plane};
  ASSIGN_OR_RETURN(AllReduceMaxFn all_reduce, plane->Connect(request.data_plane(), rank));
  // The republish below is a collective, and a collective that failed
  // cannot be retried; a probe can. A peer still starting, or not scheduled
  // on a loaded machine, may miss the transport's short connect timeout.
  const absl::Time probing = absl::Now();
  RETURN_IF_ERROR(plane->AwaitPeers(probing + options_.step_timeout));
  if (absl::Now() - probing > absl::Seconds(1)) {
    Log(kTag, absl::StrCat("recovery ", request.epoch(), ": every data-plane peer answered after ",
                           absl::FormatDuration(absl::Now() - probing)));
  }
  phases->set_connect(absl::ToDoubleSeconds(absl::Now() - connecting));
  {
    absl::MutexLock lock(&mu_);
    if (rank != rank_) {
      return absl::FailedPreconditionError(
          absl::StrCat("Recover for daemon rank ", rank, " sent to rank ", rank_));
    }
    all_reduce_ = std::move(all_reduce);
    data_plane_transport_ = plane->transport();
    recovery_epoch_ = request.epoch();
    join_error_.clear();
    join_done_ = true;
  }
  old.reset();  // its transport served only this worker's steps
  int64_t version = -1;
  if (view != nullptr) {
    LoadSource source;
    if (request.has_snapshot_version()) {
      // This rank's own copy, or the buddy's copy of a replaced rank; of
      // the model the manifest is of, never another one's.
      const int64_t generation = request.load().manifest().model_generation();
      if (request.snapshot_source().empty()) {
        source.snapshot = snapshots_->Find(rank, request.snapshot_version(), generation);
        if (source.snapshot == nullptr) {
          return absl::NotFoundError(absl::StrCat("no snapshot v", request.snapshot_version(),
                                                  " of rank ", rank, " of model generation ",
                                                  generation, " held here"));
        }
      } else {
        const absl::Time fetching = absl::Now();
        ASSIGN_OR_RETURN(source.snapshot,
                         snapshots_->Fetch(request.snapshot_source(), rank,
                                           request.snapshot_version(), generation));
        phases->set_snapshot_fetch(absl::ToDoubleSeconds(absl::Now() - fetching));
      }
    } else {
      source.checkpoint_path = request.load().checkpoint_path();
      source.checkpoint_version = request.load().checkpoint_version();
    }
    ASSIGN_OR_RETURN(version,
                     LoadOnWorker(view, source, request.load().expected_pushers(), phases));
    snapshots_->AfterRecovery(version, source.snapshot);
  }
  leave.succeeded = true;
  absl::MutexLock lock(&mu_);
  recovering_ = false;
  Log(kTag, absl::StrCat("recovery ", request.epoch(), ": rank ", rank, " in the new world",
                         version >= 0 ? absl::StrCat(", at version ", version) : ""));
  return version;
}

grpc::ServerReadReactor<rpc::SnapshotChunk>* Daemon::Impl::PutSnapshot(
    grpc::CallbackServerContext* context, rpc::PutSnapshotResponse* response) {
  if (grpc::Status s =
          auth::Authorize(options_.authenticator.get(), *context, "/paramd.rpc.Daemon/PutSnapshot");
      !s.ok()) {
    return auth::RefusedReader<rpc::SnapshotChunk>(s);
  }
  return snapshots_->StartPut(context, response);
}

grpc::ServerWriteReactor<rpc::SnapshotChunk>* Daemon::Impl::GetSnapshot(
    grpc::CallbackServerContext* context, const rpc::GetSnapshotRequest* request) {
  if (grpc::Status s =
          auth::Authorize(options_.authenticator.get(), *context, "/paramd.rpc.Daemon/GetSnapshot");
      !s.ok()) {
    return auth::RefusedWriter<rpc::SnapshotChunk>(s);
  }
  return snapshots_->StartGet(*request);
}

absl::Status Daemon::Impl::WithStableState(const Daemon::StableStateFn& fn,
                                           absl::Duration timeout) {
  struct Gate {
    absl::Notification entered;
    absl::Notification release;
  };
  auto gate = std::make_shared<Gate>();
  worker_.Post([gate] {
    gate->entered.Notify();
    gate->release.WaitForNotification();
  });
  // Release the worker on every path, also if it never got here.
  struct Releaser {
    Gate* g;
    ~Releaser() { g->release.Notify(); }
  } releaser{gate.get()};
  if (!gate->entered.WaitForNotificationWithTimeout(timeout)) {
    return absl::UnavailableError("the daemon's worker is busy (a step or load is running)");
  }
  snapshots_->BeforeChange();  // host_state() below may rewrite what a snapshot copies
  std::shared_ptr<const PublishedVersion> latest, previous;
  int64_t model_generation = 0;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return absl::UnavailableError("daemon shutting down");
    if (!latest_ || !shards_) {
      return absl::FailedPreconditionError("no model published on this daemon yet");
    }
    latest = latest_;
    previous = previous_;
    // Set with shards_ by a load on the worker, which is parked here.
    if (view_ != nullptr) model_generation = view_->manifest.model_generation();
  }
  const ShardSet* host = shards_->host_state();
  if (host == nullptr) {
    return absl::UnimplementedError(
        absl::StrCat("checkpoints and exports are not supported by the ", shards_->name(),
                     " daemon backend (run the daemons with --backend=cpu)"));
  }
  // gpu backend: the published bytes of both versions on the host.
  if (HostBytesFn bytes = shards_->host_bytes()) {
    ASSIGN_OR_RETURN(latest, bytes(latest));
    if (previous) {
      absl::StatusOr<std::shared_ptr<const PublishedVersion>> p = bytes(previous);
      previous = p.ok() ? *std::move(p) : nullptr;
    }
  }
  return fn(*host, *latest, previous.get(), model_generation);
}

}  // namespace paramd
