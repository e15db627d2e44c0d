// The daemon's backend seam without a GPU: the cpu backend is ShardSet
// (same published bytes), and asking for the gpu backend in a binary that
// does not link it is a clear FAILED_PRECONDITION at Daemon::Create.
#include "server/backend/shard_backend.h"

#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "server/daemon/daemon.h"
#include "server/server.h"

namespace paramd {
namespace {

std::vector<TensorDef> Tensors() {
  TensorDef t;
  t.name = "w";
  t.rows = 40;
  t.cols = 64;
  t.spec.rowwise = DefaultQuantSpec(Format::kFp8Current);
  t.spec.columnwise = DefaultQuantSpec(Format::kMxfp8);
  return {t};
}

absl::Status NoReduce(absl::Span<float>) { return absl::OkStatus(); }

TEST(ShardBackendTest, CpuBackendPublishesWhatShardSetPublishes) {
  const std::vector<ShardDef> shards = {{0, 0, 40}};
  OptimizerOptions opt;
  ShardBackendOptions options;
  options.optimizer = opt;
  absl::StatusOr<std::unique_ptr<ShardBackend>> backend =
      CreateShardBackend(DaemonBackend::kCpu, Tensors(), shards, options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->name(), "cpu");
  ASSERT_NE((*backend)->host_state(), nullptr);
  absl::StatusOr<std::unique_ptr<ShardSet>> set = ShardSet::Create(Tensors(), shards, opt);
  ASSERT_TRUE(set.ok());
  for (int i = 0; i < 40 * 64; ++i) {
    (*backend)->load_master(0)[i] = (*set)->master(0)[i] = 0.01f * (i % 97) - 0.3f;
    (*backend)->gradient(0)[i] = (*set)->gradient(0)[i] = 0.001f * (i % 13);
  }
  for (bool apply : {false, true}) {
    absl::StatusOr<std::shared_ptr<const PublishedVersion>> a =
        (*backend)->Step(apply ? 1 : 0, apply, NoReduce, true);
    absl::StatusOr<std::shared_ptr<const PublishedVersion>> b =
        (*set)->Step(apply ? 1 : 0, apply, NoReduce);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ((*a)->pieces.size(), 2u);
    ASSERT_EQ((*a)->pieces.size(), (*b)->pieces.size());
    for (size_t i = 0; i < (*a)->pieces.size(); ++i) {
      EXPECT_EQ((*a)->pieces[i].q.data, (*b)->pieces[i].q.data);
      EXPECT_EQ((*a)->pieces[i].q.scales, (*b)->pieces[i].q.scales);
      EXPECT_EQ((*a)->pieces[i].q.scale_inv, (*b)->pieces[i].q.scale_inv);
    }
  }
  // The optimizer step consumed the accumulator.
  EXPECT_EQ((*backend)->gradient(0)[5], 0.0f);
}

TEST(ShardBackendTest, GpuBackendNotLinkedIsAClearError) {
  ASSERT_FALSE(GpuShardBackendLinked());  // this test binary never links it
  absl::StatusOr<std::unique_ptr<ShardBackend>> backend =
      CreateShardBackend(DaemonBackend::kGpu, Tensors(), {{0, 0, 40}}, ShardBackendOptions());
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(backend.status().message().find("--config=cuda"), absl::string_view::npos);
}

TEST(ShardBackendTest, DaemonBackendFlag) {
  DaemonOptions options;
  options.backend = "gpu";
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Create(options);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition) << d.status();
  options.backend = "tpu";
  d = Daemon::Create(options);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << d.status();
  for (const char* ok : {"auto", "cpu"}) {
    options.backend = ok;
    d = Daemon::Create(options);
    EXPECT_TRUE(d.ok()) << ok << ": " << d.status();
  }
}

// The binary's startup path: a refused --backend is an error, not a crash
// (ParamdServer::Start used to shut down a server it never built).
TEST(ShardBackendTest, ServerStartWithRefusedBackendFailsCleanly) {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.daemon.backend = "gpu";
  absl::StatusOr<std::unique_ptr<ParamdServer>> s = ParamdServer::Start(options);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
}

}  // namespace
}  // namespace paramd
