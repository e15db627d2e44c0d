#include "server/coordinator/recovery.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "server/coordinator/frozen_data.h"
#include "server/rpc/fan_out.h"

namespace paramd {
namespace {

// FanOut, waited for: the calls in rank order.
template <class Request, class Response>
DaemonCalls<Request, Response> CallAll(
    const std::vector<std::shared_ptr<rpc::Daemon::Stub>>& stubs, absl::Duration timeout,
    std::function<void(int rank, Request*)> make_request,
    std::function<void(rpc::Daemon::Stub*, grpc::ClientContext*, const Request*, Response*,
                       std::function<void(grpc::Status)>)>
        call) {
  absl::Notification done;
  DaemonCalls<Request, Response> result;
  FanOut<Request, Response>(stubs, timeout, std::move(make_request), std::move(call),
                            [&](DaemonCalls<Request, Response>& calls) {
                              result = std::move(calls);
                              done.Notify();
                            });
  done.WaitForNotification();
  return result;
}

// The Recover calls, one per daemon, ended at the first failure: the calls
// still running are cancelled and that failure is returned (naming its
// rank) at once. A daemon whose republish waits for a peer that has already
// failed would otherwise hold the whole attempt until its step timeout,
// with nothing logged and no retry; the next attempt's PrepareRecovery
// frees it.
absl::StatusOr<std::vector<rpc::RecoverResponse>> RecoverAll(
    const std::vector<std::shared_ptr<rpc::Daemon::Stub>>& stubs, absl::Duration timeout,
    const std::function<void(int rank, rpc::RecoverRequest*)>& make_request) {
  using Call = DaemonCall<rpc::RecoverRequest, rpc::RecoverResponse>;
  struct State {
    absl::Mutex mu;
    size_t remaining ABSL_GUARDED_BY(mu) = 0;
    int failed ABSL_GUARDED_BY(mu) = -1;  // the rank that failed first
    std::vector<std::unique_ptr<Call>> calls;
  };
  auto state = std::make_shared<State>();
  for (size_t i = 0; i < stubs.size(); ++i) {
    auto c = std::make_unique<Call>();
    c->context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    make_request(static_cast<int>(i), &c->request);
    c->stub = stubs[i];
    state->calls.push_back(std::move(c));
  }
  {
    absl::MutexLock lock(&state->mu);
    state->remaining = stubs.size();
  }
  for (size_t i = 0; i < stubs.size(); ++i) {
    Call* c = state->calls[i].get();
    c->stub->async()->Recover(&c->context, &c->request, &c->response,
                              [state, c, i](grpc::Status s) {
                                bool first_failure = false;
                                {
                                  absl::MutexLock lock(&state->mu);
                                  c->status = std::move(s);
                                  --state->remaining;
                                  if (!c->status.ok() && state->failed < 0) {
                                    state->failed = static_cast<int>(i);
                                    first_failure = true;
                                  }
                                }
                                // Outside the lock: a cancelled call's
                                // callback may run on this thread.
                                if (first_failure) {
                                  for (auto& other : state->calls) other->context.TryCancel();
                                }
                              });
  }
  absl::MutexLock lock(&state->mu);
  auto ended = [&state]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state->mu) {
    return state->remaining == 0 || state->failed >= 0;
  };
  state->mu.Await(absl::Condition(&ended));
  if (state->failed >= 0) {
    return FromGrpcStatus(state->calls[state->failed]->status,
                          absl::StrCat("Recover on daemon rank ", state->failed));
  }
  std::vector<rpc::RecoverResponse> responses;
  for (auto& c : state->calls) responses.push_back(c->response);
  return responses;
}

// The daemon parts of the slowest daemon into `phases` (its parts add up;
// maxima of each part would not: a daemon's republish waits for the
// slowest peer).
void TakeSlowestDaemonPhases(const std::vector<rpc::RecoverResponse>& responses,
                             rpc::RecoveryPhases& phases) {
  double slowest = -1;
  for (const rpc::RecoverResponse& response : responses) {
    const rpc::RecoveryPhases& p = response.phases();
    const double sum =
        p.connect() + p.snapshot_fetch() + p.backend_create() + p.restore() + p.republish();
    if (sum <= slowest) continue;
    slowest = sum;
    const double prepare = phases.prepare(), recover = phases.recover();
    phases = p;
    phases.set_prepare(prepare);
    phases.set_recover(recover);
  }
}

// The payload of NothingToRecoverFrom.
constexpr char kNothingToRecoverFromUrl[] = "type.paramd/recovery.nothing_to_recover_from";

}  // namespace

absl::Status NothingToRecoverFrom(absl::Status status) {
  status.SetPayload(kNothingToRecoverFromUrl, absl::Cord("1"));
  return status;
}

bool IsNothingToRecoverFrom(const absl::Status& status) {
  return !status.ok() && status.GetPayload(kNothingToRecoverFromUrl).has_value();
}

int64_t NewestCompleteSnapshot(const std::vector<std::vector<rpc::SnapshotHeld>>& held, int n,
                               int64_t generation, std::vector<int>* holders) {
  // version -> holder of each rank (-1: nobody yet)
  std::map<int64_t, std::vector<int>> by_version;
  for (int d = 0; d < static_cast<int>(held.size()); ++d) {
    for (const rpc::SnapshotHeld& h : held[d]) {
      if (h.rank() < 0 || h.rank() >= n || h.version() < 0) continue;
      if (h.model_generation() != generation) continue;  // another model's
      std::vector<int>& who = by_version[h.version()];
      if (who.empty()) who.assign(n, -1);
      if (who[h.rank()] < 0 || d == h.rank()) who[h.rank()] = d;
    }
  }
  for (auto it = by_version.rbegin(); it != by_version.rend(); ++it) {
    if (std::all_of(it->second.begin(), it->second.end(), [](int d) { return d >= 0; })) {
      *holders = it->second;
      return it->first;
    }
  }
  holders->clear();
  return -1;
}

rpc::Manifest RelocatedManifest(rpc::Manifest manifest, const std::vector<std::string>& addresses) {
  for (rpc::ShardPiece& p : *manifest.mutable_pieces()) {
    if (p.daemon_rank() >= 0 && p.daemon_rank() < static_cast<int>(addresses.size())) {
      p.set_daemon_address(addresses[p.daemon_rank()]);
    }
  }
  manifest.clear_daemons();
  manifest.clear_plan_fingerprint();
  manifest.clear_committed_version();
  // As the coordinator's BuildManifest: unchanged when nothing moved.
  manifest.set_plan_fingerprint(absl::HashOf(manifest.SerializeAsString()));
  for (int r = 0; r < static_cast<int>(addresses.size()); ++r) {
    rpc::DaemonInfo* d = manifest.add_daemons();
    d->set_rank(r);
    d->set_address(addresses[r]);
  }
  return manifest;
}

absl::StatusOr<RecoveryResult> RunRecovery(const RecoveryPlan& plan) {
  RecoveryResult result;
  const int n = static_cast<int>(plan.stubs.size());
  absl::Time phase_start = absl::Now();
  auto prepared = CallAll<rpc::PrepareRecoveryRequest, rpc::PrepareRecoveryResponse>(
      plan.stubs, plan.prepare_timeout,
      [&](int, rpc::PrepareRecoveryRequest* r) { r->set_epoch(plan.epoch); },
      [](rpc::Daemon::Stub* stub, grpc::ClientContext* c, const rpc::PrepareRecoveryRequest* req,
         rpc::PrepareRecoveryResponse* resp, std::function<void(grpc::Status)> cb) {
        stub->async()->PrepareRecovery(c, req, resp, std::move(cb));
      });
  RETURN_IF_ERROR(FirstError(prepared, "PrepareRecovery"));
  result.phases.set_prepare(absl::ToDoubleSeconds(absl::Now() - phase_start));
  phase_start = absl::Now();
  rpc::DataPlane world;
  world.set_transport(plan.transport);
  world.set_num_daemons(n);
  world.set_world_size(n);
  std::vector<std::vector<rpc::SnapshotHeld>> held(n);
  for (int r = 0; r < n; ++r) {
    result.data_plane_addresses.push_back(prepared[r]->response.data_plane_address());
    (*world.mutable_address_book())[r] = prepared[r]->response.data_plane_address();
    held[r].assign(prepared[r]->response.snapshots().begin(),
                   prepared[r]->response.snapshots().end());
  }
  // The source: the newest of snapshot and checkpoint (a snapshot on a tie:
  // it needs no file system).
  std::vector<int> holders;
  const int64_t snapshot =
      plan.have_model
          ? NewestCompleteSnapshot(held, n, plan.snapshot_manifest.model_generation(), &holders)
          : -1;
  int64_t checkpoint_version = -1;
  if (!plan.have_model) {
    result.source = "none (no model loaded)";
  } else if (snapshot >= 0 && snapshot >= plan.disk_version) {
    result.manifest = plan.snapshot_manifest;
    result.source = absl::StrCat("snapshot v", snapshot);
  } else if (plan.disk_version >= 0 && plan.disk_manifest) {
    ASSIGN_OR_RETURN(result.manifest, plan.disk_manifest(&checkpoint_version));
    result.source = absl::StrCat("checkpoint ", plan.checkpoint_path, " v", checkpoint_version);
  } else {
    return NothingToRecoverFrom(absl::FailedPreconditionError(
        absl::StrCat("nothing to recover from: no in-memory snapshot of the served model that "
                     "every rank still has (--snapshot_every_steps) and no complete checkpoint "
                     "of it (--checkpoint_dir)",
                     plan.disk_refused.empty() ? "" : absl::StrCat("; ", plan.disk_refused))));
  }
  absl::StatusOr<std::vector<rpc::RecoverResponse>> recovered =
      RecoverAll(plan.stubs, plan.recover_timeout, [&](int rank, rpc::RecoverRequest* r) {
        r->set_epoch(plan.epoch);
        *r->mutable_data_plane() = world;
        rpc::LoadShardsRequest* load = r->mutable_load();
        *load->mutable_manifest() = ManifestForDaemons(result.manifest);
        load->set_daemon_rank(rank);
        load->set_expected_pushers(plan.expected_pushers);
        if (checkpoint_version >= 0) {
          load->set_checkpoint_path(plan.checkpoint_path);
          load->set_checkpoint_version(checkpoint_version);
        } else if (snapshot >= 0 && plan.have_model) {
          r->set_snapshot_version(snapshot);
          if (holders[rank] != rank) r->set_snapshot_source(plan.addresses[holders[rank]]);
        }
      });
  RETURN_IF_ERROR(recovered.status());
  result.phases.set_recover(absl::ToDoubleSeconds(absl::Now() - phase_start));
  TakeSlowestDaemonPhases(*recovered, result.phases);
  for (int r = 0; r < n; ++r) {
    const int64_t v = (*recovered)[r].published_version();
    if (r > 0 && v != result.published_version) {
      return absl::InternalError(absl::StrCat("Recover: daemon rank ", r, " published version ", v,
                                              ", rank 0 ", result.published_version));
    }
    result.published_version = v;
  }
  return result;
}

}  // namespace paramd
