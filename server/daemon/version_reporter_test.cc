// VersionReporter: Report never blocks however long the calls fail, only the
// newest request is sent once the coordinator answers again, a failing
// request is given up after its bound, and Stop cuts a backoff short.
#include "server/daemon/version_reporter.h"

#include <atomic>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace paramd {
namespace {

rpc::ReportVersionRequest Request(int64_t version) {
  rpc::ReportVersionRequest r;
  r.set_published_version(version);
  return r;
}

// A coordinator that refuses while `down`, and records what it accepted.
struct FakeCoordinator {
  absl::Mutex mu;
  bool down = true;
  int calls = 0;
  std::vector<int64_t> accepted;
  grpc::Status Call(const rpc::ReportVersionRequest& r) {
    absl::SleepFor(absl::Milliseconds(5));
    absl::MutexLock lock(&mu);
    ++calls;
    if (down) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator down");
    accepted.push_back(r.published_version());
    return grpc::Status::OK;
  }
};

TEST(VersionReporterTest, ReportsNeverBlockAndOnlyTheNewestIsSentWhenTheCoordinatorIsBack) {
  FakeCoordinator c;
  std::atomic<int> failures{0};
  VersionReporter reporter(
      [&](const rpc::ReportVersionRequest& r) { return c.Call(r); },
      [&](const rpc::ReportVersionRequest&, const grpc::Status&) { ++failures; });
  const absl::Time start = absl::Now();
  for (int64_t v = 1; v <= 50; ++v) {
    reporter.Report(Request(v));
    absl::SleepFor(absl::Milliseconds(2));
  }
  // 50 reports (each retried while down) cost the caller no waiting.
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(50 * 2 + 200));
  EXPECT_GT(failures.load(), 0);
  absl::SleepFor(absl::Milliseconds(300));  // in backoff on version 50
  {
    absl::MutexLock lock(&c.mu);
    c.down = false;
  }
  ASSERT_TRUE(reporter.WaitIdle(absl::Seconds(5)));
  absl::MutexLock lock(&c.mu);
  ASSERT_EQ(c.accepted.size(), 1u);
  EXPECT_EQ(c.accepted[0], 50);
}

TEST(VersionReporterTest, AFailingReportIsGivenUpAfterItsBoundAndTheNextIsSent) {
  FakeCoordinator c;
  VersionReporter reporter([&](const rpc::ReportVersionRequest& r) { return c.Call(r); }, nullptr,
                           absl::Milliseconds(400));
  reporter.Report(Request(7));
  ASSERT_TRUE(reporter.WaitIdle(absl::Seconds(3)));  // given up
  int calls;
  {
    absl::MutexLock lock(&c.mu);
    calls = c.calls;
    c.down = false;
  }
  EXPECT_GE(calls, 2);  // retried, with backoff (100, 200 ms ...)
  EXPECT_LE(calls, 5);
  reporter.Report(Request(8));
  ASSERT_TRUE(reporter.WaitIdle(absl::Seconds(3)));
  absl::MutexLock lock(&c.mu);
  ASSERT_EQ(c.accepted.size(), 1u);
  EXPECT_EQ(c.accepted[0], 8);
}

TEST(VersionReporterTest, StopCutsABackoffShort) {
  FakeCoordinator c;
  auto reporter = std::make_unique<VersionReporter>(
      [&](const rpc::ReportVersionRequest& r) { return c.Call(r); }, nullptr, absl::Minutes(1));
  reporter->Report(Request(1));
  absl::SleepFor(absl::Milliseconds(1500));  // backoff at its 1 s cap
  const absl::Time start = absl::Now();
  reporter.reset();
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(200));
}

}  // namespace
}  // namespace paramd
