// File: server/coordinator/membership.h
//
// The coordinator's table of daemon ranks and their leases
// (docs/ARCHITECTURE.md "Membership"). A rank is a slot: the shards of the
// plan belong to the rank, not to a process. Each slot is held by at most
// one daemon process, told apart by its incarnation (a random id per
// process start). A daemon renews its lease with heartbeats; when none
// arrives for `lease` it is DOWN, and another process may take its rank
// (hybrid-paramd --rank=N, or the lowest DOWN rank when it gives none).
//
// Pure bookkeeping: no RPCs, no clock of its own (callers pass `now`), so
// it is unit-tested without processes.
//
// Threading: not thread-safe; the coordinator calls it under its mutex.
#ifndef PARAMD_SERVER_COORDINATOR_MEMBERSHIP_H_
#define PARAMD_SERVER_COORDINATOR_MEMBERSHIP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "proto/paramd.pb.h"

namespace paramd {

struct DaemonSlot {
  bool joined = false;  // a daemon has taken this rank at least once
  // rank, member_id, address, data-plane address, name, state, incarnation.
  rpc::Member member;
  int64_t published = -1;  // latest version it reported (ReportVersion)
  double last_step_seconds = 0;
  absl::Time last_heartbeat = absl::InfinitePast();
  absl::Time down_since = absl::InfinitePast();
  // A replacement that joined after a model was loaded: it holds no shards
  // until the coordinator's recovery gives it the rank's state.
  bool needs_state = false;
  // Join calls of the holder still open, waiting for the rest of the world
  // (wait_for_world). Such a daemon cannot heartbeat yet (it learns its
  // member id from the reply), so an open Join holds its lease instead.
  int joins_waiting = 0;
};

class DaemonTable {
 public:
  DaemonTable(int expected_daemons, absl::Duration lease);

  struct Joined {
    rpc::Member member;
    // The join took the rank of another process (DOWN, or at the same
    // address: the old process cannot hold that port any more).
    bool replaced = false;
    // The same incarnation joined again (a retried Join): nothing changed.
    bool retry = false;
  };
  // A daemon's JoinRequest (role ROLE_DAEMON). `model_loaded`: a
  // replacement then needs the rank's state (DaemonSlot::needs_state).
  // INVALID_ARGUMENT: no address, rank outside [0, expected). UNAVAILABLE:
  // the rank asked for is held by a live daemon (retry: its lease may be
  // about to expire). FAILED_PRECONDITION: no rank is free or DOWN, or the
  // request's pipelined_step (or, with it, step_bucket_elements) differs
  // from a daemon that joined before (the message names both values).
  absl::StatusOr<Joined> Join(const rpc::JoinRequest& request, absl::Time now, bool model_loaded);

  // A heartbeat: renews the lease of the slot's holder. A DOWN holder that
  // heartbeats again (it was only stopped) is ALIVE again; `revived` says
  // so. UNKNOWN for a rank nobody joined or an unknown member id; REPLACED
  // when another incarnation holds the rank now.
  rpc::HeartbeatVerdict Heartbeat(const rpc::HeartbeatRequest& request, absl::Time now,
                                  bool* revived);

  // The holder of `rank` (by `incarnation`; empty matches any) has a Join
  // open that waits for the world: its lease does not expire until the
  // matching JoinWaitEnded. The coordinator calls Ended when that Join
  // finishes or is cancelled (the daemon died: its connection closed), and
  // the lease then runs from `now`, so a daemon killed while waiting is
  // DOWN one lease after its Join was cancelled. Calls for a rank whose
  // holder changed in between are ignored.
  void JoinWaitBegan(int rank, absl::string_view incarnation);
  void JoinWaitEnded(int rank, absl::string_view incarnation, absl::Time now);

  // Marks DOWN every live daemon whose last heartbeat is older than the
  // lease and that has no Join waiting (JoinWaitBegan); returns the ranks
  // that went DOWN with this call.
  std::vector<int> ExpireLeases(absl::Time now);

  // UNAVAILABLE naming the first rank that is not joined, DOWN or (unless
  // `state_needed` is false: a load gives it) waiting for its state (`what`
  // says what needed it), else OK.
  absl::Status CheckAllReady(absl::string_view what, absl::Time now,
                             bool state_needed = true) const;

  int size() const { return static_cast<int>(slots_.size()); }
  int joined() const;
  bool all_joined() const { return joined() == size(); }
  bool alive(int rank) const;
  absl::Duration lease() const { return lease_; }
  DaemonSlot& slot(int rank) { return slots_[rank]; }
  const DaemonSlot& slot(int rank) const { return slots_[rank]; }
  // Every joined slot's member with its state and heartbeat age at `now`.
  std::vector<rpc::Member> Members(absl::Time now) const;
  // "rank 1 (127.0.0.1:7072)".
  std::string Name(int rank) const;

 private:
  absl::StatusOr<int> ChooseRank(const rpc::JoinRequest& request, absl::Time now) const;
  // Join's check that `request` steps as every joined daemon does.
  absl::Status CheckSameStepping(const rpc::JoinRequest& request) const;

  const absl::Duration lease_;
  std::vector<DaemonSlot> slots_;
  int next_member_ = 0;
};

}  // namespace paramd

#endif  // PARAMD_SERVER_COORDINATOR_MEMBERSHIP_H_
