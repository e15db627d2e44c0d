// Multi-process: hostile requests that used to crash, hang or corrupt a
// coordinator + two daemon processes (issue 12, D1-D3) are refused with a
// clear status, change nothing, and the cluster keeps serving. Each test
// ends with a valid step whose result proves nothing refused was summed.
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "gtest/gtest.h"
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

using Tensors = std::map<std::string, std::vector<float>>;

class ServerValidationTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    TestClusterOptions options = TwoDaemonSgd(kLr);
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

}  // namespace
}  // namespace testing
}  // namespace paramd
