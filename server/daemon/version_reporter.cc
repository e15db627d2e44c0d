#include "server/daemon/version_reporter.h"

#include <algorithm>
#include <utility>

#include "absl/time/clock.h"

namespace paramd {

VersionReporter::VersionReporter(
    SendFn send,
    std::function<void(const rpc::ReportVersionRequest&, const grpc::Status&)> on_failure,
    absl::Duration give_up)
    : send_(std::move(send)), on_failure_(std::move(on_failure)), give_up_(give_up) {
  thread_ = std::thread([this] { Run(); });
}

VersionReporter::~VersionReporter() { Stop(); }

void VersionReporter::Report(rpc::ReportVersionRequest request) {
  absl::MutexLock lock(&mu_);
  if (stop_) return;
  queued_ = std::move(request);  // replaces one not sent yet (or being retried)
  queued_at_ = absl::Now();
}

void VersionReporter::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    queued_.reset();
  }
  if (thread_.joinable()) thread_.join();
}

bool VersionReporter::WaitIdle(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]()
                  ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queued_.has_value() && !sending_; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

void VersionReporter::Run() {
  for (;;) {
    rpc::ReportVersionRequest request;
    absl::Time queued_at;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || queued_.has_value(); };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      request = std::move(*queued_);
      queued_.reset();
      queued_at = queued_at_;
      sending_ = true;
    }
    absl::Duration backoff = absl::Milliseconds(100);
    for (;;) {
      const grpc::Status s = send_(request);
      if (!s.ok() && on_failure_) on_failure_(request, s);
      absl::MutexLock lock(&mu_);
      if (s.ok() || stop_ || queued_.has_value() || absl::Now() - queued_at >= give_up_) break;
      // Sleeps the backoff unless a newer request or Stop comes first.
      auto wake = [this]()
                      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || queued_.has_value(); };
      if (mu_.AwaitWithTimeout(absl::Condition(&wake), backoff)) break;
      backoff = std::min(backoff * 2, absl::Seconds(1));
    }
    absl::MutexLock lock(&mu_);
    sending_ = false;
  }
}

}  // namespace paramd
