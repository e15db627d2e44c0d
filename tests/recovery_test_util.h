// File: tests/recovery_test_util.h
//
// What the recovery and coordinator-restart integration tests share: the
// test model, its deterministic gradients, and diagnostics. Test-only.
#ifndef PARAMD_TESTS_RECOVERY_TEST_UTIL_H_
#define PARAMD_TESTS_RECOVERY_TEST_UTIL_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "proto/paramd.pb.h"
#include "tests/client_cluster.h"

namespace paramd {
namespace testing {

// The test model. b.weight is large enough (9 MiB, 4.5 MiB per daemon when
// split) that a daemon's snapshot arrays and checkpoint shards span several
// gRPC messages, each under the default 4 MiB receive limit.
extern const std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> kTensors;

// Writes kTensors as an FP32 safetensors file at `path` (fixed values, plus
// `offset`: another model of the same shapes); fails the running test if
// it cannot.
void WriteModel(const std::string& path, float offset = 0.0f);

// The gradient every test pusher sends for `version`, one vector per entry
// of kTensors (deterministic).
std::vector<std::vector<float>> GradientsFor(int64_t version);

// Writes the test model at `path` and loads it through `client`, retried
// while the coordinator answers UNAVAILABLE (daemons still joining, or the
// coordinator restarting; 10 s at most): the version it was loaded as.
absl::StatusOr<int64_t> WriteAndLoadModel(client::Client& client, const std::string& path);

// Pushes GradientsFor(version), every tensor of kTensors, from `client`.
absl::Status PushGradientsFor(client::Client& client, int64_t version);

// The daemon process of `cluster` (its index for KillDaemon) holding
// `rank` in `status`; -1 if none.
int DaemonProcessOfRank(const rpc::GetStatusResponse& status, const TestCluster& cluster, int rank);

// The integer in environment variable `name`, else `fallback`.
int EnvInt(const char* name, int fallback);

// The TCP sockets of this machine with `port` at either end, from
// /proc/net/tcp ("local -> remote state"; state 0A is LISTEN, 01 ESTABLISHED,
// 02 SYN_SENT). Printed when a client cannot reach a restarted coordinator:
// it tells a listener that does not accept, or a socket connected to itself
// on the coordinator's port, from a coordinator that is simply gone.
std::string SocketsOnPort(int port);

}  // namespace testing
}  // namespace paramd

#endif  // PARAMD_TESTS_RECOVERY_TEST_UTIL_H_
