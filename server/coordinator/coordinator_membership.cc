// File: server/coordinator/coordinator_membership.cc
//
// The coordinator's membership (server/coordinator/coordinator.h, server/coordinator/membership.h):
// Join and its policies, Leave, Heartbeat and the lease thread.

#include "server/coordinator/coordinator_internal.h"

#include <algorithm>
#include <utility>
#include <vector>

#include <openssl/crypto.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "server/step/optimizer_config.h"

namespace paramd {

using coordinator_internal::kTag;

grpc::ServerUnaryReactor* Coordinator::Impl::Join(grpc::CallbackServerContext* context,
                                                  const rpc::JoinRequest* request,
                                                  rpc::JoinResponse* response) {
  // A stranger learns nothing but that it is one: authorization first
  // (it reads only the role, never the strings below).
  bool may_take_rank = true;
  if (grpc::Status s = AuthorizeJoin(*context, *request, &may_take_rank); !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  // The joiner's free strings are stored (and written to the state file):
  // bounded before anything is.
  if (absl::Status s = CheckClientIds({{"name", request->name()},
                                       {"address", request->address()},
                                       {"data_plane_address", request->data_plane_address()},
                                       {"member_id", request->member_id()},
                                       {"incarnation", request->incarnation()},
                                       {"member_secret", request->member_secret()}});
      !s.ok()) {
    return Done(context, s);
  }
  absl::StatusOr<rpc::Member> member = AddMember(*request, may_take_rank);
  if (!member.ok()) {
    // UNAVAILABLE (the rank's holder is still alive) is retried by the
    // joiner every 100 ms until its lease ends: no news each time.
    LogAt(absl::IsUnavailable(member.status()) ? LogLevel::kDebug : LogLevel::kWarning, kTag,
          absl::StrCat("join refused: ", rpc::Role_Name(request->role()), " at ",
                       QuoteForMessage(request->address()), " (", QuoteForMessage(request->name()),
                       "): ", member.status().ToString()));
    return Done(context, member.status());
  }
  if (!request->wait_for_world()) {
    absl::MutexLock lock(&mu_);
    FillJoinResponseLocked(*member, response);
    return Done(context, absl::OkStatus());
  }
  // A daemon waiting here has no member id to heartbeat with yet: the open
  // Join holds its lease (DaemonTable::JoinWaitBegan), so a daemon that
  // waits longer than the lease is not DOWN when the world completes. A
  // daemon that dies while waiting closes its connection, which cancels
  // the call and starts its lease running.
  const bool holds_lease = member->role() == rpc::ROLE_DAEMON;
  if (holds_lease) {
    absl::MutexLock lock(&mu_);
    table_.JoinWaitBegan(member->rank(), request->incarnation());
  }
  auto end_wait = [this, holds_lease, rank = member->rank(), incarnation = request->incarnation()]()
                      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                        if (holds_lease) table_.JoinWaitEnded(rank, incarnation, absl::Now());
                      };
  return StartWaitingUnary(
      &world_waiters_,
      [this, m = *member, response, end_wait]() -> std::optional<grpc::Status> {
        absl::MutexLock lock(&mu_);
        if (shut_down_) {
          end_wait();
          return Unavailable("coordinator shutting down");
        }
        if (!table_.all_joined()) return std::nullopt;
        end_wait();
        FillJoinResponseLocked(m, response);
        return grpc::Status::OK;
      },
      [this, end_wait]() {
        absl::MutexLock lock(&mu_);
        end_wait();
      });
}

grpc::ServerUnaryReactor* Coordinator::Impl::Leave(grpc::CallbackServerContext* context,
                                                   const rpc::LeaveRequest* request,
                                                   rpc::LeaveResponse* /*response*/) {
  if (grpc::Status s =
          auth::Authorize(options_.authenticator.get(), *context, "/paramd.rpc.Coordinator/Leave");
      !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  absl::MutexLock lock(&mu_);
  auto it = std::find_if(others_.begin(), others_.end(), [&](const rpc::Member& m) {
    return m.member_id() == request->member_id();
  });
  if (it == others_.end()) {
    return Done(context, absl::NotFoundError(absl::StrCat("no trainer/observer ",
                                                          QuoteForMessage(request->member_id()))));
  }
  LogInfo(kTag, absl::StrCat(it->role() == rpc::ROLE_TRAINER ? "trainer " : "observer ",
                             it->member_id(), " (", QuoteForMessage(it->name()), ") left"));
  others_.erase(it);  // daemons never leave: their rank is their shards
  StateChangedLocked();
  return Done(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* Coordinator::Impl::Heartbeat(grpc::CallbackServerContext* context,
                                                       const rpc::HeartbeatRequest* request,
                                                       rpc::HeartbeatResponse* response) {
  if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                       "/paramd.rpc.Coordinator/Heartbeat");
      !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  // Compared with the stored ones only: bounded first all the same.
  if (absl::Status s = CheckClientIds(
          {{"member_id", request->member_id()}, {"incarnation", request->incarnation()}});
      !s.ok()) {
    return Done(context, s);
  }
  bool revived = false;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    const int rank = request->rank();
    const absl::Time down_since =
        rank >= 0 && rank < table_.size() ? table_.slot(rank).down_since : now;
    response->set_verdict(table_.Heartbeat(*request, now, &revived));
    response->set_committed_version(committed_);
    if (revived) {
      Log(kTag, absl::StrFormat("daemon %s is back: heartbeats resumed %.1f s after it went down",
                                table_.Name(rank), absl::ToDoubleSeconds(now - down_since)));
    }
  }
  if (revived) world_waiters_.WakeAll();  // a Load waiting for it (TryLoadJoinWait)
  return Done(context, absl::OkStatus());
}

void Coordinator::Impl::LeaseLoop() {
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
        LogWarning(kTag, absl::StrCat("daemon ", table_.Name(r),
                                      " is DOWN: ", table_.slot(r).member.down_reason(),
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

grpc::Status Coordinator::Impl::AuthorizeJoin(const grpc::CallbackServerContext& context,
                                              const rpc::JoinRequest& request,
                                              bool* may_take_rank) const {
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

absl::Status Coordinator::Impl::CheckOpenDaemonJoinLocked(const rpc::JoinRequest& request) {
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
      return absl::UnauthenticatedError(absl::StrCat("a Join as daemon rank ", rank, " (",
                                                     slot.member.member_id(),
                                                     ") again needs that daemon's member secret"));
    }
  }
  // A new process: the rank it would take, in DaemonTable::ChooseRank's
  // order. The generated cluster secret goes only to a rank's first daemon
  // (the world's formation); a rank that has joined before (DOWN, or held
  // by a live daemon) is taken only by a process proving the secret, else
  // any local process could wait for a lease to lapse and be handed it.
  int taken = -1;
  if (request.has_rank()) {
    const int r = request.rank();
    if (r >= 0 && r < table_.size() && table_.slot(r).joined) taken = r;
  } else {
    bool free_rank = false;
    for (int r = 0; r < table_.size() && taken < 0; ++r) {
      const DaemonSlot& slot = table_.slot(r);
      if (slot.joined && slot.member.address() == request.address()) taken = r;
      free_rank = free_rank || !slot.joined;
    }
    for (int r = 0; r < table_.size() && taken < 0 && !free_rank; ++r) {
      if (table_.slot(r).member.state() == rpc::MEMBER_STATE_DOWN) taken = r;
    }
  }
  if (taken < 0) return absl::OkStatus();
  return absl::UnauthenticatedError(absl::StrCat(
      "daemon ", table_.Name(taken),
      " has joined before: a daemon taking its rank must "
      "present the cluster secret, which this coordinator generated and handed only to the "
      "rank's first daemon. Start the replacement with --cluster_secret_file=FILE, FILE being "
      "the file the coordinator writes with --cluster_secret_out (docs/SECURITY.md, "
      "\"The cluster secret\")"));
}

absl::StatusOr<rpc::Member> Coordinator::Impl::AddMember(const rpc::JoinRequest& request,
                                                         bool may_take_rank) {
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
          // No credentials (no token file, no configured secret, the
          // generated secret not presented): a rank nobody has joined, or
          // a retry of this process's own Join (same incarnation and
          // member secret); never a rank another process has held.
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
          Log(kTag, absl::StrCat(
                        "daemon rank ", rank, " replaced by ", QuoteForMessage(request.address()),
                        " (", QuoteForMessage(request.name()), ")",
                        table_.slot(rank).needs_state ? "; it needs the rank's state" : ""));
        } else {
          Log(kTag, absl::StrCat("daemon rank ", rank, " joined from ",
                                 QuoteForMessage(request.address()), " (", joined_before + 1, "/",
                                 options_.expected_daemons, ")"));
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
        LogInfo(kTag,
                absl::StrCat(trainer ? "trainer " : "observer ", m.member_id(),
                             trainer ? absl::StrCat(" rank ", m.rank()) : "", " (",
                             QuoteForMessage(m.name()), m.pusher() ? ", pusher" : "", ") joined"));
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
    StartStartupLoad();
  }
  return result;
}

void Coordinator::Impl::StartStartupLoad() {
  if (options_.model_path.empty() && options_.restore_from.empty()) return;
  {
    absl::MutexLock lock(&startup_mu_);
    if (startup_load_started_) return;
    startup_load_started_ = true;
  }
  rpc::LoadRequest load;
  if (!options_.restore_from.empty()) {
    load.set_checkpoint_path(options_.restore_from);
    load.set_checkpoint_version(options_.restore_version);
  } else {
    load.set_safetensors_path(options_.model_path);
  }
  StartLoad(load, [this](const absl::Status& s, const rpc::LoadResponse&) {
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

void Coordinator::Impl::FillJoinResponseLocked(const rpc::Member& m, rpc::JoinResponse* response) {
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

}  // namespace paramd
