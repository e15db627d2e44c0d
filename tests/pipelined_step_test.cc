// Multi-process: two clusters (coordinator + 2 daemons each, host data
// plane), one with --pipelined_step (one bucket per tensor), one without.
// The same pushes give byte-identical versions for every format pair; a
// push failing in the middle of a bucket commits nothing (also when the
// pipelined step had already used its earlier buckets, and a fetch that
// had streamed that step's first tensor answers ABORTED); FetchRequest.
// as_ready streams a tensor before the version is published; a step that
// fails after some buckets fails their as_ready fetches with ABORTED.
// PARAMD_TEST_DAEMON_BACKEND=gpu: the daemons run --backend=gpu (one GPU).
// A daemon whose --pipelined_step differs from the world's is refused at
// join.
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "format/convert.h"
#include "gtest/gtest.h"
#include "kernels/format.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

constexpr float kLr = 0.5f;
using Tensors = std::map<std::string, std::vector<float>>;

// One tensor per format pair ("t0".."t12", [260 x 96]), then "w" [520 x 200]
// (FP32 passthrough: the test reads the masters from it) split across the
// daemons.
std::string Recipe() {
  std::string r;
  const std::vector<FormatCombo> combos = FormatCombos();
  for (size_t i = 0; i < combos.size(); ++i) {
    absl::StrAppend(&r, "rule { pattern: \"t", i, "\" spec { ", combos[i].spec, " } }\n");
  }
  absl::StrAppend(&r,
                  "default_spec { rowwise { format: IDENTITY_FP32 } columnwise { format: "
                  "IDENTITY_FP32 } source_dtype: FP32 }\n");
  return r;
}

std::vector<TestTensor> Model() {
  std::vector<TestTensor> t;
  for (size_t i = 0; i < FormatCombos().size(); ++i) {
    t.push_back({absl::StrCat("t", i), {260, 96}, RandomValues(260 * 96, 10 + i)});
  }
  t.push_back({"w", {520, 200}, RandomValues(520 * 200, 1)});
  return t;
}

Tensors Gradients(uint32_t seed) {
  Tensors g;
  for (const TestTensor& t : Model()) {
    g[t.name] = RandomValues(static_cast<int64_t>(t.values.size()), seed++, 0.1f);
  }
  return g;
}

class PipelinedStepTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    for (bool pipelined : {true, false}) {
      TestClusterOptions options;
      options.daemons = 2;
      options.expected_pushers = 2;
      options.optimizer = "sgd";
      options.lr = kLr;
      options.daemon_flags = {"--step_timeout_s=3"};
      // On a GPU machine it runs again on the gpu backend with
      // PARAMD_TEST_DAEMON_BACKEND=gpu (a --config=cuda build).
      if (const char* backend = std::getenv("PARAMD_TEST_DAEMON_BACKEND")) {
        options.daemon_flags.push_back(absl::StrCat("--backend=", backend));
      }
      if (pipelined) {
        options.daemon_flags.push_back("--pipelined_step");
        options.daemon_flags.push_back("--step_bucket_elements=1");
      }
      absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(options);
      ASSERT_TRUE(c.ok()) << c.status();
      (pipelined ? pipelined_ : whole_) = c->release();
    }
    const std::string model = pipelined_->cluster().dir() + "/model.safetensors";
    ASSERT_TRUE(WriteModel(model, Model()).ok());
    for (RawCluster* c : {pipelined_, whole_}) {
      absl::StatusOr<int64_t> v = c->Load(model, Recipe());
      ASSERT_TRUE(v.ok()) << v.status() << c->cluster().Logs();
    }
  }
  static void TearDownTestSuite() {
    delete pipelined_;
    delete whole_;
    pipelined_ = whole_ = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(pipelined_ != nullptr && whole_ != nullptr); }
  void TearDown() override {
    if (HasFailure() && pipelined_ != nullptr) ADD_FAILURE() << pipelined_->cluster().Logs();
  }

  static int64_t Committed(RawCluster* c) {
    absl::StatusOr<int64_t> v = c->WaitForVersion(0);
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? *v : -1;
  }

  // Pushers "a" and "b" at once (two streams per daemon in parallel).
  static void PushBoth(RawCluster* c, int64_t version, const Tensors& a, const Tensors& b) {
    absl::Status sa, sb;
    std::thread t([&] { sb = c->PushAll(version, "b", b); });
    sa = c->PushAll(version, "a", a);
    t.join();
    ASSERT_TRUE(sa.ok()) << sa;
    ASSERT_TRUE(sb.ok()) << sb;
  }

  // Every published direction of every tensor at `version`, assembled.
  static std::map<std::string, QuantizedTensor> Published(RawCluster* c, int64_t version) {
    std::map<std::string, QuantizedTensor> out;
    for (const rpc::TensorInfo& t : c->manifest().tensors()) {
      const HybridSpec spec = c->spec(t.name());
      for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
        if (!(d == Direction::kRowwise ? spec.rowwise_usage : spec.columnwise_usage)) continue;
        absl::StatusOr<QuantizedTensor> q = c->FetchAssembled(version, t.name(), d);
        EXPECT_TRUE(q.ok()) << t.name() << ": " << q.status();
        if (q.ok()) out[absl::StrCat(t.name(), " ", DirectionName(d))] = *std::move(q);
      }
    }
    return out;
  }

  // The pipelined cluster equals the whole-step one at `version`.
  static void ExpectSameVersion(int64_t version) {
    const auto got = Published(pipelined_, version);
    const auto want = Published(whole_, version);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, q] : want) {
      SCOPED_TRACE(name);
      const QuantizedTensor& p = got.at(name);
      EXPECT_EQ(p.data, q.data);
      EXPECT_EQ(p.scales, q.scales);
      EXPECT_EQ(p.scale_inv, q.scale_inv);
      EXPECT_EQ(p.amax, q.amax);
    }
  }

  // Both clusters take the same step (pushers "a" and "b").
  static void StepBoth(uint32_t seed) {
    const int64_t v = Committed(pipelined_);
    ASSERT_EQ(Committed(whole_), v);
    const Tensors a = Gradients(seed);
    const Tensors b = Gradients(seed + 1000);
    PushBoth(pipelined_, v, a, b);
    PushBoth(whole_, v, a, b);
    for (RawCluster* c : {pipelined_, whole_}) {
      absl::StatusOr<int64_t> now = c->WaitForVersion(v + 1);
      ASSERT_TRUE(now.ok()) << now.status() << c->cluster().Logs();
    }
    ExpectSameVersion(v + 1);
  }

  // The pieces of `tensor` at `version` on daemon `rank` with as_ready.
  static grpc::Status FetchAsReady(int rank, int64_t version, const std::string& tensor,
                                   FetchedPieces* out, absl::Duration timeout = absl::Seconds(20)) {
    rpc::FetchRequest request;
    request.set_version(version);
    request.set_as_ready(true);
    request.add_tensors()->set_tensor(tensor);
    return pipelined_->FetchFrom(rank, request, timeout, out);
  }

  // A rank holding rows of `tensor`.
  static int HolderOf(const std::string& tensor) {
    for (const rpc::ShardPiece& p : pipelined_->manifest().pieces()) {
      if (p.tensor() == tensor) return p.daemon_rank();
    }
    return -1;
  }
  static bool Holds(int rank, const std::string& tensor) {
    for (const rpc::ShardPiece& p : pipelined_->manifest().pieces()) {
      if (p.tensor() == tensor && p.daemon_rank() == rank) return true;
    }
    return false;
  }

  // PushUntil to every daemon at once; their statuses.
  static std::vector<grpc::Status> PushUntilOnAll(int64_t version, const std::string& pusher,
                                                  const Tensors& g, const std::string& last,
                                                  absl::Duration hold) {
    std::vector<grpc::Status> s(2);
    std::thread t([&] { s[1] = PushUntil(1, version, pusher, g, last, hold); });
    s[0] = PushUntil(0, version, pusher, g, last, hold);
    t.join();
    return s;
  }

  // A push stream to daemon `rank` that sends every piece of `g` the daemon
  // holds of the tensors before `last`, plus half of its first piece of
  // `last`, waits `hold`, then half-closes without the end marker.
  static grpc::Status PushUntil(int rank, int64_t version, const std::string& pusher,
                                const Tensors& g, const std::string& last, absl::Duration hold) {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(20));
    rpc::PushGradientsResponse response;
    auto writer = pipelined_->daemon(rank).PushGradients(&context, &response);
    for (const rpc::ShardPiece& p : pipelined_->manifest().pieces()) {
      if (p.daemon_rank() != rank) continue;
      rpc::PushGradientsRequest m =
          GradientMessage(version, pusher, p.tensor(), p.row_begin(), p.row_end(),
                          g.at(p.tensor()).data(), pipelined_->tensor(p.tensor()).cols());
      if (p.tensor() == last) {
        m.mutable_chunk()->mutable_data()->resize(m.chunk().data().size() / 2);
        writer->Write(m);
        break;
      }
      writer->Write(m);
    }
    absl::SleepFor(hold);
    writer->WritesDone();
    return writer->Finish();
  }

  static RawCluster* pipelined_;
  static RawCluster* whole_;
};

RawCluster* PipelinedStepTest::pipelined_ = nullptr;
RawCluster* PipelinedStepTest::whole_ = nullptr;

TEST_F(PipelinedStepTest, BytesEqualTheWholeStepForEveryFormat) {
  ExpectSameVersion(Committed(pipelined_));
  StepBoth(100);
  StepBoth(200);
}

TEST_F(PipelinedStepTest, AsReadyStreamsATensorBeforeTheVersionIsPublished) {
  const int64_t v = Committed(pipelined_);
  const int rank = HolderOf("t0");
  const Tensors a = Gradients(300);
  const Tensors b = Gradients(1300);
  ASSERT_TRUE(pipelined_->PushAll(v, "a", a).ok());
  // b delivers t0..t2 to both daemons but holds the rest of its push: t0
  // of v+1 is stepped and quantized, the version is not published.
  std::vector<grpc::Status> held;
  std::thread hold([&] { held = PushUntilOnAll(v, "b", b, "t3", absl::Seconds(1)); });
  FetchedPieces early;
  const absl::Time start = absl::Now();
  grpc::Status s = FetchAsReady(rank, v + 1, "t0", &early);
  hold.join();
  // The stream broke (no end marker): the step that used it was abandoned,
  // so the fetch that streamed t0 is ABORTED, and nothing was committed.
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(900)) << "answered before the step ended";
  EXPECT_EQ(early.plan.version(), v + 1);
  EXPECT_GT(early.plan.pieces_size(), 0) << "the bytes came before the push ended";
  for (const grpc::Status& h : held) {
    EXPECT_EQ(h.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << h.error_message();
  }
  EXPECT_EQ(Committed(pipelined_), v);
  absl::StatusOr<rpc::DaemonStats> stats = pipelined_->Stats(rank);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->published_version(), v);
  EXPECT_EQ(stats->pushers_received(), 1) << "the broken push was not counted";

  // b pushes again: the step equals the whole-step cluster's with a + b.
  PushBoth(whole_, v, a, b);
  FetchedPieces streamed;
  grpc::Status fetched;
  std::thread fetch([&] {
    fetched = FetchAsReady(rank, v + 1, "t0", &streamed);
    // A daemon whose own copy of the broken push was still open when the
    // other one left the step ran it again with that push, and its next
    // all-reduce left again: a bucket streamed in between is ABORTED. The
    // trainer fetches again, as it would.
    if (fetched.error_code() == grpc::StatusCode::ABORTED) {
      streamed = FetchedPieces();
      fetched = FetchAsReady(rank, v + 1, "t0", &streamed);
    }
  });
  absl::SleepFor(absl::Milliseconds(100));
  ASSERT_TRUE(pipelined_->PushAll(v, "b", b).ok());
  fetch.join();
  EXPECT_TRUE(fetched.ok()) << fetched.error_message();
  ASSERT_TRUE(pipelined_->WaitForVersion(v + 1).ok());
  ASSERT_TRUE(whole_->WaitForVersion(v + 1).ok());
  ExpectSameVersion(v + 1);
  // What the as_ready fetch streamed is that version's t0.
  FetchedPieces published;
  rpc::FetchRequest request;
  request.set_version(v + 1);
  request.add_tensors()->set_tensor("t0");
  ASSERT_TRUE(pipelined_->FetchFrom(rank, request, absl::Seconds(5), &published).ok());
  ASSERT_EQ(streamed.pieces.size(), published.pieces.size());
  for (size_t k = 0; k < published.pieces.size(); ++k) {
    EXPECT_EQ(streamed.pieces[k].data, published.pieces[k].data);
    EXPECT_EQ(streamed.pieces[k].scales, published.pieces[k].scales);
  }
}

TEST_F(PipelinedStepTest, APushFailingMidBucketCommitsNothing) {
  const int64_t v = Committed(pipelined_);
  const Tensors a = Gradients(400);
  const Tensors b = Gradients(1400);
  // Half of b's first piece of t5 on every daemon, then the stream ends
  // without its end marker (a has not pushed: no step can have started
  // past its first bucket).
  for (const grpc::Status& s : PushUntilOnAll(v, "b", b, "t5", absl::ZeroDuration())) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  }
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<rpc::DaemonStats> stats = pipelined_->Stats(r);
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->pushers_received(), 0);
    EXPECT_EQ(stats->published_version(), v);
  }
  PushBoth(pipelined_, v, a, b);
  PushBoth(whole_, v, a, b);
  ASSERT_TRUE(pipelined_->WaitForVersion(v + 1).ok());
  ASSERT_TRUE(whole_->WaitForVersion(v + 1).ok());
  ExpectSameVersion(v + 1);
}

TEST_F(PipelinedStepTest, PiecesOutOfTensorOrderAreRefused) {
  const int64_t v = Committed(pipelined_);
  // Two tensors with pieces on daemon 0, the later one first.
  std::vector<std::string> held;
  for (size_t i = 0; i < FormatCombos().size(); ++i) {
    if (Holds(0, absl::StrCat("t", i))) held.push_back(absl::StrCat("t", i));
  }
  ASSERT_GE(held.size(), 2u);
  const Tensors g = Gradients(500);
  std::vector<rpc::PushGradientsRequest> messages;
  for (const std::string& name : {held[1], held[0]}) {
    for (const rpc::ShardPiece& p : pipelined_->manifest().pieces()) {
      if (p.tensor() != name || p.daemon_rank() != 0) continue;
      messages.push_back(GradientMessage(v, "a", name, p.row_begin(), p.row_end(),
                                         g.at(name).data(), pipelined_->tensor(name).cols()));
    }
  }
  grpc::Status s = pipelined_->PushRaw(0, messages);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("manifest order"), std::string::npos) << s.error_message();
  absl::StatusOr<rpc::DaemonStats> stats = pipelined_->Stats(0);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->pushers_received(), 0);
}

// Last: it leaves the version unpublished on purpose.
TEST_F(PipelinedStepTest, AStepFailingAfterSomeBucketsAbortsTheirFetches) {
  const int64_t v = Committed(pipelined_);
  const Tensors a = Gradients(600);
  const Tensors b = Gradients(1600);
  ASSERT_TRUE(pipelined_->PushAll(v, "a", a).ok());
  // b's push to daemon 1 stalls in t6 for longer than the step timeout
  // (3 s); daemon 0 gets all of it. Both daemons step t0..t5, then daemon
  // 0's all-reduce for t6 times out: its step fails.
  std::thread stall([&] { PushUntil(1, v, "b", b, "t6", absl::Seconds(5)); });
  grpc::Status pushed0;
  std::thread push0([&] {
    std::vector<rpc::PushGradientsRequest> m;
    for (const rpc::ShardPiece& p : pipelined_->manifest().pieces()) {
      if (p.daemon_rank() != 0) continue;
      m.push_back(GradientMessage(v, "b", p.tensor(), p.row_begin(), p.row_end(),
                                  b.at(p.tensor()).data(), pipelined_->tensor(p.tensor()).cols()));
    }
    pushed0 = pipelined_->PushRaw(0, m);
  });
  std::string early;
  for (int t = 5; t >= 0; --t) {
    if (Holds(0, absl::StrCat("t", t))) early = absl::StrCat("t", t);
  }
  ASSERT_FALSE(early.empty()) << "daemon 0 holds none of t0..t5";
  FetchedPieces got;
  grpc::Status s = FetchAsReady(0, v + 1, early, &got);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  EXPECT_GT(got.plan.pieces_size(), 0) << "its bytes were streamed before the failure";
  push0.join();
  stall.join();
  EXPECT_TRUE(pushed0.ok()) << pushed0.error_message();
  absl::StatusOr<rpc::DaemonStats> stats = pipelined_->Stats(0);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->published_version(), v);
  EXPECT_NE(stats->error().find("step from"), std::string::npos) << stats->error();
}

// Every daemon of a world steps alike: a daemon started without
// --pipelined_step, joining a world whose first daemon runs with it, is
// refused at join and exits 1 naming both values.
TEST(PipelinedJoinTest, ADaemonWithAnotherPipelinedStepIsRefusedAtJoin) {
  TestClusterOptions o;
  o.daemons = 1;
  o.expected_pushers = 1;
  o.coordinator_flags = {"--daemons=2"};  // the second daemon is started below
  o.daemon_flags = {"--pipelined_step"};
  absl::StatusOr<std::unique_ptr<TestCluster>> c = TestCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  // The first daemon has joined (and waits for the world) before the second
  // asks: the coordinator logs it.
  auto read = [](const std::string& path) {
    std::ifstream in(path);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (read((*c)->dir() + "/coordinator.log").find("daemon rank 0 joined") == std::string::npos &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  demo::ChildProcesses children;
  const std::string log = (*c)->dir() + "/refused.log";
  absl::StatusOr<int> child =
      children.Start({"daemon",
                      {"server/hybrid-paramd", "--role=daemon", "--listen=127.0.0.1:0",
                       "--coordinator=" + (*c)->coordinator_address(), "--optimizer=sgd",
                       "--lr=0.5", "--momentum=0"},
                      log,
                      log});
  ASSERT_TRUE(child.ok()) << child.status();
  absl::StatusOr<int> status = children.Wait(*child, absl::Seconds(30));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 1) << *status;
  const std::string out = read(log);
  EXPECT_NE(out.find("this daemon runs with --pipelined_step=false"), std::string::npos) << out;
  EXPECT_NE(out.find("with --pipelined_step=true"), std::string::npos) << out;
}

}  // namespace
}  // namespace testing
}  // namespace paramd
