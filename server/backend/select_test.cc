#include "server/backend/select.h"

#include "gtest/gtest.h"
#include "transport/transport.h"

namespace paramd {
namespace {

TEST(ChooseDaemonBackendTest, FollowsTheFlagAndTheProbe) {
  EXPECT_EQ(*ChooseDaemonBackend("cpu"), DaemonBackend::kCpu);
  EXPECT_EQ(ChooseDaemonBackend("fast").status().code(), absl::StatusCode::kInvalidArgument);
  const bool gpu = ProbeTransport("nccl").ok();
  EXPECT_EQ(*ChooseDaemonBackend("auto"), gpu ? DaemonBackend::kGpu : DaemonBackend::kCpu);
  if (gpu) {
    EXPECT_EQ(*ChooseDaemonBackend("gpu"), DaemonBackend::kGpu);
  } else {
    EXPECT_EQ(ChooseDaemonBackend("gpu").status().code(), absl::StatusCode::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace paramd
