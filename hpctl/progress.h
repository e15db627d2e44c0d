// File: hpctl/progress.h
//
// The progress bar hpctl prints to stderr on a terminal for long transfers
// (export, streamed load). Not thread-safe: call Update from one thread at a
// time.
#ifndef PARAMD_HPCTL_PROGRESS_H_
#define PARAMD_HPCTL_PROGRESS_H_

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace paramd {
namespace hpctl {

// "\r[#########           ]  45%  1.2/2.7 GB  350 MB/s" on a terminal.
class ProgressBar {
 public:
  explicit ProgressBar(bool enabled) : enabled_(enabled), start_(Clock::now()) {}
  void Update(uint64_t done, uint64_t total) {
    if (!enabled_) return;
    const auto now = Clock::now();
    if (done != total && now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    const double fraction = total == 0 ? 1.0 : static_cast<double>(done) / total;
    const int filled = static_cast<int>(fraction * kWidth);
    const double seconds = std::chrono::duration<double>(now - start_).count();
    std::fprintf(stderr, "\r[%s%s] %3d%%  %.2f/%.2f GB  %.0f MB/s ",
                 std::string(filled, '#').c_str(), std::string(kWidth - filled, ' ').c_str(),
                 static_cast<int>(fraction * 100), done / 1e9, total / 1e9,
                 seconds > 0 ? done / 1e6 / seconds : 0.0);
    if (done == total) std::fprintf(stderr, "\n");
    std::fflush(stderr);
  }

 private:
  using Clock = std::chrono::steady_clock;
  static constexpr int kWidth = 30;
  bool enabled_;
  Clock::time_point start_;
  Clock::time_point last_;
};

}  // namespace hpctl
}  // namespace paramd

#endif  // PARAMD_HPCTL_PROGRESS_H_
