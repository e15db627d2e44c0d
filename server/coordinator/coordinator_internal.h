// File: server/coordinator/coordinator_internal.h
//
// Private to the coordinator's implementation
// (server/coordinator/coordinator*.cc); nothing outside
// //server/coordinator:coordinator includes it. The declaration of
// Coordinator::Impl, the object behind the public Coordinator of
// server/coordinator/coordinator.h, shared by the files its methods are
// defined in:
//   coordinator.cc             Shutdown, accessors, GetStatus, Create
//   coordinator_membership.cc  Join, Leave, Heartbeat, the lease thread
//   coordinator_load.cc        Load, GetManifest, the manifest and StartLoad
//   coordinator_step.cc        Step, ReportVersion, WaitForVersion,
//                              WatchVersion, SetOptimizerSchedule
//   coordinator_recovery.cc    recovery, the state file, a restart's rebuild
//
// Ownership and threading are those of server/coordinator/coordinator.h: one Impl per
// Coordinator, which owns it; mu_ guards the cluster state. gRPC callbacks
// never block (waits are reactors on world_waiters_ / version_waiters_);
// the lease, recovery and rebuild threads are the Impl's own.
#ifndef PARAMD_SERVER_COORDINATOR_COORDINATOR_INTERNAL_H_
#define PARAMD_SERVER_COORDINATOR_COORDINATOR_INTERNAL_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "auth/security.h"
#include "proto/paramd.grpc.pb.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/coordinator_state.h"
#include "server/coordinator/membership.h"
#include "server/rpc/async_util.h"

namespace paramd {
namespace coordinator_internal {

// The coordinator's log tag.
inline constexpr char kTag[] = "coordinator";

}  // namespace coordinator_internal

struct RecoveryPlan;    // server/coordinator/recovery.h
struct RecoveryResult;  // server/coordinator/recovery.h

// The optimizer a checkpoint was written with (checkpoint/service.cc
// metadata "optimizer_config" and "optimizer_tensors", protobuf text);
// no config for checkpoints written before these existed.
struct SavedOptimizer {
  std::optional<OptimizerOptions> config;
  std::map<std::string, TensorOptimizer> tensors;
};

class Coordinator::Impl : public rpc::Coordinator::CallbackService {
 public:
  // `restored`: the state file of an earlier run (server/coordinator/coordinator_state.h).
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
      state_writer_ =
          std::make_unique<StateWriter>(options_.state_file, [this] { return CurrentState(); });
      state_writer_->MarkDirty();
    }
    lease_thread_ = std::thread([this] { LeaseLoop(); });
    if (restored) rebuild_thread_ = std::thread([this] { RebuildFromDaemons(); });
  }

  const std::string& cluster_secret() const { return cluster_secret_; }

  void Shutdown();

  // The recovery epoch and, for a rewind, the version of the last recovery
  // (WatchVersion).
  void RecoveryEpoch(int64_t* epoch, int64_t* rewound_to) const;

  std::vector<rpc::Member> daemon_members() const;

  int64_t daemons_lost() const;

  rpc::RecoveryStatus recovery() const;

  int64_t committed_version() const;

  rpc::Manifest manifest() const;

  int joined_daemons() const;

  absl::Status startup_error() const;

  bool shut_down() const;

  WaitList* version_waiters() { return &version_waiters_; }
  const CoordinatorOptions& options() const { return options_; }

  // ---- RPCs ----

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* context,
                                 const rpc::JoinRequest* request,
                                 rpc::JoinResponse* response) override;

  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* context,
                                  const rpc::LeaveRequest* request,
                                  rpc::LeaveResponse* /*response*/) override;

  grpc::ServerUnaryReactor* GetManifest(grpc::CallbackServerContext* context,
                                        const rpc::GetManifestRequest* /*request*/,
                                        rpc::GetManifestResponse* response) override;

  grpc::ServerUnaryReactor* WaitForVersion(grpc::CallbackServerContext* context,
                                           const rpc::WaitForVersionRequest* request,
                                           rpc::WaitForVersionResponse* response) override;

  grpc::ServerWriteReactor<rpc::VersionEvent>* WatchVersion(
      grpc::CallbackServerContext* context, const rpc::WatchVersionRequest* request) override;

  grpc::ServerUnaryReactor* Load(grpc::CallbackServerContext* context,
                                 const rpc::LoadRequest* request,
                                 rpc::LoadResponse* response) override;

  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* context,
                                 const rpc::StepRequest* request,
                                 rpc::StepResponse* response) override;

  // A report moves the committed version only for a version that daemon
  // really published: a new one is confirmed by asking the daemon itself
  // (GetStats on the address it joined with) before it counts, so a forged
  // report (member ids are listed by GetStatus) cannot commit a version no
  // daemon holds. Reports of versions already known change nothing.
  grpc::ServerUnaryReactor* ReportVersion(grpc::CallbackServerContext* context,
                                          const rpc::ReportVersionRequest* request,
                                          rpc::ReportVersionResponse* response) override;

  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const rpc::HeartbeatRequest* request,
                                      rpc::HeartbeatResponse* response) override;

  grpc::ServerUnaryReactor* SetOptimizerSchedule(
      grpc::CallbackServerContext* context, const rpc::SetOptimizerScheduleRequest* request,
      rpc::SetOptimizerScheduleResponse* response) override;

  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* context,
                                      const rpc::GetStatusRequest* request,
                                      rpc::GetStatusResponse* response) override;

 private:
  static grpc::Status Unavailable(absl::string_view message);

  static grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* context,
                                        const absl::Status& status);

  std::vector<std::shared_ptr<rpc::Daemon::Stub>> StubsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Starts a recovery if a replacement waits for its state and every rank
  // is held by a live daemon (else the next join or lease tick does).
  void MaybeStartRecoveryLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Recovery thread: the newest complete checkpoint onto every daemon
  // (docs/ARCHITECTURE.md "Recovery"), then the rewind is committed.
  void Recover(int64_t epoch);
  // The newest complete checkpoint of the served model (plan.snapshot_manifest)
  // as the plan's disk source, and why others were refused.
  void AddCheckpointSource(RecoveryPlan& plan);
  // A failed recovery attempt: RecoveryStatus error/state/needs_load, and
  // one ERROR line per distinct error (with the way out when there is
  // nothing to recover from); repeats go to debug.
  void RecoveryFailedLocked(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A recovery's new world (RunRecovery succeeded): every rank's data-plane
  // address, no rank waits for state any more, the epoch is `epoch`.
  void AdoptRecoveredWorldLocked(const RecoveryResult& result, int64_t epoch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- The state file (server/coordinator/coordinator_state.h) ----

  void StateChangedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  rpc::CoordinatorState CurrentState() const;

  // Constructor: takes back an earlier run's cluster. Every daemon of the
  // file is taken as alive (its heartbeats renew the lease; one that died
  // meanwhile goes DOWN after it); what each publishes is asked by
  // RebuildFromDaemons.
  void Restore(const rpc::CoordinatorState& state);

  // Thread of a restarted coordinator: asks every live daemon of the state
  // file which version it publishes (GetStats, every 200 ms until each has
  // answered once or is DOWN), so the committed version is the daemons'
  // (never below the file's) and steps can go on.
  // A file with every daemon and no model (the earlier run died before its
  // startup load finished) runs that load once they answered.
  void RebuildFromDaemons();
  // --model / --restore_from, once per process: when the world completes
  // (Join), or from RebuildFromDaemons.
  void StartStartupLoad();

  int table_size_at_start() const { return options_.expected_daemons; }

  // Marks daemons whose lease expired DOWN (every lease/10, at most 100 ms
  // apart, so a dead daemon is seen within lease + 100 ms) and wakes the
  // waits that need them.
  void LeaseLoop();

  // The Join policies of auth/method_policy.cc. `may_take_rank`: whether a
  // daemon join may take over a rank that already has a daemon (a rejoin):
  // only with a cluster credential, since the reply carries the cluster
  // secret and the coordinator's calls then go to the joiner's secret.
  grpc::Status AuthorizeJoin(const grpc::CallbackServerContext& context,
                             const rpc::JoinRequest& request, bool* may_take_rank) const;

  // The daemon joins allowed without credentials (see AddMember): a rank
  // no daemon has joined yet (the world's formation), and what
  // DaemonTable::Join takes for a retry of a registered process only with
  // the member secret it gave. A rank another process has held (DOWN or
  // alive) is UNAUTHENTICATED, naming how to start a replacement.
  absl::Status CheckOpenDaemonJoinLocked(const rpc::JoinRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::StatusOr<rpc::Member> AddMember(const rpc::JoinRequest& request, bool may_take_rank);

  void FillJoinResponseLocked(const rpc::Member& m, rpc::JoinResponse* response)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // `with_frozen_data` false leaves the frozen buffers' bytes out.
  rpc::Manifest ManifestLocked(bool with_pieces, bool with_frozen_data = false) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // True if the committed version advanced.
  bool RecomputeCommittedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The tensors of a load request, with their 2-D views, and its frozen
  // buffers (the request's, or a safetensors file's non-floating tensors,
  // read here) into `frozen`.
  absl::StatusOr<std::vector<rpc::TensorDecl>> LoadTensors(
      const rpc::LoadRequest& request, google::protobuf::RepeatedPtrField<FrozenTensor>* frozen);

  // A checkpoint's tensors and their saved specs, and its frozen buffers
  // into `frozen`; `version` becomes the resolved version (-1 = newest
  // complete). Verifies every checksum.
  absl::StatusOr<std::vector<std::pair<rpc::TensorDecl, HybridSpec>>> CheckpointTensors(
      const std::string& path, int64_t& version, SavedOptimizer* saved_optimizer,
      google::protobuf::RepeatedPtrField<FrozenTensor>* frozen);

  // `checkpoint_version` is resolved for a restore.
  // Changes nothing of the coordinator: the manifest carries the optimizer
  // config the model will step with.
  absl::StatusOr<rpc::Manifest> BuildManifest(const rpc::LoadRequest& request,
                                              int64_t& checkpoint_version);
  // Makes the manifest's optimizer config the coordinator's, once a load
  // or recovery that built it was accepted.
  void AdoptManifestOptimizerLocked(const rpc::Manifest& manifest)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  using LoadDone = std::function<void(absl::Status, const rpc::LoadResponse&)>;

  // The Load's file paths resolved below the trusted roots (no "..",
  // no symlink out); the daemons get the resolved paths.
  absl::StatusOr<rpc::LoadRequest> ConfineLoadPaths(rpc::LoadRequest request) const;

  // Refused (`done` called at once) unless every daemon is joined and
  // ready; once the recovery found nothing to recover from
  // (RecoveryStatus.needs_load), replacements waiting for their state are
  // taken too, and the data plane is rebuilt (RebuildThenLoad) before the
  // daemons load.
  void StartLoad(const rpc::LoadRequest& original, LoadDone done);
  // Thread of a load after a failed recovery: waits for a recovery attempt
  // in flight, rebuilds the daemons' data-plane world (a recovery without
  // a model: every DOWN-replacing rank is live again), then FanOutLoad.
  void RebuildThenLoad(const rpc::Manifest& manifest, const rpc::LoadRequest& request,
                       int64_t checkpoint_version, LoadDone done);
  // A validated load (`manifest` built from `request`): becomes the
  // coordinator's model, every daemon loads its shards, `done` answers.
  void FanOutLoad(const rpc::Manifest& manifest, const rpc::LoadRequest& request,
                  int64_t checkpoint_version, LoadDone done);

  // A Load that came before every expected daemon had joined: its request,
  // its answer and how long it may wait (coordinator_load.cc).
  struct LoadJoinWait;
  // Registers `wait` on world_waiters_ (before looking, so that a join in
  // between still wakes it), then: every daemon joined and ready
  // (DaemonTable::CheckAllReady): StartLoad; shut down, or `give_up`
  // reached (`at_give_up`: called by its alarm): UNAVAILABLE naming the
  // missing ranks (or the daemon not ready); else keeps waiting. Settles
  // `wait` once; `woken`: called by world_waiters_ (the registration was
  // taken). Takes wait->mu, then mu_.
  void TryLoadJoinWait(const std::shared_ptr<LoadJoinWait>& wait, bool woken, bool at_give_up);

  const CoordinatorOptions options_;
  const bool cluster_secret_configured_;
  const std::string cluster_secret_;
  WaitList world_waiters_;
  WaitList version_waiters_;

  mutable absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  std::thread lease_thread_;
  // Recovery (server/coordinator/recovery.h): one at a time, on its own thread.
  std::thread recovery_thread_ ABSL_GUARDED_BY(mu_);
  bool recovering_ ABSL_GUARDED_BY(mu_) = false;
  int64_t recovery_epoch_ ABSL_GUARDED_BY(mu_) = 0;                 // recoveries completed
  rpc::RecoveryStatus recovery_ ABSL_GUARDED_BY(mu_);               // the last one
  absl::Time lost_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();  // first lease expiry
  absl::Time last_recovery_attempt_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // The last recovery error logged at ERROR: a retry failing the same way
  // logs at debug only.
  std::string recovery_error_logged_ ABSL_GUARDED_BY(mu_);
  std::thread rebuild_thread_for_load_ ABSL_GUARDED_BY(mu_);  // RebuildThenLoad
  DaemonTable table_ ABSL_GUARDED_BY(mu_);                    // daemon ranks, leases
  // By rank; replaced when a daemon (re)joins. Shared with calls in flight.
  std::vector<std::shared_ptr<rpc::Daemon::Stub>> stubs_ ABSL_GUARDED_BY(mu_);
  // By rank: the member secret the rank's daemon gave at Join (what the
  // coordinator's calls to it present).
  std::vector<std::string> member_secrets_ ABSL_GUARDED_BY(mu_);
  int64_t daemons_lost_ ABSL_GUARDED_BY(mu_) = 0;         // leases that expired
  std::vector<rpc::Member> others_ ABSL_GUARDED_BY(mu_);  // trainers, observers
  int next_member_ ABSL_GUARDED_BY(mu_) = 0;
  int next_trainer_rank_ ABSL_GUARDED_BY(mu_) = 0;
  rpc::Manifest manifest_ ABSL_GUARDED_BY(mu_);
  // Loads accepted in this cluster's life (server/coordinator/model_generation.h):
  // BuildManifest stamps the next one, StartLoad takes it once accepted.
  int64_t model_generation_ ABSL_GUARDED_BY(mu_) = 0;
  // The config of the next load and of joins; the loaded model's is
  // manifest_.optimizer_config (the same once a model is loaded).
  OptimizerOptions optimizer_ ABSL_GUARDED_BY(mu_);
  bool loading_ ABSL_GUARDED_BY(mu_) = false;
  int64_t committed_ ABSL_GUARDED_BY(mu_) = -1;
  // The startup load (model_path / restore_from) failed: fatal.
  mutable absl::Mutex startup_mu_;
  absl::Status startup_error_ ABSL_GUARDED_BY(startup_mu_);
  bool startup_load_started_ ABSL_GUARDED_BY(startup_mu_) = false;
  std::thread rebuild_thread_;  // a restarted coordinator's RebuildFromDaemons
  // Last: destroyed first (its thread reads the state above).
  std::unique_ptr<StateWriter> state_writer_;
};

}  // namespace paramd

#endif  // PARAMD_SERVER_COORDINATOR_COORDINATOR_INTERNAL_H_
