// File: hpctl/progress.h
//
// Progress output of the long hpctl commands (load, streamed load,
// checkpoint, export), on
// stderr so that stdout stays the command's result. On a terminal the line
// is redrawn in place ("\r"); otherwise (a pipe, a log file, CI) the
// commands print whole lines only: one when the work starts and the
// result when it ends, never a carriage return.
//
// Not thread-safe: one object per command, used from one thread (Spinner
// owns its drawing thread).
#ifndef PARAMD_HPCTL_PROGRESS_H_
#define PARAMD_HPCTL_PROGRESS_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"

namespace paramd {
namespace hpctl {

// Whether stderr is a terminal (where progress is drawn in place).
bool StderrIsTerminal();

// "\r[#########           ]  45%  1.20/2.70 GB  350 MB/s" for work whose
// size is known. Draws nothing unless enabled.
class ProgressBar {
 public:
  explicit ProgressBar(bool enabled);
  // At most every 100 ms, and always at done == total (then a newline).
  void Update(uint64_t done, uint64_t total);

 private:
  using Clock = std::chrono::steady_clock;
  static constexpr int kWidth = 30;
  bool enabled_;
  Clock::time_point start_;
  Clock::time_point last_;
};

// For one blocking call whose progress the server does not report:
// "<label> ... 12 s" redrawn every 200 ms on a terminal, or the single line
// "<label> ..." when not on a terminal. Stop() (or the destructor) ends the
// line; the caller prints the result after it.
class Spinner {
 public:
  Spinner(std::string label, bool terminal);
  ~Spinner();
  Spinner(const Spinner&) = delete;
  Spinner& operator=(const Spinner&) = delete;
  // Idempotent. Returns the seconds since construction.
  double Stop();

 private:
  std::string label_;
  bool terminal_;
  std::chrono::steady_clock::time_point start_;
  absl::Notification stop_;
  std::thread thread_;
  bool stopped_ = false;
  double seconds_ = 0;
};

}  // namespace hpctl
}  // namespace paramd

#endif  // PARAMD_HPCTL_PROGRESS_H_
