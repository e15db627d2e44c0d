#include "server/daemon/lease_keeper.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace paramd {

LeaseKeeper::LeaseKeeper(rpc::Coordinator::Stub* coordinator, absl::Duration interval,
                         RequestFn request, VerdictFn on_verdict)
    : coordinator_(coordinator),
      interval_(interval),
      request_(std::move(request)),
      on_verdict_(std::move(on_verdict)),
      thread_([this] { Run(); }) {}

LeaseKeeper::~LeaseKeeper() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void LeaseKeeper::Run() {
  auto stopped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopped), interval_)) return;
    }
    std::optional<rpc::HeartbeatRequest> request = request_();
    if (!request) continue;
    grpc::ClientContext context;
    // Late answers are useless: the next heartbeat is due.
    context.set_deadline(absl::ToChronoTime(absl::Now() + std::max(interval_, absl::Seconds(1))));
    rpc::HeartbeatResponse response;
    const grpc::Status s = coordinator_->Heartbeat(&context, *request, &response);
    // An unreachable coordinator is not a verdict: the daemon keeps serving
    // and keeps trying (a restarted coordinator answers UNKNOWN).
    if (s.ok() && response.verdict() != rpc::HEARTBEAT_OK)
      on_verdict_(*request, response.verdict());
  }
}

}  // namespace paramd
