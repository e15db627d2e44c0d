// File: server/daemon/version_reporter.h
//
// The daemon's ReportVersion calls to the coordinator, off the daemon's
// worker: Report() never blocks, so a coordinator that is down or being
// restarted never holds up the next step (its retries used to sleep on the
// worker, up to 3.2 s at a time). One thread sends the newest request; a
// failed call is retried with backoff (100 ms doubling, at most 1 s apart)
// until it succeeds, a newer request replaces it (a newer version, or the
// same version after a rewind: the coordinator only needs the latest), or
// `give_up` has passed since it was queued (a restarted coordinator asks
// the daemons what they publish anyway).
//
// Threading: thread-safe. Stop() (and the destructor) drops what is queued,
// cuts a backoff short and waits for a call in progress (bounded by its
// deadline, which `send` sets).
#ifndef PARAMD_SERVER_DAEMON_VERSION_REPORTER_H_
#define PARAMD_SERVER_DAEMON_VERSION_REPORTER_H_

#include <functional>
#include <optional>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/paramd.pb.h"

namespace paramd {

class VersionReporter {
 public:
  // One call (blocking, with its own deadline).
  using SendFn = std::function<grpc::Status(const rpc::ReportVersionRequest&)>;
  // `on_failure`: called (on the reporter's thread) for each failed call.
  VersionReporter(
      SendFn send,
      std::function<void(const rpc::ReportVersionRequest&, const grpc::Status&)> on_failure,
      absl::Duration give_up = absl::Seconds(30));
  ~VersionReporter();
  VersionReporter(const VersionReporter&) = delete;
  VersionReporter& operator=(const VersionReporter&) = delete;

  void Report(rpc::ReportVersionRequest request);
  void Stop();
  // Until nothing is queued or being sent, at most `timeout`; whether so.
  bool WaitIdle(absl::Duration timeout);

 private:
  void Run();

  const SendFn send_;
  const std::function<void(const rpc::ReportVersionRequest&, const grpc::Status&)> on_failure_;
  const absl::Duration give_up_;
  absl::Mutex mu_;
  std::optional<rpc::ReportVersionRequest> queued_ ABSL_GUARDED_BY(mu_);
  absl::Time queued_at_ ABSL_GUARDED_BY(mu_);
  bool sending_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace paramd

#endif  // PARAMD_SERVER_DAEMON_VERSION_REPORTER_H_
