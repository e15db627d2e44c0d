// GPU only (tag gpu). Recovery of --backend=gpu daemons at 1.07 B
// parameters by default: a coordinator and two gpu daemons on one GPU
// (each rank holds half the model), snapshots every 2 steps. Rank 1 is
// SIGKILLed after version 3, a replacement started with --rank=1 takes its
// place from its buddy's snapshot of version 2, the other rank rewinds to
// its own, and the next step commits version 3 again. Prints the snapshot's
// block of the step and copy time as each daemon reports them, and the
// recovery time (kill to recovered, kill to the first new version).
//
// PARAMD_GPU_RECOVERY_TENSORS / PARAMD_GPU_RECOVERY_ROWS (16 / 8192: square
// tensors) size the model.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "proto/paramd.grpc.pb.h"
#include "safetensors/safetensors.h"
#include "tests/client_cluster.h"

namespace paramd {
namespace {

using client::Client;
using client::ClientOptions;
using testing::TestCluster;
using testing::TestClusterOptions;

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : fallback;
}

double Since(absl::Time t) { return absl::ToDoubleSeconds(absl::Now() - t); }

TEST(GpuRecoveryTest, KilledGpuDaemonIsReplacedFromItsBuddysSnapshot) {
  const int tensors = EnvInt("PARAMD_GPU_RECOVERY_TENSORS", 16);
  const int64_t rows = EnvInt("PARAMD_GPU_RECOVERY_ROWS", 8192);
  TestClusterOptions options;
  options.daemons = 2;
  options.expected_pushers = 0;  // admin steps
  options.optimizer = "adamw";
  options.lr = 0.001;
  options.daemon_flags = {"--backend=gpu", "--snapshot_every_steps=2"};
  auto started = TestCluster::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<TestCluster> cluster = *std::move(started);

  absl::Time t = absl::Now();
  const std::string model = cluster->dir() + "/model.safetensors";
  {
    std::vector<safetensors::TensorSpec> specs;
    for (int i = 0; i < tensors; ++i) {
      specs.push_back({absl::StrCat("w", i), safetensors::Dtype::kF32, {rows, rows}});
    }
    auto writer = safetensors::SafetensorsWriter::Create(model, specs);
    ASSERT_TRUE(writer.ok()) << writer.status();
    std::vector<float> v(static_cast<size_t>(rows * rows));
    for (size_t k = 0; k < v.size(); ++k) v[k] = 0.001f * static_cast<float>(k % 2001) - 1.0f;
    for (const auto& spec : specs) {
      ASSERT_TRUE((*writer)
                      ->WriteTensor(spec.name,
                                    absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(v.data()),
                                                        v.size() * 4))
                      .ok());
    }
    ASSERT_TRUE((*writer)->Finish().ok());
  }
  std::printf("model: %d x [%lld, %lld] written in %.1f s\n", tensors, static_cast<long long>(rows),
              static_cast<long long>(rows), Since(t));

  ClientOptions co;
  co.coordinator_address = cluster->coordinator_address();
  co.role = ClientOptions::Role::kObserver;
  auto connected = Client::Connect(co);
  ASSERT_TRUE(connected.ok()) << connected.status();
  std::unique_ptr<Client> c = *std::move(connected);
  const std::string recipe =
      "default_spec { rowwise { format: FP8_CURRENT } columnwise { format: FP8_CURRENT } }";
  t = absl::Now();
  absl::StatusOr<int64_t> loaded;
  for (int attempt = 0; attempt < 600; ++attempt) {
    loaded = c->Load(model, recipe, absl::Seconds(300));
    if (!absl::IsUnavailable(loaded.status())) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(loaded.ok()) << loaded.status() << cluster->Logs();
  std::printf("loaded in %.1f s\n", Since(t));
  for (int64_t v = 0; v < 3; ++v) {
    t = absl::Now();
    auto stepped = c->Step(v, /*wait=*/true, absl::Seconds(120));
    ASSERT_TRUE(stepped.ok()) << stepped.status() << cluster->Logs();
    std::printf("admin step %lld -> %lld: %.3f s\n", static_cast<long long>(v),
                static_cast<long long>(*stepped), Since(t));
  }
  // Both snapshots of 2 copied and sent to the buddy.
  t = absl::Now();
  rpc::GetStatusResponse status;
  while (Since(t) < 240) {
    auto s = c->Status(false, absl::Seconds(10));
    ASSERT_TRUE(s.ok()) << s.status();
    status = *s;
    if (status.daemons_size() == 2 && status.daemons(0).buddy_snapshot_version() == 2 &&
        status.daemons(1).buddy_snapshot_version() == 2) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_EQ(status.daemons(0).buddy_snapshot_version(), 2) << cluster->Logs();
  ASSERT_EQ(status.daemons(1).buddy_snapshot_version(), 2) << cluster->Logs();
  std::printf("snapshots of 2 copied and at the buddies %.1f s after version 3\n", Since(t));
  for (int d = 0; d < 2; ++d) {
    const rpc::DaemonStats& s = status.daemons(d);
    std::printf("rank %d: snapshot v%lld (%s, %lld MiB): blocked the step %.6f s, copy %.3f s\n",
                s.rank(), static_cast<long long>(s.snapshot_version()),
                s.snapshot_capture().c_str(), static_cast<long long>(s.snapshot_bytes() >> 20),
                s.snapshot_block_seconds(), s.snapshot_copy_seconds());
    EXPECT_EQ(s.snapshot_capture(), "device spare");
    EXPECT_LT(s.snapshot_block_seconds(), 1.0);
  }

  // Kill rank 1 and start its replacement at once.
  int victim = -1;
  for (const rpc::Member& m : status.members()) {
    if (m.role() != rpc::ROLE_DAEMON || m.rank() != 1) continue;
    for (int d = 0; d < 2; ++d) {
      if (m.address() == absl::StrCat("127.0.0.1:", cluster->daemon_port(d))) victim = d;
    }
  }
  ASSERT_GE(victim, 0);
  const absl::Time killed = absl::Now();
  cluster->KillDaemon(victim);
  auto replacement = cluster->StartDaemon({"--rank=1"});
  ASSERT_TRUE(replacement.ok()) << replacement.status();
  rpc::RecoveryStatus recovery;
  while (Since(killed) < 300) {
    auto s = c->Status(false, absl::Seconds(10));
    if (s.ok() && s->recovery().epoch() >= 1 && s->committed_version() >= 0) {
      recovery = s->recovery();
      break;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  const double recovered = Since(killed);
  ASSERT_EQ(recovery.epoch(), 1) << cluster->Logs();
  EXPECT_EQ(recovery.rewound_to_version(), 2);
  EXPECT_EQ(recovery.source(), "snapshot v2");
  auto next = c->Step(2, /*wait=*/true, absl::Seconds(120));
  ASSERT_TRUE(next.ok()) << next.status() << cluster->Logs();
  EXPECT_EQ(*next, 3);
  const double first = Since(killed);
  std::printf(
      "recovery (gpu, %s): kill to recovered %.3f s, kill to first new version %.3f s "
      "(rewound to %lld, %lld versions lost)\n",
      recovery.source().c_str(), recovered, first,
      static_cast<long long>(recovery.rewound_to_version()),
      static_cast<long long>(recovery.versions_lost()));
  // Phase by phase: the kill until the lease expired (seen here as what the
  // coordinator's count does not cover), then its phases.
  const rpc::RecoveryPhases& p = recovery.phases();
  std::printf(
      "recovery phases: kill to loss seen %.3f s (lease), waiting for the replacement (process "
      "start, CUDA init, join) %.3f s, prepare %.3f s, recover %.3f s = connect %.3f + snapshot "
      "fetch %.3f + backend %.3f + restore %.3f + republish %.3f (+ rest)\n",
      recovered - recovery.seconds(), p.wait(), p.prepare(), p.recover(), p.connect(),
      p.snapshot_fetch(), p.backend_create(), p.restore(), p.republish());
  EXPECT_GT(p.restore(), 0);
  EXPECT_GT(p.republish(), 0);
}

}  // namespace
}  // namespace paramd
