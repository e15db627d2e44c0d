// File: tests/gpu_integration/gpu_cluster_util.h
//
// The set-up the device tests against real processes share (testonly,
// header-only): the format pairs the gpu backend publishes, a cluster of
// --backend=gpu daemons on GPU 0, an observer client, and a direction in
// device memory copied to a host QuantizedTensor. Failures are gtest
// failures of the calling test (a null result).
#ifndef PARAMD_TESTS_GPU_INTEGRATION_GPU_CLUSTER_UTIL_H_
#define PARAMD_TESTS_GPU_INTEGRATION_GPU_CLUSTER_UTIL_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "client/client.h"
#include "client/gpu_fetch/fetch.h"
#include "gtest/gtest.h"
#include "kernels/format.h"
#include "tests/gpu_integration/device_test_util.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {

// Every format pair of FormatCombos() but the rowwise_dequantized ones
// (UNIMPLEMENTED on the gpu backend).
inline std::vector<FormatCombo> GpuCombos() {
  std::vector<FormatCombo> out;
  for (FormatCombo& c : FormatCombos()) {
    if (!absl::StrContains(c.spec, "ROWWISE_DEQUANTIZED")) out.push_back(std::move(c));
  }
  return out;
}

// A coordinator and `daemons` daemons of `backend`, all on GPU 0, AdamW
// lr 0.01, one expected pusher.
inline std::unique_ptr<RawCluster> StartGpuCluster(int daemons,
                                                   const std::string& backend = "gpu") {
  TestClusterOptions options;
  options.daemons = daemons;
  options.expected_pushers = 1;
  options.optimizer = "adamw";
  options.lr = 0.01;
  options.daemon_flags = {"--backend=" + backend, "--gpu=0"};
  absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// An observer (no rank, not a pusher) of `c`'s coordinator.
inline std::unique_ptr<client::Client> Observer(RawCluster& c, const std::string& name) {
  client::ClientOptions options;
  options.coordinator_address = c.cluster().coordinator_address();
  options.role = client::ClientOptions::Role::kObserver;
  options.name = name;
  absl::StatusOr<std::unique_ptr<client::Client>> cl = client::Client::Connect(options);
  EXPECT_TRUE(cl.ok()) << cl.status();
  return cl.ok() ? *std::move(cl) : nullptr;
}

// The direction `b` (device buffers of a [rows, cols] tensor in `format`)
// as a host QuantizedTensor.
inline QuantizedTensor HostCopy(Format format, Direction direction, int64_t rows, int64_t cols,
                                const gpu_fetch::DeviceDirection& b) {
  QuantizedTensor q;
  q.format = format;
  q.direction = direction;
  q.rows = rows;
  q.cols = cols;
  q.data = ToHost(b.data, b.layout.data_bytes());
  q.scales = ToHost(b.scales, b.layout.scale_bytes());
  q.scale_inv = FloatToHost(b.scale_inv);
  q.amax = FloatToHost(b.amax);
  return q;
}

}  // namespace testing
}  // namespace paramd

#endif  // PARAMD_TESTS_GPU_INTEGRATION_GPU_CLUSTER_UTIL_H_
