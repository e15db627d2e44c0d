// Gradient push from device memory through real hybrid-paramd processes
// (a daemon on the trainer's GPU reads it in place). Runs on two GPUs
// through tools/gpu_test.sh (5/5 on 2 H200s, 2026-11-30).
//
// A coordinator and --backend=gpu daemons (daemon i on GPU i mod #GPUs),
// this test process as the trainer on GPU 1 (GPU 0 with one GPU):
//   - DeviceEqualsHost/*: FP32 and BF16 gradients, one daemon and a tensor
//     split across two: pushing the gradients from device buffers
//     (DeviceFetcher::Push) and stepping publishes byte-identical versions
//     (FP32 rowwise identity = the master itself, and MXFP8 columnwise) to
//     pushing the same values over the host stream (Client::PushGradients),
//     two steps each; NaN refused (INVALID_ARGUMENT), stale refused; the
//     *Clip cases with global-norm clipping (the last pusher's device add
//     takes the norm's row sums: the same clip factor and bytes as the
//     host push's);
//   - KillTrainerMidPush: a trainer process (device_fetch_loop --mode=push)
//     pushing BF16 gradients from its GPU every version is SIGKILLed; the daemon closes the
//     channel, has counted no pusher for the version it is at, and after host pushes of the same
//     gradients the published bytes equal those of a run that pushed over the host stream only
//     (nothing of the killed push stayed in the accumulators).
// Tag gpu; run from a directory holding server/hybrid-paramd and
// tests/gpu_integration/device_fetch_loop (bazel runfiles or the bundle of
// tools/gpu_test.sh).
#include <signal.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/gpu_fetch/device_fetcher.h"
#include "deploy/process.h"
#include "gtest/gtest.h"
#include "kernels/format.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

using gpu_fetch::DeviceFetcher;
using gpu_fetch::DeviceGradient;

constexpr char kRecipe[] =
    "default_spec { rowwise { format: IDENTITY_FP32 } columnwise { format: MXFP8 } "
    "source_dtype: FP32 }";

int GpuCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}
int TrainerDevice() { return GpuCount() >= 2 ? 1 : 0; }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Daemon i on GPU i mod #GPUs (two daemons on two GPUs when there are two:
// the fetcher refuses two NCCL daemons on one GPU, device_fetcher.h).
std::unique_ptr<RawCluster> StartCluster(int daemons) {
  TestClusterOptions options;
  options.daemons = daemons;
  options.expected_pushers = 1;
  options.optimizer = "adamw";
  options.lr = 0.01;
  options.daemon_flags = {"--backend=gpu"};
  const int gpus = GpuCount() > 0 ? GpuCount() : 1;
  for (int i = 0; i < daemons; ++i) {
    options.per_daemon_flags.push_back({absl::StrCat("--gpu=", i % gpus)});
  }
  absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

std::unique_ptr<client::Client> Trainer(RawCluster& c) {
  client::ClientOptions options;
  options.coordinator_address = c.cluster().coordinator_address();
  options.role = client::ClientOptions::Role::kTrainer;
  options.pusher = true;
  options.name = "daemon_push_test";
  absl::StatusOr<std::unique_ptr<client::Client>> cl = client::Client::Connect(options);
  EXPECT_TRUE(cl.ok()) << cl.status();
  return cl.ok() ? *std::move(cl) : nullptr;
}

std::unique_ptr<DeviceFetcher> Fetcher(client::Client* c, bool same_gpu_ipc = true) {
  gpu_fetch::DeviceFetcherOptions options;
  options.device = TrainerDevice();
  options.same_gpu_ipc = same_gpu_ipc;
  options.timeout = absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<DeviceFetcher>> f = DeviceFetcher::Create(c, options);
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? *std::move(f) : nullptr;
}

// Gradient bytes of one tensor for one step (FP32 or BF16 bits).
std::vector<uint8_t> GradientBytes(int64_t n, bool bf16, uint32_t seed) {
  const std::vector<float> v = RandomValues(n, seed, 0.3f);
  std::vector<uint8_t> out(n * (bf16 ? 2 : 4));
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &v[i], 4);
    if (bf16) {
      const uint16_t h = static_cast<uint16_t>(bits >> 16);  // truncation: any BF16 will do
      std::memcpy(out.data() + 2 * i, &h, 2);
    } else {
      std::memcpy(out.data() + 4 * i, &bits, 4);
    }
  }
  return out;
}

// Every published direction of every tensor at `version`, host stream.
std::map<std::string, QuantizedTensor> Published(RawCluster& c, int64_t version,
                                                 const std::vector<TestTensor>& tensors) {
  std::map<std::string, QuantizedTensor> out;
  for (const TestTensor& t : tensors) {
    for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
      absl::StatusOr<QuantizedTensor> q = c.FetchAssembled(version, t.name, d);
      EXPECT_TRUE(q.ok()) << t.name << " " << DirectionName(d) << ": " << q.status();
      if (q.ok()) out[absl::StrCat(t.name, "/", DirectionName(d))] = *std::move(q);
    }
  }
  return out;
}

void ExpectSameBytes(const std::map<std::string, QuantizedTensor>& host,
                     const std::map<std::string, QuantizedTensor>& device,
                     const std::string& what) {
  ASSERT_EQ(host.size(), device.size()) << what;
  for (const auto& [key, h] : host) {
    const QuantizedTensor& d = device.at(key);
    EXPECT_TRUE(h.data == d.data) << what << " " << key << " data differs";
    EXPECT_TRUE(h.scales == d.scales) << what << " " << key << " scales differ";
    EXPECT_EQ(std::memcmp(&h.scale_inv, &d.scale_inv, 4), 0) << what << " " << key;
    EXPECT_EQ(std::memcmp(&h.amax, &d.amax, 4), 0) << what << " " << key;
  }
}

struct PushCase {
  std::string name;
  int daemons = 1;
  bool bf16 = false;
  // Global-norm clipping on (a bound every step clips at): the last
  // pusher's NCCL device add takes the norm's row sums (an in-place push's
  // rows are summed by the step).
  bool clip = false;
  // Daemons on the trainer's GPU read the gradients in place (same-GPU
  // session); false: NCCL for every daemon (one daemon only: two NCCL
  // daemons on one GPU are refused).
  bool ipc = true;
};

class DeviceEqualsHost : public ::testing::TestWithParam<PushCase> {};

TEST_P(DeviceEqualsHost, PublishedVersionsByteIdentical) {
  const PushCase& p = GetParam();
  std::unique_ptr<RawCluster> c = StartCluster(p.daemons);
  ASSERT_NE(c, nullptr);
  // w: split across two daemons (as daemon_fetch_test's); o: odd columns
  // (a split piece at a row offset that is no multiple of 8 elements takes
  // the widening path for BF16); b: 1-D.
  const std::vector<TestTensor> tensors = {{"w", {520, 200}, RandomValues(520 * 200, 1)},
                                           {"o", {333, 131}, RandomValues(333 * 131, 2)},
                                           {"b", {77}, RandomValues(77, 3, 0.1f)}};
  const std::string path = c->cluster().dir() + "/model.safetensors";
  ASSERT_TRUE(WriteModel(path, tensors).ok());
  std::unique_ptr<client::Client> trainer = Trainer(*c);
  ASSERT_NE(trainer, nullptr);
  std::unique_ptr<DeviceFetcher> fetcher = Fetcher(trainer.get(), p.ipc);
  ASSERT_NE(fetcher, nullptr);
  constexpr int kSteps = 2;
  // grads[step][tensor]
  std::vector<std::vector<std::vector<uint8_t>>> grads(kSteps);
  for (int s = 0; s < kSteps; ++s) {
    for (size_t t = 0; t < tensors.size(); ++t) {
      grads[s].push_back(GradientBytes(tensors[t].values.size(), p.bf16, 100 + 10 * s + t));
    }
  }
  const client::Gradient::DType dtype =
      p.bf16 ? client::Gradient::DType::kBf16 : client::Gradient::DType::kFp32;
  std::vector<std::map<std::string, QuantizedTensor>> host(kSteps), device(kSteps);
  for (int run = 0; run < 2; ++run) {
    const std::string recipe =
        std::string(kRecipe) +
        (p.clip ? " optimizer { kind: ADAMW lr: 0.01 max_grad_norm: 0.05 }" : "");
    absl::StatusOr<int64_t> v0 =
        trainer->Load(path, recipe, absl::Seconds(60), /*replace_model=*/run > 0);
    ASSERT_TRUE(v0.ok()) << v0.status();
    ASSERT_EQ(*v0, 0);
    ASSERT_TRUE(trainer->RefreshManifest().ok());
    ASSERT_TRUE(c->RefreshManifest().ok());
    if (p.daemons == 2) {
      ASSERT_EQ(trainer->manifest().Find("w")->pieces.size(), 2u) << "w must be split";
    }
    for (int s = 0; s < kSteps; ++s) {
      if (run == 0) {
        std::vector<client::Gradient> push;
        for (size_t t = 0; t < tensors.size(); ++t) {
          push.push_back({tensors[t].name, dtype, grads[s][t]});
        }
        absl::StatusOr<client::PushResult> r = trainer->PushGradients(s, push);
        ASSERT_TRUE(r.ok()) << r.status();
      } else {
        cudaSetDevice(TrainerDevice());
        std::vector<void*> buffers;
        std::vector<DeviceGradient> push;
        for (size_t t = 0; t < tensors.size(); ++t) {
          void* d = nullptr;
          ASSERT_EQ(cudaMalloc(&d, grads[s][t].size()), cudaSuccess);
          ASSERT_EQ(cudaMemcpy(d, grads[s][t].data(), grads[s][t].size(), cudaMemcpyHostToDevice),
                    cudaSuccess);
          buffers.push_back(d);
          push.push_back({tensors[t].name, dtype, d, grads[s][t].size()});
        }
        absl::StatusOr<client::PushResult> r = fetcher->Push(s, push);
        for (void* d : buffers) cudaFree(d);
        ASSERT_TRUE(r.ok()) << r.status() << "\n" << c->cluster().Logs();
        EXPECT_EQ(r->pushers_received, 1);
      }
      absl::StatusOr<int64_t> v = trainer->WaitForVersion(s + 1, absl::Seconds(30));
      ASSERT_TRUE(v.ok()) << v.status();
      if (p.clip) {
        absl::StatusOr<rpc::DaemonStats> st = c->Stats(0);
        ASSERT_TRUE(st.ok()) << st.status();
        EXPECT_LT(st->clip_factor(), 1.0f) << "not clipped: the case does not test clipping";
      }
      (run == 0 ? host : device)[s] = Published(*c, s + 1, tensors);
    }
  }
  for (int s = 0; s < kSteps; ++s) {
    ExpectSameBytes(host[s], device[s], absl::StrCat(p.name, " version ", s + 1));
  }
  // The path each daemon's push took: in place for a daemon on the
  // trainer's GPU (daemon i runs on GPU i mod #GPUs), NCCL otherwise.
  {
    const int gpus = GpuCount() > 0 ? GpuCount() : 1;
    int local = 0;
    for (int i = 0; i < p.daemons; ++i) local += i % gpus == TrainerDevice() ? 1 : 0;
    if (!p.ipc) local = 0;
    const gpu_fetch::DevicePathStats st = fetcher->path_stats();
    std::printf("PUSH_PATHS %s: same-GPU %lld, NCCL %lld daemon pushes\n", p.name.c_str(),
                static_cast<long long>(st.push_same_gpu), static_cast<long long>(st.push_nccl));
    EXPECT_EQ(st.push_same_gpu, int64_t{kSteps} * local) << p.name;
    EXPECT_EQ(st.push_nccl, int64_t{kSteps} * (p.daemons - local)) << p.name;
  }
  // NaN in every piece of every tensor (each daemon holds rows of w): refused as on the
  // host stream, nothing counted.
  {
    std::vector<void*> buffers;
    std::vector<DeviceGradient> push;
    for (size_t t = 0; t < tensors.size(); ++t) {
      std::vector<uint8_t> bytes = grads[0][t];
      const uint32_t nan32 = 0x7fc00000u;
      const uint16_t nan16 = 0x7fc0u;
      // First and last element: in the first and the last piece of a split.
      const size_t element = p.bf16 ? 2 : 4;
      for (size_t at : {size_t{0}, bytes.size() - element}) {
        std::memcpy(bytes.data() + at, p.bf16 ? static_cast<const void*>(&nan16) : &nan32, element);
      }
      void* d = nullptr;
      ASSERT_EQ(cudaMalloc(&d, bytes.size()), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
      buffers.push_back(d);
      push.push_back({tensors[t].name, dtype, d, bytes.size()});
    }
    absl::StatusOr<client::PushResult> r = fetcher->Push(kSteps, push);
    for (void* d : buffers) cudaFree(d);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), "non-finite")) << r.status();
    for (int rank = 0; rank < c->num_daemons(); ++rank) {
      absl::StatusOr<rpc::DaemonStats> st = c->Stats(rank);
      ASSERT_TRUE(st.ok()) << st.status();
      EXPECT_EQ(st->pushers_received(), 0) << "daemon " << rank;
      EXPECT_EQ(st->published_version(), kSteps) << "daemon " << rank;
    }
  }
  // A device push of a version already stepped is stale, as on the host.
  std::vector<DeviceGradient> again;
  void* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, grads[0][2].size()), cudaSuccess);
  again.push_back({"b", dtype, d, grads[0][2].size()});
  absl::StatusOr<client::PushResult> stale =
      fetcher->Push(0, again, nullptr, absl::ZeroDuration(), client::PushCoverage::kPartial);
  cudaFree(d);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
}

INSTANTIATE_TEST_SUITE_P(
    Cases, DeviceEqualsHost,
    ::testing::Values(PushCase{"OneDaemonFp32", 1, false}, PushCase{"OneDaemonBf16", 1, true},
                      PushCase{"OneDaemonBf16Nccl", 1, true, false, false},
                      PushCase{"TwoDaemonsFp32", 2, false}, PushCase{"TwoDaemonsBf16", 2, true},
                      PushCase{"OneDaemonBf16Clip", 1, true, true, false},
                      PushCase{"TwoDaemonsFp32Clip", 2, false, true}),
    [](const ::testing::TestParamInfo<PushCase>& info) { return info.param.name; });

// The gradient device_fetch_loop --mode=push pushes (keep in sync with its
// PushGradient()).
std::vector<uint8_t> PushLoopGradient(int64_t n) {
  std::vector<uint8_t> out(2 * n);
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t h = static_cast<uint16_t>(0x3c00 + (i * 7919) % 1024);
    std::memcpy(out.data() + 2 * i, &h, 2);
  }
  return out;
}

TEST(Kills, KillTrainerMidPush) {
  constexpr int64_t kRows = 4096, kCols = 4096;  // 32 MiB of BF16 per push
  const std::vector<TestTensor> tensors = {{"big", {kRows, kCols}, RandomValues(kRows * kCols, 5)}};
  const std::vector<uint8_t> grad = PushLoopGradient(kRows * kCols);
  std::unique_ptr<RawCluster> c = StartCluster(1);
  ASSERT_NE(c, nullptr);
  const std::string path = c->cluster().dir() + "/big.safetensors";
  ASSERT_TRUE(WriteModel(path, tensors).ok());
  ASSERT_TRUE(c->Load(path, kRecipe, absl::Seconds(60)).ok());

  demo::ChildProcesses children;
  const std::string out = c->cluster().dir() + "/loop.log";
  absl::StatusOr<int> loop = children.Start(
      {"trainer",
       {"tests/gpu_integration/device_fetch_loop", "--mode=push", "--same_gpu_ipc=false",
        "--coordinator=" + c->cluster().coordinator_address(),
        absl::StrCat("--device=", TrainerDevice()), "--tensor=big", "--seconds=60"},
       out,
       out});
  ASSERT_TRUE(loop.ok()) << loop.status();
  const absl::Time until = absl::Now() + absl::Seconds(60);
  while (absl::Now() < until && !absl::StrContains(ReadFile(out), "push 4 ok")) {
    ASSERT_FALSE(children.Poll(*loop).has_value()) << ReadFile(out);
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(absl::StrContains(ReadFile(out), "push 4 ok")) << ReadFile(out);
  children.Signal(*loop, SIGKILL);
  ASSERT_TRUE(children.Wait(*loop, absl::Seconds(5)).ok());
  const std::string log = c->cluster().dir() + "/daemon0.log";
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline && !absl::StrContains(ReadFile(log), ") closed: ")) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(absl::StrContains(ReadFile(log), ") closed: ")) << ReadFile(log);
  // Whatever the kill interrupted: the daemon is at some version V with no
  // pusher counted (a committed push would have stepped it: one pusher).
  absl::SleepFor(absl::Seconds(1));  // a step started by the last push ends
  absl::StatusOr<rpc::DaemonStats> stats = c->Stats(0);
  ASSERT_TRUE(stats.ok()) << stats.status();
  const int64_t at = stats->published_version();
  ASSERT_GE(at, 4);
  EXPECT_EQ(stats->pushers_received(), 0);
  // One more step on the host stream, then the same steps on a fresh load
  // over the host stream only: byte-identical.
  auto host_push = [&](int64_t v) {
    rpc::PushGradientsRequest m;
    m.set_version(v);
    m.set_pusher_id("rescuer");
    rpc::GradientChunk* ch = m.mutable_chunk();
    ch->set_tensor("big");
    ch->set_row_begin(0);
    ch->set_row_end(kRows);
    ch->set_dtype(rpc::DTYPE_BF16);
    // One message would pass the gRPC limit: chunks of 1 MiB.
    std::vector<rpc::PushGradientsRequest> messages;
    for (int64_t off = 0; off < static_cast<int64_t>(grad.size()); off += 1 << 20) {
      rpc::PushGradientsRequest x = m;
      x.mutable_chunk()->set_offset(off);
      x.mutable_chunk()->set_data(grad.data() + off, std::min<int64_t>(1 << 20, grad.size() - off));
      if (off > 0) {
        x.clear_version();
        x.clear_pusher_id();
      }
      messages.push_back(std::move(x));
    }
    return c->PushRaw(0, messages);
  };
  ASSERT_TRUE(host_push(at).ok());
  ASSERT_TRUE(c->WaitForVersion(at + 1, absl::Seconds(30)).ok());
  const std::map<std::string, QuantizedTensor> after_kill = Published(*c, at + 1, tensors);
  ASSERT_TRUE(c->Load(path, kRecipe, absl::Seconds(60)).ok());
  for (int64_t v = 0; v <= at; ++v) {
    ASSERT_TRUE(host_push(v).ok());
    ASSERT_TRUE(c->WaitForVersion(v + 1, absl::Seconds(30)).ok());
  }
  ExpectSameBytes(Published(*c, at + 1, tensors), after_kill, "after the kill");
}

}  // namespace
}  // namespace testing
}  // namespace paramd
