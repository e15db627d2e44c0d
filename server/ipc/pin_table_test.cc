#include "server/ipc/pin_table.h"

#include <memory>

#include <atomic>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "ipc/pin_page.h"

namespace paramd {
namespace ipc {
namespace {

// A clock the test moves by hand.
class FakeClock {
 public:
  absl::Time Now() {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  absl::Mutex mu_;
  absl::Time now_ = absl::FromUnixSeconds(1000);
};

PinTableOptions WithClock(FakeClock* clock) {
  PinTableOptions o;
  o.now = [clock] { return clock->Now(); };
  return o;
}

constexpr PinKey kV5{1, 5};
constexpr PinKey kV6{1, 6};

TEST(PinTable, PinHoldsUntilUnpinAndRetireThenWaitsForIt) {
  FakeClock clock;
  PinTable table(WithClock(&clock));
  absl::StatusOr<uint64_t> s = table.Open("trainer-a", absl::Seconds(5));
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE(table.Pin(*s, kV5).ok());
  ASSERT_TRUE(table.Pin(*s, kV5).ok());  // idempotent: one pin
  EXPECT_EQ(table.PinCount(kV5), 1);
  EXPECT_EQ(table.PinCount(kV6), 0);

  // The step rewriting v5 waits while the pin is held...
  std::atomic<bool> retired{false};
  absl::Status retire_status;
  std::thread step([&] {
    retire_status = table.Retire(kV5, absl::InfiniteFuture());
    retired = true;
  });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(retired);
  // ... new pins of v5 are refused meanwhile (another session) ...
  absl::StatusOr<uint64_t> other = table.Open("trainer-b", absl::Seconds(5));
  ASSERT_TRUE(other.ok());
  absl::Status refused = table.Pin(*other, kV5);
  EXPECT_EQ(refused.code(), absl::StatusCode::kNotFound) << refused;
  EXPECT_NE(refused.message().find("being retired"), absl::string_view::npos) << refused;
  EXPECT_TRUE(table.Pin(*other, kV6).ok());
  // ... and it goes on once the pin is released.
  ASSERT_TRUE(table.Unpin(*s, kV5).ok());
  step.join();
  EXPECT_TRUE(retired);
  EXPECT_TRUE(retire_status.ok()) << retire_status;
  table.EndRetire(kV5);
  EXPECT_TRUE(table.Pin(*other, kV5).ok());  // after EndRetire: the caller's check decides
}

TEST(PinTable, ExpiredLeaseReleasesPinsAndRetireGoesOn) {
  FakeClock clock;
  PinTable table(WithClock(&clock));
  std::atomic<int> ended{0};
  table.set_on_session_end([&](uint64_t) { ++ended; });
  absl::StatusOr<uint64_t> s = table.Open("killed trainer", absl::Seconds(2));
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(table.Pin(*s, kV5).ok());
  std::atomic<bool> retired{false};
  std::thread step([&] {
    EXPECT_TRUE(table.Retire(kV5, absl::InfiniteFuture()).ok());
    retired = true;
  });
  clock.Advance(absl::Seconds(1));
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(retired);  // lease not over yet
  clock.Advance(absl::Seconds(1));
  step.join();  // the lease lapsed: the pin went with it
  EXPECT_TRUE(retired);
  EXPECT_EQ(ended.load(), 1);
  EXPECT_EQ(table.PinCount(kV5), 0);
  EXPECT_EQ(table.Renew(*s).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(table.Pin(*s, kV6).code(), absl::StatusCode::kNotFound);
  table.EndRetire(kV5);
}

TEST(PinTable, EveryCallRenewsTheLease) {
  FakeClock clock;
  PinTable table(WithClock(&clock));
  absl::StatusOr<uint64_t> s = table.Open("t", absl::Seconds(2));
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(table.Pin(*s, kV5).ok());
  for (int i = 0; i < 5; ++i) {
    clock.Advance(absl::Milliseconds(1500));
    ASSERT_TRUE(table.Renew(*s).ok()) << i;
  }
  EXPECT_EQ(table.PinCount(kV5), 1);
  clock.Advance(absl::Milliseconds(2001));
  EXPECT_EQ(table.PinCount(kV5), 0);
}

TEST(PinTable, RetireDeadlineNamesTheHolderAndShutdownCancels) {
  PinTable table;
  absl::StatusOr<uint64_t> s = table.Open("holder-x", absl::Seconds(30));
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(table.Pin(*s, kV5).ok());
  absl::Status late = table.Retire(kV5, absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  EXPECT_NE(late.message().find("holder-x"), std::string::npos) << late;
  table.EndRetire(kV5);
  std::thread step([&] {
    EXPECT_EQ(table.Retire(kV5, absl::InfiniteFuture()).code(), absl::StatusCode::kCancelled);
  });
  absl::SleepFor(absl::Milliseconds(50));
  table.Shutdown();
  step.join();
  EXPECT_EQ(table.Open("late", absl::Seconds(1)).status().code(), absl::StatusCode::kUnavailable);
}

TEST(PinTable, LimitsAndCloseAndGenerations) {
  PinTableOptions o;
  o.max_sessions = 2;
  o.max_pins_per_session = 2;
  PinTable table(o);
  EXPECT_EQ(table.Open("t", absl::Milliseconds(10)).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<uint64_t> a = table.Open("a", absl::Seconds(5));
  absl::StatusOr<uint64_t> b = table.Open("b", absl::Seconds(5));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
  EXPECT_EQ(table.Open("c", absl::Seconds(5)).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(table.Pin(*a, kV5).ok());
  ASSERT_TRUE(table.Pin(*a, kV6).ok());
  EXPECT_EQ(table.Pin(*a, PinKey{1, 7}).code(), absl::StatusCode::kResourceExhausted);
  // A new model generation's version 5 is another key.
  EXPECT_EQ(table.PinCount(PinKey{2, 5}), 0);
  absl::StatusOr<std::vector<PinKey>> pins = table.Pins(*a);
  ASSERT_TRUE(pins.ok());
  EXPECT_EQ(pins->size(), 2u);
  // Done with version 6 of any generation; pins of another model dropped.
  ASSERT_TRUE(table.UnpinVersion(*a, 6).ok());
  EXPECT_EQ(table.PinCount(kV6), 0);
  ASSERT_TRUE(table.Pin(*a, PinKey{0, 9}).ok());
  ASSERT_TRUE(table.DropOtherGenerations(*a, 1).ok());
  EXPECT_EQ(table.PinCount(PinKey{0, 9}), 0);
  EXPECT_EQ(table.PinCount(kV5), 1);
  ASSERT_TRUE(table.Close(*a).ok());
  EXPECT_EQ(table.PinCount(kV5), 0);
  EXPECT_EQ(table.Close(*a).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(table.Open("c", absl::Seconds(5)).ok());  // a's place is free
}

// Page pins (ipc/pin_page.h): a trainer's pin in its shared page
// holds the step like a table pin; a version the step withdrew cannot be
// page-pinned any more; the page pins of an expired session count no more.
TEST(PinTable, PagePinsHoldTheStepAndLapseWithTheLease) {
  FakeClock clock;
  PinTable table(WithClock(&clock));
  absl::StatusOr<uint64_t> s = table.Open("trainer-a", absl::Seconds(5));
  ASSERT_TRUE(s.ok()) << s.status();
  absl::StatusOr<std::unique_ptr<PinPage>> daemon_side = PinPage::Create();
  ASSERT_TRUE(daemon_side.ok()) << daemon_side.status();
  absl::StatusOr<int> fd = (*daemon_side)->Dup();
  ASSERT_TRUE(fd.ok()) << fd.status();
  absl::StatusOr<std::unique_ptr<PinPage>> trainer = PinPage::Map(*fd);  // the other mapping
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  ASSERT_TRUE(table.AttachPage(*s, std::shared_ptr<PinPage>(std::move(*daemon_side))).ok());
  const uint64_t v5 = PackPin(kV5.first, kV5.second), v6 = PackPin(kV6.first, kV6.second);
  EXPECT_EQ(PinVersion(v5), 5);
  // Nothing offered yet: no page pin.
  EXPECT_EQ((*trainer)->TryPin(0, v5), -1);
  table.SetPageSlots({v5, v6});
  EXPECT_EQ((*trainer)->SlotOf(v6), 1);
  EXPECT_EQ((*trainer)->TryPin(1, v5), -1);  // slot 1 offers v6, not v5
  const int pin = (*trainer)->TryPin(0, v5);
  ASSERT_GE(pin, 0);
  EXPECT_EQ(table.PinCount(kV5), 1);

  std::atomic<bool> retired{false};
  std::thread step([&] {
    EXPECT_TRUE(table.Retire(kV5, absl::InfiniteFuture()).ok());
    retired = true;
  });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(retired) << "the step rewrote a page-pinned version";
  // Withdrawn: another page pin of v5 fails its re-check; v6 still pins.
  EXPECT_EQ((*trainer)->SlotOf(v5), -1);
  EXPECT_EQ((*trainer)->TryPin(0, v5), -1);
  const int pin6 = (*trainer)->TryPin(1, v6);
  EXPECT_GE(pin6, 0);
  (*trainer)->Unpin(pin);  // shared memory only: Retire notices by looking again
  step.join();
  EXPECT_TRUE(retired);
  table.EndRetire(kV5);

  // v6 stays page-pinned until the session's lease lapses.
  EXPECT_EQ(table.PinCount(kV6), 1);
  clock.Advance(absl::Seconds(6));
  EXPECT_EQ(table.PinCount(kV6), 0);
  EXPECT_TRUE(table.Retire(kV6, absl::Now()).ok());
  table.EndRetire(kV6);
}

// A page pin racing a step's withdrawal: the trainer either sees its pin
// refused or the step waits for it; never a pin the step does not see.
TEST(PinTable, PagePinRacingTheStepIsNeverMissed) {
  PinTable table;
  absl::StatusOr<uint64_t> s = table.Open("trainer", absl::Seconds(30));
  ASSERT_TRUE(s.ok());
  absl::StatusOr<std::unique_ptr<PinPage>> daemon_side = PinPage::Create();
  ASSERT_TRUE(daemon_side.ok());
  absl::StatusOr<int> fd = (*daemon_side)->Dup();
  ASSERT_TRUE(fd.ok());
  absl::StatusOr<std::unique_ptr<PinPage>> trainer = PinPage::Map(*fd);
  ASSERT_TRUE(trainer.ok());
  ASSERT_TRUE(table.AttachPage(*s, std::shared_ptr<PinPage>(std::move(*daemon_side))).ok());
  for (int round = 0; round < 2000; ++round) {
    const PinKey key{1, round};
    const uint64_t packed = PackPin(1, round);
    table.SetPageSlots({packed, 0});
    std::atomic<bool> rewriting{false};
    std::atomic<int> pinned{-1};
    std::thread step([&] {
      ASSERT_TRUE(table.Retire(key, absl::InfiniteFuture()).ok());
      rewriting = true;  // from here the step rewrites the buffers
    });
    const int pin = (*trainer)->TryPin(0, packed);
    if (pin >= 0) {
      // Pinned: the step must not be rewriting while the pin is held.
      EXPECT_FALSE(rewriting) << "round " << round;
      (*trainer)->Unpin(pin);
    }
    step.join();
    table.EndRetire(key);
  }
}

}  // namespace
}  // namespace ipc
}  // namespace paramd
