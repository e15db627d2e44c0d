#include "server/coordinator/membership.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace paramd {

DaemonTable::DaemonTable(int expected_daemons, absl::Duration lease)
    : lease_(lease), slots_(expected_daemons) {
  for (int r = 0; r < expected_daemons; ++r) {
    slots_[r].member.set_role(rpc::ROLE_DAEMON);
    slots_[r].member.set_rank(r);
    slots_[r].member.set_state(rpc::MEMBER_STATE_NOT_JOINED);
  }
}

int DaemonTable::joined() const {
  int n = 0;
  for (const DaemonSlot& s : slots_) n += s.joined ? 1 : 0;
  return n;
}

bool DaemonTable::alive(int rank) const {
  return slots_[rank].joined && slots_[rank].member.state() != rpc::MEMBER_STATE_DOWN;
}

std::string DaemonTable::Name(int rank) const {
  const DaemonSlot& s = slots_[rank];
  return s.joined ? absl::StrCat("rank ", rank, " (", s.member.address(), ")")
                  : absl::StrCat("rank ", rank);
}

absl::StatusOr<int> DaemonTable::ChooseRank(const rpc::JoinRequest& request, absl::Time now) const {
  if (request.has_rank()) {
    const int r = request.rank();
    if (r < 0 || r >= size()) {
      return absl::InvalidArgumentError(absl::StrCat("--rank=", r, " is outside [0, ", size(),
                                                     ") (the coordinator's --daemons)"));
    }
    const DaemonSlot& s = slots_[r];
    if (s.joined && s.member.state() != rpc::MEMBER_STATE_DOWN &&
        s.member.address() != request.address()) {
      return absl::UnavailableError(absl::StrFormat(
          "rank %d is held by the live daemon at %s (last heartbeat %.1f s ago, lease %.1f s); "
          "a replacement takes it once that lease expires",
          r, s.member.address(), absl::ToDoubleSeconds(now - s.last_heartbeat),
          absl::ToDoubleSeconds(lease_)));
    }
    return r;
  }
  // A new process at the address of a daemon: that daemon's process is gone
  // (it cannot share the port), so this one takes its rank.
  for (int r = 0; r < size(); ++r) {
    if (slots_[r].joined && slots_[r].member.address() == request.address()) return r;
  }
  for (int r = 0; r < size(); ++r) {
    if (!slots_[r].joined) return r;
  }
  for (int r = 0; r < size(); ++r) {
    if (slots_[r].member.state() == rpc::MEMBER_STATE_DOWN) return r;
  }
  return absl::FailedPreconditionError(absl::StrCat("all ", size(),
                                                    " daemons have joined and are alive; ",
                                                    request.address(), " is not one of them"));
}

absl::Status DaemonTable::CheckSameStepping(const rpc::JoinRequest& request) const {
  for (int r = 0; r < size(); ++r) {
    const rpc::Member& m = slots_[r].member;
    if (!slots_[r].joined) continue;
    if (m.pipelined_step() != request.pipelined_step()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "this daemon runs with --pipelined_step=", request.pipelined_step() ? "true" : "false",
          ", daemon ", Name(r), " with --pipelined_step=", m.pipelined_step() ? "true" : "false",
          ": every daemon of a world must use the same (their all-reduce calls differ)"));
    }
    if (m.pipelined_step() && m.step_bucket_elements() != request.step_bucket_elements()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "this daemon runs with --step_bucket_elements=", request.step_bucket_elements(),
          ", daemon ", Name(r), " with --step_bucket_elements=", m.step_bucket_elements(),
          ": every daemon of a pipelined world must cut the same buckets"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<DaemonTable::Joined> DaemonTable::Join(const rpc::JoinRequest& request,
                                                      absl::Time now, bool model_loaded) {
  if (request.address().empty()) {
    return absl::InvalidArgumentError("a daemon must give its address");
  }
  Joined result;
  // A retried Join of a process already registered (same incarnation, or,
  // for daemons that send none, the same member id).
  for (DaemonSlot& s : slots_) {
    if (!s.joined) continue;
    const bool same =
        !request.incarnation().empty()
            ? s.member.incarnation() == request.incarnation()
            : (!request.member_id().empty() && s.member.member_id() == request.member_id()) ||
                  s.member.address() == request.address();
    if (same) {
      s.member.set_name(request.name());
      result.member = s.member;
      result.retry = true;
      return result;
    }
  }
  if (absl::Status same = CheckSameStepping(request); !same.ok()) return same;
  absl::StatusOr<int> rank = ChooseRank(request, now);
  if (!rank.ok()) return rank.status();
  DaemonSlot& s = slots_[*rank];
  result.replaced = s.joined;
  const int holder = next_member_++;
  s.joined = true;
  s.member.set_member_id(result.replaced ? absl::StrCat("daemon-", *rank, "-", holder)
                                         : absl::StrCat("daemon-", *rank));
  s.member.set_address(request.address());
  s.member.set_data_plane_address(
      request.data_plane_address().empty() ? request.address() : request.data_plane_address());
  s.member.set_name(request.name());
  s.member.set_incarnation(request.incarnation());
  s.member.set_pipelined_step(request.pipelined_step());
  s.member.set_step_bucket_elements(request.step_bucket_elements());
  s.needs_state = result.replaced && model_loaded;
  s.member.set_state(s.needs_state ? rpc::MEMBER_STATE_RECOVERING : rpc::MEMBER_STATE_ALIVE);
  s.member.set_down_reason("");
  s.published = -1;
  s.last_step_seconds = 0;
  s.last_heartbeat = now;
  s.down_since = absl::InfinitePast();
  s.joins_waiting = 0;  // any still open belong to the process replaced
  result.member = s.member;
  return result;
}

void DaemonTable::JoinWaitBegan(int rank, absl::string_view incarnation) {
  if (rank < 0 || rank >= size()) return;
  DaemonSlot& s = slots_[rank];
  if (!s.joined || (!incarnation.empty() && s.member.incarnation() != incarnation)) return;
  ++s.joins_waiting;
}

void DaemonTable::JoinWaitEnded(int rank, absl::string_view incarnation, absl::Time now) {
  if (rank < 0 || rank >= size()) return;
  DaemonSlot& s = slots_[rank];
  if (!s.joined || (!incarnation.empty() && s.member.incarnation() != incarnation)) return;
  if (s.joins_waiting == 0) return;
  --s.joins_waiting;
  // The open Join stood for heartbeats up to now.
  if (s.member.state() != rpc::MEMBER_STATE_DOWN) {
    s.last_heartbeat = std::max(s.last_heartbeat, now);
  }
}

rpc::HeartbeatVerdict DaemonTable::Heartbeat(const rpc::HeartbeatRequest& request, absl::Time now,
                                             bool* revived) {
  *revived = false;
  const int r = request.rank();
  if (r < 0 || r >= size() || !slots_[r].joined) return rpc::HEARTBEAT_UNKNOWN;
  DaemonSlot& s = slots_[r];
  if (!request.incarnation().empty() && s.member.incarnation() != request.incarnation()) {
    return rpc::HEARTBEAT_REPLACED;  // another process holds the rank now
  }
  // A member id of an earlier coordinator run: join again.
  if (s.member.member_id() != request.member_id()) return rpc::HEARTBEAT_UNKNOWN;
  s.last_heartbeat = now;
  if (s.member.state() == rpc::MEMBER_STATE_DOWN) {
    s.member.set_state(s.needs_state ? rpc::MEMBER_STATE_RECOVERING : rpc::MEMBER_STATE_ALIVE);
    s.member.set_down_reason("");
    *revived = true;
  }
  return rpc::HEARTBEAT_OK;
}

std::vector<int> DaemonTable::ExpireLeases(absl::Time now) {
  std::vector<int> expired;
  for (int r = 0; r < size(); ++r) {
    DaemonSlot& s = slots_[r];
    if (!s.joined || s.member.state() == rpc::MEMBER_STATE_DOWN) continue;
    if (s.joins_waiting > 0 || now - s.last_heartbeat <= lease_) continue;
    s.member.set_state(rpc::MEMBER_STATE_DOWN);
    s.member.set_down_reason(absl::StrFormat("no heartbeat for %.1f s (lease %.1f s)",
                                             absl::ToDoubleSeconds(now - s.last_heartbeat),
                                             absl::ToDoubleSeconds(lease_)));
    s.down_since = now;
    expired.push_back(r);
  }
  return expired;
}

absl::Status DaemonTable::CheckAllReady(absl::string_view what, absl::Time now,
                                        bool state_needed) const {
  for (int r = 0; r < size(); ++r) {
    const DaemonSlot& s = slots_[r];
    if (!s.joined) {
      return absl::UnavailableError(
          absl::StrCat(what, " needs daemon rank ", r, ", which has not joined yet"));
    }
    if (s.member.state() == rpc::MEMBER_STATE_DOWN) {
      return absl::UnavailableError(absl::StrFormat(
          "%s needs daemon %s, which is down (%s, %.1f s ago); start a replacement with "
          "--rank=%d",
          what, Name(r), s.member.down_reason(), absl::ToDoubleSeconds(now - s.down_since), r));
    }
    if (s.needs_state && state_needed) {
      return absl::UnavailableError(absl::StrCat(what, " needs daemon ", Name(r),
                                                 ", a replacement still recovering its state"));
    }
  }
  return absl::OkStatus();
}

std::vector<rpc::Member> DaemonTable::Members(absl::Time now) const {
  std::vector<rpc::Member> out;
  for (const DaemonSlot& s : slots_) {
    if (!s.joined) continue;
    rpc::Member m = s.member;
    m.set_heartbeat_age_seconds(absl::ToDoubleSeconds(now - s.last_heartbeat));
    out.push_back(std::move(m));
  }
  return out;
}

}  // namespace paramd
