// The checkpoint services over real gRPC on localhost: two fake daemons and
// a coordinator service; checkpoint, list, describe, restore onto other
// plans, export, and the refusals.
#include "checkpoint/service.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/daemon_io.h"
#include "checkpoint/export.h"
#include "checkpoint/fake_daemon.h"
#include "checkpoint/file_util.h"
#include "checkpoint/remote_export.h"
#include "checkpoint/store.h"
#include "checkpoint/test_util.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/reference.h"
#include "proto/checkpoint_service.grpc.pb.h"
#include "safetensors/sharded.h"

namespace paramd {
namespace checkpoint {
namespace {

using testing::FakeClusterManifest;
using testing::FakeClusterView;
using testing::FakeDaemon;

std::unique_ptr<grpc::Server> Serve(grpc::Service* service, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), port);
  builder.RegisterService(service);
  return builder.BuildAndStart();
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

class ServiceTest : public ::testing::Test {
 protected:
  static constexpr int kWorld = 2;

  void SetUp() override {
    base_ = testing::MakeTestDir("service");
    root_ = base_ + "/ckpt";
    tensors_ = testing::FakeTensors({{300, 64}, {1, 257}, {129, 3}, {2, 5}});
    plan_ = testing::SimplePlan(tensors_, kWorld);
    CheckpointServiceOptions options;
    options.root = root_;
    options.export_chunk_bytes = 1000;  // many chunks
    std::vector<std::string> addresses;
    for (int rank = 0; rank < kWorld; ++rank) {
      daemons_.push_back(std::make_unique<FakeDaemon>(tensors_, plan_[rank], 5));
      auto service = CheckpointDaemonService::Create(options, daemons_.back().get());
      ASSERT_TRUE(service.ok()) << service.status();
      daemon_services_.push_back(*std::move(service));
      int port = 0;
      daemon_servers_.push_back(Serve(daemon_services_.back()->service(), &port));
      ASSERT_GT(port, 0);
      addresses.push_back(absl::StrCat("127.0.0.1:", port));
    }
    addresses_ = addresses;
    auto view =
        std::make_unique<FakeClusterView>(FakeClusterManifest(tensors_, plan_, addresses, 5));
    view_ = view.get();
    options.keep = 0;
    auto coordinator = CheckpointCoordinatorService::Create(options, std::move(view));
    ASSERT_TRUE(coordinator.ok()) << coordinator.status();
    coordinator_ = *std::move(coordinator);
    int port = 0;
    coordinator_server_ = Serve(coordinator_->service(), &port);
    stub_ = CheckpointCoordinator::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    if (coordinator_server_) coordinator_server_->Shutdown();
    for (auto& server : daemon_servers_) {
      if (server) server->Shutdown();
    }
  }

  // Every daemon steps to `version`, and the coordinator commits it.
  void StepTo(int64_t version) {
    for (auto& daemon : daemons_) daemon->SetVersion(version);
    view_->SetCommittedVersion(version);
  }

  grpc::Status Checkpoint(const CheckpointRequest& request, CheckpointResponse* response) {
    grpc::ClientContext context;
    return stub_->Checkpoint(&context, request, response);
  }

  std::vector<uint64_t> Listed(const std::string& dir = "") {
    grpc::ClientContext context;
    ListCheckpointsRequest request;
    request.set_dir(dir);
    ListCheckpointsResponse response;
    grpc::Status status = stub_->ListCheckpoints(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    std::vector<uint64_t> versions;
    for (const CheckpointEntry& entry : response.checkpoints()) versions.push_back(entry.version());
    return versions;
  }

  std::map<std::string, std::vector<RemotePiece>> RemotePieces() {
    std::map<std::string, std::vector<RemotePiece>> pieces;
    for (int rank = 0; rank < kWorld; ++rank) {
      for (const PieceInfo& piece : plan_[rank]) {
        pieces[piece.tensor()].push_back({piece.row_begin(), piece.row_end(), addresses_[rank]});
      }
    }
    for (auto& [name, list] : pieces) {
      std::sort(list.begin(), list.end(), [](const RemotePiece& a, const RemotePiece& b) {
        return a.row_begin < b.row_begin;
      });
    }
    return pieces;
  }

  std::vector<ExportTensor> ExportTensors() {
    std::vector<ExportTensor> tensors;
    for (const TensorInfo& t : tensors_) {
      tensors.push_back({t.name(), {t.rows(), t.cols()}, t.rows(), t.cols()});
    }
    return tensors;
  }

  std::string base_, root_;
  std::vector<TensorInfo> tensors_;
  testing::PiecePlan plan_;
  std::vector<std::string> addresses_;
  std::vector<std::unique_ptr<FakeDaemon>> daemons_;
  std::vector<std::unique_ptr<CheckpointDaemonService>> daemon_services_;
  std::vector<std::unique_ptr<grpc::Server>> daemon_servers_;
  FakeClusterView* view_ = nullptr;
  std::unique_ptr<CheckpointCoordinatorService> coordinator_;
  std::unique_ptr<grpc::Server> coordinator_server_;
  std::unique_ptr<CheckpointCoordinator::Stub> stub_;
};

TEST_F(ServiceTest, CheckpointListDescribeAndRestoreOntoOtherPlans) {
  CheckpointRequest request;
  request.set_version(-1);
  CheckpointResponse response;
  grpc::Status status = Checkpoint(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.version(), 5u);
  EXPECT_FALSE(response.already_existed());
  EXPECT_GT(response.total_bytes(), 0u);
  EXPECT_EQ(Listed(), std::vector<uint64_t>{5});

  // The same version again: nothing rewritten.
  ASSERT_TRUE(Checkpoint(request, &response).ok());
  EXPECT_TRUE(response.already_existed());

  grpc::ClientContext context;
  DescribeCheckpointRequest describe;
  describe.set_version(-1);
  describe.set_verify(true);
  DescribeCheckpointResponse described;
  status = stub_->DescribeCheckpoint(&context, describe, &described);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(described.verified());
  EXPECT_EQ(described.manifest().version(), 5u);
  EXPECT_EQ(described.manifest().world_size(), kWorld);
  EXPECT_EQ(described.manifest().tensors_size(), 4);
  EXPECT_EQ(described.manifest().tensors(0).spec_type(), "paramd.rpc.HybridSpec");
  EXPECT_EQ(described.manifest().metadata().at("optimizer"), "adamw");

  // Restore: the checkpoint holds exactly version 5's state, readable
  // through plans for 1 and 3 daemons.
  auto store = CheckpointStore::Open(root_, false);
  ASSERT_TRUE(store.ok());
  for (int world : {1, 2, 3}) {
    absl::Status exact = testing::CheckFakeCheckpoint(*store, 5, 5, tensors_, world);
    EXPECT_TRUE(exact.ok()) << world << ": " << exact;
  }
  auto reader = OpenForRestore(*store, -1, /*verify=*/true);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const auto one = testing::SimplePlan(tensors_, 1);
  auto state = ReadDaemonState(**reader, one[0]);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->version, 5u);
  EXPECT_EQ(state->daemon_blob, "fake daemon");
  ASSERT_EQ(state->pieces.size(), tensors_.size());
  EXPECT_EQ(state->pieces[0].moments.size(), 2u);
  const auto want = testing::FakeRows(5, tensors_[0], "exp_avg_sq", 0, 300);
  EXPECT_EQ(
      std::memcmp(state->pieces[0].moments["exp_avg_sq"].data(), want.data(), want.size() * 4), 0);
  EXPECT_EQ(state->tensor_states.at(tensors_[1].name()).SerializeAsString(),
            testing::FakeState(5, tensors_[1].name()).SerializeAsString());
}

TEST_F(ServiceTest, KeepAndDirectories) {
  for (int64_t v : {5, 6, 7, 8}) {
    StepTo(v);
    CheckpointRequest request;
    request.set_version(-1);
    request.set_dir("nightly/run1");
    request.set_keep(2);
    CheckpointResponse response;
    ASSERT_TRUE(Checkpoint(request, &response).ok());
    if (v == 7) {
      EXPECT_EQ(response.removed_versions_size(), 1);
    }
  }
  EXPECT_EQ(Listed("nightly/run1"), (std::vector<uint64_t>{7, 8}));
  EXPECT_TRUE(Listed().empty());  // the root itself holds none
  EXPECT_TRUE(Exists(root_ + "/nightly/run1/v8/MANIFEST"));
}

TEST_F(ServiceTest, RefusesPathTraversal) {
  const std::string outside = testing::MakeTestDir("outside");
  ASSERT_EQ(symlink(outside.c_str(), (root_ + "/link").c_str()), 0);
  for (const char* bad : {"../escape", "/etc", "/tmp/x", "a/../../b", "link", "link/sub"}) {
    CheckpointRequest request;
    request.set_dir(bad);
    request.set_version(-1);
    CheckpointResponse response;
    grpc::Status status = Checkpoint(request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << bad << ": " << status.error_message();
    grpc::ClientContext context;
    ListCheckpointsRequest list;
    list.set_dir(bad);
    ListCheckpointsResponse listed;
    EXPECT_EQ(stub_->ListCheckpoints(&context, list, &listed).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT)
        << bad;
  }
  // The daemons refuse such names on their own too.
  auto daemon_stub = CheckpointDaemon::NewStub(
      grpc::CreateChannel(addresses_[0], grpc::InsecureChannelCredentials()));
  for (const char* bad : {"../escape", "/etc", "link/x"}) {
    grpc::ClientContext context;
    WriteShardRequest request;
    request.set_dir(bad);
    request.set_version(5);
    request.set_daemon_rank(0);
    request.set_world_size(2);
    WriteShardResponse response;
    EXPECT_EQ(daemon_stub->WriteShard(&context, request, &response).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT)
        << bad;
  }
  EXPECT_FALSE(Exists(base_ + "/escape"));
  EXPECT_FALSE(Exists(outside + "/sub"));
  EXPECT_FALSE(Exists(outside + "/v5"));
}

// A WriteShard the daemon refuses -- a version it does not hold, a rank
// outside the world -- leaves no directory behind.
TEST_F(ServiceTest, RefusedWriteShardCreatesNothing) {
  auto daemon_stub = CheckpointDaemon::NewStub(
      grpc::CreateChannel(addresses_[0], grpc::InsecureChannelCredentials()));
  struct Case {
    uint64_t version;
    int rank, world;
    grpc::StatusCode code;
  };
  for (const Case& c : {Case{99, 0, 2, grpc::StatusCode::FAILED_PRECONDITION},
                        Case{5, 0, 0, grpc::StatusCode::INVALID_ARGUMENT},
                        Case{5, -1, 2, grpc::StatusCode::INVALID_ARGUMENT}}) {
    grpc::ClientContext context;
    WriteShardRequest request;
    request.set_dir("refused/run");
    request.set_version(c.version);
    request.set_daemon_rank(c.rank);
    request.set_world_size(c.world);
    WriteShardResponse response;
    EXPECT_EQ(daemon_stub->WriteShard(&context, request, &response).error_code(), c.code)
        << "v" << c.version << " rank " << c.rank << " of " << c.world;
    EXPECT_FALSE(Exists(root_ + "/refused")) << "v" << c.version << " rank " << c.rank;
  }
  // Into the root itself: no v5/ either.
  grpc::ClientContext context;
  WriteShardRequest request;
  request.set_version(5);
  request.set_daemon_rank(3);
  request.set_world_size(2);
  WriteShardResponse response;
  EXPECT_NE(daemon_stub->WriteShard(&context, request, &response).error_code(),
            grpc::StatusCode::OK);
  EXPECT_FALSE(Exists(root_ + "/v5"));
}

TEST_F(ServiceTest, DaemonThatMovedOn) {
  // Explicit version the daemons no longer hold: refused, nothing listed.
  StepTo(6);
  CheckpointRequest request;
  request.set_version(5);
  CheckpointResponse response;
  grpc::Status status = Checkpoint(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_TRUE(Listed().empty());
  // "The committed version" while daemon 1 steps ahead once: retried with
  // the new committed version.
  int gets = 0;
  view_->set_on_get([&] {
    if (++gets == 1) daemons_[1]->SetVersion(7);
    if (gets == 2) StepTo(7);
  });
  request.set_version(-1);
  status = Checkpoint(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.version(), 7u);
  EXPECT_EQ(Listed(), std::vector<uint64_t>{7});
  view_->set_on_get(nullptr);
  request.set_version(8);  // not committed
  EXPECT_EQ(Checkpoint(request, &response).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

// A load replaces the model between the coordinator's manifest and the
// daemons' writes, and the new model reaches the same version number: its
// state is never written under the replaced model's manifest.
TEST_F(ServiceTest, ShardsOfAModelThatALoadReplacedAreNotWritten) {
  view_->SetModelGeneration(1);
  for (auto& daemon : daemons_) daemon->set_model_generation(1);
  int gets = 0;
  view_->set_on_get([&] {
    // The first manifest is checked; the load lands after the second.
    if (++gets == 2) {
      for (auto& daemon : daemons_) daemon->set_model_generation(2);
    }
    if (gets == 3) view_->SetModelGeneration(2);
  });
  // Version 5 by number: refused, naming both generations, nothing written.
  CheckpointRequest request;
  request.set_version(5);
  CheckpointResponse response;
  grpc::Status status = Checkpoint(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_NE(status.error_message().find("serves model generation 2, not 1"), std::string::npos)
      << status.error_message();
  EXPECT_TRUE(Listed().empty());
  EXPECT_FALSE(Exists(root_ + "/v5"));
  // "The committed version": taken again from the new manifest, of the
  // model that is served now.
  gets = 0;
  view_->SetModelGeneration(1);
  for (auto& daemon : daemons_) daemon->set_model_generation(1);
  request.set_version(-1);
  status = Checkpoint(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(Listed(), std::vector<uint64_t>{5});
  auto store = CheckpointStore::Open(root_, false);
  ASSERT_TRUE(store.ok()) << store.status();
  auto manifest = store->ReadManifest(5);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_EQ(manifest->metadata().at(kModelGenerationKey), "2");
  view_->set_on_get(nullptr);
}

TEST_F(ServiceTest, DeadDaemonFailsTheCheckpointAndKeepsThePreviousOne) {
  CheckpointRequest request;
  request.set_version(-1);
  CheckpointResponse response;
  ASSERT_TRUE(Checkpoint(request, &response).ok());
  StepTo(6);
  daemon_servers_[1]->Shutdown();
  daemon_servers_[1].reset();
  grpc::Status status = Checkpoint(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_EQ(Listed(), std::vector<uint64_t>{5});
  auto store = CheckpointStore::Open(root_, false);
  EXPECT_TRUE(store->Verify(5).ok());
  // Daemon 0's shard of v6 is on disk, unlisted; KeepLast clears it.
  EXPECT_TRUE(Exists(root_ + "/v6/shard-00000-of-00002.ckpt"));
}

TEST_F(ServiceTest, ExportFromDaemonsEqualsReferenceRounding) {
  for (ExportDtype dtype : {ExportDtype::kBf16, ExportDtype::kFp32}) {
    RemoteExportOptions remote;
    remote.version = 5;
    auto source = NewRemoteExportSource(RemotePieces(), remote);
    ExportOptions options;
    options.out_dir = base_ + "/export_" + std::string(ExportDtypeName(dtype));
    options.dtype = dtype;
    options.max_shard_bytes = 20000;
    auto result = ExportSafetensors(ExportTensors(), *source, options);
    ASSERT_TRUE(result.ok()) << result.status();
    auto files = safetensors::ShardedSafetensors::Open(options.out_dir);
    ASSERT_TRUE(files.ok()) << files.status();
    for (const TensorInfo& tensor : tensors_) {
      auto bytes = files->ReadTensor(tensor.name());
      ASSERT_TRUE(bytes.ok());
      const auto masters = testing::FakeRows(5, tensor, "master", 0, tensor.rows());
      std::vector<uint8_t> want;
      for (float m : masters) {
        if (dtype == ExportDtype::kBf16) {
          const uint16_t b = ref::EncodeBf16(m);
          want.push_back(b & 0xFF);
          want.push_back(b >> 8);
        } else {
          uint8_t b[4];
          std::memcpy(b, &m, 4);
          want.insert(want.end(), b, b + 4);
        }
      }
      EXPECT_EQ(*bytes, want) << tensor.name();
    }
  }
}

TEST_F(ServiceTest, ExportOfAnOlderVersionComesFromItsCheckpoint) {
  CheckpointRequest request;
  request.set_version(-1);
  CheckpointResponse response;
  ASSERT_TRUE(Checkpoint(request, &response).ok());
  StepTo(6);
  RemoteExportOptions remote;
  remote.version = 5;
  auto source = NewRemoteExportSource(RemotePieces(), remote);
  ExportOptions options;
  options.out_dir = base_ + "/export_v5";
  ASSERT_TRUE(ExportSafetensors(ExportTensors(), *source, options).ok());
  auto files = safetensors::ShardedSafetensors::Open(options.out_dir);
  ASSERT_TRUE(files.ok());
  auto bytes = files->ReadTensor(tensors_[0].name());
  ASSERT_TRUE(bytes.ok());
  const auto masters = testing::FakeRows(5, tensors_[0], "master", 0, 300);
  uint16_t first;
  std::memcpy(&first, bytes->data(), 2);
  EXPECT_EQ(first, ref::EncodeBf16(masters[0]));

  // Version 4 is neither held nor checkpointed.
  remote.version = 4;
  auto missing = NewRemoteExportSource(RemotePieces(), remote);
  options.out_dir = base_ + "/export_v4";
  auto result = ExportSafetensors(ExportTensors(), *missing, options);
  EXPECT_TRUE(absl::IsFailedPrecondition(result.status())) << result.status();
  EXPECT_FALSE(Exists(options.out_dir + "/model.safetensors.index.json"));
}

TEST_F(ServiceTest, ExportOfDequantizedDirection) {
  RemoteExportOptions remote;
  remote.version = 5;
  remote.values = ExportValuesKind::kColumnwise;
  auto source = NewRemoteExportSource(RemotePieces(), remote);
  ExportOptions options;
  options.out_dir = base_ + "/export_col";
  options.dtype = ExportDtype::kFp32;
  ASSERT_TRUE(ExportSafetensors(ExportTensors(), *source, options).ok());
  auto files = safetensors::ShardedSafetensors::Open(options.out_dir);
  auto bytes = files->ReadTensor(tensors_[2].name());
  ASSERT_TRUE(bytes.ok());
  const auto want = testing::FakeRows(5, tensors_[2], "columnwise", 0, 129);
  EXPECT_EQ(std::memcmp(bytes->data(), want.data(), want.size() * 4), 0);
}

// D9: a daemon's start removes the temporary files killed writers left in
// complete checkpoints, at the root and in request dirs below it.
TEST(ServiceOptionsTest, StartRemovesStaleTempFilesOfKilledWriters) {
  const std::string root = testing::MakeTestDir("sweep");
  auto tensors = testing::FakeTensors({{8, 8}});
  auto top = CheckpointStore::Open(root, true);
  auto below = CheckpointStore::OpenUnder(root, "run1", true);
  ASSERT_TRUE(top.ok() && below.ok());
  ASSERT_TRUE(testing::WriteFakeCheckpoint(*top, 2, 2, tensors, 1).ok());
  ASSERT_TRUE(testing::WriteFakeCheckpoint(*below, 3, 3, tensors, 1).ok());
  const pid_t dead = fork();
  if (dead == 0) _exit(0);
  int status = 0;
  waitpid(dead, &status, 0);
  const std::string stale_top =
      absl::StrCat(top->VersionDir(2), "/.shard-00000-of-00001.ckpt.tmp-", dead, "-0");
  const std::string stale_below =
      absl::StrCat(below->VersionDir(3), "/.shard-00000-of-00001.ckpt.tmp-", dead, "-1");
  const std::string live =
      absl::StrCat(below->VersionDir(3), "/.shard-00000-of-00001.ckpt.tmp-", getpid(), "-2");
  for (const std::string& f : {stale_top, stale_below, live}) {
    ASSERT_TRUE(CreateExclusive(f).ok()) << f;
  }
  FakeDaemon daemon(tensors, testing::SimplePlan(tensors, 1)[0], 1);
  CheckpointServiceOptions options;
  options.root = root;
  auto service = CheckpointDaemonService::Create(options, &daemon);
  ASSERT_TRUE(service.ok()) << service.status();
  EXPECT_FALSE(Exists(stale_top));
  EXPECT_FALSE(Exists(stale_below));
  EXPECT_TRUE(Exists(live)) << "a live writer's file stays";
  EXPECT_TRUE(top->Verify(2).ok());
  EXPECT_TRUE(below->Verify(3).ok());
}

// A daemon without a root (hybrid-paramd without --checkpoint_dir) refuses
// WriteShard, and a coordinator with one in front of it refuses a
// Checkpoint at once as FAILED_PRECONDITION naming the flag and the daemon,
// without retrying it as if the daemons had moved on (ABORTED).
TEST(ServiceOptionsTest, NoRootMeansRefused) {
  auto tensors = testing::FakeTensors({{4, 4}});
  FakeDaemon daemon(tensors, testing::SimplePlan(tensors, 1)[0], 1);
  auto service = CheckpointDaemonService::Create({}, &daemon);
  ASSERT_TRUE(service.ok());
  int port = 0;
  auto server = Serve((*service)->service(), &port);
  const std::string address = absl::StrCat("127.0.0.1:", port);
  auto stub =
      CheckpointDaemon::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  WriteShardRequest request;
  request.set_version(1);
  request.set_world_size(1);
  WriteShardResponse response;
  grpc::Status status = stub->WriteShard(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(status.error_message().find("--checkpoint_dir"), std::string::npos);

  CheckpointServiceOptions options;
  options.root = testing::MakeTestDir("service_no_daemon_root") + "/ckpt";
  auto coordinator = CheckpointCoordinatorService::Create(
      options, std::make_unique<FakeClusterView>(
                   FakeClusterManifest(tensors, testing::SimplePlan(tensors, 1), {address}, 1)));
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  auto coordinator_server = Serve((*coordinator)->service(), &port);
  auto coordinator_stub = CheckpointCoordinator::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  for (int64_t version : {-1, 1}) {
    grpc::ClientContext checkpoint_context;
    CheckpointRequest checkpoint;
    checkpoint.set_version(version);
    CheckpointResponse checkpoint_response;
    status = coordinator_stub->Checkpoint(&checkpoint_context, checkpoint, &checkpoint_response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << version << ": " << status.error_message();
    EXPECT_NE(status.error_message().find("--checkpoint_dir"), std::string::npos)
        << status.error_message();
    EXPECT_NE(status.error_message().find("daemon 0 at " + address), std::string::npos)
        << status.error_message();
  }
  coordinator_server->Shutdown();
  server->Shutdown();
}

}  // namespace
}  // namespace checkpoint
}  // namespace paramd
