// The device fetch RPCs on a daemon that cannot serve them (runs on CPU-only
// machines, in CI): a --backend=cpu daemon refuses OpenDeviceChannel with
// FAILED_PRECONDITION (whether or not the binary was built with CUDA), an
// unknown channel is NOT_FOUND (also at once with reply_after_send), and
// the daemon keeps serving the host Fetch stream.
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "proto/paramd.grpc.pb.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

TEST(DeviceFetchRefusal, CpuDaemonRefusesClearlyAndKeepsServing) {
  TestClusterOptions options;
  options.daemons = 1;
  options.expected_pushers = 1;
  options.daemon_flags = {"--backend=cpu"};
  absl::StatusOr<std::unique_ptr<RawCluster>> cluster = RawCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  RawCluster& c = **cluster;
  const std::vector<TestTensor> tensors = {{"w", {64, 32}, RandomValues(64 * 32, 1)}};
  const std::string path = c.cluster().dir() + "/m.safetensors";
  ASSERT_TRUE(WriteModel(path, tensors).ok());
  ASSERT_TRUE(c.Load(path, "").ok());

  {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(10));
    rpc::OpenDeviceChannelRequest request;
    request.set_trainer_address("nccl|127.0.0.1:1|127.0.0.1:2|host|0000:00:00.0");
    std::unique_ptr<grpc::ClientReader<rpc::DeviceChannelEvent>> reader =
        c.daemon(0).OpenDeviceChannel(&context, request);
    rpc::DeviceChannelEvent event;
    EXPECT_FALSE(reader->Read(&event));
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), "--backend=gpu")) << s.error_message();
  }
  {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(10));
    rpc::FetchDeviceRequest request;
    request.set_channel(42);
    request.set_version(0);
    rpc::TensorDirections* td = request.add_tensors();
    td->set_tensor("w");
    td->add_directions(rpc::DIRECTION_ROWWISE);
    rpc::FetchDeviceResponse response;
    const grpc::Status s = c.daemon(0).FetchDevice(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  }
  // reply_after_send (the trainer receives beside the call): a request
  // refused before any send answers at once, never at its deadline, for a
  // published version and for one that is not (nothing is stepped here).
  for (int64_t version : {0, 5}) {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(10));
    rpc::FetchDeviceRequest request;
    request.set_channel(42);
    request.set_version(version);
    request.set_reply_after_send(true);
    rpc::TensorDirections* td = request.add_tensors();
    td->set_tensor("w");
    td->add_directions(rpc::DIRECTION_ROWWISE);
    rpc::FetchDeviceResponse response;
    const absl::Time start = absl::Now();
    const grpc::Status s = c.daemon(0).FetchDevice(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << version << ": " << s.error_message();
    EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << version;
  }
  absl::StatusOr<QuantizedTensor> host = c.FetchAssembled(0, "w", Direction::kRowwise);
  EXPECT_TRUE(host.ok()) << host.status();
}

}  // namespace
}  // namespace testing
}  // namespace paramd
