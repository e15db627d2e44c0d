// Multi-process: hostile requests that used to crash, hang or corrupt a
// coordinator + two daemon processes are refused with a
// clear status, change nothing, and the cluster keeps serving. Each test
// ends with a valid step whose result proves nothing refused was summed.
#include <signal.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "gtest/gtest.h"
#include "proto/checkpoint_service.grpc.pb.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

constexpr int64_t kRows = 300;
constexpr int64_t kCols = 128;
constexpr float kLr = 0.5f;
// The daemons' --max_message_bytes: a push message above it fails the read.
constexpr int64_t kMaxMessage = 1 << 20;

constexpr const char* kRecipe = kFp32PassthroughRecipe;

// The tests call cluster-internal RPCs (LoadShards, ReportVersion, Step,
// ExportRows) as a rogue or buggy member would: with the cluster secret, so
// that what they reach is the validation behind authentication
// (//tests:auth_cluster_test covers strangers without it).
constexpr char kClusterSecret[] = "server-validation-test-cluster-secret";

using Tensors = std::map<std::string, std::vector<float>>;

class ServerValidationTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    TestClusterOptions options = TwoDaemonSgd(kLr);
    options.cluster_secret = kClusterSecret;
    options.daemon_flags = {absl::StrCat("--max_message_bytes=", kMaxMessage)};
    absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(options);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = c->release();
    model_ = cluster_->cluster().dir() + "/model.safetensors";
    ASSERT_TRUE(WriteModel(model_, {{"w", {kRows, kCols}, RandomValues(kRows * kCols, 1)},
                                    {"b", {77}, RandomValues(77, 2)}})
                    .ok());
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(cluster_, nullptr);
    absl::StatusOr<int64_t> v = cluster_->Load(model_, kRecipe);
    ASSERT_TRUE(v.ok()) << v.status() << cluster_->cluster().Logs();
    split_ = 0;
    for (const rpc::ShardPiece& p : cluster_->manifest().pieces()) {
      if (p.tensor() == "w" && p.daemon_rank() == 1) split_ = p.row_begin();
    }
    ASSERT_GT(split_, 0) << cluster_->manifest().DebugString();
  }
  void TearDown() override {
    if (HasFailure() && cluster_ != nullptr) ADD_FAILURE() << cluster_->cluster().Logs();
  }

  static Tensors Masters(int64_t version) {
    absl::StatusOr<Tensors> m = cluster_->Fp32Masters(version, {"w", "b"});
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? *m : Tensors();
  }

  static Tensors Gradients(uint32_t seed) {
    return {{"w", RandomValues(kRows * kCols, seed, 0.1f)},
            {"b", RandomValues(77, seed + 1, 0.1f)}};
  }

  static int Pushers(int rank) {
    absl::StatusOr<rpc::DaemonStats> stats = cluster_->Stats(rank);
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? stats->pushers_received() : -1;
  }

  // Pushers "a" and "b" complete `version`; the new masters are exactly
  // before - lr * (a + b): nothing of any refused push was summed.
  static void ExpectValidStep(int64_t version, const Tensors& before) {
    const Tensors a = Gradients(100), b = Gradients(200);
    ASSERT_TRUE(cluster_->PushAll(version, "a", a).ok()) << "the retry is accepted";
    ASSERT_TRUE(cluster_->PushAll(version, "b", b).ok());
    absl::StatusOr<int64_t> v = cluster_->WaitForVersion(version + 1);
    ASSERT_TRUE(v.ok()) << v.status();
    const Tensors after = Masters(version + 1);
    for (const auto& [name, w] : before) {
      std::vector<float> want = w;
      for (size_t i = 0; i < want.size(); ++i) want[i] -= kLr * (a.at(name)[i] + b.at(name)[i]);
      EXPECT_EQ(after.at(name), want) << name;
    }
  }

  static grpc::Status RawLoad(const rpc::LoadRequest& request) {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(20));
    rpc::LoadResponse response;
    return cluster_->coordinator().Load(&context, request, &response);
  }

  static RawCluster* cluster_;
  static std::string model_;
  int64_t split_ = 0;
};

RawCluster* ServerValidationTest::cluster_ = nullptr;
std::string ServerValidationTest::model_;

// ---- D1: names ----

TEST_F(ServerValidationTest, LongAndControlCharacterNamesAreRefusedAtEveryEntry) {
  const Tensors before = Masters(0);
  const absl::Time start = absl::Now();
  // Declared tensors (the audit's crash: ~100 KB).
  rpc::LoadRequest declared;
  rpc::TensorDecl* d = declared.add_tensors();
  d->set_name(std::string(100 << 10, 'a') + ".weight");
  d->add_shape(4);
  d->add_shape(4);
  grpc::Status s = RawLoad(declared);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "limit of 1024 bytes")) << s.error_message();
  d->set_name(std::string("w\0x", 3));
  s = RawLoad(declared);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "control character")) << s.error_message();
  // A safetensors file whose header holds such a name.
  const std::string file = cluster_->cluster().dir() + "/long_name.safetensors";
  ASSERT_TRUE(WriteModel(file, {{std::string(100 << 10, 'n') + ".weight", {2}, {1, 2}}}).ok());
  absl::StatusOr<int64_t> v = cluster_->Load(file, kRecipe);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
  EXPECT_TRUE(absl::StrContains(v.status().message(), "--max_tensor_name_bytes")) << v.status();
  // Straight to a daemon.
  rpc::LoadShardsRequest shards;
  rpc::TensorInfo* t = shards.mutable_manifest()->add_tensors();
  t->set_name(std::string(100 << 10, 'n'));
  t->set_rows(1);
  t->set_cols(1);
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(10));
  rpc::LoadShardsResponse response;
  s = cluster_->daemon(0).LoadShards(&context, shards, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // Everything still serves the loaded model.
  ASSERT_TRUE(cluster_->RefreshManifest().ok()) << "the coordinator is alive";
  EXPECT_EQ(Masters(0), before);
  ExpectValidStep(0, before);
}

// ---- D2: recipe patterns ----

TEST_F(ServerValidationTest, ReDoSRecipeIsRefusedAtParseAndTheNextLoadRuns) {
  const absl::Time start = absl::Now();
  rpc::LoadRequest request;
  request.set_safetensors_path(model_);
  request.set_recipe_text(
      "rule {\n  pattern: \".**mlp.*\\\\.weight\"\n  spec { rowwise { format: MXFP8 } }\n}\n");
  const grpc::Status s = RawLoad(request);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "LoadRequest.recipe_text:2:3"))
      << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "not a valid RE2 regex")) << s.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // Not "a load is already in progress".
  absl::StatusOr<int64_t> v = cluster_->Load(model_, kRecipe);
  ASSERT_TRUE(v.ok()) << v.status();
  ExpectValidStep(0, Masters(0));
}

// ---- D3: a push commits only on its end marker ----

// Header + one good piece, then a message over the daemon's size limit: the
// read fails. Repeated 100 times, nothing is summed and the pusher is never
// counted; its retry is accepted.
TEST_F(ServerValidationTest, PushFailingMidStreamIsNeverCommitted) {
  const Tensors before = Masters(0);
  const Tensors g = Gradients(7);
  const rpc::PushGradientsRequest good =
      GradientMessage(0, "a", "w", 0, split_, g.at("w").data(), kCols);
  rpc::PushGradientsRequest huge = good;
  huge.clear_version();
  huge.clear_pusher_id();
  huge.mutable_chunk()->set_row_begin(0);
  huge.mutable_chunk()->set_row_end(split_);
  huge.mutable_chunk()->set_offset(good.chunk().data().size());
  huge.mutable_chunk()->set_data(std::string(2 * kMaxMessage, '\0'));
  const absl::Time start = absl::Now();
  for (int i = 0; i < 100; ++i) {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(10));
    rpc::PushGradientsResponse response;
    auto writer = cluster_->daemon(0).PushGradients(&context, &response);
    writer->Write(good);
    writer->Write(huge);
    writer->Write(EndMessage({good, huge}));
    writer->WritesDone();
    const grpc::Status s = writer->Finish();
    ASSERT_FALSE(s.ok()) << "attempt " << i;
    ASSERT_NE(s.error_code(), grpc::StatusCode::ALREADY_EXISTS)
        << "attempt " << i << ": an earlier failed stream was counted";
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  EXPECT_EQ(Pushers(0), 0);
  EXPECT_EQ(Masters(0), before);
  ExpectValidStep(0, before);
}

TEST_F(ServerValidationTest, StreamsWithoutAValidEndMarkerCountNothing) {
  const Tensors before = Masters(0);
  const Tensors g = Gradients(8);
  const rpc::PushGradientsRequest piece =
      GradientMessage(0, "a", "w", 0, split_, g.at("w").data(), kCols);
  rpc::PushGradientsRequest header;
  header.set_version(0);
  header.set_pusher_id("a");
  for (int r = 0; r < 2; ++r) {  // header-only: never a pusher
    const grpc::Status s = cluster_->PushRaw(r, {header}, nullptr, /*add_end=*/false);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), "end marker")) << s.error_message();
  }
  // A whole piece, half-closed without the marker.
  grpc::Status s = cluster_->PushRaw(0, {piece}, nullptr, /*add_end=*/false);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  // A marker with the wrong total.
  rpc::PushGradientsRequest end = EndMessage({piece});
  end.mutable_end()->set_total_bytes(end.end().total_bytes() - 4);
  s = cluster_->PushRaw(0, {piece, end}, nullptr, /*add_end=*/false);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "end marker says")) << s.error_message();
  EXPECT_EQ(Pushers(0), 0);
  EXPECT_EQ(Pushers(1), 0);
  EXPECT_EQ(Masters(0), before);
  ExpectValidStep(0, before);
}

// ---- D4: LoadShards ----

TEST_F(ServerValidationTest, EmptyOrInvalidManifestLeavesTheModelLoaded) {
  const Tensors before = Masters(0);
  for (int rank = 0; rank < 2; ++rank) {
    rpc::LoadShardsRequest request;  // empty manifest: used to wipe the model
    request.set_daemon_rank(rank);
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(10));
    rpc::LoadShardsResponse response;
    const grpc::Status s = cluster_->daemon(rank).LoadShards(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  }
  EXPECT_EQ(Masters(0), before);
  ExpectValidStep(0, before);
}

// ---- D5: ReportVersion ----

TEST_F(ServerValidationTest, ForgedReportVersionIsRefusedAndCommitsNothing) {
  for (int rank = 0; rank < 2; ++rank) {
    rpc::ReportVersionRequest request;
    request.set_member_id(absl::StrCat("daemon-", rank));
    request.set_daemon_rank(rank);
    request.set_published_version(1);  // not published by anyone
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(10));
    rpc::ReportVersionResponse response;
    const grpc::Status s = cluster_->coordinator().ReportVersion(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  }
  ASSERT_TRUE(cluster_->RefreshManifest().ok());
  EXPECT_EQ(cluster_->manifest().committed_version(), 0) << "the committed version did not move";
  for (const rpc::DaemonInfo& d : cluster_->manifest().daemons()) {
    EXPECT_EQ(d.published_version(), 0);
  }
  ExpectValidStep(0, Masters(0));  // real reports still commit
}

// ---- D8: negative versions, tiny chunks, ExportRows, GetStatus ----

TEST_F(ServerValidationTest, NegativeVersionsAndTinyChunksAreRefused) {
  const Tensors before = Masters(0);
  FetchedPieces got;
  rpc::FetchRequest fetch;
  fetch.set_version(-7);
  grpc::Status s = cluster_->FetchFrom(0, fetch, absl::Seconds(5), &got);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  fetch.set_version(-1);  // the documented "latest"
  EXPECT_TRUE(cluster_->FetchFrom(0, fetch, absl::Seconds(5), &got).ok());
  fetch.set_version(0);
  fetch.set_max_chunk_bytes(1);
  s = cluster_->FetchFrom(0, fetch, absl::Seconds(5), &got);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "--min_chunk_bytes")) << s.error_message();
  {
    rpc::DaemonStepRequest step;
    step.set_version(-1);
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(5));
    rpc::DaemonStepResponse response;
    s = cluster_->daemon(0).Step(&context, step, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  }
  {  // A bad checkpoint_dir is refused even when the daemon holds the version.
    auto stub = checkpoint::CheckpointDaemon::NewStub(
        cluster_->Channel(cluster_->manifest().daemons(0).address()));
    checkpoint::ExportRowsRequest request;
    request.set_version(0);
    request.set_tensor("w");
    request.set_row_begin(0);
    request.set_row_end(1);
    request.set_cols(kCols);
    request.set_checkpoint_dir("../../etc");
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(5));
    auto reader = stub->ExportRows(&context, request);
    checkpoint::ExportRowsChunk chunk;
    while (reader->Read(&chunk)) {
    }
    s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  }
  EXPECT_EQ(Pushers(0), 0);
  EXPECT_EQ(Masters(0), before);
  ExpectValidStep(0, before);
}

TEST_F(ServerValidationTest, GetStatusAnswersQuicklyWithAStoppedDaemon) {
  // The process started first; find its rank by port.
  const std::string address = absl::StrCat("127.0.0.1:", cluster_->cluster().daemon_port(0));
  int stopped = -1;
  for (const rpc::DaemonInfo& d : cluster_->manifest().daemons()) {
    if (d.address() == address) stopped = d.rank();
  }
  ASSERT_GE(stopped, 0);
  cluster_->cluster().SignalDaemon(0, SIGSTOP);
  // The stop is delivered asynchronously: in one CI run the "stopped" daemon
  // still answered a call made at once. Let it take effect (well inside the
  // 1.5 s lease, so the daemon is not yet DOWN and must be asked).
  absl::SleepFor(absl::Milliseconds(200));
  const absl::Time start = absl::Now();
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(20));
  rpc::GetStatusResponse response;
  const grpc::Status s =
      cluster_->coordinator().GetStatus(&context, rpc::GetStatusRequest(), &response);
  const absl::Duration took = absl::Now() - start;
  cluster_->cluster().SignalDaemon(0, SIGCONT);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_LT(took, absl::Seconds(4)) << "the daemon call timeout is 10 s";
  ASSERT_EQ(response.daemons_size(), 2);
  EXPECT_TRUE(absl::StrContains(response.daemons(stopped).error(), "unreachable"))
      << response.daemons(stopped).DebugString();
  EXPECT_TRUE(response.daemons(1 - stopped).error().empty())
      << response.daemons(1 - stopped).DebugString();
}

// ---- D6: Load without --model_root never echoes file contents ----

TEST_F(ServerValidationTest, LoadOfANonModelFileDoesNotShowItsBytes) {
  const std::string secret = cluster_->cluster().dir() + "/passwd";
  {
    std::ofstream f(secret);
    f << "root:x:0:0:root:/root:/bin/bash\nsecret-token-123\n";
  }
  absl::StatusOr<int64_t> v = cluster_->Load(secret, kRecipe);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().message().find("root:x"), absl::string_view::npos) << v.status();
  uint64_t as_number = 0;
  std::memcpy(&as_number, "root:x:0", 8);
  EXPECT_EQ(v.status().message().find(absl::StrCat(as_number)), absl::string_view::npos)
      << v.status();
  ASSERT_TRUE(cluster_->Load(model_, kRecipe).ok());
}

// ---- D6 + D4 paths: --model_root confines every file a request names ----

TEST(ModelRootTest, LoadAndLoadShardsReadOnlyBelowTheRoot) {
  const std::string base = absl::StrCat(::testing::TempDir(), "/model_root_test_", getpid());
  const std::string root = base + "/models";
  std::filesystem::create_directories(root);
  TestClusterOptions options = TwoDaemonSgd(kLr);
  options.cluster_secret = kClusterSecret;
  options.coordinator_flags = {"--model_root=" + root};
  options.daemon_flags = {"--model_root=" + root};
  absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(options);
  ASSERT_TRUE(c.ok()) << c.status();
  RawCluster& cluster = **c;
  const std::vector<TestTensor> tensors = {{"w", {kRows, kCols}, RandomValues(kRows * kCols, 1)}};
  ASSERT_TRUE(WriteModel(root + "/m.safetensors", tensors).ok());
  ASSERT_TRUE(WriteModel(base + "/outside.safetensors", tensors).ok());
  std::filesystem::create_symlink(base + "/outside.safetensors", root + "/link.safetensors");
  ASSERT_TRUE(cluster.Load(root + "/m.safetensors", kRecipe).ok()) << cluster.cluster().Logs();
  ASSERT_TRUE(cluster.Load("m.safetensors", kRecipe).ok()) << "relative to the root";
  for (const std::string& path :
       {std::string("/etc/passwd"), base + "/outside.safetensors", root + "/../outside.safetensors",
        root + "/link.safetensors", std::string("/etc/no-such-file"),
        base + "/missing.safetensors"}) {
    // Existing or missing: the same answer, so Load is no probe of the host.
    absl::StatusOr<int64_t> v = cluster.Load(path, kRecipe);
    EXPECT_EQ(v.status().code(), absl::StatusCode::kPermissionDenied) << path << ": " << v.status();
    EXPECT_TRUE(
        absl::StrContains(v.status().message(), "\" is not a readable file below --model_root"))
        << v.status();
    EXPECT_EQ(v.status().message().find("root:x"), absl::string_view::npos) << v.status();
  }
  // Straight to a daemon: its own --model_root.
  rpc::LoadShardsRequest request;
  *request.mutable_manifest() = cluster.manifest();
  request.set_daemon_rank(0);
  request.set_safetensors_path("/etc/passwd");
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(10));
  rpc::LoadShardsResponse response;
  const grpc::Status s = cluster.daemon(0).LoadShards(&context, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  // Still serving the loaded model.
  EXPECT_TRUE(cluster.Fp32Masters(0, {"w"}).ok());
  std::filesystem::remove_all(base);
}

// ---- Limits ----

class LimitsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    TestClusterOptions options = TwoDaemonSgd(kLr);
    options.cluster_secret = kClusterSecret;
    options.expected_pushers = 0;  // admin steps only: no bound from expected_pushers
    options.coordinator_flags = {"--max_tensors=3", "--max_tensor_name_bytes=16",
                                 "--memory_budget_bytes=67108864"};
    options.daemon_flags = {"--max_pushers_per_version=2", "--max_parked_fetches_per_client=2",
                            "--memory_budget_bytes=67108864"};
    absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(options);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = c->release();
    const std::string model = cluster_->cluster().dir() + "/model.safetensors";
    ASSERT_TRUE(WriteModel(model, {{"w", {kRows, kCols}, RandomValues(kRows * kCols, 1)}}).ok());
    ASSERT_TRUE(cluster_->Load(model, kRecipe).ok()) << cluster_->cluster().Logs();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  void TearDown() override {
    if (HasFailure() && cluster_ != nullptr) ADD_FAILURE() << cluster_->cluster().Logs();
  }
  static int64_t Version() {
    absl::StatusOr<rpc::DaemonStats> stats = cluster_->Stats(0);
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? stats->published_version() : -1;
  }
  // Admin step from the committed version; returns the new one.
  static int64_t AdminStep() {
    const int64_t from = Version();
    rpc::StepRequest request;
    request.set_version(from);
    request.set_wait(true);
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(20));
    rpc::StepResponse response;
    const grpc::Status s = cluster_->coordinator().Step(&context, request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return response.committed_version();
  }
  // The cluster's logs come to hold "\"<before>\\n<forged>\"" (a client
  // string with a newline, quoted and escaped) within 5 s, and never the
  // newline itself followed by `forged` (a forged log line).
  static void ExpectLoggedEscaped(const std::string& before, const std::string& forged) {
    const std::string escaped = absl::StrCat("\"", before, "\\n", forged, "\"");
    const absl::Time give_up = absl::Now() + absl::Seconds(5);
    std::string logs;
    while (!absl::StrContains(logs = cluster_->cluster().Logs(), escaped) &&
           absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_TRUE(absl::StrContains(logs, escaped)) << logs;
    EXPECT_FALSE(absl::StrContains(logs, "\n" + forged)) << logs;
  }
  static RawCluster* cluster_;
};

RawCluster* LimitsTest::cluster_ = nullptr;

TEST_F(LimitsTest, TensorCountAndNameLength) {
  rpc::LoadRequest request;
  for (const char* name : {"a", "b", "c", "d"}) {
    rpc::TensorDecl* d = request.add_tensors();
    d->set_name(name);
    d->add_shape(4);
  }
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(10));
  rpc::LoadResponse response;
  grpc::Status s = cluster_->coordinator().Load(&context, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "--max_tensors")) << s.error_message();
  request.clear_tensors();
  rpc::TensorDecl* d = request.add_tensors();
  d->set_name(std::string(17, 'n'));
  d->add_shape(4);
  grpc::ClientContext context2;
  SetDeadline(context2, absl::Seconds(10));
  s = cluster_->coordinator().Load(&context2, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "limit of 16 bytes")) << s.error_message();
  EXPECT_GT(AdminStep(), 0) << "the loaded model still steps";
}

// The audit's 32768 x 4096 declared tensor (RSS 175 -> 700 MB per daemon).
TEST_F(LimitsTest, DeclaredModelOverTheMemoryBudget) {
  rpc::LoadRequest request;
  rpc::TensorDecl* d = request.add_tensors();
  d->set_name("huge");
  d->add_shape(32768);
  d->add_shape(4096);
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(10));
  rpc::LoadResponse response;
  grpc::Status s = cluster_->coordinator().Load(&context, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "--memory_budget_bytes")) << s.error_message();
  // Straight to a daemon (its own budget).
  rpc::LoadShardsRequest shards;
  rpc::TensorInfo* t = shards.mutable_manifest()->add_tensors();
  t->set_name("huge");
  t->set_rows(32768);
  t->set_cols(4096);
  rpc::ShardPiece* p = shards.mutable_manifest()->add_pieces();
  p->set_tensor("huge");
  p->set_row_begin(0);
  p->set_row_end(32768);
  grpc::ClientContext context2;
  SetDeadline(context2, absl::Seconds(10));
  rpc::LoadShardsResponse shards_response;
  s = cluster_->daemon(0).LoadShards(&context2, shards, &shards_response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_GT(AdminStep(), 0) << "the loaded model still steps";
}

TEST_F(LimitsTest, PushersPerVersion) {
  const int64_t v = Version();
  const std::vector<float> g(kRows * kCols, 0.25f);
  for (const char* pusher : {"p1", "p2"}) {
    ASSERT_TRUE(cluster_->PushAll(v, pusher, {{"w", g}}).ok()) << pusher;
  }
  const absl::Status third = cluster_->PushAll(v, "p3", {{"w", g}});
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
  EXPECT_TRUE(absl::StrContains(third.message(), "--max_pushers_per_version")) << third;
  EXPECT_EQ(AdminStep(), v + 1) << "the daemon keeps serving";
  ASSERT_TRUE(cluster_->PushAll(v + 1, "p3", {{"w", g}}).ok()) << "a new version starts afresh";
}

// A client's names and ids reach replies and log lines bounded and
// escaped; an id over 256 bytes is refused before it is stored.
TEST_F(LimitsTest, ClientStringsAreBoundedAndEscaped) {
  // A 1 MiB tensor name: a short INVALID_ARGUMENT (echoed whole, the message
  // overflowed gRPC's metadata and came back as RESOURCE_EXHAUSTED).
  rpc::FetchRequest fetch;
  fetch.set_version(Version());
  fetch.add_tensors()->set_tensor(std::string(1 << 20, 'a'));
  FetchedPieces got;
  grpc::Status s = cluster_->FetchFrom(0, fetch, absl::Seconds(10), &got);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message().substr(0, 300);
  EXPECT_LT(s.error_message().size(), 1500u);
  // A control character is escaped in the reply.
  fetch.mutable_tensors(0)->set_tensor("w\nE0101 forged");
  s = cluster_->FetchFrom(0, fetch, absl::Seconds(10), &got);
  EXPECT_EQ(s.error_message().find('\n'), std::string::npos) << s.error_message();
  // An 8 MiB pusher id: refused, nothing pushed.
  const int64_t v = AdminStep();  // a version nobody pushed for yet
  const std::vector<float> g(kRows * kCols, 0.25f);
  const absl::Status pushed = cluster_->PushAll(v, std::string(8 << 20, 'p'), {{"w", g}});
  EXPECT_EQ(pushed.code(), absl::StatusCode::kInvalidArgument) << pushed.message().substr(0, 300);
  EXPECT_TRUE(absl::StrContains(pushed.message(), "pusher_id of 8388608 bytes"))
      << pushed.message().substr(0, 300);
  EXPECT_LT(pushed.message().size(), 1500u);
  for (const char* pusher : {"p1", "p2"}) {  // --max_pushers_per_version=2: none was used up
    EXPECT_TRUE(cluster_->PushAll(v, pusher, {{"w", g}}).ok()) << pusher;
  }
  EXPECT_EQ(AdminStep(), v + 1);
  // A joiner's name with a newline: one log line, the newline escaped.
  rpc::JoinRequest join;
  join.set_role(rpc::ROLE_OBSERVER);
  join.set_address("127.0.0.1:1");
  join.set_name("evil\nE0101 00:00:00 forged line");
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(10));
  rpc::JoinResponse joined;
  const grpc::Status j = cluster_->coordinator().Join(&context, join, &joined);
  ASSERT_TRUE(j.ok()) << j.error_message();
  ExpectLoggedEscaped("evil", "E0101 00:00:00 forged line");
  // Ids over 256 bytes are refused at the door.
  join.set_name(std::string(300, 'n'));
  grpc::ClientContext context2;
  SetDeadline(context2, absl::Seconds(10));
  EXPECT_EQ(cluster_->coordinator().Join(&context2, join, &joined).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

// Paths, the joiner's other strings, heartbeat ids and the tensor of an
// ExportRows: bounded before use, escaped wherever they are echoed.
TEST_F(LimitsTest, PathsIdsAndExportNamesAreBoundedAndEscaped) {
  // Load paths: a control character or a megabyte is a short
  // INVALID_ARGUMENT, before any file is looked at.
  for (const std::string& path :
       {std::string("/no/such\nE0101 forged.safetensors"), std::string(1 << 20, 'p')}) {
    for (const bool checkpoint : {false, true}) {
      rpc::LoadRequest load;
      if (checkpoint) {
        load.set_checkpoint_path(path);
      } else {
        load.set_safetensors_path(path);
      }
      grpc::ClientContext context;
      SetDeadline(context, absl::Seconds(10));
      rpc::LoadResponse response;
      const grpc::Status s = cluster_->coordinator().Load(&context, load, &response);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
          << s.error_message().substr(0, 300);
      EXPECT_LT(s.error_message().size(), 1500u);
      EXPECT_EQ(s.error_message().find('\n'), std::string::npos) << s.error_message();
      EXPECT_TRUE(
          absl::StrContains(s.error_message(), checkpoint ? "checkpoint_path" : "safetensors_path"))
          << s.error_message().substr(0, 300);
    }
  }
  // A joiner's stored strings beyond name/address/member_id, and the ids a
  // heartbeat is compared by: over 256 bytes is refused.
  for (const char* field : {"data_plane_address", "incarnation", "member_secret"}) {
    rpc::JoinRequest join;
    join.set_role(rpc::ROLE_OBSERVER);
    join.set_address("127.0.0.1:1");
    const std::string big(1024, 'x');
    if (std::string(field) == "data_plane_address") join.set_data_plane_address(big);
    if (std::string(field) == "incarnation") join.set_incarnation(big);
    if (std::string(field) == "member_secret") join.set_member_secret(big);
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(10));
    rpc::JoinResponse joined;
    const grpc::Status s = cluster_->coordinator().Join(&context, join, &joined);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field;
    EXPECT_TRUE(absl::StrContains(s.error_message(), absl::StrCat(field, " of 1024 bytes")))
        << s.error_message();
  }
  rpc::HeartbeatRequest heartbeat;
  heartbeat.set_rank(0);
  heartbeat.set_member_id(std::string(1 << 20, 'm'));
  grpc::ClientContext heartbeat_context;
  SetDeadline(heartbeat_context, absl::Seconds(10));
  rpc::HeartbeatResponse beat;
  const grpc::Status h = cluster_->coordinator().Heartbeat(&heartbeat_context, heartbeat, &beat);
  EXPECT_EQ(h.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << h.error_message();
  EXPECT_LT(h.error_message().size(), 1500u);
  // ExportRows of a tensor named with a newline: the reply and the daemon's
  // log line carry it escaped.
  checkpoint::ExportRowsRequest request;
  request.set_version(Version());
  request.set_tensor("w\nE0101 00:00:00 forged export");
  request.set_row_begin(0);
  request.set_row_end(1);
  request.set_cols(kCols);
  auto daemon = checkpoint::CheckpointDaemon::NewStub(
      cluster_->Channel(cluster_->manifest().daemons(0).address()));
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(10));
  auto reader = daemon->ExportRows(&context, request);
  checkpoint::ExportRowsChunk chunk;
  while (reader->Read(&chunk)) {
  }
  const grpc::Status exported = reader->Finish();
  EXPECT_FALSE(exported.ok());
  EXPECT_EQ(exported.error_message().find('\n'), std::string::npos) << exported.error_message();
  ExpectLoggedEscaped("w", "E0101 00:00:00 forged export");
  EXPECT_GT(AdminStep(), 0) << "the cluster still steps";
}

TEST_F(LimitsTest, ParkedFetchesPerClient) {
  const int64_t ahead = Version() + 5;  // not published for a while
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReader<rpc::FetchResponse>>> parked;
  rpc::FetchRequest request;
  request.set_version(ahead);
  for (int i = 0; i < 2; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    SetDeadline(*contexts.back(), absl::Seconds(20));
    parked.push_back(cluster_->daemon(0).Fetch(contexts.back().get(), request));
  }
  // The third waits for nothing: refused at once (the first two park).
  absl::Time give_up = absl::Now() + absl::Seconds(10);
  grpc::Status s;
  for (;;) {
    FetchedPieces got;
    s = cluster_->FetchFrom(0, request, absl::Seconds(3), &got);
    if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED || absl::Now() > give_up) break;
  }
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "--max_parked_fetches_per_client"))
      << s.error_message();
  for (auto& c : contexts) c->TryCancel();
  for (auto& r : parked) r->Finish();
  absl::SleepFor(absl::Milliseconds(300));  // the cancelled calls finish on the daemon
  // Cancelled fetches no longer count: a fetch of the latest version works
  // and one more may park again (answered by the deadline).
  FetchedPieces got;
  rpc::FetchRequest latest;
  latest.set_version(-1);
  EXPECT_TRUE(cluster_->FetchFrom(0, latest, absl::Seconds(5), &got).ok());
  s = cluster_->FetchFrom(0, request, absl::Milliseconds(300), &got);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
}

}  // namespace
}  // namespace testing
}  // namespace paramd
