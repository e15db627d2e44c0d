#include "server/coordinator.h"

#include <google/protobuf/text_format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include <openssl/crypto.h>

#include "absl/hash/hash.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "checkpoint/daemon_io.h"
#include "checkpoint/store.h"
#include "common/file_util.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "proto/paramd.grpc.pb.h"
#include "safetensors/safetensors.h"
#include "server/async_util.h"
#include "server/fan_out.h"
#include "server/membership.h"
#include "server/coordinator_state.h"
#include "server/recovery.h"
#include "server/convert.h"
#include "server/optimizer_config.h"
#include "sharding/balance.h"

namespace paramd {
namespace {

constexpr char kTag[] = "coordinator";

// The optimizer a checkpoint was written with (checkpoint/service.cc
// metadata "optimizer_config" and "optimizer_tensors", protobuf text);
// no config for checkpoints written before these existed.
struct SavedOptimizer {
  std::optional<OptimizerOptions> config;
  std::map<std::string, TensorOptimizer> tensors;
};

absl::StatusOr<SavedOptimizer> ReadSavedOptimizer(const checkpoint::Manifest& manifest) {
  SavedOptimizer saved;
  auto it = manifest.metadata().find("optimizer_config");
  if (it == manifest.metadata().end()) return saved;
  absl::StatusOr<OptimizerOptions> config =
      ParseOptimizerConfig(it->second, "checkpoint metadata optimizer_config");
  if (!config.ok()) return absl::DataLossError(config.status().message());
  saved.config = *config;
  auto t = manifest.metadata().find("optimizer_tensors");
  if (t != manifest.metadata().end()) {
    rpc::Manifest tensors;
    if (!google::protobuf::TextFormat::ParseFromString(t->second, &tensors)) {
      return absl::DataLossError("checkpoint metadata optimizer_tensors does not parse");
    }
    for (const rpc::TensorInfo& info : tensors.tensors()) {
      saved.tensors[info.name()] = TensorOptimizerFromProto(info.optimizer());
    }
  }
  return saved;
}

// The newest complete checkpoint of the store at `root`; -1 if none.
int64_t NewestCheckpointVersion(const std::string& root) {
  absl::StatusOr<checkpoint::CheckpointStore> store =
      checkpoint::CheckpointStore::Open(root, /*create=*/false);
  if (!store.ok()) return -1;
  absl::StatusOr<std::vector<checkpoint::CheckpointSummary>> list = store->List();
  if (!list.ok() || list->empty()) return -1;
  return static_cast<int64_t>(list->back().version);
}

}  // namespace

class WatchReactor;

class Coordinator::Impl : public rpc::Coordinator::CallbackService {
 public:
  // `restored`: the state file of an earlier run (server/coordinator_state.h).
  Impl(CoordinatorOptions options, std::optional<rpc::CoordinatorState> restored)
      : options_(std::move(options)),
        cluster_secret_configured_(!options_.cluster_secret.empty()),
        cluster_secret_(cluster_secret_configured_ ? options_.cluster_secret
                        : restored && !restored->cluster_secret().empty()
                            ? restored->cluster_secret()
                            : auth::RandomSecret()),
        table_(options_.expected_daemons, options_.daemon_lease),
        stubs_(options_.expected_daemons),
        member_secrets_(options_.expected_daemons) {
    if (options_.authenticator) options_.authenticator->AddClusterSecret(cluster_secret_);
    optimizer_ = options_.optimizer;
    if (restored) Restore(*restored);
    if (!options_.state_file.empty()) {
      state_writer_ = std::make_unique<StateWriter>(options_.state_file,
                                                    [this] { return CurrentState(); });
      state_writer_->MarkDirty();
    }
    lease_thread_ = std::thread([this] { LeaseLoop(); });
    if (restored) rebuild_thread_ = std::thread([this] { RebuildFromDaemons(); });
  }

  const std::string& cluster_secret() const { return cluster_secret_; }

  void Shutdown() {
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) return;
      shut_down_ = true;
    }
    if (lease_thread_.joinable()) lease_thread_.join();
    std::thread recovery;
    {
      absl::MutexLock lock(&mu_);
      recovery = std::move(recovery_thread_);
    }
    if (recovery.joinable()) recovery.join();
    if (rebuild_thread_.joinable()) rebuild_thread_.join();
    if (state_writer_) (void)state_writer_->Flush();
    world_waiters_.WakeAll();
    version_waiters_.WakeAll();
  }

  // The recovery epoch and, for a rewind, the version of the last recovery
  // (WatchVersion).
  void RecoveryEpoch(int64_t* epoch, int64_t* rewound_to) const {
    absl::MutexLock lock(&mu_);
    *epoch = recovery_epoch_;  // grows when a recovery completes
    *rewound_to = recovery_.rewound_to_version();
  }

  std::vector<rpc::Member> daemon_members() const {
    absl::MutexLock lock(&mu_);
    return table_.Members(absl::Now());
  }

  int64_t daemons_lost() const {
    absl::MutexLock lock(&mu_);
    return daemons_lost_;
  }

  int64_t committed_version() const {
    absl::MutexLock lock(&mu_);
    return committed_;
  }

  rpc::Manifest manifest() const {
    absl::MutexLock lock(&mu_);
    return ManifestLocked(/*with_pieces=*/true);
  }

  int joined_daemons() const {
    absl::MutexLock lock(&mu_);
    return table_.joined();
  }

  absl::Status startup_error() const {
    absl::MutexLock lock(&startup_mu_);
    return startup_error_;
  }

  bool shut_down() const {
    absl::MutexLock lock(&mu_);
    return shut_down_;
  }

  WaitList* version_waiters() { return &version_waiters_; }
  const CoordinatorOptions& options() const { return options_; }

  // ---- RPCs ----

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* context,
                                 const rpc::JoinRequest* request,
                                 rpc::JoinResponse* response) override {
    bool may_take_rank = true;
    if (grpc::Status s = AuthorizeJoin(*context, *request, &may_take_rank); !s.ok()) {
      return auth::RefusedUnary(context, s);
    }
    absl::StatusOr<rpc::Member> member = AddMember(*request, may_take_rank);
    if (!member.ok()) return Done(context, member.status());
    if (!request->wait_for_world()) {
      absl::MutexLock lock(&mu_);
      FillJoinResponseLocked(*member, response);
      return Done(context, absl::OkStatus());
    }
    return StartWaitingUnary(&world_waiters_,
                             [this, m = *member, response]() -> std::optional<grpc::Status> {
                               absl::MutexLock lock(&mu_);
                               if (shut_down_) return Unavailable("coordinator shutting down");
                               if (!table_.all_joined()) return std::nullopt;
                               FillJoinResponseLocked(m, response);
                               return grpc::Status::OK;
                             });
  }

  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* context,
                                  const rpc::LeaveRequest* request,
                                  rpc::LeaveResponse* /*response*/) override {
    if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                         "/paramd.rpc.Coordinator/Leave");
        !s.ok()) {
      return auth::RefusedUnary(context, s);
    }
    absl::MutexLock lock(&mu_);
    auto it = std::find_if(others_.begin(), others_.end(), [&](const rpc::Member& m) {
      return m.member_id() == request->member_id();
    });
    if (it == others_.end()) {
      return Done(context, absl::NotFoundError(
                               absl::StrCat("no trainer/observer ", request->member_id())));
    }
    LogInfo(kTag, absl::StrCat(it->role() == rpc::ROLE_TRAINER ? "trainer " : "observer ",
                               it->member_id(), " (", it->name(), ") left"));
    others_.erase(it);  // daemons never leave: their rank is their shards
    StateChangedLocked();
    return Done(context, absl::OkStatus());
  }

  grpc::ServerUnaryReactor* GetManifest(grpc::CallbackServerContext* context,
                                        const rpc::GetManifestRequest* /*request*/,
                                        rpc::GetManifestResponse* response) override {
    if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                         "/paramd.rpc.Coordinator/GetManifest");
        !s.ok()) {
      return auth::RefusedUnary(context, s);
    }
    absl::MutexLock lock(&mu_);
    *response->mutable_manifest() = ManifestLocked(/*with_pieces=*/true);
    return Done(context, absl::OkStatus());
  }

  grpc::ServerUnaryReactor* WaitForVersion(grpc::CallbackServerContext* context,
                                           const rpc::WaitForVersionRequest* request,
                                           rpc::WaitForVersionResponse* response) override {
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

  grpc::ServerWriteReactor<rpc::VersionEvent>* WatchVersion(
      grpc::CallbackServerContext* context, const rpc::WatchVersionRequest* request) override;

  grpc::ServerUnaryReactor* Load(grpc::CallbackServerContext* context,
                                 const rpc::LoadRequest* request,
                                 rpc::LoadResponse* response) override {
    if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                         "/paramd.rpc.Coordinator/Load");
        !s.ok()) {
      return auth::RefusedUnary(context, s);
    }
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    StartLoad(*request, [reactor, response](absl::Status s, const rpc::LoadResponse& r) {
      if (s.ok()) *response = r;
      reactor->Finish(ToGrpcStatus(s));
    });
    return reactor;
  }

  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* context,
                                 const rpc::StepRequest* request,
                                 rpc::StepResponse* response) override {
    if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                         "/paramd.rpc.Coordinator/Step");
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
      absl::Status ready = table_.CheckAllReady(absl::StrCat("step from version ", from),
                                                absl::Now());
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
        &version_waiters_,
        [this, state, wait, from, response]() -> std::optional<grpc::Status> {
          absl::MutexLock lock(&mu_);
          if (shut_down_) return Unavailable("coordinator shutting down");
          if (!state->done) {
            // A daemon that died (or stopped) mid-step never answers: its
            // lease ends the wait.
            absl::Status ready = table_.CheckAllReady(
                absl::StrCat("step from version ", from), absl::Now());
            if (!ready.ok()) return ToGrpcStatus(ready);
            return std::nullopt;
          }
          if (!state->status.ok()) return ToGrpcStatus(state->status);
          if (wait && committed_ < from + 1) return std::nullopt;
          response->set_committed_version(committed_);
          return grpc::Status::OK;
        });
  }

  // A report moves the committed version only for a version that daemon
  // really published: a new one is confirmed by asking the daemon itself
  // (GetStats on the address it joined with) before it counts, so a forged
  // report (member ids are listed by GetStatus) cannot commit a version no
  // daemon holds. Reports of versions already known change nothing.
  grpc::ServerUnaryReactor* ReportVersion(grpc::CallbackServerContext* context,
                                          const rpc::ReportVersionRequest* request,
                                          rpc::ReportVersionResponse* response) override {
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
        return finish(
            absl::InvalidArgumentError(absl::StrCat("ReportVersion of version ", version)));
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
           epoch = request->recovery_epoch(), response](grpc::Status s) {
            bool advanced = false;
            absl::Status result;
            {
              absl::MutexLock lock(&mu_);
              const rpc::DaemonStats& stats = confirm->response.stats();
              if (!s.ok()) {
                result = absl::UnavailableError(absl::StrCat(
                    "cannot confirm version ", version, " with daemon rank ", rank, ": ",
                    s.error_message()));
              } else if (stats.rank() != rank || stats.published_version() < version ||
                         // Backwards (a rewind): only to what it publishes now.
                         (version < table_.slot(rank).published &&
                          stats.published_version() != version)) {
                result = absl::FailedPreconditionError(absl::StrCat(
                    "daemon rank ", rank, " has not published version ", version,
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

  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const rpc::HeartbeatRequest* request,
                                      rpc::HeartbeatResponse* response) override {
    if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                         "/paramd.rpc.Coordinator/Heartbeat");
        !s.ok()) {
      return auth::RefusedUnary(context, s);
    }
    {
      absl::MutexLock lock(&mu_);
      const absl::Time now = absl::Now();
      const int rank = request->rank();
      const absl::Time down_since =
          rank >= 0 && rank < table_.size() ? table_.slot(rank).down_since : now;
      bool revived = false;
      response->set_verdict(table_.Heartbeat(*request, now, &revived));
      response->set_committed_version(committed_);
      if (revived) {
        Log(kTag, absl::StrFormat("daemon %s is back: heartbeats resumed %.1f s after it went down",
                                  table_.Name(rank), absl::ToDoubleSeconds(now - down_since)));
      }
    }
    return Done(context, absl::OkStatus());
  }

  grpc::ServerUnaryReactor* SetOptimizerSchedule(
      grpc::CallbackServerContext* context, const rpc::SetOptimizerScheduleRequest* request,
      rpc::SetOptimizerScheduleResponse* response) override {
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

  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* context,
                                      const rpc::GetStatusRequest* request,
                                      rpc::GetStatusResponse* response) override {
    if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                         "/paramd.rpc.Coordinator/GetStatus");
        !s.ok()) {
      return auth::RefusedUnary(context, s);
    }
    std::vector<std::shared_ptr<rpc::Daemon::Stub>> stubs;
    std::vector<int> ranks;  // of `stubs`: joined daemons that are not DOWN
    {
      absl::MutexLock lock(&mu_);
      response->set_committed_version(committed_);
      response->set_expected_daemons(options_.expected_daemons);
      response->set_expected_pushers(options_.expected_pushers);
      *response->mutable_manifest() = ManifestLocked(request->include_shards());
      *response->mutable_recovery() = recovery_;
      response->mutable_recovery()->set_epoch(recovery_epoch_);
      response->mutable_recovery()->set_in_progress(recovering_);
      *response->mutable_optimizer() = OptimizerToProto(optimizer_);
      // A DOWN daemon is not asked (a stopped one would hold the answer
      // until the call's deadline); its row says why.
      for (int r = 0; r < table_.size(); ++r) {
        if (!table_.alive(r)) continue;
        stubs.push_back(stubs_[r]);
        ranks.push_back(r);
      }
    }
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    const bool include_shards = request->include_shards();
    // Bounded by the lease: a stopped daemon not yet DOWN must not hold the
    // whole status (a live one answers in milliseconds).
    FanOut<rpc::GetStatsRequest, rpc::GetStatsResponse>(
        stubs, std::min(options_.daemon_call_timeout, options_.daemon_lease),
        [include_shards](int, rpc::GetStatsRequest* r) { r->set_include_shards(include_shards); },
        [](rpc::Daemon::Stub* stub, grpc::ClientContext* c, const rpc::GetStatsRequest* req,
           rpc::GetStatsResponse* resp, std::function<void(grpc::Status)> cb) {
          stub->async()->GetStats(c, req, resp, std::move(cb));
        },
        [this, reactor, response, ranks](auto& calls) {
          absl::MutexLock lock(&mu_);
          // Members as of the answer (a lease may have expired meanwhile).
          for (rpc::Member& m : table_.Members(absl::Now())) {
            *response->add_members() = std::move(m);
          }
          for (const rpc::Member& m : others_) *response->add_members() = m;
          size_t next = 0;
          for (int r = 0; r < table_.size(); ++r) {
            const DaemonSlot& slot = table_.slot(r);
            if (!slot.joined) continue;
            rpc::DaemonStats* s = response->add_daemons();
            const bool asked = next < ranks.size() && ranks[next] == r;
            const size_t i = asked ? next++ : 0;
            if (asked && calls[i]->status.ok()) {
              *s = calls[i]->response.stats();
              continue;
            }
            s->set_rank(r);
            s->set_address(slot.member.address());
            s->set_published_version(slot.published);
            s->set_error(asked ? absl::StrCat("unreachable: ", calls[i]->status.error_message())
                               : absl::StrCat("down: ", slot.member.down_reason()));
          }
          reactor->Finish(grpc::Status::OK);
        });
    return reactor;
  }

 private:
  static grpc::Status Unavailable(absl::string_view message) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, std::string(message));
  }

  static grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* context,
                                        const absl::Status& status) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(ToGrpcStatus(status));
    return reactor;
  }

  std::vector<std::shared_ptr<rpc::Daemon::Stub>> StubsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stubs_;
  }

  // Starts a recovery if a replacement waits for its state and every rank
  // is held by a live daemon (else the next join or lease tick does).
  void MaybeStartRecoveryLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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

  // Recovery thread: the newest complete checkpoint onto every daemon
  // (docs/ARCHITECTURE.md "Recovery"), then the rewind is committed.
  void Recover(int64_t epoch) {
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
    if (have_model && !options_.checkpoint_root.empty()) {
      plan.disk_version = NewestCheckpointVersion(options_.checkpoint_root);
      plan.checkpoint_path = options_.checkpoint_root;
      plan.disk_manifest = [this](int64_t* version) {
        rpc::LoadRequest request;
        request.set_checkpoint_path(options_.checkpoint_root);
        request.set_checkpoint_version(-1);  // the newest complete one
        return BuildManifest(request, *version);
      };
    }
    absl::StatusOr<RecoveryResult> result = RunRecovery(plan);
    {
      absl::MutexLock lock(&mu_);
      recovering_ = false;
      if (!result.ok()) {
        recovery_.set_error(result.status().ToString());
        recovery_.set_state("failed; retrying");
        Log(kTag, absl::StrCat("recovery failed (retrying in 2 s): ", result.status().ToString()));
      } else {
        const absl::Time now = absl::Now();
        for (int r = 0; r < table_.size(); ++r) {
          DaemonSlot& d = table_.slot(r);
          d.member.set_data_plane_address(result->data_plane_addresses[r]);
          d.needs_state = false;
          if (d.member.state() == rpc::MEMBER_STATE_RECOVERING) {
            d.member.set_state(rpc::MEMBER_STATE_ALIVE);
          }
          d.published = result->published_version;
        }
        if (have_model) {
          manifest_ = result->manifest;
          committed_ = result->published_version;
        }
        recovery_epoch_ = epoch;
        recovery_.set_replaced_rank(replaced);
        recovery_.set_rewound_to_version(committed_);
        recovery_.set_committed_before(committed_before);
        recovery_.set_versions_lost(have_model ? std::max<int64_t>(0, committed_before - committed_)
                                               : 0);
        recovery_.set_source(result->source);
        const absl::Time from = lost_at_ == absl::InfinitePast() ? start : lost_at_;
        recovery_.set_seconds(absl::ToDoubleSeconds(now - from));
        recovery_.set_error("");
        recovery_.set_state("done");
        StateChangedLocked();
        lost_at_ = absl::InfinitePast();
        Log(kTag, absl::StrFormat(
                      "recovery %d done: rank %d replaced, every daemon rewound to version %d "
                      "(committed was %d: %d versions lost) from %s, %.2f s after the loss",
                      epoch, replaced, committed_, committed_before,
                      recovery_.versions_lost(), result->source, recovery_.seconds()));
      }
    }
    version_waiters_.WakeAll();
  }

  // ---- The state file (server/coordinator_state.h) ----

  void StateChangedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (state_writer_) state_writer_->MarkDirty();
  }

  rpc::CoordinatorState CurrentState() const {
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
    return s;
  }

  // Constructor: takes back an earlier run's cluster. Every daemon of the
  // file is taken as alive (its heartbeats renew the lease; one that died
  // meanwhile goes DOWN after it); what each publishes is asked by
  // RebuildFromDaemons.
  void Restore(const rpc::CoordinatorState& state) {
    absl::MutexLock lock(&mu_);
    manifest_ = state.manifest();
    manifest_.clear_committed_version();
    committed_ = manifest_.tensors_size() > 0 ? state.committed_version() : -1;
    recovery_epoch_ = state.recovery_epoch();
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
    Log(kTag, absl::StrCat("restarted from ", options_.state_file, ": ", table_.joined(), " of ",
                           table_.size(), " daemons, ",
                           manifest_.tensors_size() > 0
                               ? absl::StrCat(manifest_.tensors_size(),
                                              " tensors at committed version ", committed_)
                               : std::string("no model"),
                           ", recovery epoch ", recovery_epoch_,
                           "; asking the daemons what they publish"));
  }

  // Thread of a restarted coordinator: asks every live daemon of the state
  // file which version it publishes (GetStats, every 200 ms until each has
  // answered once or is DOWN), so the committed version is the daemons'
  // (never below the file's) and steps can go on.
  void RebuildFromDaemons() {
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
    absl::MutexLock lock(&mu_);
    Log(kTag, absl::StrCat("state rebuilt from the daemons: committed version ", committed_));
  }

  int table_size_at_start() const { return options_.expected_daemons; }

  // Marks daemons whose lease expired DOWN (every lease/10, at most 100 ms
  // apart, so a dead daemon is seen within lease + 100 ms) and wakes the
  // waits that need them.
  void LeaseLoop() {
    const absl::Duration tick = std::min(absl::Milliseconds(100), options_.daemon_lease / 10);
    auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return shut_down_; };
    for (;;) {
      std::vector<int> expired;
      {
        absl::MutexLock lock(&mu_);
        if (mu_.AwaitWithTimeout(absl::Condition(&stop), tick)) return;
        const absl::Time now = absl::Now();
        expired = table_.ExpireLeases(now);
        if (!expired.empty() && lost_at_ == absl::InfinitePast()) lost_at_ = now;
        // A recovery that failed (say a daemon was slow) is tried again.
        if (!recovering_ && now - last_recovery_attempt_ > absl::Seconds(2)) {
          MaybeStartRecoveryLocked();
        }
        for (int r : expired) {
          ++daemons_lost_;
          Log(kTag, absl::StrCat("daemon ", table_.Name(r), " is DOWN: ",
                                 table_.slot(r).member.down_reason(),
                                 "; steps needing it are refused until a replacement joins "
                                 "(hybrid-paramd --role=daemon --rank=",
                                 r, ")"));
        }
      }
      if (!expired.empty()) {
        version_waiters_.WakeAll();
        world_waiters_.WakeAll();
      }
    }
  }

  // The Join policies of auth/method_policy.cc. `may_take_rank`: whether a
  // daemon join may take over a rank that already has a daemon (a rejoin):
  // only with a cluster credential, since the reply carries the cluster
  // secret and the coordinator's calls then go to the joiner's secret.
  grpc::Status AuthorizeJoin(const grpc::CallbackServerContext& context,
                             const rpc::JoinRequest& request, bool* may_take_rank) const {
    const auth::Authenticator* a = options_.authenticator.get();
    *may_take_rank = true;
    if (a == nullptr) return grpc::Status::OK;
    const auth::Caller caller = a->Identify(context);
    constexpr absl::string_view kJoin = "/paramd.rpc.Coordinator/Join";
    if (grpc::Status s = a->AuthorizeCaller(caller, kJoin); !s.ok()) return s;
    if (request.role() == rpc::ROLE_DAEMON) {
      if (caller.role == auth::Role::kCluster) return grpc::Status::OK;
      if (a->tokens_required()) return a->AuthorizeCaller(caller, auth::kJoinAsDaemon);
      if (cluster_secret_configured_) {
        return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                            "joining as a daemon needs the cluster secret (--cluster_secret_file)");
      }
      *may_take_rank = false;  // open: CheckOpenDaemonJoinLocked decides
      return grpc::Status::OK;
    }
    if (request.role() == rpc::ROLE_TRAINER && request.pusher()) {
      return a->AuthorizeCaller(caller, auth::kJoinAsPusher);
    }
    return grpc::Status::OK;
  }

  // The daemon joins allowed without credentials (see AddMember): not a
  // live daemon's address, and what DaemonTable::Join takes for a retry
  // of a registered process only with the member secret it gave.
  absl::Status CheckOpenDaemonJoinLocked(const rpc::JoinRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (int rank = 0; rank < table_.size(); ++rank) {
      const DaemonSlot& slot = table_.slot(rank);
      if (!slot.joined) continue;
      // What DaemonTable::Join takes for a retry of the same process.
      const bool same_process =
          !request.incarnation().empty()
              ? slot.member.incarnation() == request.incarnation()
              : (!request.member_id().empty() && slot.member.member_id() == request.member_id()) ||
                    slot.member.address() == request.address();
      if (same_process) {
        const std::string& known = member_secrets_[rank];
        if (known.size() == request.member_secret().size() &&
            CRYPTO_memcmp(known.data(), request.member_secret().data(), known.size()) == 0) {
          return absl::OkStatus();
        }
        return absl::UnauthenticatedError(absl::StrCat(
            "a Join as daemon rank ", rank, " (", slot.member.member_id(),
            ") again needs that daemon's member secret"));
      }
      if (table_.alive(rank) && slot.member.address() == request.address()) {
        return absl::UnauthenticatedError(absl::StrCat(
            "daemon rank ", rank, " (", slot.member.member_id(), ") is alive at ",
            request.address(), "; replacing it needs the cluster secret "
            "(--cluster_secret_file) or a cluster token"));
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<rpc::Member> AddMember(const rpc::JoinRequest& request, bool may_take_rank) {
    bool world_complete = false;
    bool start_recovery = false;
    rpc::Member result;
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) return absl::UnavailableError("coordinator shutting down");
      switch (request.role()) {
        case rpc::ROLE_DAEMON: {
          // The config is the coordinator's: a daemon told otherwise on its
          // command line is refused, both values named.
          RETURN_IF_ERROR(CheckOptimizerFlags(request.optimizer_flags(), optimizer_));
          if (!may_take_rank) {
            // No credentials (no token file, no configured secret): a new
            // rank, a DOWN rank, or a retry of this process's own Join
            // (same incarnation and member secret), but not the place of
            // a live daemon (by its address): that would hand a stranger
            // the cluster secret and the live daemon's calls.
            RETURN_IF_ERROR(CheckOpenDaemonJoinLocked(request));
          }
          const bool was_complete = table_.all_joined();
          const int joined_before = table_.joined();
          ASSIGN_OR_RETURN(DaemonTable::Joined j,
                           table_.Join(request, absl::Now(), manifest_.tensors_size() > 0));
          result = j.member;
          if (j.retry) break;
          const int rank = j.member.rank();
          // Calls to this daemon present its own member secret: it accepts
          // that from the start, whereas it learns the cluster secret only
          // from the Join reply, which LoadShards may overtake.
          member_secrets_[rank] =
              request.member_secret().empty() ? cluster_secret_ : request.member_secret();
          stubs_[rank] = rpc::Daemon::NewStub(auth::CreateChannel(
              request.address(),
              {options_.tls, std::make_shared<auth::BearerToken>(member_secrets_[rank])}));
          world_complete = !was_complete && table_.all_joined();
          StateChangedLocked();  // a restart takes this daemon back
          if (j.replaced) {
            start_recovery = true;
            Log(kTag, absl::StrCat("daemon rank ", rank, " replaced by ", request.address(),
                                   " (", request.name(), ")",
                                   table_.slot(rank).needs_state
                                       ? "; it needs the rank's state"
                                       : ""));
          } else {
            Log(kTag, absl::StrCat("daemon rank ", rank, " joined from ", request.address(), " (",
                                   joined_before + 1, "/", options_.expected_daemons, ")"));
          }
          break;
        }
        case rpc::ROLE_TRAINER:
        case rpc::ROLE_OBSERVER: {
          if (request.expected_pushers() != 0 &&
              request.expected_pushers() != options_.expected_pushers) {
            return absl::FailedPreconditionError(
                absl::StrCat("this trainer expects ", request.expected_pushers(),
                             " pushers, the coordinator ", options_.expected_pushers));
          }
          if (!request.member_id().empty()) {
            for (const rpc::Member& m : others_) {
              if (m.member_id() == request.member_id()) return m;
            }
          }
          rpc::Member m;
          m.set_role(request.role());
          const bool trainer = request.role() == rpc::ROLE_TRAINER;
          m.set_member_id(absl::StrCat(trainer ? "trainer-" : "observer-", next_member_++));
          m.set_rank(trainer ? options_.expected_daemons + next_trainer_rank_++ : -1);
          m.set_address(request.address());
          m.set_data_plane_address(request.data_plane_address());
          m.set_pusher(trainer && request.pusher());
          m.set_name(request.name());
          others_.push_back(m);
          StateChangedLocked();
          LogInfo(kTag, absl::StrCat(trainer ? "trainer " : "observer ", m.member_id(),
                                     trainer ? absl::StrCat(" rank ", m.rank()) : "", " (",
                                     m.name(), m.pusher() ? ", pusher" : "", ") joined"));
          result = m;
          break;
        }
        default:
          return absl::InvalidArgumentError(
              absl::StrCat("Join with unknown role ", static_cast<int>(request.role())));
      }
    }
    if (start_recovery) {
      absl::MutexLock lock(&mu_);
      MaybeStartRecoveryLocked();
    }
    if (world_complete) {
      world_waiters_.WakeAll();
      if (!options_.model_path.empty() || !options_.restore_from.empty()) {
        rpc::LoadRequest load;
        if (!options_.restore_from.empty()) {
          load.set_checkpoint_path(options_.restore_from);
          load.set_checkpoint_version(options_.restore_version);
        } else {
          load.set_safetensors_path(options_.model_path);
        }
        StartLoad(load, [this](absl::Status s, const rpc::LoadResponse&) {
          if (s.ok()) return;
          LogError(kTag, absl::StrCat("loading the startup model failed: ", s.ToString()));
          // Its own mutex: StartLoad may call back with mu_ held.
          absl::MutexLock lock(&startup_mu_);
          startup_error_ = absl::Status(
              s.code(), absl::StrCat(options_.restore_from.empty()
                                         ? absl::StrCat("--model=", options_.model_path)
                                         : absl::StrCat("--restore_from=", options_.restore_from),
                                     ": loading the startup model failed: ", s.message()));
        });
      }
    }
    return result;
  }

  void FillJoinResponseLocked(const rpc::Member& m, rpc::JoinResponse* response)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    response->set_member_id(m.member_id());
    response->set_rank(m.rank());
    if (m.role() == rpc::ROLE_DAEMON && m.rank() >= 0 && m.rank() < table_.size()) {
      response->set_replacement(table_.slot(m.rank()).needs_state);
    }
    if (m.role() == rpc::ROLE_DAEMON) response->set_cluster_secret(cluster_secret_);
    response->set_expected_pushers(options_.expected_pushers);
    response->set_committed_version(committed_);
    *response->mutable_optimizer() = OptimizerToProto(optimizer_);
    rpc::DataPlane* dp = response->mutable_data_plane();
    dp->set_transport(options_.data_plane);
    dp->set_num_daemons(options_.expected_daemons);
    int world = options_.expected_daemons;
    for (int r = 0; r < table_.size(); ++r) {
      if (!table_.slot(r).joined) continue;
      (*dp->mutable_address_book())[r] = table_.slot(r).member.data_plane_address();
    }
    for (const rpc::Member& o : others_) {
      if (o.rank() < 0) continue;
      world = std::max(world, o.rank() + 1);
      if (!o.data_plane_address().empty()) {
        (*dp->mutable_address_book())[o.rank()] = o.data_plane_address();
      }
    }
    dp->set_world_size(world);
  }

  rpc::Manifest ManifestLocked(bool with_pieces) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    rpc::Manifest m = manifest_;
    if (!with_pieces) m.clear_pieces();
    m.set_committed_version(committed_);
    m.set_expected_pushers(options_.expected_pushers);
    m.clear_daemons();
    for (int r = 0; r < table_.size(); ++r) {
      const DaemonSlot& d = table_.slot(r);
      if (!d.joined) continue;
      rpc::DaemonInfo* info = m.add_daemons();
      info->set_rank(r);
      info->set_address(d.member.address());
      info->set_data_plane_address(d.member.data_plane_address());
      info->set_published_version(d.published);
    }
    return m;
  }

  // True if the committed version advanced.
  bool RecomputeCommittedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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

  // The tensors of a load request, with their 2-D views.
  absl::StatusOr<std::vector<rpc::TensorDecl>> LoadTensors(const rpc::LoadRequest& request) {
    std::vector<rpc::TensorDecl> tensors;
    if (!request.safetensors_path().empty()) {
      if (request.tensors_size() > 0) {
        return absl::InvalidArgumentError("Load: give a safetensors path or tensors, not both");
      }
      ASSIGN_OR_RETURN(safetensors::SafetensorsFile file,
                       safetensors::SafetensorsFile::Open(request.safetensors_path(),
                                                          options_.limits.max_tensor_name_bytes));
      // (request.safetensors_path() is already resolved below --model_root:
      // ConfineLoadPaths.)
      for (const safetensors::TensorInfo& t : file.tensors()) {
        rpc::TensorDecl d;
        d.set_name(t.name);
        for (int64_t s : t.shape) d.add_shape(s);
        tensors.push_back(std::move(d));
      }
    } else {
      tensors.assign(request.tensors().begin(), request.tensors().end());
    }
    if (tensors.empty()) return absl::InvalidArgumentError("Load: no tensors");
    RETURN_IF_ERROR(CheckTensorDecls(tensors, options_.limits));
    return tensors;
  }

  // A checkpoint's tensors and their saved specs; `version` becomes the
  // resolved version (-1 = newest complete). Verifies every checksum.
  absl::StatusOr<std::vector<std::pair<rpc::TensorDecl, HybridSpec>>> CheckpointTensors(
      const std::string& path, int64_t& version, SavedOptimizer* saved_optimizer) {
    ASSIGN_OR_RETURN(checkpoint::CheckpointStore store,
                     checkpoint::CheckpointStore::Open(path, /*create=*/false));
    ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::CheckpointReader> reader,
                     checkpoint::OpenForRestore(store, version, /*verify=*/true));
    version = static_cast<int64_t>(reader->manifest().version());
    ASSIGN_OR_RETURN(*saved_optimizer, ReadSavedOptimizer(reader->manifest()));
    std::vector<std::pair<rpc::TensorDecl, HybridSpec>> out;
    for (const checkpoint::TensorInfo& t : reader->manifest().tensors()) {
      rpc::TensorDecl d;
      d.set_name(t.name());
      *d.mutable_shape() = t.shape();
      rpc::HybridSpec proto;
      if (!proto.ParseFromString(t.spec())) {
        return absl::DataLossError(
            absl::StrCat("checkpoint ", version, ": tensor ", t.name(), " has a bad spec"));
      }
      ASSIGN_OR_RETURN(HybridSpec spec, HybridSpecFromProto(proto));
      out.emplace_back(std::move(d), spec);
    }
    return out;
  }

  // `checkpoint_version` is resolved for a restore.
  absl::StatusOr<rpc::Manifest> BuildManifest(const rpc::LoadRequest& request,
                                              int64_t& checkpoint_version) {
    RETURN_IF_ERROR(CheckLoadRequest(request, options_.limits));
    std::vector<rpc::TensorDecl> decls;
    std::vector<HybridSpec> saved_specs;
    SavedOptimizer saved_optimizer;
    if (!request.checkpoint_path().empty()) {
      if (!request.safetensors_path().empty() || request.tensors_size() > 0 ||
          !request.recipe_text().empty()) {
        return absl::InvalidArgumentError(
            "Load: a checkpoint restore takes no safetensors path, tensors or recipe");
      }
      checkpoint_version = request.checkpoint_version();
      ASSIGN_OR_RETURN(auto saved, CheckpointTensors(request.checkpoint_path(), checkpoint_version,
                                                     &saved_optimizer));
      for (auto& [decl, spec] : saved) {
        decls.push_back(std::move(decl));
        saved_specs.push_back(spec);
      }
    } else {
      ASSIGN_OR_RETURN(decls, LoadTensors(request));
    }
    SpecResolver resolver = options_.resolver;
    OptimizerResolver optimizer_resolver = options_.optimizer_resolver;
    OptimizerOptions optimizer;
    {
      absl::MutexLock lock(&mu_);
      optimizer = optimizer_;
    }
    if (!saved_specs.empty()) {
      resolver = [&](const std::string& name,
                     absl::Span<const int64_t>) -> absl::StatusOr<HybridSpec> {
        for (size_t i = 0; i < decls.size(); ++i) {
          if (decls[i].name() == name) return saved_specs[i];
        }
        return absl::InternalError(name);
      };
    }
    if (!request.recipe_text().empty()) {
      if (!options_.recipe_parser) {
        return absl::UnimplementedError("this coordinator cannot parse recipes");
      }
      ASSIGN_OR_RETURN(ParsedRecipe parsed, options_.recipe_parser(request.recipe_text()));
      resolver = parsed.resolver;
      optimizer_resolver = parsed.optimizer_resolver;
      if (parsed.optimizer.has_value()) optimizer = *parsed.optimizer;
    }
    // A restore steps on with the checkpoint's optimizer config and
    // overrides, unless this coordinator was given a config: that one is
    // an override, logged here and recorded by the next checkpoint.
    if (!request.checkpoint_path().empty() && saved_optimizer.config.has_value()) {
      if (!options_.optimizer_explicit) {
        optimizer = *saved_optimizer.config;
        optimizer_resolver = [tensors = saved_optimizer.tensors](const std::string& name) {
          auto it = tensors.find(name);
          return it == tensors.end() ? TensorOptimizer() : it->second;
        };
      } else if (DescribeOptimizer(optimizer) != DescribeOptimizer(*saved_optimizer.config)) {
        Log(kTag, absl::StrCat("restore of checkpoint ", checkpoint_version,
                               ": optimizer config override: the checkpoint has ",
                               DescribeOptimizer(*saved_optimizer.config), "; stepping with ",
                               DescribeOptimizer(optimizer)));
      }
    }
    rpc::Manifest manifest;
    std::vector<sharding::ManifestTensor> entries;
    for (size_t i = 0; i < decls.size(); ++i) {
      const rpc::TensorDecl& d = decls[i];
      int64_t rows = 1;
      for (int j = 0; j + 1 < d.shape_size(); ++j) rows *= d.shape(j);
      const int64_t cols = d.shape_size() > 0 ? d.shape(d.shape_size() - 1) : 1;
      for (int64_t s : d.shape()) {
        if (s < 1) {
          return absl::InvalidArgumentError(
              absl::StrCat("tensor ", d.name(), " has an empty dimension"));
        }
      }
      HybridSpec spec;
      if (resolver) {
        ASSIGN_OR_RETURN(spec, resolver(d.name(), std::vector<int64_t>(d.shape().begin(),
                                                                         d.shape().end())));
      }
      rpc::TensorInfo* t = manifest.add_tensors();
      t->set_name(d.name());
      *t->mutable_shape() = d.shape();
      t->set_rows(rows);
      t->set_cols(cols);
      *t->mutable_spec() = HybridSpecToProto(spec);
      t->set_index(static_cast<int>(i));
      *t->mutable_optimizer() = TensorOptimizerToProto(
          optimizer_resolver ? optimizer_resolver(d.name()) : TensorOptimizer(), optimizer);
      ASSIGN_OR_RETURN(sharding::ManifestTensor e, sharding::ManifestEntry(d.name(), rows, cols, spec));
      entries.push_back(std::move(e));
    }
    ASSIGN_OR_RETURN(sharding::ShardPlan plan,
                     sharding::MakeShardPlan(entries, options_.expected_daemons, options_.plan));
    absl::MutexLock lock(&mu_);
    for (const sharding::Piece& p : plan.pieces) {
      rpc::ShardPiece* sp = manifest.add_pieces();
      sp->set_tensor(plan.tensors[p.tensor].name);
      sp->set_tensor_index(p.tensor);
      sp->set_row_begin(p.row_begin);
      sp->set_row_end(p.row_end);
      sp->set_daemon_rank(p.daemon);
      sp->set_daemon_address(table_.slot(p.daemon).member.address());
    }
    manifest.set_expected_pushers(options_.expected_pushers);
    manifest.set_optimizer(std::string(OptimizerName(optimizer.kind)));
    *manifest.mutable_optimizer_config() = OptimizerToProto(optimizer);
    RETURN_IF_ERROR(CheckMemoryBudget(manifest, options_.limits));
    manifest.set_plan_fingerprint(absl::HashOf(manifest.SerializeAsString()));
    // Every daemon's address: snapshots go to the buddy (server/snapshot.h).
    for (int r = 0; r < table_.size(); ++r) {
      rpc::DaemonInfo* info = manifest.add_daemons();
      info->set_rank(r);
      info->set_address(table_.slot(r).member.address());
    }
    if (DescribeOptimizer(optimizer) != DescribeOptimizer(optimizer_)) {
      Log(kTag, absl::StrCat("optimizer for this model: ", DescribeOptimizer(optimizer)));
    }
    optimizer_ = optimizer;
    return manifest;
  }

  using LoadDone = std::function<void(absl::Status, const rpc::LoadResponse&)>;

  // The Load's file paths resolved below the trusted roots (no "..",
  // no symlink out); the daemons get the resolved paths.
  absl::StatusOr<rpc::LoadRequest> ConfineLoadPaths(rpc::LoadRequest request) const {
    const std::vector<std::string>& roots = options_.limits.file_roots;
    if (!request.safetensors_path().empty()) {
      ASSIGN_OR_RETURN(*request.mutable_safetensors_path(),
                       ResolveBelow(roots, request.safetensors_path(), "--model_root"));
    }
    if (!request.checkpoint_path().empty()) {
      ASSIGN_OR_RETURN(*request.mutable_checkpoint_path(),
                       ResolveBelow(roots, request.checkpoint_path(), "--model_root"));
    }
    return request;
  }

  void StartLoad(const rpc::LoadRequest& original, LoadDone done) {
    absl::StatusOr<rpc::LoadRequest> confined = ConfineLoadPaths(original);
    if (!confined.ok()) {
      done(confined.status(), rpc::LoadResponse());
      return;
    }
    const rpc::LoadRequest& request = *confined;
    {
      absl::MutexLock lock(&mu_);
      absl::Status s;
      if (!table_.all_joined()) {
        s = absl::UnavailableError(absl::StrCat("waiting for daemons: ", table_.joined(), " of ",
                                                options_.expected_daemons, " joined"));
      } else if (absl::Status ready = table_.CheckAllReady("a load", absl::Now()); !ready.ok()) {
        s = ready;
      } else if (loading_) {
        s = absl::FailedPreconditionError("a load is already in progress");
      }
      if (!s.ok()) {
        done(s, rpc::LoadResponse());
        return;
      }
      loading_ = true;
    }
    int64_t checkpoint_version = -1;
    absl::StatusOr<rpc::Manifest> manifest = BuildManifest(request, checkpoint_version);
    if (manifest.ok() && !request.force()) {
      // After BuildManifest, so that a bad request gets its own error; the
      // running model is untouched either way.
      absl::MutexLock lock(&mu_);
      if (committed_ >= 0) {
        manifest = absl::FailedPreconditionError(absl::StrCat(
            "the cluster already holds a model (", manifest_.tensors_size(),
            " tensors, committed version ", committed_,
            "); loading another discards it and its training state: set force "
            "(hpctl load --force) to replace it"));
      }
    }
    if (!manifest.ok()) {
      absl::MutexLock lock(&mu_);
      loading_ = false;
      done(manifest.status(), rpc::LoadResponse());
      return;
    }
    std::vector<std::shared_ptr<rpc::Daemon::Stub>> stubs;
    {
      absl::MutexLock lock(&mu_);
      manifest_ = *manifest;
      committed_ = -1;
      for (int r = 0; r < table_.size(); ++r) table_.slot(r).published = -1;
      stubs = StubsLocked();
    }
    LogInfo(kTag, absl::StrCat("loading ", manifest->tensors_size(), " tensors in ",
                               manifest->pieces_size(), " pieces on ", stubs.size(), " daemons",
                               request.checkpoint_path().empty()
                                   ? absl::StrCat(" from ", request.safetensors_path().empty()
                                                                ? "pushed weights"
                                                                : request.safetensors_path())
                                   : absl::StrCat(" from checkpoint ", checkpoint_version, " of ",
                                                  request.checkpoint_path())));
    const absl::Time load_start = absl::Now();
    FanOut<rpc::LoadShardsRequest, rpc::LoadShardsResponse>(
        stubs, options_.load_timeout,
        [this, &manifest, &request, checkpoint_version](int rank, rpc::LoadShardsRequest* r) {
          *r->mutable_manifest() = *manifest;
          r->set_daemon_rank(rank);
          r->set_safetensors_path(request.safetensors_path());
          r->set_expected_pushers(options_.expected_pushers);
          r->set_checkpoint_path(request.checkpoint_path());
          r->set_checkpoint_version(checkpoint_version);
        },
        [](rpc::Daemon::Stub* stub, grpc::ClientContext* c, const rpc::LoadShardsRequest* req,
           rpc::LoadShardsResponse* resp, std::function<void(grpc::Status)> cb) {
          stub->async()->LoadShards(c, req, resp, std::move(cb));
        },
        [this, load_start, done = std::move(done)](auto& calls) {
          absl::Status s = FirstError(calls, "LoadShards");
          const std::string took = absl::FormatDuration(
              absl::Trunc(absl::Now() - load_start, absl::Milliseconds(1)));
          if (s.ok()) {
            LogInfo(kTag, absl::StrCat("load done in ", took, " on ", calls.size(), " daemons"));
          } else {
            LogError(kTag, absl::StrCat("load failed after ", took, ": ", s.ToString()));
          }
          rpc::LoadResponse response;
          bool advanced = false;
          {
            absl::MutexLock lock(&mu_);
            loading_ = false;
            StateChangedLocked();
            if (s.ok()) {
              for (size_t i = 0; i < calls.size(); ++i) {
                DaemonSlot& d = table_.slot(static_cast<int>(i));
                d.published = std::max(d.published, calls[i]->response.published_version());
              }
              advanced = RecomputeCommittedLocked();
            }
            *response.mutable_manifest() = ManifestLocked(/*with_pieces=*/true);
            response.set_committed_version(committed_);
          }
          if (advanced) version_waiters_.WakeAll();
          done(s, response);
        });
  }

  const CoordinatorOptions options_;
  const bool cluster_secret_configured_;
  const std::string cluster_secret_;
  WaitList world_waiters_;
  WaitList version_waiters_;

  mutable absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  std::thread lease_thread_;
  // Recovery (server/recovery.h): one at a time, on its own thread.
  std::thread recovery_thread_ ABSL_GUARDED_BY(mu_);
  bool recovering_ ABSL_GUARDED_BY(mu_) = false;
  int64_t recovery_epoch_ ABSL_GUARDED_BY(mu_) = 0;  // recoveries completed
  rpc::RecoveryStatus recovery_ ABSL_GUARDED_BY(mu_);  // the last one
  absl::Time lost_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();  // first lease expiry
  absl::Time last_recovery_attempt_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  DaemonTable table_ ABSL_GUARDED_BY(mu_);  // daemon ranks, leases
  // By rank; replaced when a daemon (re)joins. Shared with calls in flight.
  std::vector<std::shared_ptr<rpc::Daemon::Stub>> stubs_ ABSL_GUARDED_BY(mu_);
  // By rank: the member secret the rank's daemon gave at Join (what the
  // coordinator's calls to it present).
  std::vector<std::string> member_secrets_ ABSL_GUARDED_BY(mu_);
  int64_t daemons_lost_ ABSL_GUARDED_BY(mu_) = 0;  // leases that expired
  std::vector<rpc::Member> others_ ABSL_GUARDED_BY(mu_);   // trainers, observers
  int next_member_ ABSL_GUARDED_BY(mu_) = 0;
  int next_trainer_rank_ ABSL_GUARDED_BY(mu_) = 0;
  rpc::Manifest manifest_ ABSL_GUARDED_BY(mu_);
  // The config of the next load and of joins; the loaded model's is
  // manifest_.optimizer_config (the same once a model is loaded).
  OptimizerOptions optimizer_ ABSL_GUARDED_BY(mu_);
  bool loading_ ABSL_GUARDED_BY(mu_) = false;
  int64_t committed_ ABSL_GUARDED_BY(mu_) = -1;
  // The startup load (model_path / restore_from) failed: fatal.
  mutable absl::Mutex startup_mu_;
  absl::Status startup_error_ ABSL_GUARDED_BY(startup_mu_);
  std::thread rebuild_thread_;  // a restarted coordinator's RebuildFromDaemons
  // Last: destroyed first (its thread reads the state above).
  std::unique_ptr<StateWriter> state_writer_;
};

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

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(CoordinatorOptions options) {
  if (options.expected_daemons < 1) {
    return absl::InvalidArgumentError("coordinator: expected_daemons must be >= 1");
  }
  if (options.expected_pushers < 0) {
    return absl::InvalidArgumentError("coordinator: expected_pushers must be >= 0");
  }
  // "nccl": the daemons' device all-reduce (they must be built with
  // --config=cuda; the coordinator only relays addresses).
  if (options.data_plane != "host" && options.data_plane != "local" &&
      options.data_plane != "nccl") {
    return absl::InvalidArgumentError(absl::StrCat("coordinator: unknown data plane \"",
                                                   options.data_plane, "\" (host, local or nccl)"));
  }
  if (options.data_plane == "local" && options.expected_daemons != 1) {
    return absl::InvalidArgumentError(
        "coordinator: the local data plane serves one process; use host for several daemons");
  }
  std::optional<rpc::CoordinatorState> restored;
  if (!options.state_file.empty()) {
    ASSIGN_OR_RETURN(restored, ReadStateFile(options.state_file));
    if (restored && restored->expected_daemons() != options.expected_daemons) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--state_file=", options.state_file, " is of a cluster of ",
          restored->expected_daemons(), " daemons, this coordinator expects ",
          options.expected_daemons, " (--daemons)"));
    }
  }
  return std::unique_ptr<Coordinator>(
      new Coordinator(std::make_unique<Impl>(std::move(options), std::move(restored))));
}

Coordinator::Coordinator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Coordinator::~Coordinator() { Shutdown(); }
grpc::Service* Coordinator::service() { return impl_.get(); }
void Coordinator::Shutdown() { impl_->Shutdown(); }
int64_t Coordinator::committed_version() const { return impl_->committed_version(); }
rpc::Manifest Coordinator::manifest() const { return impl_->manifest(); }
int Coordinator::joined_daemons() const { return impl_->joined_daemons(); }
int Coordinator::expected_daemons() const { return impl_->options().expected_daemons; }
absl::Status Coordinator::startup_error() const { return impl_->startup_error(); }
std::vector<rpc::Member> Coordinator::daemon_members() const { return impl_->daemon_members(); }
int64_t Coordinator::daemons_lost() const { return impl_->daemons_lost(); }
const std::string& Coordinator::cluster_secret() const { return impl_->cluster_secret(); }

}  // namespace paramd
