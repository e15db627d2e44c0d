// File: client/client_internal.h
//
// Inside client::Client (not for users; include client/client.h): the
// Impl class that client.cc (connection, manifest, versions,
// administration), client_data.cc (fetch and push over the daemons' data
// streams) and manifest.cc (the manifest and push routing) share.
// Threading and ownership are those of client/client.h.
#ifndef PARAMD_CLIENT_CLIENT_INTERNAL_H_
#define PARAMD_CLIENT_CLIENT_INTERNAL_H_

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "grpcpp/grpcpp.h"
#include "proto/paramd.grpc.pb.h"

namespace paramd {
namespace client {
namespace internal {

inline std::chrono::system_clock::time_point ToChrono(absl::Time t) {
  return absl::ToChronoTime(t);
}

// The client's view of a GetManifest / Load answer (INTERNAL if the
// coordinator's manifest is inconsistent).
absl::StatusOr<Manifest> ManifestFromProto(const rpc::Manifest& m);

// The calls of one multi-daemon fetch or push (client_data.cc).
class CallGroup;
// Daemon.Fetch of one channel, read raw (client/fetch_stream.h).
class FetchMethod;

}  // namespace internal

class Client::Impl {
 public:
  explicit Impl(ClientOptions options) : options_(std::move(options)) {}

  absl::Status Connect();
  void Leave();

  absl::Time DeadlineFor(absl::Duration timeout) const {
    return absl::Now() + (timeout == absl::ZeroDuration() ? options_.call_timeout : timeout);
  }

  absl::StatusOr<Manifest> RefreshManifest(absl::Time deadline, bool with_frozen_data = false);
  Manifest manifest() const {
    absl::MutexLock lock(&mu_);
    return manifest_;
  }
  absl::StatusOr<Layout> LayoutOf(const std::string& tensor, Direction direction) const;
  // `as_ready`: FetchRequest.as_ready, and `on_bytes_in` (if set) is called
  // with the result as soon as every target's bytes are in place, before
  // the daemons' streams end (Client::FetchAsReady).
  absl::StatusOr<FetchResult> Fetch(int64_t version, const std::vector<FetchTarget>& targets,
                                    absl::Time deadline, bool as_ready = false,
                                    const std::function<void(FetchResult&)>& on_bytes_in = nullptr);
  absl::StatusOr<PushResult> PushGradients(int64_t version, absl::Span<const Gradient> gradients,
                                           absl::Time deadline, PushCoverage coverage);
  absl::StatusOr<int64_t> WaitForVersion(int64_t min_version, absl::Time deadline);
  absl::StatusOr<VersionInfo> WaitForVersionInfo(int64_t min_version, absl::Time deadline);
  absl::Status WatchVersion(int64_t min_version,
                            const std::function<bool(const VersionInfo&)>& on_event,
                            absl::Time deadline);
  absl::StatusOr<rpc::GetStatusResponse> Status(bool include_shards, absl::Time deadline);
  absl::StatusOr<int64_t> Load(const std::string& path, const std::string& recipe,
                               absl::Time deadline, bool replace_model);
  absl::StatusOr<int64_t> Step(int64_t version, bool wait, absl::Time deadline);
  absl::StatusOr<recipe::OptimizerConfig> SetOptimizerSchedule(const recipe::LrSchedule& schedule,
                                                               std::optional<float> lr,
                                                               absl::Time deadline);
  FetchStats fetch_stats() const {
    absl::MutexLock lock(&mu_);
    return totals_;
  }

  std::string member_id_;
  int rank_ = -1;

  std::shared_ptr<grpc::Channel> DaemonChannel(const std::string& address) {
    absl::MutexLock lock(&mu_);
    return DaemonChannelLocked(address);
  }
  absl::StatusOr<int64_t> LoadDeclared(
      const std::vector<std::pair<std::string, std::vector<int64_t>>>& tensors,
      const std::string& recipe, absl::Time deadline, bool replace_model,
      const std::vector<FrozenTensor>& frozen);
  // Set by Connect, then read-only.
  std::shared_ptr<grpc::Channel> coordinator_channel() const { return coordinator_channel_; }
  const auth::ChannelSecurity& security() const { return security_; }

 private:
  // One (tensor, direction) of a fetch, resolved against the manifest.
  struct Resolved {
    const TensorMeta* meta = nullptr;
    Direction direction = Direction::kRowwise;
    QuantSpec spec;
    Layout layout;
    absl::Span<uint8_t> data;  // destination (caller's or the result's)
    absl::Span<uint8_t> scales;
    // Filled while pieces arrive (under the fetch's mutex).
    int64_t rows_covered = 0;
    bool have_scale = false;
    float scale_inv = 1.0f;
    float amax = 0.0f;
  };

  void SetManifest(Manifest m) {
    absl::MutexLock lock(&mu_);
    manifest_ = std::move(m);
  }
  std::shared_ptr<rpc::Daemon::Stub> DaemonStub(const std::string& address);
  std::shared_ptr<const internal::FetchMethod> DaemonFetchMethod(const std::string& address);
  std::shared_ptr<grpc::Channel> DaemonChannelLocked(const std::string& address)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status FetchFromDaemon(int64_t version, const std::string& address,
                               const rpc::FetchRequest& request,
                               std::map<std::pair<std::string, Direction>, int>& index,
                               std::vector<Resolved>& resolved, absl::Mutex& result_mu,
                               FetchStats& stats, internal::CallGroup& group, absl::Time deadline,
                               const std::function<absl::Status()>& on_bytes_in);
  absl::Status PushToDaemon(int64_t version, const Manifest& manifest, int rank,
                            absl::Span<const Gradient> gradients, PushResult& result,
                            absl::Mutex& result_mu, internal::CallGroup& group,
                            absl::Time deadline);

  ClientOptions options_;
  auth::ChannelSecurity security_;  // set by Connect, then read-only
  std::shared_ptr<grpc::Channel> coordinator_channel_;
  std::unique_ptr<rpc::Coordinator::Stub> coordinator_;

  mutable absl::Mutex mu_;
  Manifest manifest_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<rpc::Daemon::Stub>> daemons_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<grpc::Channel>> daemon_channels_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<const internal::FetchMethod>> fetch_methods_
      ABSL_GUARDED_BY(mu_);
  FetchStats totals_ ABSL_GUARDED_BY(mu_);
  // The coordinator's recovery epoch as last seen (-1: none seen yet).
  int64_t recovery_epoch_ ABSL_GUARDED_BY(mu_) = -1;
};

}  // namespace client
}  // namespace paramd

#endif  // PARAMD_CLIENT_CLIENT_INTERNAL_H_
