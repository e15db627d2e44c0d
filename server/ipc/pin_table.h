// File: server/ipc/pin_table.h
//
// The daemon's record of same-GPU sessions (proto/ipc.proto) and the
// versions they pin. A session is a lease: it lives while it is renewed
// (every call of the session renews it) and expires `lease` after the last
// renewal, dropping its pins, so a killed trainer never pins a version
// forever. A pinned version's published buffers must not be rewritten: the
// step that would reuse them calls Retire(), which from then on refuses new
// pins of that version and waits until no live session pins it.
//
// Versions are keyed by (generation, version): a load starts a new
// generation, and the old generation's pins never hold back the new model.
//
// A session may also pin through its shared-memory page (server/ipc/
// pin_page.h: no RPC): Retire withdraws the key from every page's
// pinnable slots first, then counts page pins like table pins (a page pin
// of a session that expired counts no more).
//
// Threading: thread-safe; Retire blocks (bounded by its deadline, woken by
// Unpin, Close, expiry and Shutdown); nothing else blocks. The clock is
// injectable for tests.
#ifndef PARAMD_SERVER_IPC_PIN_TABLE_H_
#define PARAMD_SERVER_IPC_PIN_TABLE_H_

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "ipc/pin_page.h"

namespace paramd {
namespace ipc {

struct PinTableOptions {
  int max_sessions = 256;
  int max_pins_per_session = 4;
  absl::Duration min_lease = absl::Milliseconds(100);
  absl::Duration max_lease = absl::Minutes(10);
  // The clock (tests); null: absl::Now.
  std::function<absl::Time()> now;
};

// A pinned version: (model generation, version).
using PinKey = std::pair<int64_t, int64_t>;

class PinTable {
 public:
  explicit PinTable(PinTableOptions options = {});
  ~PinTable();

  // Opens a session named `name` (logs) with lease `lease`. INVALID_ARGUMENT
  // outside [min_lease, max_lease]; RESOURCE_EXHAUSTED past max_sessions
  // live sessions; UNAVAILABLE after Shutdown. The id is random (not
  // guessable from other ids).
  absl::StatusOr<uint64_t> Open(const std::string& name, absl::Duration lease);
  // Renews. NOT_FOUND: unknown or expired (its pins are gone).
  absl::Status Renew(uint64_t session);
  // Ends a session and its pins. NOT_FOUND as Renew.
  absl::Status Close(uint64_t session);

  // Pins `key` for the session (renewing it). Idempotent per session.
  // NOT_FOUND while `key` is being retired (as for a version no longer
  // held; the message says "being retired"); RESOURCE_EXHAUSTED past
  // max_pins_per_session; NOT_FOUND as Renew (the message names the session).
  absl::Status Pin(uint64_t session, PinKey key);
  // Releases a pin (renewing the session). NOT_FOUND: session unknown;
  // a version the session does not pin is OK (nothing to do).
  absl::Status Unpin(uint64_t session, PinKey key);
  // Releases the session's pins of `version` in every model generation
  // (what a client means by "done with v"). NOT_FOUND as Unpin.
  absl::Status UnpinVersion(uint64_t session, int64_t version);
  // Releases the session's pins of generations other than `generation`
  // (versions of a model that a load replaced). NOT_FOUND as Renew.
  absl::Status DropOtherGenerations(uint64_t session, int64_t generation);
  // The session's pinned keys (renews). NOT_FOUND as Renew.
  absl::StatusOr<std::vector<PinKey>> Pins(uint64_t session);

  // Live sessions pinning `key` (table or page; expired ones are dropped
  // first).
  int PinCount(PinKey key);

  // The session's shared-memory pin page (one per session; replaces an
  // earlier one); it is offered the current pinnable slots at once.
  // NOT_FOUND as Renew.
  absl::Status AttachPage(uint64_t session, std::shared_ptr<PinPage> page);
  // The session's page (null if none). NOT_FOUND as Renew.
  absl::StatusOr<std::shared_ptr<PinPage>> Page(uint64_t session);
  // The pinnable (generation, version) of each double-buffer slot (packed,
  // PackPin; 0: none), written into every page now and into pages attached
  // later. A key being retired is never offered (written as 0). Called by
  // the step's thread once a step's outcome is recorded.
  void SetPageSlots(const std::array<uint64_t, kPageSlots>& slots);

  // The step that rewrites `key`'s buffers: refuses new pins of `key` from
  // now on (table pins; page pins: withdrawn from every page's slots) and
  // waits until no live session pins it. OK: nothing pins it;
  // DEADLINE_EXCEEDED (naming the holders) at `deadline`; CANCELLED after
  // Shutdown. `on_wait` (optional) is called about once a second while it
  // waits, with the holders' names (for the daemon's log). Pair every call
  // with EndRetire (also after an error).
  absl::Status Retire(PinKey key, absl::Time deadline,
                      const std::function<void(const std::string& holders)>& on_wait = nullptr);
  // `key` may be pinned again (its buffers hold another version now, so a
  // pin of it is refused by the caller's check that it is published).
  void EndRetire(PinKey key);

  // Called with the id of every session that ends (closed or expired), after
  // its pins are dropped, without the table's lock held (the daemon unmaps
  // the session's gradient buffers).
  void set_on_session_end(std::function<void(uint64_t session)> fn);

  // Fails every Retire in progress and refuses new sessions. Idempotent.
  void Shutdown();

  struct SessionInfo {
    uint64_t id = 0;
    std::string name;
    absl::Time expires;
    std::vector<PinKey> pins;
  };
  std::vector<SessionInfo> Sessions();

 private:
  struct Session {
    std::string name;
    absl::Duration lease;
    absl::Time expires;
    std::set<PinKey> pins;
    std::shared_ptr<PinPage> page;  // null: none attached
  };
  absl::Time Now() const;
  // Whether `s` pins `key` in its table set or its page.
  static bool HoldsLocked(const Session& s, PinKey key);
  // Drops expired sessions; their ids go to `ended`.
  void ExpireLocked(std::vector<uint64_t>* ended) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Finds a live session (renewing it) or NOT_FOUND.
  absl::StatusOr<Session*> LiveLocked(uint64_t session, std::vector<uint64_t>* ended)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs `fn` under the lock on the live session (renewing its lease), then
  // reports the sessions that ended meanwhile; NOT_FOUND if it is not live.
  absl::Status WithLiveSession(uint64_t session, absl::FunctionRef<absl::Status(Session&)> fn);
  // Erases the session's pins that `drop` selects, counting each as a change.
  void ErasePinsLocked(Session& session, absl::FunctionRef<bool(const PinKey&)> drop)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string HoldersLocked(PinKey key) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NotifyEnded(const std::vector<uint64_t>& ended);

  const PinTableOptions options_;
  absl::Mutex mu_;
  std::map<uint64_t, Session> sessions_ ABSL_GUARDED_BY(mu_);
  std::multiset<PinKey> retiring_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t changes_ ABSL_GUARDED_BY(mu_) = 0;  // bumped by every unpin/close
  std::array<uint64_t, kPageSlots> page_slots_ ABSL_GUARDED_BY(mu_) = {};
  std::function<void(uint64_t)> on_session_end_;
};

}  // namespace ipc
}  // namespace paramd

#endif  // PARAMD_SERVER_IPC_PIN_TABLE_H_
