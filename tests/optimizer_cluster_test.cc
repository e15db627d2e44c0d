// The cluster-owned optimizer config against real processes: a daemon flag
// that disagrees with the coordinator's config is refused at join (both
// values named); non_finite: SKIP_STEP publishes the next version with the
// masters unchanged and counts the skip; a restore steps on with the
// checkpoint's config and step counter, or with an explicitly given config
// (logged, and recorded by the next checkpoint); SetOptimizerSchedule
// changes the lr between steps; the skipped-step count survives a restore.
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <sys/wait.h>

#include <google/protobuf/text_format.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/store.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "proto/checkpoint_service.grpc.pb.h"
#include "server/step/optimizer.h"
#include "server/step/optimizer_config.h"
#include "tests/checkpoint_test_util.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

constexpr char kRecipe[] = R"txt(
  rule {
    pattern: "b"
    optimizer { weight_decay: 0 lr_multiplier: 2 }
  }
  default_spec {
    rowwise { format: IDENTITY_FP32 }
    columnwise { format: IDENTITY_FP32 }
    source_dtype: FP32
  })txt";

const std::vector<TestTensor>& Model() {
  static const auto* model = new std::vector<TestTensor>{
      {"w", {256, 16}, RandomValues(256 * 16, 1)}, {"b", {16}, RandomValues(16, 2)}};
  return *model;
}

std::map<std::string, std::vector<float>> Gradient(int64_t version, float scale = 0.1f) {
  std::map<std::string, std::vector<float>> g;
  for (const TestTensor& t : Model())
    g[t.name] = RandomValues(t.values.size(), 50 + version, scale);
  return g;
}

std::string WriteFile(const std::string& dir, const std::string& name, const std::string& text) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TestClusterOptions Options(int daemons) {
  TestClusterOptions o;
  o.daemons = daemons;
  o.expected_pushers = 1;
  o.optimizer_flags = false;
  return o;
}

// The FP32 rowwise copy of `w` at `version` (the masters, bit for bit).
std::vector<uint8_t> Weights(RawCluster& c, int64_t version) {
  absl::StatusOr<QuantizedTensor> q = c.FetchAssembled(version, "w", Direction::kRowwise);
  EXPECT_TRUE(q.ok()) << q.status();
  return q.ok() ? q->data : std::vector<uint8_t>();
}

// Starts a daemon of `c` with `flags`, expects its join to be refused (it
// exits 1) and returns what it logged.
std::string RefusedDaemonLog(TestCluster& c, const std::vector<std::string>& flags) {
  demo::ChildProcesses children;
  const std::string log = c.dir() + "/refused.log";
  std::vector<std::string> argv = {"server/hybrid-paramd", "--role=daemon", "--listen=127.0.0.1:0",
                                   "--coordinator=" + c.coordinator_address()};
  argv.insert(argv.end(), flags.begin(), flags.end());
  absl::StatusOr<int> child = children.Start({"daemon", argv, log, log});
  EXPECT_TRUE(child.ok()) << child.status();
  if (!child.ok()) return "";
  absl::StatusOr<int> status = children.Wait(*child, absl::Seconds(30));
  EXPECT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(status.ok() && WIFEXITED(*status) && WEXITSTATUS(*status) == 1);
  std::ifstream in(log);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(OptimizerClusterTest, MismatchedDaemonFlagIsRefusedAtJoin) {
  TestClusterOptions o = Options(1);
  o.coordinator_flags = {"--optimizer=adamw", "--lr=0.01"};
  absl::StatusOr<std::unique_ptr<TestCluster>> c = TestCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  // A daemon told --lr=0.5: its join is refused, it exits 1 naming both.
  const std::string out = RefusedDaemonLog(**c, {"--lr=0.5"});
  EXPECT_NE(out.find("--lr=0.5"), std::string::npos) << out;
  EXPECT_NE(out.find("lr: 0.01"), std::string::npos) << out;
}

// A daemon flag set in its --config file is set, even to the value a
// coordinator without that flag would use (1e-3): it must agree with the
// coordinator's config like a flag on the command line.
TEST(OptimizerClusterTest, DaemonFlagFromTheConfigFileIsChecked) {
  absl::StatusOr<demo::TempDir> dir = demo::TempDir::Create("paramd_opt");
  ASSERT_TRUE(dir.ok());
  TestClusterOptions o = Options(1);
  o.coordinator_flags = {"--lr=0.01"};
  absl::StatusOr<std::unique_ptr<TestCluster>> c = TestCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  const std::string config = WriteFile(dir->path(), "daemon.textproto", "lr: 0.001\n");
  const std::string out = RefusedDaemonLog(**c, {"--config=" + config});
  EXPECT_NE(out.find("--lr=0.001"), std::string::npos) << out;
  EXPECT_NE(out.find("lr: 0.01"), std::string::npos) << out;
}

TEST(OptimizerClusterTest, DaemonWithoutFlagsTakesTheConfig) {
  absl::StatusOr<demo::TempDir> dir = demo::TempDir::Create("paramd_opt");
  ASSERT_TRUE(dir.ok());
  TestClusterOptions o = Options(2);
  o.coordinator_flags = {"--optimizer=" + WriteFile(dir->path(), "opt.textproto",
                                                    "kind: SGD lr: 0.25 max_grad_norm: 1e9")};
  o.daemon_flags = {"--optimizer=sgd"};  // agrees (kind only)
  absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  RawCluster& a = **c;
  const std::string model = a.cluster().dir() + "/model.safetensors";
  ASSERT_TRUE(WriteModel(model, Model()).ok());
  ASSERT_TRUE(a.Load(model, kRecipe).ok()) << a.cluster().Logs();
  EXPECT_EQ(a.manifest().optimizer_config().kind(), recipe::SGD);
  EXPECT_EQ(a.tensor("b").optimizer().lr_multiplier(), 2.0f);
  // SGD at lr 0.25 (x2 for b, no momentum): w1 = w0 - 0.25 * g exactly.
  const std::vector<uint8_t> w0 = Weights(a, 0);
  ASSERT_TRUE(a.PushAll(0, "t", Gradient(0)).ok());
  ASSERT_TRUE(a.WaitForVersion(1).ok());
  const std::vector<uint8_t> w1 = Weights(a, 1);
  ASSERT_EQ(w1.size(), w0.size());
  const std::vector<float> g = Gradient(0)["w"];
  for (size_t k = 0; k < g.size(); ++k) {
    float before, after;
    std::memcpy(&before, w0.data() + 4 * k, 4);
    std::memcpy(&after, w1.data() + 4 * k, 4);
    ASSERT_EQ(after, std::fma(-0.25f, g[k], before)) << k;
  }
  absl::StatusOr<rpc::DaemonStats> s = a.Stats(0);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->optimizer_steps(), 1);
  EXPECT_DOUBLE_EQ(s->lr(), 0.25);
  EXPECT_GT(s->grad_norm(), 0.0);  // clipping is on (with a huge bound)
  EXPECT_EQ(s->clip_factor(), 1.0f);
}

TEST(OptimizerClusterTest, SkipStepOnNan) {
  absl::StatusOr<demo::TempDir> dir = demo::TempDir::Create("paramd_opt");
  ASSERT_TRUE(dir.ok());
  TestClusterOptions o = Options(2);
  o.coordinator_flags = {"--optimizer=" +
                         WriteFile(dir->path(), "opt.textproto", "lr: 0.01 non_finite: SKIP_STEP")};
  absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  RawCluster& a = **c;
  const std::string model = a.cluster().dir() + "/model.safetensors";
  ASSERT_TRUE(WriteModel(model, Model()).ok());
  ASSERT_TRUE(a.Load(model, kRecipe).ok()) << a.cluster().Logs();
  ASSERT_TRUE(a.PushAll(0, "t", Gradient(0)).ok());
  ASSERT_TRUE(a.WaitForVersion(1).ok());
  const std::vector<uint8_t> w1 = Weights(a, 1);
  auto nan = Gradient(1);
  nan["w"][200 * 16 + 3] = std::nanf("");  // rows 128+ are on the other daemon
  const absl::Status pushed = a.PushAll(1, "t", nan);
  ASSERT_TRUE(pushed.ok()) << pushed;  // accepted under SKIP_STEP
  ASSERT_TRUE(a.WaitForVersion(2).ok());
  EXPECT_EQ(Weights(a, 2), w1);  // masters unchanged
  for (int d = 0; d < 2; ++d) {
    absl::StatusOr<rpc::DaemonStats> s = a.Stats(d);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->skipped_steps(), 1) << d;
    EXPECT_EQ(s->optimizer_steps(), 1) << d;
    EXPECT_TRUE(std::isnan(s->grad_norm())) << d;
  }
  ASSERT_TRUE(a.PushAll(2, "t", Gradient(2)).ok());
  ASSERT_TRUE(a.WaitForVersion(3).ok());
  EXPECT_NE(Weights(a, 3), w1);
  absl::StatusOr<rpc::DaemonStats> s = a.Stats(0);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->optimizer_steps(), 2);
  EXPECT_EQ(s->skipped_steps(), 1);
}

// A cluster of `o` with Model() loaded under kRecipe.
absl::StatusOr<std::unique_ptr<RawCluster>> StartLoaded(const TestClusterOptions& o) {
  ASSIGN_OR_RETURN(std::unique_ptr<RawCluster> c, RawCluster::Start(o));
  const std::string model = c->cluster().dir() + "/model.safetensors";
  RETURN_IF_ERROR(WriteModel(model, Model()));
  RETURN_IF_ERROR(c->Load(model, kRecipe).status());
  return c;
}

// The optimizer config a checkpoint recorded.
OptimizerOptions SavedConfig(const std::string& root, uint64_t version) {
  absl::StatusOr<checkpoint::CheckpointStore> store =
      checkpoint::CheckpointStore::Open(root, /*create=*/false);
  EXPECT_TRUE(store.ok()) << store.status();
  absl::StatusOr<checkpoint::Manifest> m = store->ReadManifest(version);
  EXPECT_TRUE(m.ok()) << m.status();
  absl::StatusOr<OptimizerOptions> o =
      ParseOptimizerConfig(m->metadata().at("optimizer_config"), "checkpoint");
  EXPECT_TRUE(o.ok()) << o.status();
  return *o;
}

constexpr char kConfigA[] =
    "lr: 0.01 schedule { warmup_steps: 2 decay: COSINE decay_steps: 10 min_lr: 0.001 } "
    "max_grad_norm: 0.5";
constexpr char kConfigB[] = "lr: 0.002 schedule { decay: LINEAR decay_steps: 4 }";

TEST(OptimizerClusterTest, RestoreUsesTheCheckpointsConfigOrAnExplicitOverride) {
  absl::StatusOr<demo::TempDir> ckpt = demo::TempDir::Create("paramd_opt_ckpt");
  ASSERT_TRUE(ckpt.ok());
  absl::StatusOr<demo::TempDir> dir = demo::TempDir::Create("paramd_opt");
  ASSERT_TRUE(dir.ok());
  const std::string a_file = WriteFile(dir->path(), "a.textproto", kConfigA);
  const std::string b_file = WriteFile(dir->path(), "b.textproto", kConfigB);
  absl::StatusOr<OptimizerOptions> config_a = ParseOptimizerConfig(kConfigA, "a");
  absl::StatusOr<OptimizerOptions> config_b = ParseOptimizerConfig(kConfigB, "b");
  ASSERT_TRUE(config_a.ok() && config_b.ok());
  {
    TestClusterOptions o = Options(2);
    o.coordinator_flags = {"--optimizer=" + a_file, "--checkpoint_dir=" + ckpt->path()};
    o.daemon_flags = {"--checkpoint_dir=" + ckpt->path()};
    absl::StatusOr<std::unique_ptr<RawCluster>> c = StartLoaded(o);
    ASSERT_TRUE(c.ok()) << c.status();
    RawCluster& a = **c;
    for (int64_t v = 0; v < 3; ++v) {
      ASSERT_TRUE(a.PushAll(v, "t", Gradient(v)).ok());
      ASSERT_TRUE(a.WaitForVersion(v + 1).ok());
    }
    ASSERT_TRUE(Checkpoint(a, 3).ok()) << a.cluster().Logs();
    EXPECT_EQ(DescribeOptimizer(SavedConfig(ckpt->path(), 3)), DescribeOptimizer(*config_a));
    // hpctl names the one tensor the recipe gives settings of its own.
    ProgramRun describe =
        RunProgram({"hpctl/hpctl", "checkpoint", "describe", "--version=3",
                    "--address=" + a.cluster().coordinator_address(), "--timeout=20"},
                   dir->path());
    EXPECT_EQ(describe.exit_code, 0) << describe.out;
    EXPECT_TRUE(absl::StrContains(describe.out,
                                  "optimizer_tensors: 1 of 2 tensors with settings "
                                  "of their own: b (lr x2)\n"))
        << describe.out;
  }
  {
    // No config given: the checkpoint's, with its step counter (step 4 of
    // the schedule next).
    TestClusterOptions o = Options(1);
    absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    RawCluster& b = **c;
    absl::StatusOr<int64_t> v = Restore(b, ckpt->path());
    ASSERT_TRUE(v.ok()) << v.status() << b.cluster().Logs();
    ASSERT_EQ(*v, 3);
    absl::StatusOr<OptimizerOptions> got = OptimizerFromProto(b.manifest().optimizer_config());
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(DescribeOptimizer(*got), DescribeOptimizer(*config_a));
    EXPECT_EQ(b.tensor("b").optimizer().lr_multiplier(), 2.0f);
    ASSERT_TRUE(b.PushAll(3, "t", Gradient(3)).ok());
    ASSERT_TRUE(b.WaitForVersion(4).ok());
    absl::StatusOr<rpc::DaemonStats> s = b.Stats(0);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->optimizer_steps(), 4);
    EXPECT_DOUBLE_EQ(s->lr(), ScheduledLr(*config_a, 4));
    EXPECT_GT(s->grad_norm(), 0.0);
  }
  {
    // An explicit config overrides the checkpoint's: logged, used, and
    // recorded by the next checkpoint.
    TestClusterOptions o = Options(2);
    o.coordinator_flags = {"--optimizer=" + b_file, "--checkpoint_dir=" + ckpt->path()};
    o.daemon_flags = {"--checkpoint_dir=" + ckpt->path()};
    absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    RawCluster& b = **c;
    absl::StatusOr<int64_t> v = Restore(b, ckpt->path());
    ASSERT_TRUE(v.ok()) << v.status() << b.cluster().Logs();
    absl::StatusOr<OptimizerOptions> got = OptimizerFromProto(b.manifest().optimizer_config());
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(DescribeOptimizer(*got), DescribeOptimizer(*config_b));
    EXPECT_NE(b.cluster().Logs().find("optimizer config override"), std::string::npos)
        << b.cluster().Logs();
    ASSERT_TRUE(b.PushAll(3, "t", Gradient(3)).ok());
    ASSERT_TRUE(b.WaitForVersion(4).ok());
    absl::StatusOr<rpc::DaemonStats> s = b.Stats(0);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->optimizer_steps(), 4);  // the counter is the checkpoint's
    EXPECT_DOUBLE_EQ(s->lr(), ScheduledLr(*config_b, 4));
    EXPECT_EQ(s->grad_norm(), -1.0);  // B needs no norm
    ASSERT_TRUE(Checkpoint(b, 4).ok()) << b.cluster().Logs();
    EXPECT_EQ(DescribeOptimizer(SavedConfig(ckpt->path(), 4)), DescribeOptimizer(*config_b));
  }
}

// skip_step's counter is saved with the optimizer step and continues after
// a restore (one daemon holding both halves).
TEST(OptimizerClusterTest, RestoreKeepsTheSkippedStepCount) {
  absl::StatusOr<demo::TempDir> dir = demo::TempDir::Create("paramd_opt");
  ASSERT_TRUE(dir.ok());
  absl::StatusOr<demo::TempDir> ckpt = demo::TempDir::Create("paramd_opt_skip_ckpt");
  ASSERT_TRUE(ckpt.ok());
  {
    TestClusterOptions o = Options(2);
    o.coordinator_flags = {
        "--optimizer=" + WriteFile(dir->path(), "opt.textproto", "lr: 0.01 non_finite: SKIP_STEP"),
        "--checkpoint_dir=" + ckpt->path()};
    o.daemon_flags = {"--checkpoint_dir=" + ckpt->path()};
    absl::StatusOr<std::unique_ptr<RawCluster>> c = StartLoaded(o);
    ASSERT_TRUE(c.ok()) << c.status();
    RawCluster& a = **c;
    for (int64_t v = 0; v < 3; ++v) {
      auto g = Gradient(v);
      if (v == 1) g["w"][7] = std::nanf("");
      ASSERT_TRUE(a.PushAll(v, "t", g).ok());
      ASSERT_TRUE(a.WaitForVersion(v + 1).ok());
    }
    absl::StatusOr<rpc::DaemonStats> s = a.Stats(1);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->optimizer_steps(), 2);
    EXPECT_EQ(s->skipped_steps(), 1);
    ASSERT_TRUE(Checkpoint(a, 3).ok()) << a.cluster().Logs();
  }
  absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(Options(1));
  ASSERT_TRUE(c.ok()) << c.status();
  RawCluster& b = **c;
  absl::StatusOr<int64_t> v = Restore(b, ckpt->path());
  ASSERT_TRUE(v.ok()) << v.status() << b.cluster().Logs();
  ASSERT_EQ(*v, 3);
  absl::StatusOr<rpc::DaemonStats> s = b.Stats(0);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->optimizer_steps(), 2);
  EXPECT_EQ(s->skipped_steps(), 1);
  auto nan = Gradient(3);
  nan["b"][5] = std::nanf("");
  ASSERT_TRUE(b.PushAll(3, "t", nan).ok());
  ASSERT_TRUE(b.WaitForVersion(4).ok());
  s = b.Stats(0);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->optimizer_steps(), 2);
  EXPECT_EQ(s->skipped_steps(), 2);
}

TEST(OptimizerClusterTest, SetOptimizerScheduleBetweenSteps) {
  TestClusterOptions o = Options(2);
  o.coordinator_flags = {"--lr=0.01"};
  absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  RawCluster& a = **c;
  const std::string model = a.cluster().dir() + "/model.safetensors";
  ASSERT_TRUE(WriteModel(model, Model()).ok());
  ASSERT_TRUE(a.Load(model, kRecipe).ok()) << a.cluster().Logs();
  ASSERT_TRUE(a.PushAll(0, "t", Gradient(0)).ok());
  ASSERT_TRUE(a.WaitForVersion(1).ok());
  rpc::SetOptimizerScheduleRequest request;
  request.mutable_schedule()->set_decay(recipe::LINEAR);
  request.mutable_schedule()->set_decay_steps(4);
  request.set_lr(0.04f);
  {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(10));
    rpc::SetOptimizerScheduleResponse response;
    const grpc::Status s = a.coordinator().SetOptimizerSchedule(&context, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(response.optimizer().lr(), 0.04f);
  }
  ASSERT_TRUE(a.PushAll(1, "t", Gradient(1)).ok());
  ASSERT_TRUE(a.WaitForVersion(2).ok());
  OptimizerOptions want;
  want.lr = 0.04f;
  want.schedule.decay = LrDecay::kLinear;
  want.schedule.decay_steps = 4;
  for (int d = 0; d < 2; ++d) {
    absl::StatusOr<rpc::DaemonStats> s = a.Stats(d);
    ASSERT_TRUE(s.ok());
    EXPECT_DOUBLE_EQ(s->lr(), ScheduledLr(want, 2)) << d;
  }
  // A bad schedule is refused and changes nothing.
  request.mutable_schedule()->set_decay_steps(0);
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(10));
  rpc::SetOptimizerScheduleResponse response;
  EXPECT_EQ(a.coordinator().SetOptimizerSchedule(&context, request, &response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

}  // namespace
}  // namespace testing
}  // namespace paramd
