// File: server/coordinator/coordinator.cc
//
// The coordinator (server/coordinator/coordinator.h): shutdown, the accessors the public
// Coordinator facade reads, GetStatus, and Create. The RPC handlers live
// beside it: coordinator_membership.cc, coordinator_load.cc,
// coordinator_step.cc, coordinator_recovery.cc (the shared class declaration
// is server/coordinator/coordinator_internal.h).

#include "server/coordinator/coordinator_internal.h"

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

void Coordinator::Impl::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (lease_thread_.joinable()) lease_thread_.join();
  std::thread recovery;
  std::thread rebuild_for_load;
  {
    absl::MutexLock lock(&mu_);
    recovery = std::move(recovery_thread_);
    rebuild_for_load = std::move(rebuild_thread_for_load_);
  }
  if (recovery.joinable()) recovery.join();
  if (rebuild_for_load.joinable()) rebuild_for_load.join();
  if (rebuild_thread_.joinable()) rebuild_thread_.join();
  if (state_writer_) (void)state_writer_->Flush();
  world_waiters_.WakeAll();
  version_waiters_.WakeAll();
}

void Coordinator::Impl::RecoveryEpoch(int64_t* epoch, int64_t* rewound_to) const {
  absl::MutexLock lock(&mu_);
  *epoch = recovery_epoch_;  // grows when a recovery completes
  *rewound_to = recovery_.rewound_to_version();
}

std::vector<rpc::Member> Coordinator::Impl::daemon_members() const {
  absl::MutexLock lock(&mu_);
  return table_.Members(absl::Now());
}

int64_t Coordinator::Impl::daemons_lost() const {
  absl::MutexLock lock(&mu_);
  return daemons_lost_;
}

rpc::RecoveryStatus Coordinator::Impl::recovery() const {
  absl::MutexLock lock(&mu_);
  rpc::RecoveryStatus r = recovery_;
  r.set_epoch(recovery_epoch_);
  r.set_in_progress(recovering_);
  return r;
}

int64_t Coordinator::Impl::committed_version() const {
  absl::MutexLock lock(&mu_);
  return committed_;
}

rpc::Manifest Coordinator::Impl::manifest() const {
  absl::MutexLock lock(&mu_);
  return ManifestLocked(/*with_pieces=*/true, /*with_frozen_data=*/true);
}

int Coordinator::Impl::joined_daemons() const {
  absl::MutexLock lock(&mu_);
  return table_.joined();
}

absl::Status Coordinator::Impl::startup_error() const {
  absl::MutexLock lock(&startup_mu_);
  return startup_error_;
}

bool Coordinator::Impl::shut_down() const {
  absl::MutexLock lock(&mu_);
  return shut_down_;
}

grpc::Status Coordinator::Impl::Unavailable(absl::string_view message) {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, std::string(message));
}

grpc::ServerUnaryReactor* Coordinator::Impl::Done(grpc::CallbackServerContext* context,
                                                  const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

std::vector<std::shared_ptr<rpc::Daemon::Stub>> Coordinator::Impl::StubsLocked() { return stubs_; }

grpc::ServerUnaryReactor* Coordinator::Impl::GetStatus(grpc::CallbackServerContext* context,
                                                       const rpc::GetStatusRequest* request,
                                                       rpc::GetStatusResponse* response) {
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
          "--state_file=", options.state_file, " is of a cluster of ", restored->expected_daemons(),
          " daemons, this coordinator expects ", options.expected_daemons, " (--daemons)"));
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
rpc::RecoveryStatus Coordinator::recovery() const { return impl_->recovery(); }
const std::string& Coordinator::cluster_secret() const { return impl_->cluster_secret(); }

}  // namespace paramd
