#include "server/process_metrics.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace paramd {
namespace {

TEST(ProcessMetricsTest, ParsesAStatLineWhoseCommandHasSpacesAndParentheses) {
  // Fields 14/15 utime/stime = 250/50 ticks, 22 starttime = 1000 ticks,
  // 23 vsize = 8192000 bytes, 24 rss = 300 pages.
  const char stat[] =
      "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 7 0 1000 8192000 "
      "300 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0\n";
  absl::StatusOr<ProcessStats> s = ParseProcStat(stat, 100, 4096, 1.7e9);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_DOUBLE_EQ(s->cpu_seconds, 3.0);
  EXPECT_DOUBLE_EQ(s->start_time_seconds, 1.7e9 + 10);
  EXPECT_DOUBLE_EQ(s->virtual_bytes, 8192000);
  EXPECT_DOUBLE_EQ(s->resident_bytes, 300 * 4096);
}

TEST(ProcessMetricsTest, RefusesWhatIsNotAStatLine) {
  EXPECT_FALSE(ParseProcStat("", 100, 4096, 0).ok());
  EXPECT_FALSE(ParseProcStat("12 (x) S 1 2 3", 100, 4096, 0).ok());
  EXPECT_FALSE(
      ParseProcStat("12 (x) S 1 2 3 4 5 6 7 8 9 10 u s 0 0 0 0 0 0 st vs rss", 100, 4096, 0).ok());
}

TEST(ProcessMetricsTest, ReadsThisProcess) {
  absl::StatusOr<ProcessStats> before = ReadProcessStats();
  ASSERT_TRUE(before.ok()) << before.status();
  const double now = absl::ToUnixSeconds(absl::Now());
  // Started before now, by no more than the test's own lifetime.
  EXPECT_LE(before->start_time_seconds, now + 1);
  EXPECT_GT(before->start_time_seconds, now - 600);
  EXPECT_GT(before->resident_bytes, 1 << 20);
  EXPECT_GE(before->virtual_bytes, before->resident_bytes);
  rlimit limit{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &limit), 0);
  EXPECT_EQ(before->max_fds, static_cast<double>(limit.rlim_cur));

  // Three more descriptors, and CPU time spent.
  std::vector<int> fds;
  for (int i = 0; i < 3; ++i) fds.push_back(open("/dev/null", O_RDONLY));
  // Spin until the kernel's own count of this process's CPU time has grown
  // by 0.3 s (a wall-clock spin gets less on a loaded machine), at most 20 s.
  volatile double sink = 0;
  auto cpu_seconds = [] {
    timespec t{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
  };
  const double cpu_start = cpu_seconds();
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (cpu_seconds() - cpu_start < 0.3 && absl::Now() < give_up) {
    for (int i = 0; i < 10000; ++i) sink = sink + i * 0.5;
  }
  absl::StatusOr<ProcessStats> after = ReadProcessStats();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->open_fds, before->open_fds + 3);
  EXPECT_GE(after->cpu_seconds - before->cpu_seconds, 0.2);
  EXPECT_EQ(after->start_time_seconds, before->start_time_seconds);
  for (int fd : fds) close(fd);
  absl::StatusOr<ProcessStats> closed = ReadProcessStats();
  ASSERT_TRUE(closed.ok());
  EXPECT_EQ(closed->open_fds, before->open_fds);
}

}  // namespace
}  // namespace paramd
