// File: tests/server_test_util.h
//
// Raw-gRPC access to a real hybrid-paramd cluster (tests/client_cluster.h)
// for the server's integration tests: deliberately NOT the client library,
// so that every request the tests make (including malformed ones) is spelled
// out in proto/paramd.proto terms.
//
// Not thread-safe; use from the test's main thread.
#ifndef PARAMD_TESTS_SERVER_TEST_UTIL_H_
#define PARAMD_TESTS_SERVER_TEST_UTIL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "kernels/format.h"
#include "proto/health.grpc.pb.h"
#include "proto/paramd.grpc.pb.h"
#include "tests/client_cluster.h"

namespace paramd {
namespace testing {

// One tensor of a test model: row-major FP32 values.
struct TestTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// A recipe publishing every tensor as FP32 passthrough from an FP32 source
// in both directions (fetches return the masters exactly).
extern const char kFp32PassthroughRecipe[];

// A two-daemon SGD cluster (momentum 0) with two expected pushers.
TestClusterOptions TwoDaemonSgd(double lr);

// context.set_deadline(now + timeout).
void SetDeadline(grpc::ClientContext& context, absl::Duration timeout);

// ---- What an operator's probes see (gRPC health, /metrics) ----

using HealthStatus = grpc::health::v1::HealthCheckResponse;

// A loopback port that was free a moment ago (bound to 0, then released).
int FreePort();

// GET http://127.0.0.1:<port><path> (HTTP/1.0); the whole response, or ""
// if nothing answers.
std::string HttpGet(int port, const std::string& path);

// The health of `service` ("" = the process) at `address`; UNKNOWN if the
// call fails.
HealthStatus::ServingStatus Health(const std::string& address, const std::string& service);

// Polls Health every 50 ms until it is `want`; false after `timeout`.
bool WaitForHealth(const std::string& address, const std::string& service,
                   HealthStatus::ServingStatus want, absl::Duration timeout);

// Writes an FP32 safetensors file.
absl::Status WriteModel(const std::string& path, const std::vector<TestTensor>& tensors);

// Normally distributed values (deterministic in `seed`).
std::vector<float> RandomValues(int64_t n, uint32_t seed, float stddev = 1.0f);

// What one daemon's Fetch returned: the plan and, per piece, its bytes.
struct FetchedPieces {
  rpc::FetchPlan plan;
  std::vector<QuantizedTensor> pieces;  // parallel to plan.pieces()
};

class RawCluster {
 public:
  static absl::StatusOr<std::unique_ptr<RawCluster>> Start(const TestClusterOptions& options);

  TestCluster& cluster() { return *cluster_; }
  rpc::Coordinator::Stub& coordinator() { return *coordinator_; }
  // Daemon stubs by rank (from the manifest of the last Load/Refresh).
  rpc::Daemon::Stub& daemon(int rank) { return *daemons_.at(rank); }
  int num_daemons() const { return static_cast<int>(daemons_.size()); }
  const rpc::Manifest& manifest() const { return manifest_; }
  const rpc::TensorInfo& tensor(const std::string& name) const;
  HybridSpec spec(const std::string& name) const;

  // Coordinator.Load (retried while daemons are still joining), then
  // refreshes the manifest and daemon stubs. Returns the committed version.
  // `force` by default: test suites reload one cluster between cases (the
  // refusal without it is tested in tests/client_hpctl_test.cc).
  absl::StatusOr<int64_t> Load(const std::string& path, const std::string& recipe_text,
                               absl::Duration timeout = absl::Seconds(30), bool force = true);
  absl::Status RefreshManifest();
  absl::StatusOr<int64_t> WaitForVersion(int64_t min_version,
                                         absl::Duration timeout = absl::Seconds(20));

  // Daemon.Fetch on daemon `rank`; the grpc status of the call.
  grpc::Status FetchFrom(int rank, const rpc::FetchRequest& request, absl::Duration timeout,
                         FetchedPieces* out);
  // Every piece of (tensor, direction) at `version` from every daemon,
  // assembled (//sharding:assemble) into the whole tensor's layout.
  absl::StatusOr<QuantizedTensor> FetchAssembled(int64_t version, const std::string& tensor,
                                                 Direction direction,
                                                 absl::Duration timeout = absl::Seconds(10));
  // Each daemon's pieces of (tensor, direction) at `version`.
  absl::StatusOr<std::vector<QuantizedTensor>> FetchPieces(int64_t version,
                                                           const std::string& tensor,
                                                           Direction direction);

  // A push stream of `messages` to daemon `rank`, as given and then (with
  // `add_end`) an end marker carrying the total chunk bytes of `messages`
  // (a message of its own; it names the version and pusher of the first
  // message if `messages` is empty). Without `add_end` the stream is
  // exactly `messages`, then a half-close.
  grpc::Status PushRaw(int rank, const std::vector<rpc::PushGradientsRequest>& messages,
                       rpc::PushGradientsResponse* response = nullptr, bool add_end = true);
  // The gradients of pusher `pusher_id` for `version` (whole tensors, FP32),
  // routed by rows: one stream to EVERY daemon (empty where it owns none).
  // The first failing daemon's status.
  absl::Status PushAll(int64_t version, const std::string& pusher_id,
                       const std::map<std::string, std::vector<float>>& gradients);

  absl::StatusOr<rpc::DaemonStats> Stats(int rank, bool include_shards = false);

  // The FP32 masters of `names` at `version`, for tensors published as
  // IDENTITY_FP32 from an FP32 source (a fetch returns the masters exactly).
  absl::StatusOr<std::map<std::string, std::vector<float>>> Fp32Masters(
      int64_t version, const std::vector<std::string>& names);

  // Insecure channel; with the options' cluster secret as its bearer token
  // when one was given, so that tests can call cluster-internal RPCs as a
  // member would and reach the checks behind authentication.
  std::shared_ptr<grpc::Channel> Channel(const std::string& address) const;

 private:
  std::unique_ptr<TestCluster> cluster_;
  std::string cluster_secret_;
  std::shared_ptr<grpc::Channel> coordinator_channel_;
  std::unique_ptr<rpc::Coordinator::Stub> coordinator_;
  std::vector<std::unique_ptr<rpc::Daemon::Stub>> daemons_;
  rpc::Manifest manifest_;
};

// A named recipe HybridSpec body ("rowwise { format: ... } ...").
struct FormatCombo {
  std::string name;
  std::string spec;
};
// The format pairs the multi-process tests cover: every format in both
// directions, mixed pairs, FP32 source, pow2 scales, the three
// ROWWISE_DEQUANTIZED columnwise sources and a rowwise-only tensor.
std::vector<FormatCombo> FormatCombos();

// The end marker of a push stream of `messages` (total: their chunk bytes).
rpc::PushGradientsRequest EndMessage(const std::vector<rpc::PushGradientsRequest>& messages);

// The whole FP32 rows [row_begin, row_end) of a [rows][cols] tensor as one
// push message chunk.
rpc::PushGradientsRequest GradientMessage(int64_t version, const std::string& pusher,
                                          const std::string& tensor, int64_t row_begin,
                                          int64_t row_end, const float* values, int64_t cols);

}  // namespace testing
}  // namespace paramd

#endif  // PARAMD_TESTS_SERVER_TEST_UTIL_H_
