// What the real hybrid-paramd processes (coordinator + 2 daemons) refuse:
//   1. a checkpoint with one flipped byte, through the binaries: `hpctl
//      checkpoint describe --verify` and fresh processes started with
//      --restore_from both name the damaged file (DATA_LOSS), load
//      nothing, and the coordinator exits; --restore_version of an intact
//      older checkpoint still works.
//      (tests/checkpoint_restore_test covers the Load RPC on a live cluster.)
//   2. every RPC naming a directory outside --checkpoint_dir: "../x", "/etc",
//      "a/../../x", a symlink leading outside, NUL bytes and backslashes, on
//      the coordinator (Checkpoint, ListCheckpoints, DescribeCheckpoint) and
//      on a daemon (WriteShard, ExportRows from a checkpoint) —
//      INVALID_ARGUMENT, nothing written outside; a version directory that is
//      a symlink, a shard file that is a symlink, and a manifest (valid
//      checksum) naming "../" files are never read through.
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "auth/security.h"
#include "checkpoint/store.h"
#include "checkpoint/test_util.h"
#include "gtest/gtest.h"
#include "proto/checkpoint_service.grpc.pb.h"
#include "tests/checkpoint_test_util.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

namespace fs = std::filesystem;

const std::vector<TestTensor>& Model() {
  static const auto* model = new std::vector<TestTensor>{
      {"w", {300, 64}, RandomValues(300 * 64, 31)}, {"b", {50}, RandomValues(50, 32)}};
  return *model;
}

constexpr char kClusterSecret[] = "checkpoint-refusal-test-cluster-secret";

TestClusterOptions Options(const std::string& root, const std::vector<std::string>& extra = {}) {
  TestClusterOptions o;
  o.daemons = 2;
  o.expected_pushers = 1;
  o.optimizer = "adamw";
  o.lr = 0.01;
  o.coordinator_flags = {"--checkpoint_dir=" + root};
  o.coordinator_flags.insert(o.coordinator_flags.end(), extra.begin(), extra.end());
  o.daemon_flags = {"--checkpoint_dir=" + root};
  // ConfinementTest calls WriteShard as a rogue cluster member would.
  o.cluster_secret = kClusterSecret;
  return o;
}

// Starts a cluster, loads Model(), steps once and checkpoints v0 and v1.
std::unique_ptr<RawCluster> StartWithTwoCheckpoints(const std::string& root) {
  absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(Options(root));
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return nullptr;
  RawCluster& cluster = **c;
  const std::string path = cluster.cluster().dir() + "/model.safetensors";
  EXPECT_TRUE(WriteModel(path, Model()).ok());
  EXPECT_TRUE(cluster.Load(path, "").ok()) << cluster.cluster().Logs();
  const std::string address = cluster.cluster().coordinator_address();
  EXPECT_TRUE(CheckpointVia(address, 0, absl::Seconds(30)).ok());
  std::map<std::string, std::vector<float>> g;
  for (const TestTensor& t : Model()) g[t.name] = RandomValues(t.values.size(), 33, 0.1f);
  EXPECT_TRUE(cluster.PushAll(0, "trainer", g).ok());
  EXPECT_TRUE(cluster.WaitForVersion(1).ok());
  EXPECT_TRUE(CheckpointVia(address, 1, absl::Seconds(30)).ok());
  return *std::move(c);
}

void FlipByte(const std::string& path, std::streamoff offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char byte = 0;
  f.read(&byte, 1);
  byte ^= 0x10;
  f.seekp(offset);
  f.write(&byte, 1);
  ASSERT_TRUE(f.good()) << path;
}

// Polls the cluster's logs for `text`.
bool LogsContain(TestCluster& cluster, const std::string& text, absl::Duration timeout) {
  const absl::Time give_up = absl::Now() + timeout;
  while (absl::Now() < give_up) {
    if (absl::StrContains(cluster.Logs(), text)) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

TEST(CheckpointRefusalTest, FlippedByteIsRefusedByTheBinariesNamingTheFile) {
  absl::StatusOr<demo::TempDir> dir = demo::TempDir::Create("ckpt_flip");
  ASSERT_TRUE(dir.ok());
  const std::string root = dir->path() + "/ckpt";
  std::unique_ptr<RawCluster> a = StartWithTwoCheckpoints(root);
  ASSERT_NE(a, nullptr);
  const std::string victim = root + "/v1/shard-00001-of-00002.ckpt";
  FlipByte(victim, static_cast<std::streamoff>(fs::file_size(victim) / 2));

  // hpctl checkpoint describe --verify, against the running coordinator.
  ProgramRun describe =
      RunProgram({"hpctl/hpctl", "checkpoint", "describe", "--verify", "--version=1",
                  "--address=" + a->cluster().coordinator_address(), "--timeout=20"},
                 dir->path());
  EXPECT_EQ(describe.exit_code, 1) << describe.out;
  EXPECT_TRUE(absl::StrContains(describe.out, "DATA_LOSS")) << describe.out;
  EXPECT_TRUE(absl::StrContains(describe.out, victim)) << describe.out;
  // v0 is intact and still verifies.
  ProgramRun intact =
      RunProgram({"hpctl/hpctl", "checkpoint", "describe", "--verify", "--version=0",
                  "--address=" + a->cluster().coordinator_address(), "--timeout=20"},
                 dir->path());
  EXPECT_EQ(intact.exit_code, 0) << intact.out;
  // The optimizer metadata reads as one line each, not a proto dump.
  EXPECT_TRUE(absl::StrContains(intact.out, "\n  optimizer_config: kind: ")) << intact.out;
  EXPECT_FALSE(absl::StrContains(intact.out, "\nlr: ")) << intact.out;
  EXPECT_TRUE(absl::StrContains(intact.out,
                                "\n  optimizer_tensors: all 2 tensors step with "
                                "optimizer_config\n"))
      << intact.out;
  a.reset();

  // Fresh processes restoring the newest checkpoint (v1) refuse it.
  {
    absl::StatusOr<std::unique_ptr<RawCluster>> c =
        RawCluster::Start(Options(root, {"--restore_from=" + root}));
    ASSERT_TRUE(c.ok()) << c.status();
    TestCluster& b = (*c)->cluster();
    ASSERT_TRUE(LogsContain(b, "loading the startup model failed", absl::Seconds(30))) << b.Logs();
    const std::string logs = b.Logs();
    EXPECT_TRUE(absl::StrContains(logs, "DATA_LOSS")) << logs;
    EXPECT_TRUE(absl::StrContains(logs, victim)) << logs;
    // A failed startup restore is fatal: the coordinator exits with the
    // reason (and nothing was loaded) instead of serving an empty cluster.
    ASSERT_TRUE(
        LogsContain(b, "hybrid-paramd: DATA_LOSS: --restore_from=" + root, absl::Seconds(10)))
        << b.Logs();
    EXPECT_FALSE((*c)->RefreshManifest().ok()) << "the coordinator still serves";
  }
  // --restore_version=0 (intact) restores fine.
  absl::StatusOr<std::unique_ptr<RawCluster>> c =
      RawCluster::Start(Options(root, {"--restore_from=" + root, "--restore_version=0"}));
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<int64_t> restored = (*c)->WaitForVersion(0);
  ASSERT_TRUE(restored.ok()) << restored.status() << (*c)->cluster().Logs();
  EXPECT_EQ(*restored, 0);
}

using Coordinator = checkpoint::CheckpointCoordinator::Stub;
using Daemon = checkpoint::CheckpointDaemon::Stub;

// One unary call with a deadline; the response is dropped unless wanted.
template <class Stub, class Request, class Response>
grpc::Status Call(Stub& stub,
                  grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                  const Request& request, Response* response = nullptr) {
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(30));
  Response ignored;
  return (stub.*method)(&context, request, response != nullptr ? response : &ignored);
}

class ConfinementTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = demo::TempDir::Create("ckpt_confine");
    ASSERT_TRUE(dir.ok());
    dir_ = std::make_unique<demo::TempDir>(*std::move(dir));
    root_ = dir_->path() + "/ckpt";
    outside_ = dir_->path() + "/outside";
    cluster_ = StartWithTwoCheckpoints(root_);
    ASSERT_NE(cluster_, nullptr);
    // Outside the root: a valid copy of the checkpoints (a request that got
    // there would find them), and links to it from inside.
    fs::create_directories(outside_);
    fs::copy(root_, outside_, fs::copy_options::recursive);
    fs::create_directory_symlink(outside_, root_ + "/link");
    fs::create_directory_symlink(outside_ + "/v1", root_ + "/v9");
    coordinator_ = checkpoint::CheckpointCoordinator::NewStub(grpc::CreateChannel(
        cluster_->cluster().coordinator_address(), grpc::InsecureChannelCredentials()));
    // With the cluster secret: past authentication, so that the refusals
    // below are the daemon's own checks of the directories.
    daemon_ = checkpoint::CheckpointDaemon::NewStub(
        auth::CreateChannel(cluster_->manifest().daemons(0).address(),
                            {{}, std::make_shared<auth::BearerToken>(kClusterSecret)}));
    before_ = Tree(outside_);
  }

  // Every path below `dir` (not following links).
  static std::set<std::string> Tree(const std::string& dir) {
    std::set<std::string> paths;
    for (const auto& e : fs::recursive_directory_iterator(dir)) paths.insert(e.path().string());
    return paths;
  }

  void ExpectNothingWrittenOutside() {
    EXPECT_EQ(Tree(outside_), before_);
    struct stat st;
    EXPECT_NE(stat((dir_->path() + "/x").c_str(), &st), 0) << "created " << dir_->path() << "/x";
  }

  std::unique_ptr<demo::TempDir> dir_;
  std::string root_, outside_;
  std::unique_ptr<RawCluster> cluster_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<Daemon> daemon_;
  std::set<std::string> before_;
};

TEST_F(ConfinementTest, DirectoriesOutsideTheRootAreRefusedByEveryRpc) {
  const std::vector<std::string> bad = {"../x",
                                        "../outside",
                                        "/etc",
                                        "/tmp",
                                        "a/../../x",
                                        "..",
                                        "link",
                                        "link/sub",
                                        "a\\..\\..\\x",
                                        std::string("a\0b", 3),
                                        "a\nE0101 forged",
                                        std::string(1 << 20, 'a')};
  for (const std::string& d : bad) {
    SCOPED_TRACE("dir '" + d.substr(0, 64) + "'");
    checkpoint::CheckpointRequest create;
    create.set_dir(d);
    create.set_version(-1);
    const grpc::Status created = Call(*coordinator_, &Coordinator::Checkpoint, create);
    EXPECT_EQ(created.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << created.error_message().substr(0, 300);
    // The name comes back bounded and escaped.
    EXPECT_LT(created.error_message().size(), 1500u);
    EXPECT_EQ(created.error_message().find('\n'), std::string::npos) << created.error_message();
    checkpoint::ListCheckpointsRequest list;
    list.set_dir(d);
    checkpoint::ListCheckpointsResponse listed;
    EXPECT_EQ(Call(*coordinator_, &Coordinator::ListCheckpoints, list, &listed).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(listed.checkpoints_size(), 0);
    checkpoint::DescribeCheckpointRequest describe;
    describe.set_dir(d);
    describe.set_version(1);
    describe.set_verify(true);
    EXPECT_EQ(Call(*coordinator_, &Coordinator::DescribeCheckpoint, describe).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    // Straight to a daemon, as a rogue coordinator would.
    checkpoint::WriteShardRequest write;
    write.set_dir(d);
    write.set_version(1);
    write.set_daemon_rank(0);
    write.set_world_size(2);
    EXPECT_EQ(Call(*daemon_, &Daemon::WriteShard, write).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    // Version 0 is no longer in the daemon's memory: it would be read from
    // a checkpoint in `checkpoint_dir`.
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(10));
    checkpoint::ExportRowsRequest request;
    request.set_version(0);
    request.set_tensor("w");
    request.set_row_begin(cluster_->manifest().pieces(0).row_begin());
    request.set_row_end(cluster_->manifest().pieces(0).row_end());
    request.set_cols(64);
    request.set_checkpoint_dir(d);
    auto daemon = checkpoint::CheckpointDaemon::NewStub(grpc::CreateChannel(
        cluster_->manifest().pieces(0).daemon_address(), grpc::InsecureChannelCredentials()));
    auto reader = daemon->ExportRows(&context, request);
    checkpoint::ExportRowsChunk chunk;
    int chunks = 0;
    while (reader->Read(&chunk)) ++chunks;
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(chunks, 0);
  }
  ExpectNothingWrittenOutside();
  // The same request inside the root works (so the refusals above were
  // about the names): a checkpoint into "nightly/a".
  checkpoint::CheckpointRequest create;
  create.set_dir("nightly/a");
  create.set_version(-1);
  checkpoint::CheckpointResponse response;
  const grpc::Status s = Call(*coordinator_, &Coordinator::Checkpoint, create, &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.path(), fs::canonical(root_).string() + "/nightly/a/v1");
  EXPECT_TRUE(cluster_->WaitForVersion(1).ok()) << "the cluster still serves";
}

TEST_F(ConfinementTest, LinksAndCraftedManifestsAreNeverReadThrough) {
  // v9 -> outside/v1 (a symlink named like a version): not listed, not
  // described, not restored.
  checkpoint::ListCheckpointsResponse list;
  ASSERT_TRUE(Call(*coordinator_, &Coordinator::ListCheckpoints,
                   checkpoint::ListCheckpointsRequest(), &list)
                  .ok());
  std::vector<uint64_t> versions;
  for (const auto& e : list.checkpoints()) versions.push_back(e.version());
  EXPECT_EQ(versions, (std::vector<uint64_t>{0, 1}));
  auto describe = [&](int64_t version) {
    checkpoint::DescribeCheckpointRequest request;
    request.set_version(version);
    request.set_verify(true);
    return Call(*coordinator_, &Coordinator::DescribeCheckpoint, request);
  };
  auto restore = [&](const std::string& path, int64_t version) {
    rpc::LoadRequest request;
    request.set_checkpoint_path(path);
    request.set_checkpoint_version(version);
    return Call(cluster_->coordinator(), &rpc::Coordinator::Stub::Load, request);
  };
  EXPECT_EQ(describe(9).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(restore(root_, 9).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // A manifest with a valid checksum naming a file outside its directory
  // (the outside copy would verify): DATA_LOSS, never listed.
  const std::string v5 = root_ + "/v5";
  fs::create_directory(v5);
  auto store = checkpoint::CheckpointStore::Open(root_, false);
  ASSERT_TRUE(store.ok());
  checkpoint::Manifest crafted = store->ReadManifest(1).value();
  crafted.set_version(5);
  crafted.mutable_shards(1)->set_name("../../outside/v1/shard-00001-of-00002.ckpt");
  ASSERT_TRUE(checkpoint::testing::WriteManifestUnchecked(v5 + "/MANIFEST", crafted).ok());
  fs::copy(root_ + "/v1/shard-00000-of-00002.ckpt", v5 + "/shard-00000-of-00002.ckpt");
  grpc::Status s = describe(5);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "unexpected shard file")) << s.error_message();
  s = restore(root_, 5);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();

  // A shard file replaced by a symlink to its identical outside copy.
  const std::string shard = root_ + "/v1/shard-00000-of-00002.ckpt";
  fs::remove(shard);
  fs::create_symlink(outside_ + "/v1/shard-00000-of-00002.ckpt", shard);
  s = describe(1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), shard)) << s.error_message();
  s = restore(root_, 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();

  // Load's checkpoint_path is an operator path (like safetensors_path):
  // a directory without checkpoints is NOT_FOUND.
  EXPECT_EQ(restore("/etc", -1).error_code(), grpc::StatusCode::NOT_FOUND);
  // Nothing changed: the cluster still serves v1, v0 still verifies.
  EXPECT_TRUE(cluster_->WaitForVersion(1).ok());
  EXPECT_TRUE(describe(0).ok());
  ExpectNothingWrittenOutside();
}

}  // namespace
}  // namespace testing
}  // namespace paramd
