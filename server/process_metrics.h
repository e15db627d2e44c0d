// File: server/process_metrics.h
//
// The standard Prometheus process metrics of this process, read from /proc
// at scrape time (prometheus-cpp has no process collector):
//   process_cpu_seconds_total      user + system CPU time
//   process_resident_memory_bytes  resident set size
//   process_virtual_memory_bytes   virtual memory size
//   process_open_fds               open file descriptors
//   process_max_fds                RLIMIT_NOFILE (soft)
//   process_start_time_seconds     start time, unix seconds
// server/metrics.h serves them beside the paramd_* series.
//
// Linux only (/proc/self/stat, /proc/stat, /proc/self/fd). Thread-safe.
#ifndef PARAMD_SERVER_PROCESS_METRICS_H_
#define PARAMD_SERVER_PROCESS_METRICS_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace paramd {

struct ProcessStats {
  double cpu_seconds = 0;
  double resident_bytes = 0;
  double virtual_bytes = 0;
  double start_time_seconds = 0;
  double open_fds = 0;
  double max_fds = 0;
};

// The fields of a /proc/<pid>/stat line that ProcessStats holds (CPU time,
// memory, start time; not the descriptors): `ticks_per_second` is
// sysconf(_SC_CLK_TCK), `page_size` sysconf(_SC_PAGESIZE), `boot_time` the
// btime of /proc/stat (unix seconds). The command name may hold spaces and
// parentheses. InvalidArgument for a line that is not one.
absl::StatusOr<ProcessStats> ParseProcStat(absl::string_view stat, double ticks_per_second,
                                           double page_size, double boot_time);

// This process's stats, descriptors included. Unavailable where /proc
// cannot be read.
absl::StatusOr<ProcessStats> ReadProcessStats();

}  // namespace paramd

#endif  // PARAMD_SERVER_PROCESS_METRICS_H_
