// File: server/coordinator/coordinator_recovery.cc
//
// The coordinator's recovery and restart (server/coordinator/coordinator.h,
// server/coordinator/recovery.h, server/coordinator/coordinator_state.h): the recovery thread, the
// state file, and a restarted coordinator taking its cluster back.

#include "server/coordinator/coordinator_internal.h"

#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "checkpoint/store.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "server/coordinator/model_generation.h"
#include "server/coordinator/recovery.h"
#include "server/rpc/fan_out.h"
#include "server/step/optimizer_config.h"

namespace paramd {

using coordinator_internal::kTag;

void Coordinator::Impl::MaybeStartRecoveryLocked() {
  if (recovering_ || shut_down_ || loading_ || !table_.all_joined()) return;
  bool needed = false;
  for (int r = 0; r < table_.size(); ++r) {
    if (!table_.alive(r)) return;
    needed = needed || table_.slot(r).needs_state;
  }
  if (!needed) return;
  recovering_ = true;
  last_recovery_attempt_ = absl::Now();
  recovery_.set_state("rebuilding the data plane and restoring");
  if (recovery_thread_.joinable()) recovery_thread_.join();  // the last one has ended
  recovery_thread_ = std::thread([this, epoch = recovery_epoch_ + 1] { Recover(epoch); });
}

void Coordinator::Impl::AddCheckpointSource(RecoveryPlan& plan) {
  // Only checkpoints of the served model generation, or the one it was
  // restored from (server/coordinator/model_generation.h): another model's newer
  // checkpoint in the same store is never restored in its place.
  const rpc::Manifest& served = plan.snapshot_manifest;
  RecoveryCheckpointChoice choice =
      ChooseRecoveryCheckpoint(CheckpointsForRecovery(options_.checkpoint_root, served), served);
  plan.disk_refused = choice.refused;
  if (choice.chosen) {
    plan.disk_version = choice.chosen->version;
    plan.checkpoint_path = choice.chosen->path;
    plan.disk_manifest =
        [this, checkpoint = *choice.chosen, addresses = plan.addresses,
         generation = served.model_generation(), restored_from = served.restored_from(),
         loaded_from = served.loaded_from()](int64_t* version) -> absl::StatusOr<rpc::Manifest> {
      rpc::LoadRequest request;
      request.set_checkpoint_path(checkpoint.path);
      request.set_checkpoint_version(checkpoint.version);
      ASSIGN_OR_RETURN(rpc::Manifest manifest, BuildManifest(request, *version));
      // A recovery is no new Load: the served generation goes on, with
      // what it was loaded from (and a fingerprint of that).
      manifest.set_model_generation(generation);
      *manifest.mutable_restored_from() = restored_from;
      if (restored_from.path().empty()) manifest.clear_restored_from();
      manifest.set_loaded_from(loaded_from);
      return RelocatedManifest(std::move(manifest), addresses);
    };
  }
}

void Coordinator::Impl::Recover(int64_t epoch) {
  RecoveryPlan plan;
  plan.epoch = epoch;
  plan.transport = options_.data_plane;
  plan.expected_pushers = options_.expected_pushers;
  plan.prepare_timeout = options_.daemon_call_timeout;
  plan.recover_timeout = options_.load_timeout;
  int64_t committed_before;
  int replaced = -1;
  {
    absl::MutexLock lock(&mu_);
    plan.stubs = stubs_;
    committed_before = committed_;
    plan.have_model = manifest_.tensors_size() > 0;
    for (int r = 0; r < table_.size(); ++r) {
      if (table_.slot(r).needs_state) replaced = r;
      plan.addresses.push_back(table_.slot(r).member.address());
    }
    if (plan.have_model) plan.snapshot_manifest = RelocatedManifest(manifest_, plan.addresses);
  }
  const bool have_model = plan.have_model;
  const absl::Time start = absl::Now();
  if (have_model) AddCheckpointSource(plan);
  absl::StatusOr<RecoveryResult> result = RunRecovery(plan);
  {
    absl::MutexLock lock(&mu_);
    recovering_ = false;
    if (!result.ok()) {
      RecoveryFailedLocked(result.status());
    } else {
      const absl::Time now = absl::Now();
      AdoptRecoveredWorldLocked(*result, epoch);
      if (have_model) {
        manifest_ = result->manifest;
        AdoptManifestOptimizerLocked(manifest_);
        committed_ = result->published_version;
      }
      recovery_.set_needs_load(false);
      recovery_error_logged_.clear();
      recovery_.set_replaced_rank(replaced);
      recovery_.set_rewound_to_version(committed_);
      recovery_.set_committed_before(committed_before);
      recovery_.set_versions_lost(have_model ? std::max<int64_t>(0, committed_before - committed_)
                                             : 0);
      recovery_.set_source(result->source);
      const absl::Time from = lost_at_ == absl::InfinitePast() ? start : lost_at_;
      recovery_.set_seconds(absl::ToDoubleSeconds(now - from));
      *recovery_.mutable_phases() = result->phases;
      recovery_.mutable_phases()->set_wait(absl::ToDoubleSeconds(start - from));
      recovery_.set_error("");
      recovery_.set_state("done");
      StateChangedLocked();
      lost_at_ = absl::InfinitePast();
      const rpc::RecoveryPhases& p = recovery_.phases();
      Log(kTag,
          absl::StrFormat("recovery %d done: rank %d replaced, every daemon rewound to version %d "
                          "(committed was %d: %d versions lost) from %s, %.2f s after the loss "
                          "(waiting %.2f s, prepare %.2f s, recover %.2f s: connect %.2f, snapshot "
                          "fetch %.2f, backend %.2f, restore %.2f, republish %.2f)",
                          epoch, replaced, committed_, committed_before, recovery_.versions_lost(),
                          result->source, recovery_.seconds(), p.wait(), p.prepare(), p.recover(),
                          p.connect(), p.snapshot_fetch(), p.backend_create(), p.restore(),
                          p.republish()));
    }
  }
  version_waiters_.WakeAll();
}

void Coordinator::Impl::RecoveryFailedLocked(const absl::Status& status) {
  const std::string error = status.ToString(absl::StatusToStringMode::kWithNoExtraData);
  const bool needs_load = IsNothingToRecoverFrom(status);
  if (needs_load != recovery_.needs_load()) StateChangedLocked();
  recovery_.set_error(error);
  recovery_.set_needs_load(needs_load);
  recovery_.set_state(needs_load ? "failed: nothing to recover from; waiting for a load"
                                 : "failed; retrying");
  // Once per distinct error: a retry failing the same way every 2 s is no
  // news (it shows in GetStatus, health and metrics meanwhile).
  if (error == recovery_error_logged_) {
    LogDebug(kTag, absl::StrCat("recovery failed again (retrying in 2 s): ", error));
    return;
  }
  recovery_error_logged_ = error;
  LogError(kTag, needs_load
                     ? absl::StrCat("recovery failed: ", error,
                                    "; the cluster cannot serve until the lost state is replaced: "
                                    "load the model again (hpctl load MODEL --force) or restore a "
                                    "checkpoint (a Load with checkpoint_path and force)")
                     : absl::StrCat("recovery failed (retrying every 2 s): ", error));
}

void Coordinator::Impl::AdoptRecoveredWorldLocked(const RecoveryResult& result, int64_t epoch) {
  for (int r = 0; r < table_.size(); ++r) {
    DaemonSlot& d = table_.slot(r);
    d.member.set_data_plane_address(result.data_plane_addresses[r]);
    d.needs_state = false;
    if (d.member.state() == rpc::MEMBER_STATE_RECOVERING) {
      d.member.set_state(rpc::MEMBER_STATE_ALIVE);
    }
    d.published = result.published_version;
  }
  recovery_epoch_ = epoch;
  StateChangedLocked();
}

void Coordinator::Impl::StateChangedLocked() {
  if (state_writer_) state_writer_->MarkDirty();
}

rpc::CoordinatorState Coordinator::Impl::CurrentState() const {
  absl::MutexLock lock(&mu_);
  rpc::CoordinatorState s;
  if (!cluster_secret_configured_) s.set_cluster_secret(cluster_secret_);
  s.set_expected_daemons(options_.expected_daemons);
  *s.mutable_manifest() = manifest_;
  s.set_committed_version(committed_);
  s.set_recovery_epoch(recovery_epoch_);
  *s.mutable_recovery() = recovery_;
  *s.mutable_optimizer() = OptimizerToProto(optimizer_);
  for (int r = 0; r < table_.size(); ++r) {
    const DaemonSlot& slot = table_.slot(r);
    if (!slot.joined) continue;
    rpc::CoordinatorDaemonState* d = s.add_daemons();
    *d->mutable_member() = slot.member;
    d->set_member_secret(member_secrets_[r]);
    d->set_needs_state(slot.needs_state);
  }
  for (const rpc::Member& m : others_) *s.add_others() = m;
  s.set_next_member(next_member_);
  s.set_next_trainer_rank(next_trainer_rank_);
  s.set_model_generation(model_generation_);
  return s;
}

void Coordinator::Impl::Restore(const rpc::CoordinatorState& state) {
  absl::MutexLock lock(&mu_);
  manifest_ = state.manifest();
  manifest_.clear_committed_version();
  committed_ = manifest_.tensors_size() > 0 ? state.committed_version() : -1;
  recovery_epoch_ = state.recovery_epoch();
  // The next Load makes a newer generation than any this cluster served.
  model_generation_ = std::max(state.model_generation(), manifest_.model_generation());
  recovery_ = state.recovery();
  if (state.has_optimizer()) {
    absl::StatusOr<OptimizerOptions> o = OptimizerFromProto(state.optimizer());
    if (o.ok() && !options_.optimizer_explicit) optimizer_ = *o;
  }
  others_.assign(state.others().begin(), state.others().end());
  next_member_ = state.next_member();
  next_trainer_rank_ = state.next_trainer_rank();
  const absl::Time now = absl::Now();
  for (const rpc::CoordinatorDaemonState& d : state.daemons()) {
    const int r = d.member().rank();
    if (r < 0 || r >= table_.size()) continue;
    DaemonSlot& slot = table_.slot(r);
    slot.joined = true;
    slot.member = d.member();
    slot.needs_state = d.needs_state();
    slot.member.set_state(slot.needs_state ? rpc::MEMBER_STATE_RECOVERING
                                           : rpc::MEMBER_STATE_ALIVE);
    slot.member.set_down_reason("");
    slot.published = -1;  // asked by RebuildFromDaemons
    slot.last_heartbeat = now;
    member_secrets_[r] = d.member_secret();
    stubs_[r] = rpc::Daemon::NewStub(auth::CreateChannel(
        slot.member.address(),
        {options_.tls, std::make_shared<auth::BearerToken>(member_secrets_[r])}));
  }
  Log(kTag,
      absl::StrCat("restarted from ", options_.state_file, ": ", table_.joined(), " of ",
                   table_.size(), " daemons, ",
                   manifest_.tensors_size() > 0
                       ? absl::StrCat(manifest_.tensors_size(), " tensors at committed version ",
                                      committed_, " (", DescribeGeneration(manifest_), ")")
                       : std::string("no model"),
                   ", recovery epoch ", recovery_epoch_, "; asking the daemons what they publish"));
  // The state file's model wins over a startup load: loading --model or
  // --restore_from over it would replace the model the cluster serves
  // (another generation) behind the operator's back.
  if (manifest_.tensors_size() > 0) {
    absl::MutexLock startup(&startup_mu_);
    startup_load_started_ = true;
    if (!options_.restore_from.empty() || !options_.model_path.empty()) {
      Log(kTag,
          absl::StrCat(options_.restore_from.empty()
                           ? absl::StrCat("--model=", options_.model_path)
                           : absl::StrCat("--restore_from=", options_.restore_from),
                       " is not loaded: the cluster serves the state file's model (",
                       DescribeGeneration(manifest_),
                       "); replace it with hpctl load --force, or start without --state_file"));
    }
  }
}

void Coordinator::Impl::RebuildFromDaemons() {
  std::vector<bool> answered(table_size_at_start(), false);
  for (;;) {
    std::vector<std::shared_ptr<rpc::Daemon::Stub>> stubs;
    std::vector<int> ranks;
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) return;
      for (int r = 0; r < table_.size(); ++r) {
        if (answered[r] || !table_.alive(r)) continue;
        stubs.push_back(stubs_[r]);
        ranks.push_back(r);
      }
    }
    if (stubs.empty()) break;
    absl::Notification done;
    bool advanced = false;
    FanOut<rpc::GetStatsRequest, rpc::GetStatsResponse>(
        stubs, absl::Seconds(1), [](int, rpc::GetStatsRequest*) {},
        [](rpc::Daemon::Stub* stub, grpc::ClientContext* c, const rpc::GetStatsRequest* req,
           rpc::GetStatsResponse* resp, std::function<void(grpc::Status)> cb) {
          stub->async()->GetStats(c, req, resp, std::move(cb));
        },
        [&](auto& calls) {
          absl::MutexLock lock(&mu_);
          for (size_t i = 0; i < calls.size(); ++i) {
            const int r = ranks[i];
            const rpc::DaemonStats& stats = calls[i]->response.stats();
            if (!calls[i]->status.ok() || stats.rank() != r) continue;
            answered[r] = true;
            table_.slot(r).published = stats.published_version();
          }
          if (!recovering_) advanced = RecomputeCommittedLocked();
          done.Notify();
        });
    done.WaitForNotification();
    if (advanced) version_waiters_.WakeAll();
    absl::MutexLock lock(&mu_);
    auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return shut_down_; };
    if (mu_.AwaitWithTimeout(absl::Condition(&stop), absl::Milliseconds(200))) return;
  }
  bool load;
  {
    absl::MutexLock lock(&mu_);
    Log(kTag, absl::StrCat("state rebuilt from the daemons: committed version ", committed_));
    load = manifest_.tensors_size() == 0 && table_.all_joined();
  }
  if (load) StartStartupLoad();  // the earlier run died before loading its model
}

}  // namespace paramd
