// Membership and recovery against real processes (tests/client_cluster.h):
// a coordinator and two hybrid-paramd daemons on loopback.
//
//   Membership: a SIGKILLed or SIGSTOPped daemon is DOWN in GetStatus within
//   2 s; steps are refused with UNAVAILABLE naming it while the survivor
//   keeps serving fetches; a stopped daemon that continues is alive again;
//   a process started with --rank=N takes rank N.
//
//   Recovery: after a daemon is killed and a replacement takes its rank,
//   every daemon goes back to the newest in-memory snapshot every rank
//   still has (the replacement's from its buddy), or without snapshots to
//   the newest complete checkpoint; the trainers learn of the rewind
//   through WaitForVersion, and the masters and moments after K more pushed
//   steps equal, byte for byte, those of a cluster restored from a
//   checkpoint of an earlier version and given the same pushes.
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "checkpoint/daemon_io.h"
#include "checkpoint/store.h"
#include "client/client.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "proto/checkpoint_service.grpc.pb.h"
#include "proto/paramd.grpc.pb.h"
#include "proto/transport.grpc.pb.h"
#include "safetensors/safetensors.h"
#include "tests/client_cluster.h"
#include "tests/recovery_test_util.h"

namespace paramd {
namespace {

using client::Client;
using client::ClientOptions;
using testing::EnvInt;
using testing::kTensors;
using testing::PushGradientsFor;
using testing::TestCluster;
using testing::TestClusterFlags;
using testing::TestClusterOptions;
using testing::WriteAndLoadModel;

class MembershipTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TestClusterOptions options;
    options.daemons = 2;
    options.expected_pushers = 0;  // admin steps only
    auto cluster = TestCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    ClientOptions co;
    co.coordinator_address = cluster_->coordinator_address();
    co.role = ClientOptions::Role::kObserver;
    auto c = Client::Connect(co);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
    absl::StatusOr<int64_t> v = WriteAndLoadModel(*client_, cluster_->dir() + "/model.safetensors");
    ASSERT_TRUE(v.ok()) << v.status() << cluster_->Logs();
    auto stepped = client_->Step(0, /*wait=*/true, absl::Seconds(30));
    ASSERT_TRUE(stepped.ok()) << stepped.status() << cluster_->Logs();
  }

  // The daemon process (index for KillDaemon) that holds `rank`.
  int ProcessOfRank(int rank) {
    auto s = client_->Status(false, absl::Seconds(5));
    EXPECT_TRUE(s.ok()) << s.status();
    const int d = s.ok() ? DaemonProcessOfRank(*s, *cluster_, rank) : -1;
    if (d >= 0) return d;
    ADD_FAILURE() << "no process for rank " << rank;
    return 0;
  }

  // `timeout`: a status call asks every live daemon, and a stopped one not
  // yet DOWN holds the answer until the coordinator's bound; polls give up
  // early instead (an empty Member) and ask again.
  rpc::Member MemberOfRank(int rank, absl::Duration timeout = absl::Seconds(5)) {
    auto s = client_->Status(false, timeout);
    if (timeout < absl::Seconds(5) && !s.ok()) return rpc::Member();
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return rpc::Member();
    for (const rpc::Member& m : s->members()) {
      if (m.role() == rpc::ROLE_DAEMON && m.rank() == rank) return m;
    }
    return rpc::Member();
  }

  // Seconds until rank `rank`'s state is `state` (polled every 20 ms), or
  // -1 after `limit`.
  double SecondsUntil(int rank, rpc::MemberState state, absl::Duration limit) {
    const absl::Time start = absl::Now();
    while (absl::Now() - start < limit) {
      const rpc::Member m = MemberOfRank(rank, absl::Milliseconds(200));
      if (m.rank() == rank && m.role() == rpc::ROLE_DAEMON && m.state() == state) {
        return absl::ToDoubleSeconds(absl::Now() - start);
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return -1;
  }

  // A fetch of every tensor piece rank `rank` holds, straight from it.
  grpc::Status FetchFromDaemon(int rank) {
    auto channel =
        grpc::CreateChannel(MemberOfRank(rank).address(), grpc::InsecureChannelCredentials());
    auto stub = rpc::Daemon::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    rpc::FetchRequest request;
    request.set_version(-1);
    auto reader = stub->Fetch(&context, request);
    rpc::FetchResponse response;
    int messages = 0;
    while (reader->Read(&response)) ++messages;
    grpc::Status s = reader->Finish();
    if (s.ok() && messages < 2) return grpc::Status(grpc::StatusCode::INTERNAL, "no chunks");
    return s;
  }

  std::unique_ptr<TestCluster> cluster_;
  std::unique_ptr<Client> client_;
};

TEST_F(MembershipTest, KilledDaemonIsDownWithinTwoSecondsAndStepsNameIt) {
  const int victim = ProcessOfRank(1);
  cluster_->KillDaemon(victim);
  const double seconds = SecondsUntil(1, rpc::MEMBER_STATE_DOWN, absl::Seconds(5));
  ASSERT_GE(seconds, 0) << cluster_->Logs();
  EXPECT_LT(seconds, 2.0);
  EXPECT_NE(MemberOfRank(1).down_reason().find("no heartbeat"), std::string::npos);

  absl::StatusOr<int64_t> step = client_->Step(1, true, absl::Seconds(10));
  ASSERT_FALSE(step.ok());
  EXPECT_TRUE(absl::IsUnavailable(step.status())) << step.status();
  EXPECT_NE(step.status().message().find("rank 1"), std::string::npos) << step.status();
  EXPECT_NE(step.status().message().find("--rank=1"), std::string::npos) << step.status();

  // Everything else is served: status (without waiting on the dead one) and
  // the survivor's fetches.
  const absl::Time start = absl::Now();
  auto status = client_->Status(false, absl::Seconds(5));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  ASSERT_EQ(status->daemons_size(), 2);
  EXPECT_NE(status->daemons(1).error().find("down"), std::string::npos);
  EXPECT_TRUE(FetchFromDaemon(0).ok());
  EXPECT_NE(cluster_->Logs().find("is DOWN"), std::string::npos);
}

TEST_F(MembershipTest, StoppedDaemonIsDownThenAliveWhenContinued) {
  const int victim = ProcessOfRank(1);
  cluster_->SignalDaemon(victim, SIGSTOP);
  const double seconds = SecondsUntil(1, rpc::MEMBER_STATE_DOWN, absl::Seconds(5));
  cluster_->SignalDaemon(victim, SIGCONT);
  ASSERT_GE(seconds, 0) << cluster_->Logs();
  EXPECT_LT(seconds, 2.0);
  EXPECT_GE(SecondsUntil(1, rpc::MEMBER_STATE_ALIVE, absl::Seconds(3)), 0) << cluster_->Logs();
  absl::StatusOr<int64_t> step = client_->Step(1, true, absl::Seconds(20));
  EXPECT_TRUE(step.ok()) << step.status() << cluster_->Logs();
}

TEST_F(MembershipTest, StepHeldByAStoppedDaemonFailsWhenItsLeaseEnds) {
  const int victim = ProcessOfRank(1);
  cluster_->SignalDaemon(victim, SIGSTOP);
  const absl::Time start = absl::Now();
  absl::StatusOr<int64_t> step = client_->Step(1, true, absl::Seconds(20));
  const absl::Duration took = absl::Now() - start;
  cluster_->SignalDaemon(victim, SIGCONT);
  ASSERT_FALSE(step.ok());
  EXPECT_TRUE(absl::IsUnavailable(step.status())) << step.status();
  EXPECT_NE(step.status().message().find("rank 1"), std::string::npos) << step.status();
  EXPECT_LT(took, absl::Seconds(3));
}

TEST_F(MembershipTest, ReplacementWithTheRankTakesItsPlace) {
  const int victim = ProcessOfRank(1);
  const std::string old_address = MemberOfRank(1).address();
  cluster_->KillDaemon(victim);
  // Started at once: it retries until the dead one's lease expires.
  auto replacement = cluster_->StartDaemon({"--rank=1"});
  ASSERT_TRUE(replacement.ok()) << replacement.status();
  const absl::Time start = absl::Now();
  rpc::Member m;
  while (absl::Now() - start < absl::Seconds(5)) {
    m = MemberOfRank(1);
    if (m.address() != old_address) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(m.address(), absl::StrCat("127.0.0.1:", cluster_->daemon_port(*replacement)))
      << cluster_->Logs();
  EXPECT_NE(m.state(), rpc::MEMBER_STATE_DOWN);
  EXPECT_NE(cluster_->Logs().find("replaced by"), std::string::npos);
}

// ---- Recovery from disk ----

// A cluster with checkpoints and one pusher (this test).
class RecoveryCluster {
 public:
  // `restore_version` >= 0: the coordinator restores `restore_from` at start.
  // `snapshot_every`: the daemons' --snapshot_every_steps (0: recovery from
  // disk only). `checkpoints`: --checkpoint_dir on every process.
  static std::unique_ptr<RecoveryCluster> Start(const std::string& restore_from = "",
                                                int64_t restore_version = -1,
                                                int snapshot_every = 0, bool checkpoints = true) {
    auto c = std::make_unique<RecoveryCluster>();
    TestClusterOptions options;
    options.daemons = 2;
    options.expected_pushers = 1;
    options.optimizer = "adamw";
    options.lr = 0.01;
    auto cluster = TestCluster::Start(options, [&](const std::string& dir) {
      TestClusterFlags flags;
      if (checkpoints) flags.coordinator = {"--checkpoint_dir=" + dir + "/ckpt"};
      if (!restore_from.empty()) {
        flags.coordinator.push_back("--restore_from=" + restore_from);
        flags.coordinator.push_back(absl::StrCat("--restore_version=", restore_version));
      }
      if (checkpoints) flags.daemons = {"--checkpoint_dir=" + dir + "/ckpt"};
      flags.daemons.push_back(absl::StrCat("--snapshot_every_steps=", snapshot_every));
      return flags;
    });
    EXPECT_TRUE(cluster.ok()) << cluster.status();
    if (!cluster.ok()) return nullptr;
    c->cluster = *std::move(cluster);
    c->snapshot_every = snapshot_every;
    ClientOptions co;
    co.coordinator_address = c->cluster->coordinator_address();
    co.expected_pushers = 1;
    auto client = Client::Connect(co);
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return nullptr;
    c->client = *std::move(client);
    if (restore_from.empty()) {
      absl::StatusOr<int64_t> v =
          WriteAndLoadModel(*c->client, c->cluster->dir() + "/model.safetensors");
      EXPECT_TRUE(v.ok()) << v.status() << c->cluster->Logs();
    }
    return c;
  }

  // One pushed step from `version`; returns the version it committed.
  absl::StatusOr<int64_t> Push(int64_t version) {
    RETURN_IF_ERROR(PushGradientsFor(*client, version));
    return client->WaitForVersion(version + 1, absl::Seconds(30));
  }

  absl::Status Checkpoint() {
    auto channel =
        grpc::CreateChannel(cluster->coordinator_address(), grpc::InsecureChannelCredentials());
    auto stub = checkpoint::CheckpointCoordinator::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    checkpoint::CheckpointRequest request;
    request.set_version(-1);
    checkpoint::CheckpointResponse response;
    grpc::Status s = stub->Checkpoint(&context, request, &response);
    if (!s.ok()) return absl::InternalError(s.error_message());
    return absl::OkStatus();
  }

  rpc::GetStatusResponse Status() {
    auto s = client->Status(false, absl::Seconds(5));
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : rpc::GetStatusResponse();
  }

  int ProcessOfRank(int rank) { return DaemonProcessOfRank(Status(), *cluster, rank); }

  std::string ckpt() const { return cluster->dir() + "/ckpt"; }

  // Kills the daemon of `rank` and starts a replacement with its rank.
  absl::Status Replace(int rank) {
    const int victim = ProcessOfRank(rank);
    if (victim < 0) return absl::NotFoundError(absl::StrCat("no process of rank ", rank));
    cluster->KillDaemon(victim);
    return cluster
        ->StartDaemon({absl::StrCat("--rank=", rank), "--checkpoint_dir=" + ckpt(),
                       absl::StrCat("--snapshot_every_steps=", snapshot_every)})
        .status();
  }

  // Waits for recovery `epoch` to complete.
  // Waits (4 s at most) until each daemon holds the other's snapshot of
  // `version`.
  void AwaitBuddySnapshots(int64_t version) {
    for (int attempt = 0; attempt < 200; ++attempt) {
      const rpc::GetStatusResponse s = Status();
      if (s.daemons_size() == 2 && s.daemons(0).buddy_snapshot_version() == version &&
          s.daemons(1).buddy_snapshot_version() == version) {
        return;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  rpc::RecoveryStatus AwaitRecovery(int64_t epoch) {
    const absl::Time start = absl::Now();
    rpc::GetStatusResponse status = Status();
    while (status.recovery().epoch() < epoch && absl::Now() - start < absl::Seconds(30)) {
      absl::SleepFor(absl::Milliseconds(20));
      status = Status();
    }
    return status.recovery();
  }

  std::unique_ptr<TestCluster> cluster;
  int snapshot_every = 0;
  std::unique_ptr<Client> client;
};

// Every tensor's FP32 master and moments in checkpoint `version` of `root`.
std::vector<std::vector<float>> SavedState(const std::string& root, int64_t version) {
  std::vector<std::vector<float>> out;
  auto store = checkpoint::CheckpointStore::Open(root, false);
  EXPECT_TRUE(store.ok()) << store.status();
  if (!store.ok()) return out;
  auto reader = checkpoint::CheckpointReader::Open(*store, static_cast<uint64_t>(version));
  EXPECT_TRUE(reader.ok()) << reader.status();
  if (!reader.ok()) return out;
  std::vector<checkpoint::PieceInfo> pieces;
  for (const auto& [name, shape] : kTensors) {
    checkpoint::PieceInfo p;
    p.set_tensor(name);
    p.set_row_begin(0);
    p.set_row_end(shape.first);
    pieces.push_back(p);
  }
  auto state = checkpoint::ReadDaemonState(**reader, pieces);
  EXPECT_TRUE(state.ok()) << state.status();
  if (!state.ok()) return out;
  for (auto& p : state->pieces) {
    out.push_back(p.master);
    for (auto& [name, m] : p.moments) out.push_back(m);
  }
  return out;
}

// Checkpoint `version` in `root` (pushed steps after a rewind) against a
// cluster restored from checkpoint `from` of `root` and given the same
// pushes up to `version`: every master and moment byte for byte.
void ExpectSameAsRestoredReplay(const std::string& root, int64_t from = 3, int64_t version = 6) {
  auto reference = RecoveryCluster::Start(root, from);
  ASSERT_NE(reference, nullptr);
  ASSERT_TRUE(reference->client->WaitForVersion(from, absl::Seconds(30)).ok())
      << reference->cluster->Logs();
  ASSERT_TRUE(reference->client->RefreshManifest().ok());
  for (int64_t v = from; v < version; ++v) {
    ASSERT_TRUE(reference->Push(v).ok()) << reference->cluster->Logs();
  }
  ASSERT_TRUE(reference->Checkpoint().ok());
  const auto got = SavedState(root, version);
  const auto want = SavedState(reference->ckpt(), version);
  ASSERT_EQ(got.size(), want.size());
  ASSERT_FALSE(got.empty());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].size(), want[i].size());
    EXPECT_EQ(std::memcmp(got[i].data(), want[i].data(), got[i].size() * 4), 0) << "array " << i;
  }
}

TEST(RecoveryTest, ReplacementRecoversFromTheNewestCheckpointAndReplaysByteForByte) {
  auto c = RecoveryCluster::Start();
  ASSERT_NE(c, nullptr);
  int64_t v = 0;
  for (; v < 3; ++v) ASSERT_TRUE(c->Push(v).ok()) << c->cluster->Logs();
  ASSERT_TRUE(c->Checkpoint().ok());  // version 3
  for (; v < 5; ++v) ASSERT_TRUE(c->Push(v).ok()) << c->cluster->Logs();
  ASSERT_EQ(c->Status().committed_version(), 5);

  const absl::Time killed = absl::Now();
  ASSERT_TRUE(c->Replace(1).ok());

  // The trainer learns of the rewind.
  absl::StatusOr<client::VersionInfo> info = c->client->WaitForVersionInfo(6, absl::Seconds(30));
  ASSERT_TRUE(info.ok()) << info.status() << c->cluster->Logs();
  ASSERT_TRUE(info->rewound_to.has_value()) << c->cluster->Logs();
  EXPECT_EQ(*info->rewound_to, 3);
  EXPECT_EQ(info->committed_version, 3);
  EXPECT_EQ(info->recovery_epoch, 1);
  const rpc::RecoveryStatus r = c->Status().recovery();
  EXPECT_EQ(r.epoch(), 1);
  EXPECT_EQ(r.replaced_rank(), 1);
  EXPECT_EQ(r.rewound_to_version(), 3);
  EXPECT_EQ(r.committed_before(), 5);
  EXPECT_EQ(r.versions_lost(), 2);
  EXPECT_NE(r.source().find("checkpoint"), std::string::npos);

  // The cluster resumes: K = 3 pushed steps from the rewound version.
  for (v = 3; v < 6; ++v) ASSERT_TRUE(c->Push(v).ok()) << c->cluster->Logs();
  std::printf("recovery (disk): kill to first new version %.3f s\n",
              absl::ToDoubleSeconds(absl::Now() - killed));
  ASSERT_TRUE(c->Checkpoint().ok());  // version 6

  ExpectSameAsRestoredReplay(c->ckpt());
}

// Snapshots every 2 steps, a checkpoint at 2 (so that a reference can be
// restored) and at 4 (the snapshot and the checkpoint of 4 tie: the
// snapshot wins). Rank 1 is killed at 5; its replacement gets rank 1's
// snapshot 4 from its buddy (rank 0), rank 0 its own; 3 pushed steps from
// 4 equal a cluster restored from checkpoint 2 and pushed 2 -> 7.
TEST(RecoveryTest, ReplacementRecoversFromTheBuddysSnapshotAndReplaysByteForByte) {
  auto c = RecoveryCluster::Start("", -1, /*snapshot_every=*/2);
  ASSERT_NE(c, nullptr);
  int64_t v = 0;
  for (; v < 2; ++v) ASSERT_TRUE(c->Push(v).ok()) << c->cluster->Logs();
  ASSERT_TRUE(c->Checkpoint().ok());  // version 2
  for (; v < 5; ++v) ASSERT_TRUE(c->Push(v).ok()) << c->cluster->Logs();
  // Both snapshots of 4 are complete and sent (each daemon holds the other's).
  c->AwaitBuddySnapshots(4);
  const rpc::GetStatusResponse before = c->Status();
  ASSERT_EQ(before.daemons(1).snapshot_version(), 4) << c->cluster->Logs();
  ASSERT_EQ(before.daemons(0).buddy_snapshot_version(), 4) << c->cluster->Logs();
  EXPECT_GT(before.daemons(1).snapshot_bytes(), 0);
  EXPECT_LT(before.daemons(1).snapshot_block_seconds(), 1.0);
  std::printf("snapshot: blocked the worker %.6f s, copy %.6f s, %lld bytes\n",
              before.daemons(1).snapshot_block_seconds(), before.daemons(1).snapshot_copy_seconds(),
              static_cast<long long>(before.daemons(1).snapshot_bytes()));

  const absl::Time killed = absl::Now();
  ASSERT_TRUE(c->Replace(1).ok());
  absl::StatusOr<client::VersionInfo> info = c->client->WaitForVersionInfo(6, absl::Seconds(30));
  ASSERT_TRUE(info.ok()) << info.status() << c->cluster->Logs();
  ASSERT_TRUE(info->rewound_to.has_value()) << c->cluster->Logs();
  EXPECT_EQ(*info->rewound_to, 4);
  const rpc::RecoveryStatus r = c->Status().recovery();
  EXPECT_EQ(r.rewound_to_version(), 4);
  EXPECT_EQ(r.committed_before(), 5);
  EXPECT_EQ(r.versions_lost(), 1);
  EXPECT_EQ(r.source(), "snapshot v4") << c->cluster->Logs();
  // Where the time went: the phases add up to the whole (the checkpoint
  // listing before PrepareRecovery is the rest), and the daemon parts are
  // one daemon's (the slowest: the replacement fetching from its buddy, or
  // its peer waiting for it in the republish).
  const rpc::RecoveryPhases& p = r.phases();
  const double parts = p.wait() + p.prepare() + p.recover();
  EXPECT_LE(parts, r.seconds() + 1e-3);
  EXPECT_GE(parts, r.seconds() - 0.1);
  EXPECT_GT(p.recover(), 0);
  EXPECT_GT(p.snapshot_fetch() + p.republish(), 0);
  EXPECT_LE(p.connect() + p.snapshot_fetch() + p.backend_create() + p.restore() + p.republish(),
            p.recover() + 1e-3);
  ASSERT_TRUE(c->client->RefreshManifest().ok());
  for (v = 4; v < 7; ++v) ASSERT_TRUE(c->Push(v).ok()) << c->cluster->Logs();
  std::printf(
      "recovery (snapshot): kill to first new version %.3f s; loss to republished %.3f s = wait "
      "%.3f + prepare %.3f + recover %.3f (connect %.3f, fetch %.3f, backend %.3f, restore %.3f, "
      "republish %.3f)\n",
      absl::ToDoubleSeconds(absl::Now() - killed), r.seconds(), p.wait(), p.prepare(), p.recover(),
      p.connect(), p.snapshot_fetch(), p.backend_create(), p.restore(), p.republish());
  ASSERT_TRUE(c->Checkpoint().ok());  // version 7
  ExpectSameAsRestoredReplay(c->ckpt(), 2, 7);
}

// Every daemon's data-plane endpoint (from the address book an observer's
// Join gets) refuses a caller without the cluster secret.
void ExpectDataPlaneClosedToStrangers(const std::string& coordinator_address) {
  auto coordinator = rpc::Coordinator::NewStub(
      grpc::CreateChannel(coordinator_address, grpc::InsecureChannelCredentials()));
  rpc::JoinRequest observe;
  observe.set_role(rpc::ROLE_OBSERVER);
  rpc::JoinResponse world;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  ASSERT_TRUE(coordinator->Join(&context, observe, &world).ok());
  ASSERT_EQ(world.data_plane().address_book_size(), 2) << world.ShortDebugString();
  for (const auto& [rank, address] : world.data_plane().address_book()) {
    auto stranger = transport::DataPlane::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ping_context;
    ping_context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    transport::PingResponse pong;
    const grpc::Status s = stranger->Ping(&ping_context, transport::PingRequest(), &pong);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << "data plane of rank " << rank << " at " << address << ": " << s.error_message();
  }
}

// No --checkpoint_dir anywhere: snapshots alone bring the cluster back, and
// the data plane the recovery re-forms is as closed to strangers as the
// first one was.
TEST(RecoveryTest, SnapshotsRecoverWithoutACheckpointDirectory) {
  auto c = RecoveryCluster::Start("", -1, /*snapshot_every=*/3, /*checkpoints=*/false);
  ASSERT_NE(c, nullptr);
  for (int64_t v = 0; v < 4; ++v) ASSERT_TRUE(c->Push(v).ok()) << c->cluster->Logs();
  c->AwaitBuddySnapshots(3);
  ExpectDataPlaneClosedToStrangers(c->cluster->coordinator_address());
  ASSERT_TRUE(c->Replace(0).ok());  // rank 0's copy is on rank 1
  const rpc::RecoveryStatus r = c->AwaitRecovery(1);
  ASSERT_EQ(r.epoch(), 1) << c->cluster->Logs();
  ExpectDataPlaneClosedToStrangers(c->cluster->coordinator_address());
  EXPECT_EQ(r.rewound_to_version(), 3);
  EXPECT_EQ(r.source(), "snapshot v3");
  absl::StatusOr<client::VersionInfo> info = c->client->WaitForVersionInfo(5, absl::Seconds(10));
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_TRUE(c->client->RefreshManifest().ok());
  for (int64_t v = 3; v < 6; ++v) ASSERT_TRUE(c->Push(v).ok()) << c->cluster->Logs();
  EXPECT_EQ(c->Status().committed_version(), 6);
}

// The replacement (rank 0: the root of the republishing all-reduce) is
// stopped for 800 ms as its Recover arrives (PARAMD_TEST_RECOVER_FREEZE_MS),
// as a daemon a loaded machine does not schedule: rank 1 restores first and
// its republish finds rank 0's new data-plane endpoint connecting but not
// answering. The recovery still completes, at once, with version 4's bytes.
TEST(RecoveryTest, RecoveryWaitsForAPeerThatIsSlowToAnswer) {
  auto c = RecoveryCluster::Start("", -1, /*snapshot_every=*/2, /*checkpoints=*/false);
  ASSERT_NE(c, nullptr);
  for (int64_t v = 0; v < 4; ++v) ASSERT_TRUE(c->Push(v).ok()) << c->cluster->Logs();
  c->AwaitBuddySnapshots(4);
  const auto targets = client::AllTargets(c->client->manifest(), {Direction::kRowwise});
  auto before = c->client->Fetch(4, targets);
  ASSERT_TRUE(before.ok()) << before.status();

  setenv("PARAMD_TEST_RECOVER_FREEZE_MS", "800", /*overwrite=*/1);
  const absl::Status replaced = c->Replace(0);
  unsetenv("PARAMD_TEST_RECOVER_FREEZE_MS");
  ASSERT_TRUE(replaced.ok()) << replaced;
  const rpc::RecoveryStatus r = c->AwaitRecovery(1);
  ASSERT_EQ(r.epoch(), 1) << c->cluster->Logs();
  EXPECT_EQ(r.rewound_to_version(), 4);
  EXPECT_EQ(r.source(), "snapshot v4");
  EXPECT_EQ(r.error(), "");

  absl::StatusOr<client::VersionInfo> info = c->client->WaitForVersionInfo(4, absl::Seconds(10));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->committed_version, 4);
  ASSERT_TRUE(c->client->RefreshManifest().ok());
  auto after = c->client->Fetch(4, targets);
  ASSERT_TRUE(after.ok()) << after.status() << c->cluster->Logs();
  ASSERT_EQ(after->tensors.size(), before->tensors.size());
  for (size_t i = 0; i < after->tensors.size(); ++i) {
    EXPECT_EQ(after->tensors[i].value.data, before->tensors[i].value.data) << i;
    EXPECT_EQ(after->tensors[i].value.scales, before->tensors[i].value.scales) << i;
    EXPECT_EQ(after->tensors[i].value.scale_inv, before->tensors[i].value.scale_inv) << i;
  }
  ASSERT_TRUE(c->Push(4).ok()) << c->cluster->Logs();
  EXPECT_EQ(c->Status().committed_version(), 5);
}

// RECOVERY_KILL_TRIALS (default 2; `RECOVERY_KILL_TRIALS=20 bazel test
// //tests:recovery_test --test_env=RECOVERY_KILL_TRIALS` for the full run)
// trials: with snapshots every 2 steps, a pusher steps the cluster
// continuously from checkpoint 2 while a random rank is SIGKILLed after a
// random delay (0-600 ms: during a push, a step, a snapshot's copy or
// buddy send, or a fetch of the published version); a replacement joins,
// the cluster rewinds to the newest snapshot every rank has (or checkpoint
// 2 when the kill came before the first one), and 3 pushed steps from it
// give the masters of a cluster restored from checkpoint 2 and given the
// same pushes.
TEST(RecoveryTest, KillAtRandomPointsThenReplayMatchesARestoredCluster) {
  const int trials = EnvInt("RECOVERY_KILL_TRIALS", 2);
  std::mt19937 rng(static_cast<uint32_t>(EnvInt("RECOVERY_KILL_SEED", time(nullptr))));
  for (int trial = 0; trial < trials; ++trial) {
    SCOPED_TRACE(absl::StrCat("trial ", trial));
    auto c = RecoveryCluster::Start("", -1, /*snapshot_every=*/2);
    ASSERT_NE(c, nullptr);
    for (int64_t v = 0; v < 2; ++v) ASSERT_TRUE(c->Push(v).ok()) << c->cluster->Logs();
    ASSERT_TRUE(c->Checkpoint().ok());
    std::atomic<bool> stop{false};
    std::atomic<int64_t> reached{2};
    std::thread pusher([&] {
      // Pushes and fetches until the kill makes a call fail.
      for (int64_t v = 2; !stop.load(); ++v) {
        if (!c->client->Fetch(v, client::AllTargets(c->client->manifest(), {Direction::kRowwise}))
                 .ok()) {
          return;
        }
        if (!c->Push(v).ok()) return;
        reached = v + 1;
      }
    });
    const int delay_ms = std::uniform_int_distribution<int>(0, 600)(rng);
    const int rank = std::uniform_int_distribution<int>(0, 1)(rng);
    SCOPED_TRACE(absl::StrCat("rank ", rank, " killed after ", delay_ms, " ms"));
    absl::SleepFor(absl::Milliseconds(delay_ms));
    const int64_t committed_at_kill = reached.load();
    ASSERT_TRUE(c->Replace(rank).ok());
    stop = true;
    pusher.join();
    const rpc::RecoveryStatus r = c->AwaitRecovery(1);
    ASSERT_EQ(r.epoch(), 1) << c->cluster->Logs();
    const int64_t back = r.rewound_to_version();
    std::printf(
        "trial %d: rank %d killed after %d ms at version %lld: rewound to %lld from %s, "
        "%.3f s after the lease expired\n",
        trial, rank, delay_ms, static_cast<long long>(committed_at_kill),
        static_cast<long long>(back), r.source().c_str(), r.seconds());
    // About one snapshot period (2) lost, plus the step in flight and a
    // copy that the kill cut short.
    EXPECT_GE(back, std::max<int64_t>(2, committed_at_kill - 4));
    EXPECT_TRUE(r.source() == absl::StrCat("snapshot v", back) ||
                (back == 2 && r.source() == absl::StrCat("checkpoint ", c->ckpt(), " v2")))
        << r.source();
    absl::StatusOr<client::VersionInfo> info =
        c->client->WaitForVersionInfo(back, absl::Seconds(10));
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_TRUE(c->client->RefreshManifest().ok());
    for (int64_t v = back; v < back + 3; ++v) ASSERT_TRUE(c->Push(v).ok()) << c->cluster->Logs();
    ASSERT_TRUE(c->Checkpoint().ok());
    ExpectSameAsRestoredReplay(c->ckpt(), 2, back + 3);
  }
}

// WatchVersion reports a rewind once, with the version the cluster went back to.
TEST(RecoveryTest, WatchVersionReportsTheRewind) {
  auto c = RecoveryCluster::Start("", -1, /*snapshot_every=*/2);
  ASSERT_NE(c, nullptr);
  for (int64_t v = 0; v < 3; ++v) ASSERT_TRUE(c->Push(v).ok()) << c->cluster->Logs();
  std::vector<client::VersionInfo> events;
  std::thread watcher([&] {
    absl::Status s = c->client->WatchVersion(
        3,
        [&](const client::VersionInfo& info) {
          events.push_back(info);
          return !info.rewound_to.has_value();
        },
        absl::Seconds(30));
    EXPECT_TRUE(s.ok()) << s;
  });
  absl::SleepFor(absl::Milliseconds(200));
  for (int attempt = 0; attempt < 200 && c->Status().daemons(0).buddy_snapshot_version() < 2;
       ++attempt) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(c->Replace(1).ok());
  watcher.join();
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events.front().committed_version, 3);
  EXPECT_FALSE(events.front().rewound_to.has_value());
  ASSERT_TRUE(events.back().rewound_to.has_value());
  EXPECT_EQ(*events.back().rewound_to, 2);
  EXPECT_EQ(events.back().committed_version, 2);
  EXPECT_EQ(events.back().recovery_epoch, 1);
}

}  // namespace
}  // namespace paramd
