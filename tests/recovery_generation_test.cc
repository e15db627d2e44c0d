// Recovery never crosses model generations, against real processes
// (tests/client_cluster.h): a coordinator and two hybrid-paramd daemons on
// loopback. Model A is loaded, stepped and checkpointed; model B (the same
// shapes, other values) replaces it with load --force and steps; a daemon
// is SIGKILLed and a replacement takes its rank. The cluster comes back
// with B's bytes -- from B's checkpoint, or from B's snapshots -- never
// from A's newer checkpoint in the same store; with nothing of B to go
// back to, the recovery fails and says whose checkpoint it refused; a
// restore of a checkpoint is then a way out. A coordinator restarted from
// its --state_file keeps the generation, and a Checkpoint of a version of
// the replaced model is refused saying so.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "proto/checkpoint_service.grpc.pb.h"
#include "proto/paramd.grpc.pb.h"
#include "tests/checkpoint_test_util.h"
#include "tests/client_cluster.h"
#include "tests/recovery_test_util.h"

namespace paramd {
namespace {

using client::Client;
using client::ClientOptions;
using testing::DaemonProcessOfRank;
using testing::PushGradientsFor;
using testing::TestCluster;
using testing::TestClusterFlags;
using testing::TestClusterOptions;

class Cluster {
 public:
  // Two daemons, one pusher (this test), --checkpoint_dir everywhere, the
  // daemons' --snapshot_every_steps, the coordinator's --state_file if
  // `state_file`; model A loaded.
  static std::unique_ptr<Cluster> Start(int snapshot_every, bool state_file = false) {
    auto c = std::make_unique<Cluster>();
    c->snapshot_every_ = snapshot_every;
    TestClusterOptions options;
    options.daemons = 2;
    options.expected_pushers = 1;
    options.optimizer = "adamw";
    options.lr = 0.01;
    auto cluster = TestCluster::Start(options, [&](const std::string& dir) {
      TestClusterFlags flags;
      flags.coordinator = {"--checkpoint_dir=" + dir + "/ckpt"};
      if (state_file) flags.coordinator.push_back("--state_file=" + dir + "/coordinator.state");
      flags.daemons = {"--checkpoint_dir=" + dir + "/ckpt",
                       absl::StrCat("--snapshot_every_steps=", snapshot_every)};
      return flags;
    });
    EXPECT_TRUE(cluster.ok()) << cluster.status();
    if (!cluster.ok()) return nullptr;
    c->cluster = *std::move(cluster);
    ClientOptions co;
    co.coordinator_address = c->cluster->coordinator_address();
    co.expected_pushers = 1;
    auto client = Client::Connect(co);
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return nullptr;
    c->client = *std::move(client);
    absl::StatusOr<int64_t> v =
        testing::WriteAndLoadModel(*c->client, c->cluster->dir() + "/a.safetensors");
    EXPECT_TRUE(v.ok()) << v.status() << c->cluster->Logs();
    if (!v.ok()) return nullptr;
    return c;
  }

  // load --force of model B over whatever is served.
  absl::Status LoadB() {
    const std::string path = cluster->dir() + "/b.safetensors";
    testing::WriteModel(path, /*offset=*/2.0f);  // model B: A's shapes, other values
    absl::StatusOr<int64_t> v = client->Load(path, "", absl::Seconds(30), /*replace_model=*/true);
    if (!v.ok()) return v.status();
    return client->RefreshManifest().status();
  }

  std::unique_ptr<rpc::Coordinator::Stub> Coordinator() {
    return rpc::Coordinator::NewStub(
        grpc::CreateChannel(cluster->coordinator_address(), grpc::InsecureChannelCredentials()));
  }

  // The model generation the coordinator serves (GetManifest).
  int64_t Generation() {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    rpc::GetManifestResponse response;
    grpc::Status s = Coordinator()->GetManifest(&context, rpc::GetManifestRequest(), &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return response.manifest().model_generation();
  }

  // Load --force of checkpoint `version` of the store (a restore).
  grpc::Status Restore(int64_t version) {
    rpc::LoadRequest request;
    request.set_checkpoint_path(ckpt());
    request.set_checkpoint_version(version);
    request.set_force(true);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    rpc::LoadResponse response;
    return Coordinator()->Load(&context, request, &response);
  }

  absl::Status Push(int64_t version) {
    RETURN_IF_ERROR(PushGradientsFor(*client, version));
    return client->WaitForVersion(version + 1, absl::Seconds(30)).status();
  }

  absl::Status Checkpoint() {
    const grpc::Status s =
        testing::CheckpointVia(cluster->coordinator_address(), -1, absl::Seconds(30));
    if (!s.ok()) return absl::InternalError(s.error_message());
    return absl::OkStatus();
  }

  // Every tensor's published rowwise bytes of `version`, concatenated.
  absl::StatusOr<std::string> Published(int64_t version) {
    RETURN_IF_ERROR(client->RefreshManifest().status());
    ASSIGN_OR_RETURN(
        client::FetchResult r,
        client->Fetch(version, client::AllTargets(client->manifest(), {Direction::kRowwise})));
    std::string bytes;
    for (const client::FetchedTensor& t : r.tensors) {
      bytes.append(reinterpret_cast<const char*>(t.value.data.data()), t.value.data.size());
    }
    return bytes;
  }

  rpc::GetStatusResponse Status() {
    auto s = client->Status(false, absl::Seconds(5));
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : rpc::GetStatusResponse();
  }

  // Kills the daemon of `rank` and starts a replacement with its rank.
  absl::Status Replace(int rank) {
    const int victim = DaemonProcessOfRank(Status(), *cluster, rank);
    if (victim < 0) return absl::NotFoundError(absl::StrCat("no process of rank ", rank));
    cluster->KillDaemon(victim);
    return cluster
        ->StartDaemon({absl::StrCat("--rank=", rank), "--checkpoint_dir=" + ckpt(),
                       absl::StrCat("--snapshot_every_steps=", snapshot_every_)})
        .status();
  }

  // The recovery status once `done` holds for it (30 s at most).
  rpc::RecoveryStatus AwaitRecovery(const std::function<bool(const rpc::RecoveryStatus&)>& done) {
    const absl::Time start = absl::Now();
    rpc::RecoveryStatus r = Status().recovery();
    while (!done(r) && absl::Now() - start < absl::Seconds(30)) {
      absl::SleepFor(absl::Milliseconds(20));
      r = Status().recovery();
    }
    return r;
  }

  // Both daemons hold each other's snapshot of `version`.
  void AwaitBuddySnapshots(int64_t version) {
    for (int attempt = 0; attempt < 250; ++attempt) {
      const rpc::GetStatusResponse s = Status();
      if (s.daemons_size() == 2 && s.daemons(0).buddy_snapshot_version() == version &&
          s.daemons(1).buddy_snapshot_version() == version) {
        return;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    ADD_FAILURE() << "no buddy snapshots of version " << version << cluster->Logs();
  }

  std::string ckpt() const { return cluster->dir() + "/ckpt"; }

  // Model A stepped to 3 and checkpointed there, then model B loaded over
  // it with load --force (generation 2).
  void CheckpointAThenLoadB() {
    for (int64_t v = 0; v < 3; ++v) ASSERT_TRUE(Push(v).ok()) << cluster->Logs();
    ASSERT_TRUE(Checkpoint().ok());  // A v3
    ASSERT_TRUE(LoadB().ok()) << cluster->Logs();
    EXPECT_EQ(Generation(), 2);
  }

  std::unique_ptr<TestCluster> cluster;
  std::unique_ptr<Client> client;

 private:
  int snapshot_every_ = 0;
};

// A's checkpoint 3 is newer than B's checkpoint 1 in the same store: the
// recovery goes back to B's.
TEST(RecoveryGenerationTest, RecoveryFromDiskRestoresTheServedModelsCheckpoint) {
  auto c = Cluster::Start(/*snapshot_every=*/0);
  ASSERT_NE(c, nullptr);
  ASSERT_NO_FATAL_FAILURE(c->CheckpointAThenLoadB());
  ASSERT_TRUE(c->Push(0).ok()) << c->cluster->Logs();
  ASSERT_TRUE(c->Checkpoint().ok());  // B v1
  absl::StatusOr<std::string> b1 = c->Published(1);
  ASSERT_TRUE(b1.ok()) << b1.status();
  ASSERT_TRUE(c->Push(1).ok()) << c->cluster->Logs();

  ASSERT_TRUE(c->Replace(1).ok());
  const rpc::RecoveryStatus r =
      c->AwaitRecovery([](const rpc::RecoveryStatus& r) { return r.epoch() >= 1; });
  ASSERT_EQ(r.epoch(), 1) << r.ShortDebugString() << c->cluster->Logs();
  EXPECT_EQ(r.source(), absl::StrCat("checkpoint ", c->ckpt(), " v1"));
  EXPECT_EQ(r.rewound_to_version(), 1);
  absl::StatusOr<std::string> recovered = c->Published(1);
  ASSERT_TRUE(recovered.ok()) << recovered.status() << c->cluster->Logs();
  EXPECT_TRUE(*recovered == *b1) << "the recovered bytes are not model B's";
  EXPECT_EQ(c->Generation(), 2);
  // The trainer learns of the rewind, and the cluster steps on.
  absl::StatusOr<client::VersionInfo> info = c->client->WaitForVersionInfo(2, absl::Seconds(10));
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_TRUE(info->rewound_to.has_value());
  EXPECT_EQ(*info->rewound_to, 1);
  absl::Status pushed = c->Push(1);
  EXPECT_TRUE(pushed.ok()) << pushed << c->cluster->Logs();
}

// Snapshots every step: B's snapshot 2 is what every rank goes back to,
// not A's (newer) checkpoint 3.
TEST(RecoveryGenerationTest, RecoveryWithSnapshotsRestoresTheServedModels) {
  auto c = Cluster::Start(/*snapshot_every=*/1);
  ASSERT_NE(c, nullptr);
  ASSERT_NO_FATAL_FAILURE(c->CheckpointAThenLoadB());
  for (int64_t v = 0; v < 2; ++v) ASSERT_TRUE(c->Push(v).ok()) << c->cluster->Logs();
  c->AwaitBuddySnapshots(2);
  absl::StatusOr<std::string> b2 = c->Published(2);
  ASSERT_TRUE(b2.ok()) << b2.status();

  ASSERT_TRUE(c->Replace(1).ok());
  const rpc::RecoveryStatus r =
      c->AwaitRecovery([](const rpc::RecoveryStatus& r) { return r.epoch() >= 1; });
  ASSERT_EQ(r.epoch(), 1) << r.ShortDebugString() << c->cluster->Logs();
  EXPECT_EQ(r.source(), "snapshot v2");
  absl::StatusOr<std::string> recovered = c->Published(2);
  ASSERT_TRUE(recovered.ok()) << recovered.status() << c->cluster->Logs();
  EXPECT_TRUE(*recovered == *b2) << "the recovered bytes are not model B's";
}

// Nothing of B to go back to: the recovery fails, naming A's checkpoint and
// both generations, and never serves A.
TEST(RecoveryGenerationTest, NothingOfTheServedModelIsAFailedRecoveryThatSaysWhy) {
  auto c = Cluster::Start(/*snapshot_every=*/0);
  ASSERT_NE(c, nullptr);
  ASSERT_NO_FATAL_FAILURE(c->CheckpointAThenLoadB());
  ASSERT_TRUE(c->Push(0).ok()) << c->cluster->Logs();

  ASSERT_TRUE(c->Replace(1).ok());
  const rpc::RecoveryStatus r =
      c->AwaitRecovery([](const rpc::RecoveryStatus& r) { return !r.error().empty(); });
  EXPECT_EQ(r.epoch(), 0) << r.ShortDebugString() << c->cluster->Logs();
  EXPECT_NE(r.error().find(absl::StrCat("checkpoint 3 in ", c->ckpt(),
                                        " belongs to another model (generation 1; the cluster "
                                        "serves generation 2, loaded from ")),
            std::string::npos)
      << r.error();
  EXPECT_NE(c->Status().committed_version(), 3);
}

// A version of the replaced model, asked for by number after load --force:
// refused, saying which model the committed version belongs to.
TEST(RecoveryGenerationTest, CheckpointOfAVersionOfTheReplacedModelIsRefused) {
  auto c = Cluster::Start(/*snapshot_every=*/0);
  ASSERT_NE(c, nullptr);
  ASSERT_NO_FATAL_FAILURE(c->CheckpointAThenLoadB());
  checkpoint::CheckpointResponse response;
  const grpc::Status refused =
      testing::CheckpointVia(c->cluster->coordinator_address(), 2, absl::Seconds(30), &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << refused.error_message();
  EXPECT_NE(refused.error_message().find("version 2 is not committed (committed: 0 by model "
                                         "generation 2, loaded from "),
            std::string::npos)
      << refused.error_message();
  EXPECT_NE(refused.error_message().find("b.safetensors"), std::string::npos)
      << refused.error_message();
  // B's own committed version is checkpointed as B's.
  const grpc::Status own =
      testing::CheckpointVia(c->cluster->coordinator_address(), -1, absl::Seconds(30), &response);
  ASSERT_TRUE(own.ok()) << own.error_message();
  EXPECT_EQ(response.version(), 0u);
}

// A coordinator restarted from its --state_file serves the same model
// generation: a recovery after the restart still refuses A's checkpoint,
// and the next load is a generation after B's.
TEST(RecoveryGenerationTest, RestartedCoordinatorKeepsTheModelGeneration) {
  auto c = Cluster::Start(/*snapshot_every=*/0, /*state_file=*/true);
  ASSERT_NE(c, nullptr);
  ASSERT_NO_FATAL_FAILURE(c->CheckpointAThenLoadB());
  ASSERT_TRUE(c->Push(0).ok()) << c->cluster->Logs();
  absl::SleepFor(absl::Milliseconds(300));  // the state writer's coalescing
  ASSERT_TRUE(c->cluster->RestartCoordinator().ok()) << c->cluster->Logs();
  int64_t generation = -1;
  for (const absl::Time give_up = absl::Now() + absl::Seconds(30);
       generation != 2 && absl::Now() < give_up;) {
    absl::SleepFor(absl::Milliseconds(50));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    rpc::GetManifestResponse manifest;
    if (c->Coordinator()->GetManifest(&context, rpc::GetManifestRequest(), &manifest).ok() &&
        manifest.manifest().committed_version() >= 1) {
      generation = manifest.manifest().model_generation();
    }
  }
  ASSERT_EQ(generation, 2) << c->cluster->Logs();

  ASSERT_TRUE(c->Replace(1).ok());
  const rpc::RecoveryStatus r =
      c->AwaitRecovery([](const rpc::RecoveryStatus& r) { return !r.error().empty(); });
  EXPECT_NE(r.error().find(absl::StrCat("checkpoint 3 in ", c->ckpt(),
                                        " belongs to another model (generation 1; the cluster "
                                        "serves generation 2")),
            std::string::npos)
      << r.ShortDebugString() << c->cluster->Logs();
  EXPECT_TRUE(r.needs_load()) << r.ShortDebugString();
  ASSERT_TRUE(c->LoadB().ok()) << c->cluster->Logs();
  EXPECT_EQ(c->Generation(), 3);
}

// After a recovery with nothing to recover from, restoring a checkpoint is
// a way out as a load is: the cluster serves again (no load needed; gRPC
// health follows that flag, tests/health_truth_test), with the
// checkpoint's bytes, as a new model generation, and steps on.
TEST(RecoveryGenerationTest, RestoringACheckpointIsAWayOutOfNothingToRecoverFrom) {
  auto c = Cluster::Start(/*snapshot_every=*/0);
  ASSERT_NE(c, nullptr);
  for (int64_t v = 0; v < 3; ++v) ASSERT_TRUE(c->Push(v).ok()) << c->cluster->Logs();
  absl::StatusOr<std::string> a3 = c->Published(3);
  ASSERT_TRUE(a3.ok()) << a3.status();
  ASSERT_TRUE(c->Checkpoint().ok());  // A v3
  ASSERT_TRUE(c->LoadB().ok()) << c->cluster->Logs();
  ASSERT_TRUE(c->Push(0).ok()) << c->cluster->Logs();

  ASSERT_TRUE(c->Replace(1).ok());
  rpc::RecoveryStatus r =
      c->AwaitRecovery([](const rpc::RecoveryStatus& r) { return r.needs_load(); });
  ASSERT_TRUE(r.needs_load()) << r.ShortDebugString() << c->cluster->Logs();

  const grpc::Status restored = c->Restore(3);
  ASSERT_TRUE(restored.ok()) << restored.error_message() << c->cluster->Logs();
  r = c->Status().recovery();
  EXPECT_FALSE(r.needs_load()) << r.ShortDebugString();
  EXPECT_EQ(r.error(), "");
  EXPECT_EQ(c->Generation(), 3);
  EXPECT_EQ(c->Status().committed_version(), 3);
  absl::StatusOr<std::string> back = c->Published(3);
  ASSERT_TRUE(back.ok()) << back.status() << c->cluster->Logs();
  EXPECT_TRUE(*back == *a3) << "the restored bytes are not checkpoint 3's";
  // The trainer learns that the cluster went back to version 3, and steps on.
  absl::StatusOr<client::VersionInfo> info = c->client->WaitForVersionInfo(3, absl::Seconds(10));
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_TRUE(info->rewound_to.has_value());
  EXPECT_EQ(*info->rewound_to, 3);
  absl::Status pushed = c->Push(3);
  EXPECT_TRUE(pushed.ok()) << pushed << c->cluster->Logs();
}

}  // namespace
}  // namespace paramd
