#include "hpctl/progress.h"

#include <unistd.h>

#include <cstdio>
#include <utility>

#include "absl/time/time.h"

namespace paramd {
namespace hpctl {

bool StderrIsTerminal() { return ::isatty(STDERR_FILENO) == 1; }

ProgressBar::ProgressBar(bool enabled) : enabled_(enabled), start_(Clock::now()) {}

void ProgressBar::Update(uint64_t done, uint64_t total) {
  if (!enabled_) return;
  const auto now = Clock::now();
  if (done != total && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  const double fraction = total == 0 ? 1.0 : static_cast<double>(done) / total;
  const int filled = static_cast<int>(fraction * kWidth);
  const double seconds = std::chrono::duration<double>(now - start_).count();
  std::fprintf(stderr, "\r[%s%s] %3d%%  %.2f/%.2f GB  %.0f MB/s ", std::string(filled, '#').c_str(),
               std::string(kWidth - filled, ' ').c_str(), static_cast<int>(fraction * 100),
               done / 1e9, total / 1e9, seconds > 0 ? done / 1e6 / seconds : 0.0);
  if (done == total) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

Spinner::Spinner(std::string label, bool terminal)
    : label_(std::move(label)), terminal_(terminal), start_(std::chrono::steady_clock::now()) {
  if (!terminal_) {
    std::fprintf(stderr, "%s ...\n", label_.c_str());
    std::fflush(stderr);
    return;
  }
  thread_ = std::thread([this] {
    static constexpr char kFrames[] = "|/-\\";
    int frame = 0;
    do {
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      std::fprintf(stderr, "\r%s ... %c %.0f s ", label_.c_str(), kFrames[frame++ % 4], s);
      std::fflush(stderr);
    } while (!stop_.WaitForNotificationWithTimeout(absl::Milliseconds(200)));
  });
}

Spinner::~Spinner() { Stop(); }

double Spinner::Stop() {
  if (stopped_) return seconds_;
  stopped_ = true;
  seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  if (thread_.joinable()) {
    stop_.Notify();
    thread_.join();
    std::fprintf(stderr, "\r%s ... %.1f s   \n", label_.c_str(), seconds_);
    std::fflush(stderr);
  }
  return seconds_;
}

}  // namespace hpctl
}  // namespace paramd
