// CPU: nccl addresses and the shared-GPU guard of device fetch.
#include "transport/nccl_address.h"

#include <cstdlib>

#include "gtest/gtest.h"

namespace paramd {
namespace {

const char kTrainer[] = "nccl|127.0.0.1:1|127.0.0.1:2|hostA|0000:19:00.0|127.0.0.1:3";
const char kDaemon0[] = "nccl|127.0.0.1:11|127.0.0.1:12|hostA|0000:08:00.0|127.0.0.1:13";
const char kDaemon1[] = "nccl|127.0.0.1:21|127.0.0.1:22|hostA|0000:08:00.0";  // same GPU
const char kOtherGpu[] = "nccl|127.0.0.1:31|127.0.0.1:32|hostA|0000:29:00.0|127.0.0.1:33";
const char kOtherHost[] = "nccl|10.0.0.2:41|10.0.0.2:42|hostB|0000:08:00.0|10.0.0.2:43";
const char kOnTrainerGpu[] = "nccl|127.0.0.1:51|127.0.0.1:52|hostA|0000:19:00.0|127.0.0.1:53";

TEST(NcclAddressTest, Parses) {
  absl::StatusOr<NcclAddress> a = ParseNcclAddress(kDaemon0);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->header_address, "127.0.0.1:11");
  EXPECT_EQ(a->sync_address, "127.0.0.1:12");
  EXPECT_EQ(a->gpu, "hostA|0000:08:00.0");
  EXPECT_EQ(a->control_address, "127.0.0.1:13");
  absl::StatusOr<NcclAddress> b = ParseNcclAddress(kDaemon1);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->control_address, "");
  EXPECT_EQ(ParseNcclAddress("host|127.0.0.1:1").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseNcclAddress("nccl|a|b|c").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(NcclAddressTest, SecondNcclPeerOnOneGpuIsRefusedWithTheReasonAndTheWayOut) {
  absl::Status s =
      CheckNcclPeerGpuUnshared(kTrainer, {kDaemon0}, kDaemon1, "daemon 1 at 127.0.0.1:7001", false);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  for (const char* part : {"daemon 1 at 127.0.0.1:7001", "0000:08:00.0", "hostA",
                           "NCCL_P2P_DISABLE=1", "one daemon per GPU"}) {
    EXPECT_NE(s.message().find(part), absl::string_view::npos) << part << " in " << s;
  }
}

TEST(NcclAddressTest, AllowedCases) {
  // NCCL_P2P_DISABLE=1 in the trainer.
  EXPECT_TRUE(CheckNcclPeerGpuUnshared(kTrainer, {kDaemon0}, kDaemon1, "d", true).ok());
  // Different GPU, or the same bus id on another host.
  EXPECT_TRUE(CheckNcclPeerGpuUnshared(kTrainer, {kDaemon0}, kOtherGpu, "d", false).ok());
  EXPECT_TRUE(CheckNcclPeerGpuUnshared(kTrainer, {kDaemon0}, kOtherHost, "d", false).ok());
  // First peer.
  EXPECT_TRUE(CheckNcclPeerGpuUnshared(kTrainer, {}, kDaemon1, "d", false).ok());
  // Peers on the trainer's own GPU go inline, not over NCCL: never counted.
  EXPECT_TRUE(CheckNcclPeerGpuUnshared(kTrainer, {kOnTrainerGpu}, kOnTrainerGpu, "d", false).ok());
  EXPECT_TRUE(
      CheckNcclPeerGpuUnshared(kTrainer, {kDaemon0, kOnTrainerGpu}, kOtherGpu, "d", false).ok());
}

TEST(NcclAddressTest, BadAddressesAreInvalidArgument) {
  EXPECT_EQ(CheckNcclPeerGpuUnshared("x", {}, kDaemon0, "d", false).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckNcclPeerGpuUnshared(kTrainer, {"x"}, kDaemon0, "d", false).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(NcclAddressTest, P2pDisabledReadsTheEnvironment) {
  unsetenv("NCCL_P2P_DISABLE");
  EXPECT_FALSE(NcclP2pDisabledInEnv());
  setenv("NCCL_P2P_DISABLE", "0", 1);
  EXPECT_FALSE(NcclP2pDisabledInEnv());
  setenv("NCCL_P2P_DISABLE", "1", 1);
  EXPECT_TRUE(NcclP2pDisabledInEnv());
  unsetenv("NCCL_P2P_DISABLE");
}

}  // namespace
}  // namespace paramd
