// File: common/log.h
//
// Process logging for hybrid-paramd and hpctl, through spdlog (Debian's
// libspdlog-dev). One line per event on stderr (systemd's journal and
// Kubernetes collect it), in one of two formats:
//
//   text: 2026-12-01T20:21:12.345+00:00 INFO  coordinator rank=- pid=4242 coordinator: committed
//   version 100 json: {"ts":"2026-12-01T20:21:12.345+00:00","level":"info","role":"coordinator",
//          "rank":-1,"pid":4242,"tag":"coordinator","msg":"committed version 100"}
//
// `tag` names the component that speaks (coordinator, daemon, server, ...);
// `role` and `rank` name the process (rank -1 until it has one).
//
// Levels: debug < info < warning < error. Verbose messages (VLog(n, ...))
// are debug messages shown when n <= the verbosity (--v); a verbosity above
// 0 also lowers the level to debug.
//
// Before InitLogging() (and in tests and libraries that never call it) the
// text format at info level is used, role "-".
//
// Threading: every function is thread-safe; lines are never interleaved.
#ifndef PARAMD_COMMON_LOG_H_
#define PARAMD_COMMON_LOG_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace paramd {

enum class LogLevel { kDebug, kInfo, kWarning, kError };

struct LogOptions {
  std::string format = "text";  // "text" | "json"
  std::string level = "info";   // "debug" | "info" | "warning" | "error"
  int verbosity = 0;            // VLog(n) shown when n <= verbosity
  std::string role = "-";       // e.g. "coordinator", "daemon", "both", "hpctl"
};

// InvalidArgument for an unknown format or level (nothing changes then).
absl::Status InitLogging(const LogOptions& options);

// The rank shown on every later line (-1: none).
void SetLogRank(int rank);

// True if a message at `level` would be written.
bool LogEnabled(LogLevel level);
// True if VLog(verbosity, ...) would be written.
bool VLogEnabled(int verbosity);

void LogAt(LogLevel level, absl::string_view tag, absl::string_view message);
inline void LogDebug(absl::string_view tag, absl::string_view message) {
  LogAt(LogLevel::kDebug, tag, message);
}
inline void LogInfo(absl::string_view tag, absl::string_view message) {
  LogAt(LogLevel::kInfo, tag, message);
}
inline void LogWarning(absl::string_view tag, absl::string_view message) {
  LogAt(LogLevel::kWarning, tag, message);
}
inline void LogError(absl::string_view tag, absl::string_view message) {
  LogAt(LogLevel::kError, tag, message);
}
// A debug message shown only with --v >= `verbosity`.
void VLog(int verbosity, absl::string_view tag, absl::string_view message);

}  // namespace paramd

#endif  // PARAMD_COMMON_LOG_H_
