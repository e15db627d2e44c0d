#include "server/process_metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace paramd {
namespace {

std::string ReadFile(const char* path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// btime (unix seconds) from /proc/stat; 0 if missing.
double BootTime() {
  for (absl::string_view line : absl::StrSplit(ReadFile("/proc/stat"), '\n')) {
    double btime = 0;
    if (absl::ConsumePrefix(&line, "btime ") && absl::SimpleAtod(line, &btime)) return btime;
  }
  return 0;
}

double OpenFds() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  int n = 0;
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(dir);
  return n - 1;  // the descriptor of the listing itself
}

}  // namespace

absl::StatusOr<ProcessStats> ParseProcStat(absl::string_view stat, double ticks_per_second,
                                           double page_size, double boot_time) {
  // "pid (comm) state ppid ...": comm may hold anything, so the fields
  // start after its last ')'.
  const size_t close = stat.rfind(')');
  if (close == absl::string_view::npos || ticks_per_second <= 0) {
    return absl::InvalidArgumentError("not a /proc/<pid>/stat line");
  }
  const std::vector<absl::string_view> f =
      absl::StrSplit(absl::StripAsciiWhitespace(stat.substr(close + 1)), ' ', absl::SkipEmpty());
  // f[0] is field 3 (state): field N is f[N - 3].
  auto field = [&f](int n, double* out) {
    return n - 3 < static_cast<int>(f.size()) && absl::SimpleAtod(f[n - 3], out);
  };
  double utime = 0, stime = 0, start_ticks = 0, vsize = 0, rss_pages = 0;
  if (!field(14, &utime) || !field(15, &stime) || !field(22, &start_ticks) || !field(23, &vsize) ||
      !field(24, &rss_pages)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a /proc/<pid>/stat line with ", f.size() + 2, " fields, want >= 24"));
  }
  ProcessStats s;
  s.cpu_seconds = (utime + stime) / ticks_per_second;
  s.start_time_seconds = boot_time + start_ticks / ticks_per_second;
  s.virtual_bytes = vsize;
  s.resident_bytes = rss_pages * page_size;
  return s;
}

absl::StatusOr<ProcessStats> ReadProcessStats() {
  const std::string stat = ReadFile("/proc/self/stat");
  if (stat.empty()) return absl::UnavailableError("cannot read /proc/self/stat");
  absl::StatusOr<ProcessStats> s =
      ParseProcStat(stat, static_cast<double>(sysconf(_SC_CLK_TCK)),
                    static_cast<double>(sysconf(_SC_PAGESIZE)), BootTime());
  if (!s.ok()) return s;
  s->open_fds = OpenFds();
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    s->max_fds = static_cast<double>(limit.rlim_cur);
  }
  return s;
}

}  // namespace paramd
