// Multi-process: every bad request to a coordinator + two daemon processes
// is refused with the status code proto/paramd.proto promises, changes
// nothing, and the daemons keep serving. Each test ends with a valid step
// whose result proves that nothing of the refused request was summed.
//
// The model's tensors are published as FP32 passthrough from an FP32
// source, so a fetch returns the masters exactly.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "format/convert.h"
#include "gtest/gtest.h"
#include "kernels/format.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

constexpr int64_t kRows = 520;
constexpr int64_t kCols = 200;
constexpr float kLr = 0.5f;

constexpr char kRecipe[] = R"txt(
  rule {
    pattern: "r"
    spec { rowwise { format: FP8_CURRENT } columnwise_usage: false }
  }
  default_spec {
    rowwise { format: IDENTITY_FP32 }
    columnwise { format: IDENTITY_FP32 }
    source_dtype: FP32
  })txt";

using Tensors = std::map<std::string, std::vector<float>>;

class ServerErrorsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    TestClusterOptions options;
    options.daemons = 2;
    options.expected_pushers = 2;
    options.optimizer = "sgd";
    options.lr = kLr;
    absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(options);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = c->release();
    const std::string model = cluster_->cluster().dir() + "/model.safetensors";
    ASSERT_TRUE(WriteModel(model, {{"w", {kRows, kCols}, RandomValues(kRows * kCols, 1)},
                                   {"b", {77}, RandomValues(77, 2)},
                                   {"r", {4, 8}, RandomValues(32, 3)}})
                    .ok());
    absl::StatusOr<int64_t> v = cluster_->Load(model, kRecipe);
    ASSERT_TRUE(v.ok()) << v.status() << cluster_->cluster().Logs();
    // "w" is split: daemon 1 owns rows from `split_` on.
    for (const rpc::ShardPiece& p : cluster_->manifest().pieces()) {
      if (p.tensor() == "w" && p.daemon_rank() == 1) split_ = p.row_begin();
    }
    ASSERT_GT(split_, 0) << cluster_->manifest().DebugString();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }

  void SetUp() override { ASSERT_NE(cluster_, nullptr); }
  void TearDown() override {
    if (HasFailure() && cluster_ != nullptr) ADD_FAILURE() << cluster_->cluster().Logs();
  }

  struct Snapshot {
    int64_t version = -1;
    Tensors masters;
    std::vector<int> pushers;  // per daemon, for `version`
  };

  static int64_t Committed() {
    absl::StatusOr<int64_t> v = cluster_->WaitForVersion(0);
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? *v : -1;
  }

  static Tensors Masters(int64_t version) {
    absl::StatusOr<Tensors> m = cluster_->Fp32Masters(version, {"w", "b"});
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? *m : Tensors();
  }

  static Snapshot Snap() {
    Snapshot s;
    s.version = Committed();
    s.masters = Masters(s.version);
    for (int r = 0; r < cluster_->num_daemons(); ++r) {
      absl::StatusOr<rpc::DaemonStats> stats = cluster_->Stats(r);
      EXPECT_TRUE(stats.ok()) << stats.status();
      s.pushers.push_back(stats.ok() ? stats->pushers_received() : -1);
      EXPECT_EQ(stats->published_version(), s.version);
    }
    return s;
  }

  static Tensors Gradients(uint32_t seed) {
    return {{"w", RandomValues(kRows * kCols, seed, 0.1f)},
            {"b", RandomValues(77, seed + 1, 0.1f)},
            {"r", RandomValues(32, seed + 2, 0.1f)}};
  }

  // The daemons still serve `before` unchanged: same version, masters and
  // pusher counts.
  static void ExpectUnchanged(const Snapshot& before) {
    const Snapshot now = Snap();
    EXPECT_EQ(now.version, before.version);
    EXPECT_EQ(now.pushers, before.pushers);
    EXPECT_EQ(now.masters, before.masters);
  }

  // Completes version before.version with pushers "a" (unless `a_pushed`,
  // then `a` is what it pushed) and "b", and checks the new masters are
  // before - lr * (a + b): nothing else was summed.
  static void ExpectValidStep(const Snapshot& before, bool a_pushed = false,
                              Tensors a = Gradients(100)) {
    const Tensors b = Gradients(200);
    if (!a_pushed) {
      ASSERT_TRUE(cluster_->PushAll(before.version, "a", a).ok());
    }
    ASSERT_TRUE(cluster_->PushAll(before.version, "b", b).ok());
    absl::StatusOr<int64_t> v = cluster_->WaitForVersion(before.version + 1);
    ASSERT_TRUE(v.ok()) << v.status();
    const Tensors after = Masters(before.version + 1);
    for (const auto& [name, w] : before.masters) {
      std::vector<float> want = w;
      for (size_t i = 0; i < want.size(); ++i) want[i] -= kLr * (a.at(name)[i] + b.at(name)[i]);
      EXPECT_EQ(after.at(name), want) << name;
    }
  }

  // One push message carrying rows [b, e) of `tensor` from `values`.
  static rpc::PushGradientsRequest Message(int64_t version, const std::string& pusher,
                                           const std::string& tensor, int64_t b, int64_t e,
                                           const std::vector<float>& values) {
    return GradientMessage(version, pusher, tensor, b, e, values.data(),
                           cluster_->tensor(tensor).cols());
  }

  static RawCluster* cluster_;
  static int64_t split_;
};

RawCluster* ServerErrorsTest::cluster_ = nullptr;
int64_t ServerErrorsTest::split_ = 0;

// ---- Pushes ----

TEST_F(ServerErrorsTest, StalePushIsFailedPrecondition) {
  Snapshot first = Snap();
  ExpectValidStep(first);
  const Snapshot before = Snap();
  const Tensors g = Gradients(7);
  const grpc::Status s =
      cluster_->PushRaw(0, {Message(before.version - 1, "a", "w", 0, split_, g.at("w"))});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  ExpectUnchanged(before);
  ExpectValidStep(before);
}

TEST_F(ServerErrorsTest, DuplicatePushIsAlreadyExistsAndSummedOnce) {
  const Snapshot before = Snap();
  const Tensors a = Gradients(300);
  ASSERT_TRUE(cluster_->PushAll(before.version, "a", a).ok());
  const grpc::Status s =
      cluster_->PushRaw(0, {Message(before.version, "a", "w", 0, split_, a.at("w"))});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << s.error_message();
  absl::StatusOr<rpc::DaemonStats> stats = cluster_->Stats(0);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->pushers_received(), 1);
  EXPECT_EQ(stats->published_version(), before.version);
  ExpectValidStep(before, /*a_pushed=*/true, a);
}

TEST_F(ServerErrorsTest, EarlyPushIsOutOfRange) {
  const Snapshot before = Snap();
  const Tensors g = Gradients(8);
  const grpc::Status s =
      cluster_->PushRaw(0, {Message(before.version + 1, "a", "w", 0, split_, g.at("w"))});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << s.error_message();
  ExpectUnchanged(before);
  ExpectValidStep(before);
}

TEST_F(ServerErrorsTest, UnknownTensorIsNotFound) {
  const Snapshot before = Snap();
  const Tensors g = Gradients(9);
  rpc::PushGradientsRequest m = Message(before.version, "a", "w", 0, 1, g.at("w"));
  m.mutable_chunk()->set_tensor("no_such_tensor");
  EXPECT_EQ(cluster_->PushRaw(0, {m}).error_code(), grpc::StatusCode::NOT_FOUND);
  ExpectUnchanged(before);
  ExpectValidStep(before);
}

TEST_F(ServerErrorsTest, WrongByteCountIsInvalidArgument) {
  const Snapshot before = Snap();
  const Tensors g = Gradients(10);
  // A valid first piece, then one with a column too many per row.
  rpc::PushGradientsRequest good = Message(before.version, "a", "b", 0, 1, g.at("b"));
  rpc::PushGradientsRequest bad = Message(before.version, "a", "w", 0, 2, g.at("w"));
  bad.mutable_chunk()->mutable_data()->append(4 * 3, '\0');
  int b_daemon = -1;
  for (const rpc::ShardPiece& p : cluster_->manifest().pieces()) {
    if (p.tensor() == "b") b_daemon = p.daemon_rank();
  }
  std::vector<rpc::PushGradientsRequest> stream = {bad};
  if (b_daemon == 0) stream.insert(stream.begin(), good);
  EXPECT_EQ(cluster_->PushRaw(0, stream).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ExpectUnchanged(before);
  ExpectValidStep(before);
}

TEST_F(ServerErrorsTest, WrongDtypeIsInvalidArgument) {
  const Snapshot before = Snap();
  const Tensors g = Gradients(11);
  rpc::PushGradientsRequest m = Message(before.version, "a", "w", 0, 1, g.at("w"));
  m.mutable_chunk()->set_dtype(rpc::DTYPE_UNSPECIFIED);
  EXPECT_EQ(cluster_->PushRaw(0, {m}).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // BF16 declared, FP32 bytes: twice the expected size.
  m.mutable_chunk()->set_dtype(rpc::DTYPE_BF16);
  EXPECT_EQ(cluster_->PushRaw(0, {m}).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ExpectUnchanged(before);
  ExpectValidStep(before);
}

TEST_F(ServerErrorsTest, RowRangeOutsideTheTensorIsInvalidArgument) {
  const Snapshot before = Snap();
  const Tensors g = Gradients(12);
  rpc::PushGradientsRequest m = Message(before.version, "a", "w", 0, 1, g.at("w"));
  m.mutable_chunk()->set_row_begin(kRows);
  m.mutable_chunk()->set_row_end(kRows + 1);
  EXPECT_EQ(cluster_->PushRaw(1, {m}).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  m.mutable_chunk()->set_row_begin(3);
  m.mutable_chunk()->set_row_end(3);
  EXPECT_EQ(cluster_->PushRaw(0, {m}).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ExpectUnchanged(before);
  ExpectValidStep(before);
}

TEST_F(ServerErrorsTest, RowsOfAnotherDaemonAreFailedPrecondition) {
  const Snapshot before = Snap();
  const Tensors g = Gradients(13);
  // Daemon 0 does not own rows from split_ on; a range straddling the cut is
  // on no single daemon.
  EXPECT_EQ(cluster_->PushRaw(0, {Message(before.version, "a", "w", split_, kRows, g.at("w"))})
                .error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(
      cluster_->PushRaw(1, {Message(before.version, "a", "w", split_ - 1, split_ + 1, g.at("w"))})
          .error_code(),
      grpc::StatusCode::FAILED_PRECONDITION);
  ExpectUnchanged(before);
  ExpectValidStep(before);
}

TEST_F(ServerErrorsTest, NonFiniteGradientIsInvalidArgument) {
  const Snapshot before = Snap();
  Tensors g = Gradients(14);
  g["w"][17] = std::nanf("");
  EXPECT_EQ(
      cluster_->PushRaw(0, {Message(before.version, "a", "w", 0, split_, g.at("w"))}).error_code(),
      grpc::StatusCode::INVALID_ARGUMENT);
  ExpectUnchanged(before);
  ExpectValidStep(before);
}

TEST_F(ServerErrorsTest, PushWithoutPusherIdIsInvalidArgument) {
  const Snapshot before = Snap();
  const Tensors g = Gradients(15);
  EXPECT_EQ(
      cluster_->PushRaw(0, {Message(before.version, "", "w", 0, split_, g.at("w"))}).error_code(),
      grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(cluster_->PushRaw(0, {}).error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << "an empty stream names no version";
  ExpectUnchanged(before);
  ExpectValidStep(before);
}

TEST_F(ServerErrorsTest, StreamEndingInsideAPieceIsInvalidArgument) {
  const Snapshot before = Snap();
  const Tensors g = Gradients(16);
  rpc::PushGradientsRequest m = Message(before.version, "a", "w", 0, split_, g.at("w"));
  m.mutable_chunk()->mutable_data()->resize(m.chunk().data().size() / 2);
  EXPECT_EQ(cluster_->PushRaw(0, {m}).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ExpectUnchanged(before);
  ExpectValidStep(before);
}

TEST_F(ServerErrorsTest, ClientDisconnectingMidPushSumsNothing) {
  const Snapshot before = Snap();
  const Tensors g = Gradients(17);
  {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(10));
    rpc::PushGradientsResponse response;
    auto writer = cluster_->daemon(0).PushGradients(&context, &response);
    // Half of a piece, then the client goes away.
    rpc::PushGradientsRequest m = Message(before.version, "a", "w", 0, split_, g.at("w"));
    m.mutable_chunk()->mutable_data()->resize(m.chunk().data().size() / 2);
    ASSERT_TRUE(writer->Write(m));
    context.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  ExpectUnchanged(before);
  ExpectValidStep(before);
}

// ---- Fetches ----

TEST_F(ServerErrorsTest, FetchOfDroppedVersionIsNotFound) {
  ExpectValidStep(Snap());
  ExpectValidStep(Snap());
  const Snapshot before = Snap();
  rpc::FetchRequest request;
  request.set_version(before.version - 2);
  FetchedPieces got;
  const grpc::Status s = cluster_->FetchFrom(0, request, absl::Seconds(5), &got);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  // The previous version is still served, unchanged.
  request.set_version(before.version - 1);
  EXPECT_TRUE(cluster_->FetchFrom(0, request, absl::Seconds(5), &got).ok());
  ExpectUnchanged(before);
  ExpectValidStep(before);
}

TEST_F(ServerErrorsTest, FetchOfUnpublishedVersionIsDeadlineExceeded) {
  const Snapshot before = Snap();
  rpc::FetchRequest request;
  request.set_version(before.version + 1);
  FetchedPieces got;
  const absl::Time start = absl::Now();
  const grpc::Status s = cluster_->FetchFrom(0, request, absl::Milliseconds(300), &got);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  ExpectUnchanged(before);
  ExpectValidStep(before);
}

TEST_F(ServerErrorsTest, FetchWaitsForTheVersionToBePublished) {
  const Snapshot before = Snap();
  rpc::FetchRequest request;
  request.set_version(before.version + 1);
  FetchedPieces got;
  grpc::Status s;
  std::thread fetcher([&] { s = cluster_->FetchFrom(1, request, absl::Seconds(20), &got); });
  absl::SleepFor(absl::Milliseconds(100));
  ExpectValidStep(before);
  fetcher.join();
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(got.plan.version(), before.version + 1);
  EXPECT_GT(got.plan.pieces_size(), 0);
}

TEST_F(ServerErrorsTest, FetchOfUnknownTensorOrUnpublishedDirectionIsRefused) {
  const Snapshot before = Snap();
  rpc::FetchRequest request;
  request.set_version(before.version);
  request.add_tensors()->set_tensor("no_such_tensor");
  FetchedPieces got;
  EXPECT_EQ(cluster_->FetchFrom(0, request, absl::Seconds(5), &got).error_code(),
            grpc::StatusCode::NOT_FOUND);
  request.clear_tensors();
  rpc::TensorDirections* td = request.add_tensors();
  td->set_tensor("r");
  td->add_directions(rpc::DIRECTION_COLUMNWISE);
  EXPECT_EQ(cluster_->FetchFrom(0, request, absl::Seconds(5), &got).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  ExpectUnchanged(before);
  ExpectValidStep(before);
}

TEST_F(ServerErrorsTest, ClientDisconnectingMidFetchDoesNotHurt) {
  const Snapshot before = Snap();
  for (int i = 0; i < 3; ++i) {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(10));
    rpc::FetchRequest request;
    request.set_version(before.version);
    request.set_max_chunk_bytes(4096);  // many small chunks (the smallest accepted)
    auto reader = cluster_->daemon(i % 2).Fetch(&context, request);
    rpc::FetchResponse message;
    ASSERT_TRUE(reader->Read(&message));  // the plan
    ASSERT_TRUE(reader->Read(&message));  // one chunk
    context.TryCancel();
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  ExpectUnchanged(before);
  ExpectValidStep(before);
}

// ---- Control plane ----

TEST_F(ServerErrorsTest, AdminStepUsesThePushesSoFar) {
  const Snapshot before = Snap();
  const Tensors a = Gradients(400);
  ASSERT_TRUE(cluster_->PushAll(before.version, "a", a).ok());
  {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(10));
    rpc::StepRequest request;
    request.set_version(before.version + 1);  // not the committed version
    rpc::StepResponse response;
    EXPECT_EQ(cluster_->coordinator().Step(&context, request, &response).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(10));
  rpc::StepRequest request;
  request.set_version(before.version);
  request.set_wait(true);
  rpc::StepResponse response;
  const grpc::Status s = cluster_->coordinator().Step(&context, request, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.committed_version(), before.version + 1);
  const Tensors after = Masters(before.version + 1);
  for (const auto& [name, w] : before.masters) {
    std::vector<float> want = w;
    for (size_t i = 0; i < want.size(); ++i) want[i] -= kLr * a.at(name)[i];
    EXPECT_EQ(after.at(name), want) << name;
  }
}

TEST_F(ServerErrorsTest, JoinErrors) {
  const Snapshot before = Snap();
  auto join = [](rpc::JoinRequest request) {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(5));
    rpc::JoinResponse response;
    return cluster_->coordinator().Join(&context, request, &response).error_code();
  };
  rpc::JoinRequest request;
  request.set_role(rpc::ROLE_DAEMON);
  request.set_address("127.0.0.1:1");
  EXPECT_EQ(join(request), grpc::StatusCode::FAILED_PRECONDITION) << "the world is full";
  request.set_role(rpc::ROLE_TRAINER);
  request.set_expected_pushers(3);
  EXPECT_EQ(join(request), grpc::StatusCode::FAILED_PRECONDITION) << "pusher count mismatch";
  request.set_role(rpc::ROLE_UNSPECIFIED);
  EXPECT_EQ(join(request), grpc::StatusCode::INVALID_ARGUMENT);
  request.set_role(rpc::ROLE_TRAINER);
  request.set_expected_pushers(2);
  EXPECT_EQ(join(request), grpc::StatusCode::OK);
  ExpectUnchanged(before);
  ExpectValidStep(before);
}

TEST_F(ServerErrorsTest, WatchVersionStreamsCommits) {
  const Snapshot before = Snap();
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(20));
  rpc::WatchVersionRequest request;
  request.set_min_version(before.version);
  auto reader = cluster_->coordinator().WatchVersion(&context, request);
  rpc::VersionEvent event;
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.committed_version(), before.version);
  ExpectValidStep(before);
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.committed_version(), before.version + 1);
  context.TryCancel();
  reader->Finish();
}

// ---- A daemon that is down ----

TEST(ServerDownTest, DeadDaemonIsUnavailableWithinTheDeadline) {
  TestClusterOptions options;
  options.daemons = 2;
  options.expected_pushers = 1;
  absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(options);
  ASSERT_TRUE(c.ok()) << c.status();
  RawCluster& cluster = **c;
  const std::string model = cluster.cluster().dir() + "/model.safetensors";
  ASSERT_TRUE(WriteModel(model, {{"w", {kRows, kCols}, RandomValues(kRows * kCols, 1)}}).ok());
  ASSERT_TRUE(cluster.Load(model, kRecipe).ok());
  // Kill the process that joined as rank 1.
  const std::string address = cluster.manifest().daemons(1).address();
  for (int i = 0; i < 2; ++i) {
    if (absl::EndsWith(address, absl::StrCat(":", cluster.cluster().daemon_port(i)))) {
      cluster.cluster().KillDaemon(i);
    }
  }
  rpc::FetchRequest request;
  request.set_version(0);
  FetchedPieces got;
  const absl::Time start = absl::Now();
  const grpc::Status s = cluster.FetchFrom(1, request, absl::Seconds(3), &got);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
  // The live daemon keeps serving its pieces.
  EXPECT_TRUE(cluster.FetchFrom(0, request, absl::Seconds(5), &got).ok());
  EXPECT_GT(got.plan.pieces_size(), 0);
}

// ---- Loads: a bad model or recipe is refused before anything is replaced ----

TEST_F(ServerErrorsTest, LoadWithMalformedRecipeIsInvalidArgumentAndChangesNothing) {
  const Snapshot before = Snap();
  const std::string model = cluster_->cluster().dir() + "/model.safetensors";
  absl::StatusOr<int64_t> v = cluster_->Load(
      model, "rule {\n  pattern: \"w\"\n  spec { rowwise { format: NOT_A_FORMAT } }\n}\n");
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
  // The error points at the line of the bad field.
  EXPECT_NE(v.status().message().find(":3:"), absl::string_view::npos) << v.status();
  ExpectUnchanged(before);
  ExpectValidStep(before);
}

TEST_F(ServerErrorsTest, LoadOfCorruptSafetensorsIsRefusedAndChangesNothing) {
  const Snapshot before = Snap();
  const std::string dir = cluster_->cluster().dir();
  // An absurd header length, and a valid file cut short inside its data.
  const std::string absurd = dir + "/absurd.safetensors";
  {
    std::ofstream f(absurd, std::ios::binary);
    const uint64_t header_len = uint64_t{1} << 40;
    f.write(reinterpret_cast<const char*>(&header_len), sizeof(header_len));
    f << "{}";
  }
  const std::string truncated = dir + "/truncated.safetensors";
  ASSERT_TRUE(WriteModel(truncated, {{"w", {kRows, kCols}, RandomValues(kRows * kCols, 9)}}).ok());
  std::filesystem::resize_file(truncated, std::filesystem::file_size(truncated) - 100);

  for (const std::string& path : {absurd, truncated}) {
    absl::StatusOr<int64_t> v = cluster_->Load(path, kRecipe);
    ASSERT_FALSE(v.ok()) << path;
    EXPECT_TRUE(v.status().code() == absl::StatusCode::kInvalidArgument ||
                v.status().code() == absl::StatusCode::kDataLoss)
        << v.status();
    EXPECT_NE(v.status().message().find(path), absl::string_view::npos) << v.status();
    ExpectUnchanged(before);
  }
  ExpectValidStep(before);
}

}  // namespace
}  // namespace testing
}  // namespace paramd
