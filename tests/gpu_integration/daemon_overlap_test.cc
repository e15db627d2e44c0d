// The fetch/step overlap through real hybrid-paramd processes: a
// coordinator and one --backend=gpu daemon on GPU 0, this test process as
// the trainer on GPU 1 (GPU 0 with one GPU), gradients pushed over NCCL
// (DeviceFetcher::Push), weights fetched over NCCL (DeviceFetcher::Fetch):
//   - InFlightVersionEqualsReference: the fetch of v+1 is asked before the
//     push that starts its step; the daemon streams it tensor by tensor as
//     the step quantizes (DaemonStats.device_fetches_streamed) and the
//     bytes equal the CPU reference (host AdamW, server/step/optimizer.h, then
//     ReferencePublish) of every version;
//   - HeldVersionsBesideStep: right after the push that starts the step to
//     v+1, the fetch of v (held, not rewritten by that step) == reference,
//     and the fetch of v-1 (its slot is being rewritten) is either NOT_FOUND
//     or == reference, never torn;
//   - FailedStepFailsTheFetch: the daemon's step to version 1 fails after
//     its device work (PARAMD_GPU_FAIL_STEP=1, a test hook of the gpu
//     backend); the fetch of version 1 asked before it fails with ABORTED
//     (whether its bytes left during the step or its send came after the
//     failure), never hands out bytes; version 0 is still served;
//   - TwoDaemons.NcclAllReduceBesideFetches: two gpu daemons (GPU 0 and
//     GPU 1, --data_plane=nccl: the step's amax all-reduce runs over NCCL on
//     the step's stream) and fetchers on both GPUs, so that each daemon has
//     its data-plane communicator and trainer pair channels busy at once;
//     a tensor split across the daemons (FP8 current rowwise + columnwise,
//     global amax on the second piece) and an NVFP4/MXFP8 tensor; each step
//     streams v+1 to one GPU while v goes to the other beside the step,
//     both == the CPU reference over the whole tensors; every call bounded.
// The first four hold each optimizer step's device work back 300 ms
// (PARAMD_GPU_STEP_DELAY_MS) so that fetches meet the step in flight
// whatever the timing; the benchmark runs undelayed.
//   - Bench.StepLoop (PARAMD_OVERLAP_BENCH=1 only; `bash tools/gpu_bench.sh
//     run overlap`): push -> step -> fetch, per-step milliseconds with and
//     without the overlap, at 8 x 8192 x 16384 (1.07e9 parameters) AdamW,
//     FP8 current rowwise + columnwise by default (PARAMD_OVERLAP_BENCH_
//     TENSORS / _ROWS / _COLS override).
// Tag gpu; run from a directory holding server/hybrid-paramd (bazel
// runfiles or the bundle of tools/gpu_test.sh or tools/gpu_bench.sh).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/gpu_fetch/device_fetcher.h"
#include "gtest/gtest.h"
#include "kernels/format.h"
#include "kernels/reference.h"
#include "server/step/optimizer.h"
#include "server/step/reference_step.h"
#include "tests/gpu_integration/device_test_util.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

using gpu_fetch::DeviceFetcher;
using gpu_fetch::DeviceFetchResult;
using gpu_fetch::DeviceGradient;
using gpu_fetch::DeviceTarget;

constexpr char kRecipe[] =
    "default_spec { rowwise { format: FP8_CURRENT } columnwise { format: FP8_CURRENT } }";
constexpr double kLr = 0.01;

// `env`: variables the daemon processes inherit (the gpu backend's test
// hooks, daemon_backend.cc), set only while they start. One daemon: on GPU
// 0; two: daemon i on GPU i, their amax all-reduce over NCCL.
std::unique_ptr<RawCluster> StartCluster(
    const std::vector<std::pair<std::string, std::string>>& env = {}, int daemons = 1) {
  for (const auto& [name, value] : env) setenv(name.c_str(), value.c_str(), 1);
  TestClusterOptions options;
  options.daemons = daemons;
  options.expected_pushers = 1;
  options.optimizer = "adamw";
  options.lr = kLr;
  options.daemon_flags = {"--backend=gpu"};
  if (daemons == 1) {
    options.daemon_flags.push_back("--gpu=0");
  } else {
    options.coordinator_flags = {"--data_plane=nccl"};
    options.daemon_flags.push_back("--data_plane=nccl");
    for (int i = 0; i < daemons; ++i) {
      options.per_daemon_flags.push_back({absl::StrCat("--gpu=", i)});
    }
  }
  absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(options);
  for (const auto& [name, value] : env) unsetenv(name.c_str());
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// Every optimizer step's device work starts this late on the daemon (the
// gpu backend's PARAMD_GPU_STEP_DELAY_MS hook): fetches asked for during a
// step then meet it in flight, whatever the model's size.
constexpr char kStepDelayMs[] = "300";

std::unique_ptr<client::Client> Trainer(RawCluster& c) {
  client::ClientOptions options;
  options.coordinator_address = c.cluster().coordinator_address();
  options.role = client::ClientOptions::Role::kTrainer;
  options.pusher = true;
  options.name = "daemon_overlap_test";
  absl::StatusOr<std::unique_ptr<client::Client>> cl = client::Client::Connect(options);
  EXPECT_TRUE(cl.ok()) << cl.status();
  return cl.ok() ? *std::move(cl) : nullptr;
}

// `same_gpu_ipc` false: a daemon on the trainer's GPU is reached through
// its device channel too (as daemon_push_test's *Nccl cases do), so that the
// daemon's send paths this file tests (streamed in flight, beside the step,
// ABORTED after a failed step) run with one GPU. On one GPU the channel's
// transport moves the bytes inline through the host (NCCL refuses two ranks
// on one GPU); the daemon side (pins, events, counters) is the same.
std::unique_ptr<DeviceFetcher> Fetcher(client::Client* c, bool stream_in_flight,
                                       int device = TrainerDevice(), bool same_gpu_ipc = true) {
  gpu_fetch::DeviceFetcherOptions options;
  options.device = device;
  options.same_gpu_ipc = same_gpu_ipc;
  options.timeout = absl::Seconds(60);
  options.stream_in_flight = stream_in_flight;
  absl::StatusOr<std::unique_ptr<DeviceFetcher>> f = DeviceFetcher::Create(c, options);
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? *std::move(f) : nullptr;
}

std::vector<DeviceTarget> AllTargets(const std::vector<TestTensor>& tensors) {
  std::vector<DeviceTarget> out;
  for (const TestTensor& t : tensors) {
    out.push_back({t.name, Direction::kRowwise, {}});
    out.push_back({t.name, Direction::kColumnwise, {}});
  }
  return out;
}

// Each tensor's spec, from the manifest `c` last read.
std::vector<HybridSpec> Specs(const client::Client& c, const std::vector<TestTensor>& tensors) {
  std::vector<HybridSpec> out;
  const client::Manifest manifest = c.manifest();
  for (const TestTensor& t : tensors) {
    const client::TensorMeta* m = manifest.Find(t.name);
    EXPECT_NE(m, nullptr) << t.name;
    out.push_back(m != nullptr ? m->spec : HybridSpec());
  }
  return out;
}

// The CPU side of the test: each tensor's master, AdamW state and delayed
// state, stepped exactly as the daemon steps (FP32 gradients: no rounding).
// Whole tensors: a tensor split across daemons is quantized with its global
// amax, which is what the daemons' all-reduce must agree on.
class Reference {
 public:
  Reference(const std::vector<TestTensor>& tensors, const std::vector<HybridSpec>& specs)
      : tensors_(tensors), specs_(specs), states_(tensors.size()), moments_(tensors.size()) {
    for (size_t i = 0; i < tensors.size(); ++i) states_[i] = InitialReferenceState(specs[i]);
    options_.kind = OptimizerKind::kAdamW;
    options_.lr = static_cast<float>(kLr);
  }
  // The published copies of the current version, by tensor name.
  std::map<std::string, ref::HybridResult> Publish() {
    std::map<std::string, ref::HybridResult> out;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const TestTensor& t = tensors_[i];
      absl::StatusOr<ref::HybridResult> r =
          ReferencePublish(t.values, Rows(t), Cols(t), specs_[i], states_[i]);
      EXPECT_TRUE(r.ok()) << r.status();
      if (r.ok()) out[t.name] = *std::move(r);
    }
    return out;
  }
  void Step(const std::vector<std::vector<float>>& grads) {
    ++steps_;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      ApplyOptimizer(options_, steps_, absl::MakeSpan(tensors_[i].values), grads[i], moments_[i]);
    }
  }
  static int64_t Rows(const TestTensor& t) { return t.shape.size() == 1 ? 1 : t.shape[0]; }
  static int64_t Cols(const TestTensor& t) { return t.shape.back(); }

 private:
  std::vector<TestTensor> tensors_;
  std::vector<HybridSpec> specs_;
  std::vector<ReferenceTensorState> states_;
  std::vector<OptimizerState> moments_;
  OptimizerOptions options_;
  int64_t steps_ = 0;
};

// Every fetched direction equals `want` (data, scales, scale_inv).
void ExpectEqualsReference(const DeviceFetchResult& r,
                           const std::map<std::string, ref::HybridResult>& want,
                           const std::string& what) {
  for (const gpu_fetch::DeviceFetched& f : r.tensors) {
    SCOPED_TRACE(absl::StrCat(what, " ", f.tensor, " ", DirectionName(f.direction)));
    const ref::HybridResult& e = want.at(f.tensor);
    const std::optional<QuantizedTensor>& w =
        f.direction == Direction::kRowwise ? e.rowwise : e.columnwise;
    ASSERT_TRUE(w.has_value());
    EXPECT_TRUE(ToHost(f.buffers.data, f.buffers.layout.data_bytes()) == w->data);
    EXPECT_TRUE(ToHost(f.buffers.scales, f.buffers.layout.scale_bytes()) == w->scales);
    // amax is compared with the host stream by daemon_fetch_test; the
    // reference's scale_inv is derived from the same global amax.
    EXPECT_EQ(FloatToHost(f.buffers.scale_inv), w->scale_inv);
  }
}

// FP32 gradients of every tensor, on the trainer's device (freed with it).
class DeviceGrads {
 public:
  DeviceGrads(const std::vector<TestTensor>& tensors, const std::vector<std::vector<float>>& host) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      void* p = nullptr;
      const size_t bytes = host[i].size() * sizeof(float);
      EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(p, host[i].data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
      buffers_.push_back(p);
      grads_.push_back({tensors[i].name, client::Gradient::DType::kFp32, p, bytes});
    }
  }
  ~DeviceGrads() {
    for (void* p : buffers_) cudaFree(p);
  }
  const std::vector<DeviceGradient>& grads() const { return grads_; }

 private:
  std::vector<void*> buffers_;
  std::vector<DeviceGradient> grads_;
};

// FP32 gradients of every tensor for step `step` (deterministic).
std::vector<std::vector<float>> StepGrads(const std::vector<TestTensor>& tensors, int step) {
  std::vector<std::vector<float>> g;
  for (size_t i = 0; i < tensors.size(); ++i) {
    g.push_back(RandomValues(tensors[i].values.size(), 1000 + 10 * step + i, 0.3f));
  }
  return g;
}

class Overlap : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(cudaSetDevice(TrainerDevice()), cudaSuccess);
    cluster_ = StartCluster({{"PARAMD_GPU_STEP_DELAY_MS", kStepDelayMs}});
    ASSERT_NE(cluster_, nullptr);
    // Big enough that a step takes a while on the device (4 x 8 Mi
    // parameters), small enough for a quick CPU reference.
    for (int i = 0; i < 4; ++i) {
      tensors_.push_back(
          {absl::StrCat("t", i), {2048, 4096}, RandomValues(2048 * 4096, 10 + i, 1.0f + i)});
    }
    const std::string path = cluster_->cluster().dir() + "/model.safetensors";
    ASSERT_TRUE(WriteModel(path, tensors_).ok());
    trainer_ = Trainer(*cluster_);
    ASSERT_NE(trainer_, nullptr);
    absl::StatusOr<int64_t> v0 = trainer_->Load(path, kRecipe, absl::Seconds(120));
    ASSERT_TRUE(v0.ok()) << v0.status();
    ASSERT_TRUE(trainer_->RefreshManifest().ok());
    ASSERT_TRUE(cluster_->RefreshManifest().ok());
    specs_ = Specs(*trainer_, tensors_);
    fetcher_ = Fetcher(trainer_.get(), /*stream_in_flight=*/true, TrainerDevice(),
                       /*same_gpu_ipc=*/false);
    ASSERT_NE(fetcher_, nullptr);
    // Pushes beside a fetch in progress: a fetcher serialises its calls.
    pusher_ = Fetcher(trainer_.get(), /*stream_in_flight=*/true, TrainerDevice(),
                      /*same_gpu_ipc=*/false);
    ASSERT_NE(pusher_, nullptr);
  }
  void TearDown() override {
    if (HasFailure() && cluster_ != nullptr) ADD_FAILURE() << cluster_->cluster().Logs();
  }
  std::vector<std::vector<float>> Grads(int step) const { return StepGrads(tensors_, step); }
  rpc::DaemonStats Stats() {
    absl::StatusOr<rpc::DaemonStats> s = cluster_->Stats(0);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : rpc::DaemonStats();
  }

  std::unique_ptr<RawCluster> cluster_;
  std::vector<TestTensor> tensors_;
  std::unique_ptr<client::Client> trainer_;
  std::unique_ptr<DeviceFetcher> fetcher_;
  std::unique_ptr<DeviceFetcher> pusher_;
  std::vector<HybridSpec> specs_;
};

TEST_F(Overlap, InFlightVersionEqualsReference) {
  Reference reference(tensors_, specs_);
  absl::StatusOr<DeviceFetchResult> r = fetcher_->Fetch(0, AllTargets(tensors_));
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectEqualsReference(*r, reference.Publish(), "v0");
  constexpr int kSteps = 3;
  for (int s = 0; s < kSteps; ++s) {
    const std::vector<std::vector<float>> grads = Grads(s);
    DeviceGrads device(tensors_, grads);
    // Asked before the push: the daemon has nothing to send until the step
    // to s+1 has enqueued its work, then streams it.
    absl::StatusOr<DeviceFetchResult> next;
    std::thread fetch([&] {
      cudaSetDevice(TrainerDevice());
      next = fetcher_->Fetch(s + 1, AllTargets(tensors_));
    });
    // Long enough for the request to reach the daemon on a busy machine
    // (200 ms once let one of three arrive after its step had finished).
    absl::SleepFor(absl::Seconds(1));
    absl::StatusOr<client::PushResult> pushed = pusher_->Push(s, device.grads());
    fetch.join();
    ASSERT_TRUE(pushed.ok()) << pushed.status();
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_EQ(next->version, s + 1);
    reference.Step(grads);
    ExpectEqualsReference(*next, reference.Publish(), absl::StrCat("v", s + 1));
  }
  const rpc::DaemonStats stats = Stats();
  std::printf("OVERLAP_TEST streamed=%lld beside_step=%lld of %d in-flight fetches\n",
              static_cast<long long>(stats.device_fetches_streamed()),
              static_cast<long long>(stats.device_fetches_beside_step()), kSteps);
  // Each request waited at the daemon for its step's enqueue, and the step
  // held its device work back for kStepDelayMs: every send left in flight.
  EXPECT_GE(stats.device_fetches_streamed(), kSteps);
  EXPECT_EQ(fetcher_->path_stats().fetch_same_gpu, 0) << "the channel path must be tested";
}

TEST_F(Overlap, HeldVersionsBesideStep) {
  Reference reference(tensors_, specs_);
  std::map<std::string, ref::HybridResult> before;                     // version v-1
  std::map<std::string, ref::HybridResult> now = reference.Publish();  // version v
  DeviceFetcher* second = pusher_.get();
  int not_found = 0;
  constexpr int kSteps = 4;
  for (int v = 0; v < kSteps; ++v) {
    const std::vector<std::vector<float>> grads = Grads(v);
    DeviceGrads device(tensors_, grads);
    absl::StatusOr<client::PushResult> pushed = fetcher_->Push(v, device.grads());
    ASSERT_TRUE(pushed.ok()) << pushed.status();
    // The step to v+1 runs now: v is held (its slot untouched), v-1's slot
    // is the one being rewritten.
    absl::StatusOr<DeviceFetchResult> older;
    std::thread t([&] {
      cudaSetDevice(TrainerDevice());
      if (v > 0) older = second->Fetch(v - 1, AllTargets(tensors_));
    });
    absl::StatusOr<DeviceFetchResult> held = fetcher_->Fetch(v, AllTargets(tensors_));
    t.join();
    ASSERT_TRUE(held.ok()) << held.status();
    ExpectEqualsReference(*held, now, absl::StrCat("v", v, " beside step to v", v + 1));
    if (v > 0) {
      if (older.ok()) {
        ExpectEqualsReference(*older, before, absl::StrCat("v", v - 1, " beside step"));
      } else {
        EXPECT_TRUE(absl::IsNotFound(older.status())) << older.status();
        ++not_found;
      }
    }
    ASSERT_TRUE(trainer_->WaitForVersion(v + 1, absl::Seconds(30)).ok());
    reference.Step(grads);
    before = std::move(now);
    now = reference.Publish();
  }
  const rpc::DaemonStats stats = Stats();
  std::printf("OVERLAP_TEST beside_step=%lld streamed=%lld; previous version dropped %d of %d\n",
              static_cast<long long>(stats.device_fetches_beside_step()),
              static_cast<long long>(stats.device_fetches_streamed()), not_found, kSteps - 1);
  // Every fetch of v was served while the step to v+1 ran (it holds its
  // device work back for kStepDelayMs): no whole-step lock.
  EXPECT_GE(stats.device_fetches_beside_step(), kSteps);
}

TEST(OverlapFailure, FailedStepFailsTheFetch) {
  std::unique_ptr<RawCluster> cluster =
      StartCluster({{"PARAMD_GPU_FAIL_STEP", "1"}, {"PARAMD_GPU_STEP_DELAY_MS", kStepDelayMs}});
  ASSERT_NE(cluster, nullptr);
  ASSERT_EQ(cudaSetDevice(TrainerDevice()), cudaSuccess);
  std::vector<TestTensor> tensors = {{"w", {1024, 4096}, RandomValues(1024 * 4096, 3)}};
  const std::string path = cluster->cluster().dir() + "/model.safetensors";
  ASSERT_TRUE(WriteModel(path, tensors).ok());
  std::unique_ptr<client::Client> trainer = Trainer(*cluster);
  ASSERT_NE(trainer, nullptr);
  ASSERT_TRUE(trainer->Load(path, kRecipe, absl::Seconds(60)).ok());
  ASSERT_TRUE(trainer->RefreshManifest().ok());
  std::unique_ptr<DeviceFetcher> fetcher =
      Fetcher(trainer.get(), /*stream_in_flight=*/true, TrainerDevice(), /*same_gpu_ipc=*/false);
  ASSERT_NE(fetcher, nullptr);
  std::unique_ptr<DeviceFetcher> pusher =
      Fetcher(trainer.get(), /*stream_in_flight=*/true, TrainerDevice(), /*same_gpu_ipc=*/false);
  ASSERT_NE(pusher, nullptr);
  // The channel first: its connect (queued before the send on the daemon's
  // channel worker) would otherwise delay the send past the step.
  Reference reference(tensors, Specs(*trainer, tensors));
  const std::map<std::string, ref::HybridResult> v0_reference = reference.Publish();
  absl::StatusOr<DeviceFetchResult> v0 = fetcher->Fetch(0, AllTargets(tensors));
  ASSERT_TRUE(v0.ok()) << v0.status();
  ExpectEqualsReference(*v0, v0_reference, "v0");
  absl::StatusOr<DeviceFetchResult> next;
  std::thread fetch([&] {
    cudaSetDevice(TrainerDevice());
    next = fetcher->Fetch(1, AllTargets(tensors), nullptr, absl::Seconds(20));
  });
  absl::SleepFor(absl::Milliseconds(200));
  const std::vector<float> g = RandomValues(1024 * 4096, 7, 0.3f);
  DeviceGrads device(tensors, {g});
  absl::StatusOr<client::PushResult> pushed = pusher->Push(0, device.grads());
  fetch.join();
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  // Sent during the step (then the step failed) or refused after it:
  // ABORTED either way ("the step producing version 1 failed"), never OK,
  // never a deadline.
  EXPECT_FALSE(next.ok());
  EXPECT_TRUE(absl::IsAborted(next.status())) << next.status();
  std::printf("OVERLAP_TEST failed step -> fetch of version 1: %s\n",
              next.status().ToString().c_str());
  // Version 0 is still served, exact.
  v0 = fetcher->Fetch(0, AllTargets(tensors));
  ASSERT_TRUE(v0.ok()) << v0.status();
  ExpectEqualsReference(*v0, v0_reference, "v0 after the failed step");
  if (HasFailure()) ADD_FAILURE() << cluster->cluster().Logs();
}

// ---- Two daemons: the amax all-reduce over NCCL beside the pair channels ----

// A hang the calls' own deadlines did not catch fails loudly: unless
// destroyed within `limit`, prints `logs()` and aborts the test process
// (its daemons die with it, deploy/process.h).
class Watchdog {
 public:
  Watchdog(absl::Duration limit, std::function<std::string()> logs)
      : thread_([this, limit, logs = std::move(logs)] {
          absl::MutexLock lock(&mu_);
          if (mu_.AwaitWithTimeout(absl::Condition(&done_), limit)) return;
          std::printf("OVERLAP_TEST WATCHDOG: still running after %s; aborting. Logs:\n%s\n",
                      absl::FormatDuration(limit).c_str(), logs().c_str());
          std::fflush(stdout);
          std::abort();
        }) {}
  ~Watchdog() {
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
    }
    thread_.join();
  }

 private:
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once mu_ and done_ exist
};

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  int64_t out = fallback;
  if (v != nullptr && !absl::SimpleAtoi(v, &out)) out = fallback;
  return out;
}

// The processes' logs as a failure when the test failed (ASSERTs included).
struct LogsOnFailure {
  RawCluster* cluster;
  ~LogsOnFailure() {
    if (::testing::Test::HasFailure()) ADD_FAILURE() << cluster->cluster().Logs();
  }
};

// Two gpu daemons, daemon i on GPU i, --data_plane=nccl: every step's amax
// all-reduce is an NCCL collective on the step's stream, while the same
// daemon process sends fetches on its NCCL pair channels to this trainer.
// Fetchers on both GPUs (the one on GPU g reaches daemon g inline, the
// other daemon over an NCCL pair), device pushes from GPU 1. Each step s
// (device work held back kStepDelayMs): the fetch of s+1, asked before the
// push, streams on one GPU as the step quantizes; right after the push the
// fetch of s runs beside the step on the other GPU; the roles swap every
// step, so both daemons send both kinds over an NCCL pair while they
// all-reduce. Tensors: "w" split across the daemons (FP8 current rowwise +
// columnwise; its largest values in the second piece, so the first
// daemon's scale comes from the all-reduce) and "nvfp4" (NVFP4 rowwise,
// MXFP8 columnwise), == the CPU reference over the whole tensors.
TEST(TwoDaemons, NcclAllReduceBesideFetches) {
  if (GpuCount() < 2) GTEST_SKIP() << "needs 2 GPUs (a daemon on each)";
  const absl::Time test_start = absl::Now();
  // OVERLAP_DAEMON_EAGER=1 (a diagnostic, see below): the daemons load
  // every CUDA module at start (CUDA_MODULE_LOADING=EAGER) while this
  // process keeps its own mode.
  std::vector<std::pair<std::string, std::string>> env = {
      {"PARAMD_GPU_STEP_DELAY_MS", kStepDelayMs}};
  if (EnvInt("OVERLAP_DAEMON_EAGER", 0) == 1) env.push_back({"CUDA_MODULE_LOADING", "EAGER"});
  std::unique_ptr<RawCluster> cluster = StartCluster(env, /*daemons=*/2);
  ASSERT_NE(cluster, nullptr);
  LogsOnFailure logs{cluster.get()};
  Watchdog watchdog(absl::Seconds(100), [&] { return cluster->cluster().Logs(); });
  constexpr int64_t kRows = 2048, kCols = 4096;
  std::vector<TestTensor> tensors = {{"w", {kRows, kCols}, RandomValues(kRows * kCols, 21)},
                                     {"nvfp4", {512, kCols}, RandomValues(512 * kCols, 22, 2.0f)}};
  // "w" is most of the model's cost: the plan's one cut falls inside it.
  constexpr int64_t kLargeFrom = 1536;
  for (int64_t i = kLargeFrom * kCols; i < kRows * kCols; ++i) tensors[0].values[i] *= 4.0f;
  const std::string path = cluster->cluster().dir() + "/model.safetensors";
  ASSERT_TRUE(WriteModel(path, tensors).ok());
  std::unique_ptr<client::Client> trainer = Trainer(*cluster);
  ASSERT_NE(trainer, nullptr);
  constexpr char kTwoRecipe[] = R"txt(
    rule { pattern: "nvfp4" spec { rowwise { format: NVFP4 } columnwise { format: MXFP8 } } }
    default_spec { rowwise { format: FP8_CURRENT } columnwise { format: FP8_CURRENT } })txt";
  absl::StatusOr<int64_t> v0 = trainer->Load(path, kTwoRecipe, absl::Seconds(120));
  ASSERT_TRUE(v0.ok()) << v0.status();
  ASSERT_EQ(*v0, 0);
  ASSERT_TRUE(trainer->RefreshManifest().ok());
  ASSERT_TRUE(cluster->RefreshManifest().ok());
  ASSERT_EQ(cluster->num_daemons(), 2);
  EXPECT_TRUE(
      absl::StrContains(cluster->cluster().Logs(), "amax all-reduce on the device over NCCL"))
      << "the daemons must all-reduce over the nccl data plane";
  {
    const client::Manifest manifest = trainer->manifest();
    const client::TensorMeta* w = manifest.Find("w");
    ASSERT_NE(w, nullptr);
    ASSERT_EQ(w->pieces.size(), 2u) << "w must be split across both daemons";
    ASSERT_LE(w->pieces[1].row_begin, kLargeFrom) << "w's largest values must be in piece 2";
    std::printf(
        "OVERLAP_TEST two daemons: w rows [0, %lld) on daemon rank %d, [%lld, %lld) on "
        "rank %d; nvfp4 on rank %d\n",
        static_cast<long long>(w->pieces[0].row_end), w->pieces[0].daemon_rank,
        static_cast<long long>(w->pieces[1].row_begin),
        static_cast<long long>(w->pieces[1].row_end), w->pieces[1].daemon_rank,
        manifest.Find("nvfp4")->pieces[0].daemon_rank);
  }
  // fetchers[g] receives on GPU g; pushes through their own fetcher (a
  // fetcher serialises its calls).
  std::unique_ptr<DeviceFetcher> fetchers[2] = {Fetcher(trainer.get(), true, 0),
                                                Fetcher(trainer.get(), true, 1)};
  std::unique_ptr<DeviceFetcher> pusher = Fetcher(trainer.get(), true, 1);
  ASSERT_NE(fetchers[0], nullptr);
  ASSERT_NE(fetchers[1], nullptr);
  ASSERT_NE(pusher, nullptr);
  constexpr absl::Duration kCall = absl::Seconds(20);  // every fetch and push
  const std::vector<DeviceTarget> targets = AllTargets(tensors);
  Reference reference(tensors, Specs(*trainer, tensors));
  std::map<std::string, ref::HybridResult> now = reference.Publish();
  auto expect_reference = [&](const DeviceFetcher& f, const DeviceFetchResult& r, int64_t v,
                              const std::map<std::string, ref::HybridResult>& want,
                              const std::string& what) {
    ASSERT_EQ(cudaSetDevice(f.device()), cudaSuccess);
    EXPECT_EQ(r.version, v) << what;
    EXPECT_EQ(r.daemons, 2) << what;
    ExpectEqualsReference(r, want, absl::StrCat("v", v, " ", what, " on GPU ", f.device()));
  };
  // The channels first (their NCCL connects), outside any step.
  for (const std::unique_ptr<DeviceFetcher>& f : fetchers) {
    ASSERT_EQ(cudaSetDevice(f->device()), cudaSuccess);
    absl::StatusOr<DeviceFetchResult> r = f->Fetch(0, targets, nullptr, kCall);
    ASSERT_TRUE(r.ok()) << r.status();
    expect_reference(*f, *r, 0, now, "idle");
  }
  // Diagnostics of the first step's slow beside fetch (docs/ARCHITECTURE.md,
  // "Unexplained: at the FIRST step"), each off by default:
  //   OVERLAP_WARM_PUSHER=1: the pusher fetches v0 before the loop, so its
  //     channels (NCCL connects) open outside any step;
  //   OVERLAP_WARM_STEP=1: one push + step to v1 before the loop, with no
  //     fetch beside it (the daemons' first optimizer step and the pusher's
  //     first push happen there); the loop then runs v1..v4;
  //   OVERLAP_SWAP=1: the loop's first step fetches beside on GPU 1 (and
  //     streams on GPU 0), the roles still alternating;
  //   OVERLAP_DAEMON_EAGER=1 (read above, at the cluster's start): the
  //     daemons' kernels are loaded at start, not at their first launch.
  const bool warm_pusher = EnvInt("OVERLAP_WARM_PUSHER", 0) == 1;
  const bool warm_step = EnvInt("OVERLAP_WARM_STEP", 0) == 1;
  const int swap = EnvInt("OVERLAP_SWAP", 0) == 1 ? 1 : 0;
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  std::printf(
      "OVERLAP_TEST two daemons: warm_pusher=%d warm_step=%d swap=%d daemon_eager=%d "
      "CUDA_MODULE_LOADING=%s\n",
      warm_pusher, warm_step, swap, EnvInt("OVERLAP_DAEMON_EAGER", 0) == 1 ? 1 : 0,
      loading != nullptr ? loading : "(unset)");
  if (warm_pusher) {
    ASSERT_EQ(cudaSetDevice(pusher->device()), cudaSuccess);
    const absl::Time t = absl::Now();
    absl::StatusOr<DeviceFetchResult> r = pusher->Fetch(0, targets, nullptr, kCall);
    ASSERT_TRUE(r.ok()) << r.status();
    expect_reference(*pusher, *r, 0, now, "pusher warm-up");
    std::printf("OVERLAP_TEST two daemons: pusher's channels opened by a fetch of v0 in %.1f ms\n",
                absl::ToDoubleMilliseconds(absl::Now() - t));
  }
  int first = 0;
  if (warm_step) {
    const std::vector<std::vector<float>> grads = StepGrads(tensors, 0);
    ASSERT_EQ(cudaSetDevice(pusher->device()), cudaSuccess);
    DeviceGrads device(tensors, grads);
    const absl::Time t = absl::Now();
    absl::StatusOr<client::PushResult> pushed = pusher->Push(0, device.grads(), nullptr, kCall);
    ASSERT_TRUE(pushed.ok()) << pushed.status();
    const absl::Time pushed_at = absl::Now();
    ASSERT_TRUE(trainer->WaitForVersion(1, kCall).ok());
    std::printf(
        "OVERLAP_TEST two daemons: warm-up step: push %.1f ms, v1 published %.1f ms "
        "after it\n",
        absl::ToDoubleMilliseconds(pushed_at - t),
        absl::ToDoubleMilliseconds(absl::Now() - pushed_at));
    reference.Step(grads);
    now = reference.Publish();
    first = 1;
  }
  constexpr int kSteps = 4;
  for (int s = first; s < first + kSteps; ++s) {
    const int i = s - first + swap;
    DeviceFetcher* streamed = fetchers[(i + 1) % 2].get();  // GPU 1 first (unswapped)
    DeviceFetcher* beside = fetchers[i % 2].get();
    const std::vector<std::vector<float>> grads = StepGrads(tensors, s);
    ASSERT_EQ(cudaSetDevice(pusher->device()), cudaSuccess);
    DeviceGrads device(tensors, grads);
    absl::StatusOr<DeviceFetchResult> next, held;
    absl::Time next_done, held_done;
    std::thread a([&] {
      cudaSetDevice(streamed->device());
      next = streamed->Fetch(s + 1, targets, nullptr, kCall);
      next_done = absl::Now();
    });
    absl::SleepFor(absl::Milliseconds(200));
    const absl::Time push_start = absl::Now();
    absl::StatusOr<client::PushResult> pushed = pusher->Push(s, device.grads(), nullptr, kCall);
    const absl::Time pushed_at = absl::Now();
    // The step to s+1 runs now (both daemons counted the push): s is held.
    std::thread b([&] {
      cudaSetDevice(beside->device());
      held = beside->Fetch(s, targets, nullptr, kCall);
      held_done = absl::Now();
    });
    a.join();
    b.join();
    ASSERT_TRUE(pushed.ok()) << pushed.status();
    ASSERT_TRUE(held.ok()) << "v" << s << " beside the step: " << held.status();
    ASSERT_TRUE(next.ok()) << "v" << s + 1 << " streamed: " << next.status();
    expect_reference(*beside, *held, s, now, "beside the step");
    reference.Step(grads);
    now = reference.Publish();
    expect_reference(*streamed, *next, s + 1, now, "streamed");
    // The streamed fetch returned once both daemons published s+1.
    double step_ms[2] = {0, 0};
    for (int rank = 0; rank < 2; ++rank) {
      absl::StatusOr<rpc::DaemonStats> st = cluster->Stats(rank);
      ASSERT_TRUE(st.ok()) << st.status();
      step_ms[rank] = st->last_step_seconds() * 1e3;
    }
    std::printf(
        "OVERLAP_TEST two daemons step %d: push %.1f ms; v%d beside the step on GPU %d "
        "done %.1f ms after the push; v%d streamed on GPU %d done %.1f ms after it; "
        "daemon steps %.1f / %.1f ms\n",
        s, absl::ToDoubleMilliseconds(pushed_at - push_start), s, beside->device(),
        absl::ToDoubleMilliseconds(held_done - pushed_at), s + 1, streamed->device(),
        absl::ToDoubleMilliseconds(next_done - pushed_at), step_ms[0], step_ms[1]);
  }
  // Both daemons served every step's fetch of s+1 while stepping it (its
  // device work held back) and every fetch of s beside that step.
  for (int rank = 0; rank < 2; ++rank) {
    absl::StatusOr<rpc::DaemonStats> st = cluster->Stats(rank);
    ASSERT_TRUE(st.ok()) << st.status();
    std::printf("OVERLAP_TEST two daemons: rank %d streamed=%lld beside_step=%lld over %d steps\n",
                rank, static_cast<long long>(st->device_fetches_streamed()),
                static_cast<long long>(st->device_fetches_beside_step()), kSteps);
    EXPECT_GE(st->device_fetches_streamed(), kSteps) << "rank " << rank;
    EXPECT_GE(st->device_fetches_beside_step(), kSteps) << "rank " << rank;
  }
  std::printf("OVERLAP_TEST two daemons: %.1f s in all\n",
              absl::ToDoubleSeconds(absl::Now() - test_start));
  std::fflush(stdout);
}

// ---- The step loop benchmark (docs/BENCHMARKS.md, fetch/step overlap) ----

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

TEST(Bench, StepLoop) {
  if (EnvInt("PARAMD_OVERLAP_BENCH", 0) != 1) GTEST_SKIP() << "PARAMD_OVERLAP_BENCH=1 only";
  const int tensors_n = static_cast<int>(EnvInt("PARAMD_OVERLAP_BENCH_TENSORS", 8));
  const int64_t rows = EnvInt("PARAMD_OVERLAP_BENCH_ROWS", 8192);
  const int64_t cols = EnvInt("PARAMD_OVERLAP_BENCH_COLS", 16384);
  std::unique_ptr<RawCluster> cluster = StartCluster();
  ASSERT_NE(cluster, nullptr);
  ASSERT_EQ(cudaSetDevice(TrainerDevice()), cudaSuccess);
  // Values: one random block tiled (the step's cost does not depend on them).
  const std::vector<float> block = RandomValues(1 << 20, 5);
  std::vector<TestTensor> tensors;
  for (int i = 0; i < tensors_n; ++i) {
    TestTensor t{absl::StrCat("w", i), {rows, cols}, std::vector<float>(rows * cols)};
    for (int64_t k = 0; k < rows * cols; k += block.size()) {
      std::copy_n(block.begin(), std::min<int64_t>(block.size(), rows * cols - k),
                  t.values.begin() + k);
    }
    tensors.push_back(std::move(t));
  }
  const std::string path = cluster->cluster().dir() + "/bench.safetensors";
  absl::Time t0 = absl::Now();
  ASSERT_TRUE(WriteModel(path, tensors).ok());
  for (TestTensor& t : tensors) std::vector<float>().swap(t.values);
  std::unique_ptr<client::Client> trainer = Trainer(*cluster);
  ASSERT_NE(trainer, nullptr);
  absl::StatusOr<int64_t> v0 = trainer->Load(path, kRecipe, absl::Seconds(400));
  ASSERT_TRUE(v0.ok()) << v0.status();
  ASSERT_TRUE(trainer->RefreshManifest().ok());
  ASSERT_TRUE(cluster->RefreshManifest().ok());  // Stats(0)
  std::printf("OVERLAP_BENCH model written + loaded in %.1f s\n",
              absl::ToDoubleSeconds(absl::Now() - t0));
  // BF16 gradients on the trainer's GPU (what a trainer pushes).
  std::vector<void*> buffers;
  std::vector<DeviceGradient> grads;
  for (const TestTensor& t : tensors) {
    void* p = nullptr;
    const size_t bytes = static_cast<size_t>(rows * cols) * 2;
    ASSERT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    ASSERT_EQ(cudaMemset(p, 0x3c, bytes), cudaSuccess);  // 0x3c3c: a small finite BF16
    buffers.push_back(p);
    grads.push_back({t.name, client::Gradient::DType::kBf16, p, bytes});
  }
  std::unique_ptr<DeviceFetcher> sequential = Fetcher(trainer.get(), false);
  std::unique_ptr<DeviceFetcher> streamed = Fetcher(trainer.get(), true);
  ASSERT_NE(sequential, nullptr);
  ASSERT_NE(streamed, nullptr);
  const std::vector<DeviceTarget> targets = AllTargets(tensors);
  int64_t v = *v0;
  // Channels and owned buffers first (not timed).
  ASSERT_TRUE(sequential->Fetch(v, targets).ok());
  ASSERT_TRUE(streamed->Fetch(v, targets).ok());
  absl::Time idle_start = absl::Now();
  ASSERT_TRUE(streamed->Fetch(v, targets).ok());
  const double idle_fetch_ms = absl::ToDoubleMilliseconds(absl::Now() - idle_start);

  struct Mode {
    const char* name;
    const char* what;
    DeviceFetcher* fetcher;
    bool fetch_previous;  // fetch v beside the step to v+1 (staleness 1)
  };
  const Mode modes[] = {
      {"sequential", "push v; wait for v+1's publish, then fetch it (no overlap)", sequential.get(),
       false},
      {"streamed", "push v; fetch v+1 streamed while its step quantizes", streamed.get(), false},
      {"double_buffered", "push v; fetch v beside the step to v+1; wait for v+1", streamed.get(),
       true},
  };
  constexpr int kWarmup = 2;
  const int steps = static_cast<int>(EnvInt("PARAMD_OVERLAP_BENCH_STEPS", 8));
  std::printf(
      "OVERLAP_BENCH params=%lld (%d x %lld x %lld) AdamW FP8 current row+col, "
      "daemon GPU 0, trainer GPU %d, idle fetch of all directions %.2f ms\n",
      static_cast<long long>(tensors_n * rows * cols), tensors_n, static_cast<long long>(rows),
      static_cast<long long>(cols), TrainerDevice(), idle_fetch_ms);
  std::printf("OVERLAP_BENCH %-16s %10s %10s %10s %10s  %s\n", "mode", "step_ms", "push_ms",
              "fetch_ms", "daemon_ms", "loop");
  for (const Mode& m : modes) {
    std::vector<double> total, push, fetch, daemon;
    for (int i = 0; i < kWarmup + steps; ++i) {
      const absl::Time start = absl::Now();
      absl::StatusOr<client::PushResult> pushed = m.fetcher->Push(v, grads);
      ASSERT_TRUE(pushed.ok()) << pushed.status();
      const absl::Time pushed_at = absl::Now();
      absl::StatusOr<DeviceFetchResult> r = m.fetcher->Fetch(m.fetch_previous ? v : v + 1, targets);
      ASSERT_TRUE(r.ok()) << m.name << ": " << r.status();
      const absl::Time fetched_at = absl::Now();
      if (m.fetch_previous) {
        ASSERT_TRUE(trainer->WaitForVersion(v + 1, absl::Seconds(30)).ok());
      }
      const absl::Time end = absl::Now();
      ++v;
      absl::StatusOr<rpc::DaemonStats> stats = cluster->Stats(0);
      ASSERT_TRUE(stats.ok()) << stats.status();
      if (i < kWarmup) continue;
      total.push_back(absl::ToDoubleMilliseconds(end - start));
      push.push_back(absl::ToDoubleMilliseconds(pushed_at - start));
      fetch.push_back(absl::ToDoubleMilliseconds(fetched_at - pushed_at));
      daemon.push_back(stats->last_step_seconds() * 1e3);
    }
    std::printf("OVERLAP_BENCH %-16s %10.2f %10.2f %10.2f %10.2f  %s\n", m.name, Median(total),
                Median(push), Median(fetch), Median(daemon), m.what);
  }
  absl::StatusOr<rpc::DaemonStats> stats = cluster->Stats(0);
  ASSERT_TRUE(stats.ok());
  std::printf(
      "OVERLAP_BENCH daemon: %lld fetches streamed, %lld beside a step (medians over %d "
      "steps after %d warm-up)\n",
      static_cast<long long>(stats->device_fetches_streamed()),
      static_cast<long long>(stats->device_fetches_beside_step()), steps, kWarmup);
  std::fflush(stdout);
  for (void* p : buffers) cudaFree(p);
}

}  // namespace
}  // namespace testing
}  // namespace paramd
