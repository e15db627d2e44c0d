#include "deploy/process.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace paramd {
namespace demo {
namespace {

// Async-signal-safe registry of live children for the signal handler:
// slots hold a pid or 0. Only plain atomics, no allocation.
constexpr int kMaxTracked = 256;
std::atomic<pid_t> g_tracked[kMaxTracked];

void Track(pid_t pid) {
  for (auto& slot : g_tracked) {
    pid_t empty = 0;
    if (slot.compare_exchange_strong(empty, pid)) return;
  }
  // More than kMaxTracked live children: PDEATHSIG still covers them.
}

void Untrack(pid_t pid) {
  for (auto& slot : g_tracked) {
    pid_t expected = pid;
    if (slot.compare_exchange_strong(expected, 0)) return;
  }
}

void CleanupHandler(int sig) {
  for (auto& slot : g_tracked) {
    const pid_t pid = slot.load();
    if (pid > 0) kill(pid, SIGKILL);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

int OpenForChild(const std::string& path) {
  return open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
}

}  // namespace

ChildProcesses::~ChildProcesses() { TerminateAll(absl::Seconds(2)); }

absl::StatusOr<int> ChildProcesses::Start(const ChildOptions& options) {
  if (options.argv.empty()) return absl::InvalidArgumentError("empty argv");
  // Everything the child needs is prepared before fork (no allocation
  // between fork and exec).
  std::vector<char*> argv;
  for (const std::string& a : options.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  int out_fd = -1, err_fd = -1, pipe_fds[2] = {-1, -1};
  if (options.pipe_stdout) {
    if (pipe2(pipe_fds, O_CLOEXEC) != 0) {
      return absl::InternalError(absl::StrCat("pipe: ", strerror(errno)));
    }
  } else if (!options.stdout_path.empty()) {
    out_fd = OpenForChild(options.stdout_path);
  }
  if (!options.stderr_path.empty()) {
    err_fd = options.stderr_path == options.stdout_path && out_fd >= 0
                 ? dup(out_fd)
                 : OpenForChild(options.stderr_path);
  }
  if ((!options.pipe_stdout && !options.stdout_path.empty() && out_fd < 0) ||
      (!options.stderr_path.empty() && err_fd < 0)) {
    const std::string error = strerror(errno);
    if (out_fd >= 0) close(out_fd);
    if (err_fd >= 0) close(err_fd);
    return absl::InternalError(
        absl::StrCat("cannot open log file for ", options.name, ": ", error));
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    return absl::InternalError(absl::StrCat("fork: ", strerror(errno)));
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);  // the parent died before prctl
    // Default signal dispositions and mask for the new program.
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGHUP, SIG_DFL);
    signal(SIGPIPE, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (options.pipe_stdout) dup2(pipe_fds[1], STDOUT_FILENO);
    if (out_fd >= 0) dup2(out_fd, STDOUT_FILENO);
    if (err_fd >= 0) dup2(err_fd, STDERR_FILENO);
    execv(argv[0], argv.data());
    const char* msg = "exec failed: ";
    (void)!write(STDERR_FILENO, msg, strlen(msg));
    (void)!write(STDERR_FILENO, argv[0], strlen(argv[0]));
    (void)!write(STDERR_FILENO, "\n", 1);
    _exit(127);
  }
  Track(pid);
  if (out_fd >= 0) close(out_fd);
  if (err_fd >= 0) close(err_fd);
  Child child;
  child.name = options.name;
  child.pid = pid;
  if (options.pipe_stdout) {
    close(pipe_fds[1]);
    child.stdout_fd = pipe_fds[0];
  }
  children_.push_back(std::move(child));
  return static_cast<int>(children_.size()) - 1;
}

std::optional<int> ChildProcesses::Poll(int index) {
  Child& c = children_[index];
  if (c.status.has_value()) return c.status;
  int status = 0;
  const pid_t r = waitpid(c.pid, &status, WNOHANG);
  if (r == c.pid) {
    c.status = status;
    Untrack(c.pid);
  }
  return c.status;
}

absl::StatusOr<int> ChildProcesses::Wait(int index, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (auto s = Poll(index)) return *s;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          children_[index].name, " still running after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

void ChildProcesses::Signal(int index, int signal) {
  if (!Poll(index).has_value()) kill(children_[index].pid, signal);
}

int ChildProcesses::Stop(int index, absl::Duration grace) {
  Signal(index, SIGTERM);
  auto status = Wait(index, grace);
  if (status.ok()) return *status;
  Signal(index, SIGKILL);
  while (!Poll(index).has_value()) absl::SleepFor(absl::Milliseconds(5));
  return *children_[index].status;
}

void ChildProcesses::TerminateAll(absl::Duration grace) {
  for (size_t i = 0; i < children_.size(); ++i) Signal(i, SIGTERM);
  const absl::Time deadline = absl::Now() + grace;
  for (size_t i = 0; i < children_.size(); ++i) {
    while (!Poll(i).has_value() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
    if (!Poll(i).has_value()) Stop(i, absl::ZeroDuration());
    if (children_[i].stdout_fd >= 0) {
      close(children_[i].stdout_fd);
      children_[i].stdout_fd = -1;
    }
  }
}

void InstallCleanupSignalHandlers() {
  static std::atomic<bool> installed{false};
  if (installed.exchange(true)) return;
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = CleanupHandler;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &sa, nullptr);
}

absl::StatusOr<int> WaitForPortFile(const std::string& path, absl::Duration timeout,
                                    ChildProcesses* children, int watch) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    int port = 0;
    const std::string content = text.str();
    // A complete port file ends with a newline (or was renamed into place).
    if (!content.empty() && absl::SimpleAtoi(absl::StripAsciiWhitespace(content), &port) &&
        port > 0) {
      return port;
    }
    if (children != nullptr && watch >= 0 && children->Poll(watch).has_value()) {
      return absl::UnavailableError(absl::StrCat(children->name(watch), " exited with status ",
                                                 *children->Poll(watch),
                                                 " before writing its port file ", path));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("no port in ", path, " after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

absl::StatusOr<TempDir> TempDir::Create(const std::string& prefix) {
  const char* base = getenv("TEST_TMPDIR");
  if (base == nullptr || *base == '\0') base = getenv("TMPDIR");
  if (base == nullptr || *base == '\0') base = "/tmp";
  std::string templ = absl::StrCat(base, "/", prefix, "XXXXXX");
  if (mkdtemp(templ.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", templ, ": ", strerror(errno)));
  }
  return TempDir(templ);
}

TempDir::~TempDir() {
  if (path_.empty()) return;
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

}  // namespace demo
}  // namespace paramd
