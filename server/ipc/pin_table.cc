#include "server/ipc/pin_table.h"

#include <algorithm>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace paramd {
namespace ipc {
namespace {

// How often a waiting Retire re-checks expiry (cheap: a map walk) and at
// most how late it notices a lease that lapsed.
constexpr absl::Duration kPoll = absl::Milliseconds(20);
// A page pin's release wakes nobody (the trainer writes shared memory):
// while one holds the key, Retire looks again this often.
constexpr absl::Duration kPagePoll = absl::Microseconds(200);

std::string KeyName(PinKey key) {
  return absl::StrCat("version ", key.second, " (model generation ", key.first, ")");
}

}  // namespace

PinTable::PinTable(PinTableOptions options) : options_(std::move(options)) {}
PinTable::~PinTable() { Shutdown(); }

absl::Time PinTable::Now() const { return options_.now ? options_.now() : absl::Now(); }

void PinTable::set_on_session_end(std::function<void(uint64_t)> fn) {
  absl::MutexLock lock(&mu_);
  on_session_end_ = std::move(fn);
}

void PinTable::NotifyEnded(const std::vector<uint64_t>& ended) {
  std::function<void(uint64_t)> fn;
  {
    absl::MutexLock lock(&mu_);
    fn = on_session_end_;
  }
  if (!fn) return;
  for (uint64_t id : ended) fn(id);
}

void PinTable::ExpireLocked(std::vector<uint64_t>* ended) {
  const absl::Time now = Now();
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (it->second.expires <= now) {
      ended->push_back(it->first);
      it = sessions_.erase(it);
      ++changes_;
    } else {
      ++it;
    }
  }
}

absl::StatusOr<PinTable::Session*> PinTable::LiveLocked(uint64_t session,
                                                        std::vector<uint64_t>* ended) {
  ExpireLocked(ended);
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("IPC session ", session,
                     " is unknown or its lease expired (its pins were released); "
                     "open a new session"));
  }
  it->second.expires = Now() + it->second.lease;
  return &it->second;
}

absl::StatusOr<uint64_t> PinTable::Open(const std::string& name, absl::Duration lease) {
  if (lease < options_.min_lease || lease > options_.max_lease) {
    return absl::InvalidArgumentError(absl::StrCat("IPC session lease ",
                                                   absl::FormatDuration(lease), " outside [",
                                                   absl::FormatDuration(options_.min_lease), ", ",
                                                   absl::FormatDuration(options_.max_lease), "]"));
  }
  std::vector<uint64_t> ended;
  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return absl::UnavailableError("daemon shutting down");
    ExpireLocked(&ended);
    if (static_cast<int>(sessions_.size()) >= options_.max_sessions) {
      return absl::ResourceExhaustedError(
          absl::StrCat("this daemon already has ", sessions_.size(), " IPC sessions (the limit)"));
    }
    static thread_local std::mt19937_64 rng(std::random_device{}());
    do {
      id = rng();
    } while (id == 0 || sessions_.count(id) > 0);
    Session& s = sessions_[id];
    s.name = name;
    s.lease = lease;
    s.expires = Now() + lease;
  }
  NotifyEnded(ended);
  return id;
}

absl::Status PinTable::WithLiveSession(uint64_t session,
                                       absl::FunctionRef<absl::Status(Session&)> fn) {
  std::vector<uint64_t> ended;
  absl::Status s;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<Session*> live = LiveLocked(session, &ended);
    s = live.ok() ? fn(**live) : live.status();
  }
  NotifyEnded(ended);
  return s;
}

void PinTable::ErasePinsLocked(Session& session, absl::FunctionRef<bool(const PinKey&)> drop) {
  for (auto it = session.pins.begin(); it != session.pins.end();) {
    if (drop(*it)) {
      it = session.pins.erase(it);
      ++changes_;
    } else {
      ++it;
    }
  }
}

absl::Status PinTable::Renew(uint64_t session) {
  return WithLiveSession(session, [](Session&) { return absl::OkStatus(); });
}

absl::Status PinTable::Close(uint64_t session) {
  std::vector<uint64_t> ended;
  absl::Status s;
  {
    absl::MutexLock lock(&mu_);
    s = LiveLocked(session, &ended).status();
    if (s.ok()) {
      sessions_.erase(session);
      ended.push_back(session);
      ++changes_;
    }
  }
  NotifyEnded(ended);
  return s;
}

absl::Status PinTable::Pin(uint64_t session, PinKey key) {
  return WithLiveSession(session, [&](Session& live) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (retiring_.count(key) > 0) {
      // NOT_FOUND, as for a version already gone and as the device channel's
      // FetchDevice answers for the version a step rewrites ("dropped"): it
      // is gone a moment later in any case, and the caller's remedy is the
      // same (fetch / pin a newer version). The message keeps the reason.
      return absl::NotFoundError(
          absl::StrCat(KeyName(key),
                       " is being retired (the step in progress rewrites its buffers); "
                       "pin the latest version"));
    }
    if (live.pins.count(key) == 0 &&
        static_cast<int>(live.pins.size()) >= options_.max_pins_per_session) {
      return absl::ResourceExhaustedError(absl::StrCat("IPC session ", session, " already pins ",
                                                       live.pins.size(),
                                                       " versions (the limit); unpin one first"));
    }
    live.pins.insert(key);
    return absl::OkStatus();
  });
}

absl::Status PinTable::Unpin(uint64_t session, PinKey key) {
  return WithLiveSession(session, [&](Session& live) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    ErasePinsLocked(live, [&](const PinKey& pin) { return pin == key; });
    return absl::OkStatus();
  });
}

absl::Status PinTable::UnpinVersion(uint64_t session, int64_t version) {
  return WithLiveSession(session, [&](Session& live) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    ErasePinsLocked(live, [&](const PinKey& pin) { return pin.second == version; });
    return absl::OkStatus();
  });
}

absl::Status PinTable::DropOtherGenerations(uint64_t session, int64_t generation) {
  return WithLiveSession(session, [&](Session& live) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    ErasePinsLocked(live, [&](const PinKey& pin) { return pin.first != generation; });
    return absl::OkStatus();
  });
}

absl::StatusOr<std::vector<PinKey>> PinTable::Pins(uint64_t session) {
  std::vector<uint64_t> ended;
  absl::StatusOr<std::vector<PinKey>> out;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<Session*> live = LiveLocked(session, &ended);
    if (live.ok()) {
      out = std::vector<PinKey>((*live)->pins.begin(), (*live)->pins.end());
    } else {
      out = live.status();
    }
  }
  NotifyEnded(ended);
  return out;
}

bool PinTable::HoldsLocked(const Session& s, PinKey key) {
  return s.pins.count(key) > 0 ||
         (s.page != nullptr && s.page->Holds(PackPin(key.first, key.second)));
}

int PinTable::PinCount(PinKey key) {
  std::vector<uint64_t> ended;
  int n = 0;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(&ended);
    for (const auto& [id, s] : sessions_) n += HoldsLocked(s, key) ? 1 : 0;
  }
  NotifyEnded(ended);
  return n;
}

absl::Status PinTable::AttachPage(uint64_t session, std::shared_ptr<PinPage> page) {
  return WithLiveSession(session, [&](Session& live) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (int i = 0; i < kPageSlots; ++i) page->Publish(i, page_slots_[i]);
    live.page = std::move(page);
    return absl::OkStatus();
  });
}

absl::StatusOr<std::shared_ptr<PinPage>> PinTable::Page(uint64_t session) {
  std::shared_ptr<PinPage> page;
  RETURN_IF_ERROR(WithLiveSession(session, [&](Session& live) {
    page = live.page;
    return absl::OkStatus();
  }));
  return page;
}

void PinTable::SetPageSlots(const std::array<uint64_t, kPageSlots>& offered) {
  absl::MutexLock lock(&mu_);
  std::array<uint64_t, kPageSlots> slots = offered;
  for (uint64_t& slot : slots) {
    for (const PinKey& r : retiring_) {
      if (slot == PackPin(r.first, r.second)) slot = 0;
    }
  }
  page_slots_ = slots;
  for (auto& [id, s] : sessions_) {
    if (s.page == nullptr) continue;
    for (int i = 0; i < kPageSlots; ++i) s.page->Publish(i, slots[i]);
  }
}

std::string PinTable::HoldersLocked(PinKey key) const {
  std::vector<std::string> names;
  for (const auto& [id, s] : sessions_) {
    if (HoldsLocked(s, key)) names.push_back(absl::StrCat(s.name, " (session ", id, ")"));
  }
  return absl::StrJoin(names, ", ");
}

absl::Status PinTable::Retire(PinKey key, absl::Time deadline,
                              const std::function<void(const std::string&)>& on_wait) {
  {
    absl::MutexLock lock(&mu_);
    retiring_.insert(key);  // from now on Pin(key) is refused
    // ... and a page pin of it fails its re-check (pin_page.h): withdrawn
    // before the pins are looked at below.
    const uint64_t packed = PackPin(key.first, key.second);
    for (uint64_t& slot : page_slots_) {
      if (slot == packed) slot = 0;
    }
    for (auto& [id, s] : sessions_) {
      if (s.page != nullptr) s.page->Withdraw(packed);
    }
  }
  absl::Time next_report = absl::Now() + absl::Seconds(1);
  for (;;) {
    std::vector<uint64_t> ended;
    std::string holders;
    std::optional<absl::Status> done;
    bool report = false;
    {
      absl::MutexLock lock(&mu_);
      ExpireLocked(&ended);
      holders = HoldersLocked(key);
      if (shut_down_) {
        done = absl::CancelledError("daemon shutting down");
      } else if (holders.empty()) {
        done = absl::OkStatus();
      } else if (Now() >= deadline) {
        done = absl::DeadlineExceededError(
            absl::StrCat(KeyName(key), " is still pinned over IPC by ", holders));
      } else {
        const uint64_t seen = changes_;
        auto changed = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return shut_down_ || changes_ != seen;
        };
        // Bounded: a lease that lapses bumps nothing until ExpireLocked
        // runs, and a page pin's release nothing at all.
        bool page_holder = false;
        for (const auto& [id, s] : sessions_) {
          page_holder =
              page_holder || (s.page != nullptr && s.page->Holds(PackPin(key.first, key.second)));
        }
        mu_.AwaitWithTimeout(absl::Condition(&changed), page_holder ? kPagePoll : kPoll);
        if (absl::Now() >= next_report) {
          report = true;
          next_report = absl::Now() + absl::Seconds(1);
        }
      }
    }
    NotifyEnded(ended);
    if (done.has_value()) return *done;
    if (report && on_wait) on_wait(holders);
  }
}

void PinTable::EndRetire(PinKey key) {
  absl::MutexLock lock(&mu_);
  auto it = retiring_.find(key);
  if (it != retiring_.end()) retiring_.erase(it);
}

void PinTable::Shutdown() {
  absl::MutexLock lock(&mu_);
  shut_down_ = true;
}

std::vector<PinTable::SessionInfo> PinTable::Sessions() {
  std::vector<uint64_t> ended;
  std::vector<SessionInfo> out;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(&ended);
    for (const auto& [id, s] : sessions_) {
      out.push_back({id, s.name, s.expires, std::vector<PinKey>(s.pins.begin(), s.pins.end())});
    }
  }
  NotifyEnded(ended);
  return out;
}

}  // namespace ipc
}  // namespace paramd
