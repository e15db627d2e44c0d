// File: deploy/process.h
//
// Child processes for the demo and the multi-process tests: start a program,
// read its port file, stop it, and make sure no child outlives its parent
// on any exit path.
//
// Guarantees against orphans:
//   - every child is started with PR_SET_PDEATHSIG = SIGKILL, so it dies
//     with the parent even if the parent is SIGKILLed or crashes;
//   - ~ChildProcesses() and TerminateAll() send SIGTERM, wait a grace
//     period, then SIGKILL and reap;
//   - InstallCleanupSignalHandlers() makes SIGINT/SIGTERM/SIGHUP kill every
//     live child of every ChildProcesses object before the parent exits.
//
// Threading: a ChildProcesses object is not thread-safe (use it from one
// thread); the signal handler only reads an async-signal-safe pid table.
// Start() forks; call it from the thread that lives longest (the main
// thread): PDEATHSIG fires when the *thread* that forked exits.
#ifndef PARAMD_DEPLOY_PROCESS_H_
#define PARAMD_DEPLOY_PROCESS_H_

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace paramd {
namespace demo {

struct ChildOptions {
  std::string name;               // for messages ("daemon 1")
  std::vector<std::string> argv;  // argv[0] = program path (no PATH lookup)
  // Where the child's stdout/stderr go; empty = inherit. The same path for
  // both interleaves them in one file.
  std::string stdout_path;
  std::string stderr_path;
  // Give the child a pipe as stdout and keep the read end (stdout_fd()).
  // Overrides stdout_path.
  bool pipe_stdout = false;
};

class ChildProcesses {
 public:
  ChildProcesses() = default;
  ~ChildProcesses();  // TerminateAll(absl::Seconds(2))
  ChildProcesses(const ChildProcesses&) = delete;
  ChildProcesses& operator=(const ChildProcesses&) = delete;

  // Starts a child; returns its index. Internal if fork/exec fails (an exec
  // failure is reported by the child's exit code 127 and a line on stderr).
  absl::StatusOr<int> Start(const ChildOptions& options);

  pid_t pid(int index) const { return children_[index].pid; }
  const std::string& name(int index) const { return children_[index].name; }
  // Read end of the child's stdout pipe (-1 without pipe_stdout). Owned by
  // this object; closed by TerminateAll.
  int stdout_fd(int index) const { return children_[index].stdout_fd; }

  // The child's exit status (as from waitpid) if it has exited, reaping it;
  // nullopt while it runs.
  std::optional<int> Poll(int index);
  // Waits up to `timeout` for the child to exit; DeadlineExceeded if it is
  // still running.
  absl::StatusOr<int> Wait(int index, absl::Duration timeout);
  // Sends `signal` (no-op if the child has been reaped).
  void Signal(int index, int signal);
  // SIGTERM, up to `grace` for it to exit, then SIGKILL; reaps. Returns the
  // exit status.
  int Stop(int index, absl::Duration grace);
  // Stop() on every live child (SIGTERM to all first, then one shared grace
  // period).
  void TerminateAll(absl::Duration grace);

 private:
  struct Child {
    std::string name;
    pid_t pid = -1;
    int stdout_fd = -1;
    std::optional<int> status;
  };
  std::vector<Child> children_;
};

// Makes SIGINT, SIGTERM and SIGHUP kill (SIGKILL) every live child started
// by any ChildProcesses, then terminate this process with the same signal.
// Idempotent.
void InstallCleanupSignalHandlers();

// Waits until `path` holds a port number (a decimal line, written by a
// server started with --port=0 --port_file=PATH) and returns it. Gives up
// early (Unavailable) if `watch` (a ChildProcesses index in `children`)
// exits first, and with DeadlineExceeded after `timeout`.
absl::StatusOr<int> WaitForPortFile(const std::string& path, absl::Duration timeout,
                                    ChildProcesses* children = nullptr, int watch = -1);

// A fresh directory under $TEST_TMPDIR or $TMPDIR (or /tmp), removed with
// its contents by the destructor.
class TempDir {
 public:
  static absl::StatusOr<TempDir> Create(const std::string& prefix);
  TempDir(TempDir&& other) noexcept : path_(std::move(other.path_)) { other.path_.clear(); }
  TempDir& operator=(TempDir&&) = delete;
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  explicit TempDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

}  // namespace demo
}  // namespace paramd

#endif  // PARAMD_DEPLOY_PROCESS_H_
