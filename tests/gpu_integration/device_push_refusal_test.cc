// Daemon.PushGradientsDevice refusals that need no GPU (runs on CPU-only
// machines, in CI): the host stream's push rules with its status codes
// (missing pusher, early, duplicate, stale; unknown tensor, bad dtype, rows
// outside the tensor or overlapping, rows of another daemon, tag too large)
// come first, then a --backend=cpu daemon answers FAILED_PRECONDITION; no
// refusal counts the pusher, and the daemons keep stepping on host pushes.
// A --pipelined_step daemon refuses device pushes (host pushes only).
// The accepted path (NCCL receive + device accumulate) is
// daemon_push_test's (gpu tag).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "proto/paramd.grpc.pb.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

struct Rows {
  std::string tensor;
  int64_t begin = 0;
  int64_t end = 0;
};

rpc::PushGradientsDeviceRequest Request(int64_t version, const std::string& pusher,
                                        const std::vector<Rows>& rows,
                                        rpc::DType dtype = rpc::DTYPE_BF16) {
  rpc::PushGradientsDeviceRequest r;
  r.set_channel(1);
  r.set_version(version);
  r.set_pusher_id(pusher);
  r.set_tag(7);
  for (const Rows& x : rows) {
    rpc::DevicePushTensor* t = r.add_tensors();
    t->set_tensor(x.tensor);
    t->set_row_begin(x.begin);
    t->set_row_end(x.end);
    t->set_dtype(dtype);
  }
  return r;
}

grpc::Status PushDevice(RawCluster& c, int rank, const rpc::PushGradientsDeviceRequest& r) {
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(10));
  rpc::PushGradientsResponse response;
  return c.daemon(rank).PushGradientsDevice(&context, r, &response);
}

// A host push stream of `pusher` for `version` to daemon `rank` with no
// rows: counts the pusher there.
grpc::Status CountOnly(RawCluster& c, int rank, int64_t version, const std::string& pusher) {
  rpc::PushGradientsRequest m;
  m.set_version(version);
  m.set_pusher_id(pusher);
  return c.PushRaw(rank, {m});
}

TEST(DevicePushRefusal, HostRulesThenCpuBackendNothingCounted) {
  TestClusterOptions options;
  options.daemons = 2;
  options.expected_pushers = 2;
  options.daemon_flags = {"--backend=cpu"};
  absl::StatusOr<std::unique_ptr<RawCluster>> cluster = RawCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  RawCluster& c = **cluster;
  const std::vector<TestTensor> tensors = {{"a", {256, 64}, RandomValues(256 * 64, 1)},
                                           {"b", {256, 64}, RandomValues(256 * 64, 2)},
                                           {"c", {128, 32}, RandomValues(128 * 32, 3)}};
  const std::string path = c.cluster().dir() + "/m.safetensors";
  ASSERT_TRUE(WriteModel(path, tensors).ok());
  ASSERT_TRUE(c.Load(path, "").ok());
  ASSERT_EQ(c.num_daemons(), 2);

  absl::StatusOr<rpc::DaemonStats> s0 = c.Stats(0, /*include_shards=*/true);
  absl::StatusOr<rpc::DaemonStats> s1 = c.Stats(1, /*include_shards=*/true);
  ASSERT_TRUE(s0.ok() && s1.ok());
  ASSERT_GT(s0->shards_size(), 0);
  ASSERT_GT(s1->shards_size(), 0);
  const Rows own{s0->shards(0).tensor(), s0->shards(0).row_begin(), s0->shards(0).row_end()};
  const Rows other{s1->shards(0).tensor(), s1->shards(0).row_begin(), s1->shards(0).row_end()};
  const int64_t tensor_rows = c.tensor(own.tensor).shape(0);

  auto expect = [&](const rpc::PushGradientsDeviceRequest& r, grpc::StatusCode code,
                    const std::string& text) {
    const grpc::Status s = PushDevice(c, 0, r);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), text)) << s.error_message();
  };
  expect(Request(0, "", {own}), grpc::StatusCode::INVALID_ARGUMENT, "pusher_id");
  expect(Request(1, "p1", {own}), grpc::StatusCode::OUT_OF_RANGE, "future version");
  expect(Request(0, "p1", {{"nope", 0, 1}}), grpc::StatusCode::NOT_FOUND, "unknown tensor");
  expect(Request(0, "p1", {own}, rpc::DTYPE_UNSPECIFIED), grpc::StatusCode::INVALID_ARGUMENT,
         "DTYPE_FP32 or DTYPE_BF16");
  expect(Request(0, "p1", {{own.tensor, 0, tensor_rows + 1}}), grpc::StatusCode::INVALID_ARGUMENT,
         "outside");
  expect(Request(0, "p1", {{own.tensor, 2, 2}}), grpc::StatusCode::INVALID_ARGUMENT, "outside");
  expect(Request(0, "p1", {own, own}), grpc::StatusCode::INVALID_ARGUMENT, "overlap");
  expect(Request(0, "p1", {other}), grpc::StatusCode::FAILED_PRECONDITION,
         "not held by daemon rank 0");
  {
    rpc::PushGradientsDeviceRequest r = Request(0, "p1", {own});
    r.set_tag(uint64_t{1} << 63);
    expect(r, grpc::StatusCode::INVALID_ARGUMENT, "tag");
  }
  // Valid requests (rows or none): the cpu backend cannot take them.
  expect(Request(0, "p1", {own}), grpc::StatusCode::FAILED_PRECONDITION, "--backend=gpu");
  expect(Request(0, "p1", {}), grpc::StatusCode::FAILED_PRECONDITION, "--backend=gpu");
  expect(Request(0, "p1", {own}, rpc::DTYPE_FP32), grpc::StatusCode::FAILED_PRECONDITION,
         "--backend=gpu");
  absl::StatusOr<rpc::DaemonStats> after = c.Stats(0);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->pushers_received(), 0);
  EXPECT_EQ(after->bytes_pushed(), 0);

  // p1 pushes on the host stream to daemon 0 (nothing of its rows: counts
  // it); a device push of p1 for the same version is then a duplicate.
  ASSERT_TRUE(CountOnly(c, 0, 0, "p1").ok());
  expect(Request(0, "p1", {own}), grpc::StatusCode::ALREADY_EXISTS, "already pushed");
  after = c.Stats(0);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->pushers_received(), 1);

  // Complete version 0 on the host stream (p1 on daemon 1, p2 everywhere).
  ASSERT_TRUE(CountOnly(c, 1, 0, "p1").ok());
  ASSERT_TRUE(c.PushAll(0, "p2", {}).ok());
  absl::StatusOr<int64_t> v = c.WaitForVersion(1);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, 1);
  expect(Request(0, "p3", {own}), grpc::StatusCode::FAILED_PRECONDITION, "stale push");
  absl::StatusOr<QuantizedTensor> host = c.FetchAssembled(1, own.tensor, Direction::kRowwise);
  EXPECT_TRUE(host.ok()) << host.status();
}

// --pipelined_step takes its gradients from the host push streams, bucket
// by bucket: a valid device push is refused (FAILED_PRECONDITION naming
// the option) before any byte travels, nothing is counted, and host pushes
// still step.
TEST(DevicePushRefusal, PipelinedStepTakesHostPushesOnly) {
  TestClusterOptions options;
  options.daemons = 1;
  options.expected_pushers = 1;
  options.daemon_flags = {"--backend=cpu", "--pipelined_step"};
  absl::StatusOr<std::unique_ptr<RawCluster>> cluster = RawCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  RawCluster& c = **cluster;
  const std::vector<TestTensor> tensors = {{"a", {128, 64}, RandomValues(128 * 64, 1)}};
  const std::string path = c.cluster().dir() + "/m.safetensors";
  ASSERT_TRUE(WriteModel(path, tensors).ok());
  ASSERT_TRUE(c.Load(path, "").ok());
  const grpc::Status s = PushDevice(c, 0, Request(0, "p1", {{"a", 0, 128}}));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "--pipelined_step")) << s.error_message();
  absl::StatusOr<rpc::DaemonStats> after = c.Stats(0);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->pushers_received(), 0);
  const std::map<std::string, std::vector<float>> g = {{"a", RandomValues(128 * 64, 5, 0.1f)}};
  ASSERT_TRUE(c.PushAll(0, "p1", g).ok());
  absl::StatusOr<int64_t> v = c.WaitForVersion(1);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, 1);
}

}  // namespace
}  // namespace testing
}  // namespace paramd
