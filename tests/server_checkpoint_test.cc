// Multi-process: checkpoint and export through the real hybrid-paramd
// processes (coordinator + 2 daemons, --checkpoint_dir): Checkpoint of the
// committed version writes a complete checkpoint (listed, verified), and
// ExportRows of masters / dequantized copies returns the daemons' values.
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/reference.h"
#include "proto/checkpoint_service.grpc.pb.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

constexpr int64_t kRows = 520;
constexpr int64_t kCols = 200;
constexpr float kLr = 0.5f;

TEST(ServerCheckpointTest, CheckpointAndExportFromRealDaemons) {
  absl::StatusOr<demo::TempDir> ckpt = demo::TempDir::Create("paramd_ckpt");
  ASSERT_TRUE(ckpt.ok());
  TestClusterOptions options;
  options.daemons = 2;
  options.expected_pushers = 1;
  options.optimizer = "sgd";
  options.lr = kLr;
  options.coordinator_flags = {"--checkpoint_dir=" + ckpt->path()};
  options.daemon_flags = {"--checkpoint_dir=" + ckpt->path()};
  absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(options);
  ASSERT_TRUE(c.ok()) << c.status();
  RawCluster& cluster = **c;
  std::vector<float> w = RandomValues(kRows * kCols, 3);
  const std::string model = cluster.cluster().dir() + "/model.safetensors";
  ASSERT_TRUE(WriteModel(model, {{"w", {kRows, kCols}, w}}).ok());
  ASSERT_TRUE(cluster
                  .Load(model,
                        "default_spec { rowwise { format: MXFP8 } "
                        "columnwise { format: FP8_CURRENT } }")
                  .ok());
  const std::vector<float> g = RandomValues(w.size(), 4, 0.1f);
  ASSERT_TRUE(cluster.PushAll(0, "trainer", {{"w", g}}).ok());
  ASSERT_TRUE(cluster.WaitForVersion(1).ok());
  for (size_t i = 0; i < w.size(); ++i) w[i] -= kLr * g[i];

  auto channel = grpc::CreateChannel(cluster.cluster().coordinator_address(),
                                     grpc::InsecureChannelCredentials());
  auto coordinator = checkpoint::CheckpointCoordinator::NewStub(channel);
  {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(30));
    checkpoint::CheckpointRequest request;
    request.set_version(-1);
    checkpoint::CheckpointResponse response;
    const grpc::Status s = coordinator->Checkpoint(&context, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message() << cluster.cluster().Logs();
    EXPECT_EQ(response.version(), 1u);
    EXPECT_GT(response.total_bytes(), w.size() * 4);
  }
  {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(30));
    checkpoint::DescribeCheckpointRequest request;
    request.set_version(-1);
    request.set_verify(true);
    checkpoint::DescribeCheckpointResponse response;
    const grpc::Status s = coordinator->DescribeCheckpoint(&context, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_TRUE(response.verified());
    EXPECT_EQ(response.manifest().version(), 1u);
    EXPECT_EQ(response.manifest().world_size(), 2);
    EXPECT_EQ(response.manifest().shards_size(), 2);
  }

  // Export the masters (FP32) and the dequantized rowwise copy of each
  // daemon's rows.
  for (const rpc::ShardPiece& piece : cluster.manifest().pieces()) {
    auto daemon = checkpoint::CheckpointDaemon::NewStub(
        grpc::CreateChannel(piece.daemon_address(), grpc::InsecureChannelCredentials()));
    for (auto values : {checkpoint::EXPORT_VALUES_MASTER, checkpoint::EXPORT_VALUES_ROWWISE}) {
      grpc::ClientContext context;
      SetDeadline(context, absl::Seconds(30));
      checkpoint::ExportRowsRequest request;
      request.set_version(1);
      request.set_tensor("w");
      request.set_row_begin(piece.row_begin());
      request.set_row_end(piece.row_end());
      request.set_cols(kCols);
      request.set_dtype(checkpoint::EXPORT_DTYPE_FP32);
      request.set_values(values);
      auto reader = daemon->ExportRows(&context, request);
      std::string bytes;
      checkpoint::ExportRowsChunk chunk;
      while (reader->Read(&chunk)) bytes += chunk.data();
      const grpc::Status s = reader->Finish();
      ASSERT_TRUE(s.ok()) << s.error_message();
      const int64_t n = (piece.row_end() - piece.row_begin()) * kCols;
      ASSERT_EQ(bytes.size(), static_cast<size_t>(n * 4));
      std::vector<float> got(n);
      std::memcpy(got.data(), bytes.data(), bytes.size());
      const std::vector<float> masters(w.begin() + piece.row_begin() * kCols,
                                       w.begin() + piece.row_end() * kCols);
      if (values == checkpoint::EXPORT_VALUES_MASTER) {
        EXPECT_EQ(got, masters) << "rows " << piece.row_begin();
      } else {
        // The dequantized MXFP8 copy is close to the masters, not equal.
        int differ = 0;
        for (int64_t i = 0; i < n; ++i) {
          EXPECT_NEAR(got[i], masters[i], 0.07f * std::abs(masters[i]) + 1e-3f);
          differ += got[i] != masters[i];
        }
        EXPECT_GT(differ, 0);
      }
    }
  }
}

}  // namespace
}  // namespace testing
}  // namespace paramd

namespace paramd {
namespace testing {
namespace {

TEST(ServerCheckpointTest, CheckpointEveryNVersions) {
  absl::StatusOr<demo::TempDir> ckpt = demo::TempDir::Create("paramd_every");
  ASSERT_TRUE(ckpt.ok());
  TestClusterOptions options;
  options.daemons = 2;
  options.expected_pushers = 1;
  options.coordinator_flags = {"--checkpoint_dir=" + ckpt->path(), "--checkpoint_every=2"};
  options.daemon_flags = {"--checkpoint_dir=" + ckpt->path()};
  absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(options);
  ASSERT_TRUE(c.ok()) << c.status();
  RawCluster& cluster = **c;
  const std::string model = cluster.cluster().dir() + "/model.safetensors";
  ASSERT_TRUE(WriteModel(model, {{"w", {kRows, kCols}, RandomValues(kRows * kCols, 3)}}).ok());
  ASSERT_TRUE(cluster.Load(model, "").ok());
  const std::vector<float> g(kRows * kCols, 0.01f);
  for (int64_t v = 0; v < 2; ++v) {
    ASSERT_TRUE(cluster.PushAll(v, "trainer", {{"w", g}}).ok());
    ASSERT_TRUE(cluster.WaitForVersion(v + 1).ok());
  }
  // Version 2 was committed: a checkpoint of it appears (written in the
  // background; nothing moves the daemons on meanwhile).
  auto stub = checkpoint::CheckpointCoordinator::NewStub(grpc::CreateChannel(
      cluster.cluster().coordinator_address(), grpc::InsecureChannelCredentials()));
  checkpoint::ListCheckpointsResponse list;
  for (int i = 0; i < 200 && list.checkpoints_size() == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(5));
    ASSERT_TRUE(stub->ListCheckpoints(&context, checkpoint::ListCheckpointsRequest(), &list).ok());
  }
  ASSERT_EQ(list.checkpoints_size(), 1) << cluster.cluster().Logs();
  EXPECT_EQ(list.checkpoints(0).version(), 2u);
  EXPECT_EQ(list.checkpoints(0).world_size(), 2);
}

}  // namespace
}  // namespace testing
}  // namespace paramd
