// Same-GPU trainers through real hybrid-paramd processes: a
// coordinator and one --backend=gpu daemon on GPU 0, this test process as
// the trainer on the SAME GPU through //client/gpu_fetch:ipc_import (CUDA
// VMM buffers mapped in place, proto/ipc.proto):
//   - InPlace/*: every format pair, several shapes: the daemon's published
//     bytes read in place (and copied into caller buffers) == the CPU
//     reference at version 0 and == the host Fetch stream after a step;
//     a reload (new regions) is remapped;
//   - VersionStaysIntactWhileTheNextStepRuns: an acquired version's bytes
//     do not change while the next step runs, and the step after next (it
//     reuses those buffers) waits until the version is released;
//   - PinExpiresWhenTheTrainerIsKilled: a trainer process that pinned a
//     version is SIGKILLed: the waiting step goes on once its lease lapses;
//   - PushInPlaceEqualsHostPush: BF16 gradients read in place by the daemon
//     give the bytes of the same push over the host stream; NaN, stale and
//     early pushes are refused and add nothing;
//   - PushInPlaceNanUnderSkipStepSkipsTheStep: under non_finite: SKIP_STEP
//     a NaN pushed in place is taken and its step skipped;
//   - DaemonKilledWhileMapped: the next call fails UNAVAILABLE, and the
//     mapping still reads the last bytes (no crash, no freed memory);
//   - Bench.CoLocated (PARAMD_IPC_BENCH=1 only): the figures of
//     docs/BENCHMARKS.md at 8 x 8192 x 16384 (1.07e9 parameters) AdamW,
//     FP8 current rowwise + columnwise.
// Tag gpu; run from a directory holding server/hybrid-paramd and
// tests/gpu_integration/ipc_pin_loop (the bundle of tools/gpu_test.sh, or of
// tools/gpu_bench.sh, whose `ipc` runs it with PARAMD_IPC_BENCH=1).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/gpu_fetch/ipc_import.h"
#include "deploy/process.h"
#include "gtest/gtest.h"
#include "kernels/format.h"
#include "kernels/reference.h"
#include "server/gpu_backend/push_write.h"
#include "server/step/reference_step.h"
#include "tests/gpu_integration/device_test_util.h"
#include "tests/gpu_integration/gpu_cluster_util.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

using gpu_fetch::IpcFetcher;
using gpu_fetch::IpcTensor;
using gpu_fetch::IpcVersion;

constexpr int kDevice = 0;  // the daemon's GPU (--gpu=0) and the trainer's

QuantizedTensor HostCopy(const IpcTensor& t, const gpu_fetch::DeviceDirection& b) {
  return paramd::testing::HostCopy(t.spec.format, t.direction, t.rows, t.cols, b);
}

std::unique_ptr<IpcFetcher> OpenFetcher(client::Client* c,
                                        absl::Duration lease = absl::Seconds(5)) {
  gpu_fetch::IpcFetcherOptions o;
  o.device = kDevice;
  o.lease = lease;
  o.name = "ipc_test";
  absl::StatusOr<std::unique_ptr<IpcFetcher>> f = IpcFetcher::Open(c, 0, o);
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? *std::move(f) : nullptr;
}

// Every byte of an acquired version (data, scales, scalars), on the host.
std::vector<std::vector<uint8_t>> Snapshot(const IpcVersion& v) {
  std::vector<std::vector<uint8_t>> out;
  for (const IpcTensor& t : v.tensors) {
    for (const IpcTensor::Piece& p : t.pieces) {
      out.push_back(ToHost(p.buffers.data, p.buffers.layout.data_bytes()));
      out.push_back(ToHost(p.buffers.scales, p.buffers.layout.scale_bytes()));
      out.push_back(ToHost(p.buffers.scale_inv, 4));
    }
  }
  return out;
}

std::map<std::string, std::vector<float>> Grads(const std::vector<TestTensor>& tensors,
                                                uint32_t seed) {
  std::map<std::string, std::vector<float>> g;
  for (const TestTensor& t : tensors) g[t.name] = RandomValues(t.values.size(), seed, 0.3f);
  return g;
}

class Ipc : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cluster_ = StartGpuCluster(1).release();
    ASSERT_NE(cluster_, nullptr);
    tensors_ = {{"w", {260, 200}, RandomValues(260 * 200, 1)},
                {"b", {77}, RandomValues(77, 2, 0.1f)},
                {"row", {1, 300}, RandomValues(300, 3)},
                {"tall", {3, 129, 40}, RandomValues(3 * 129 * 40, 4, 3.0f)}};
    model_path_ = cluster_->cluster().dir() + "/model.safetensors";
    ASSERT_TRUE(WriteModel(model_path_, tensors_).ok());
    ASSERT_TRUE(cluster_
                    ->Load(model_path_,
                           "default_spec { rowwise { format: FP8_CURRENT } "
                           "columnwise { format: FP8_CURRENT } }")
                    .ok());
    client_ = Observer(*cluster_, "ipc_test").release();
    ASSERT_NE(client_, nullptr);
    ASSERT_EQ(cudaSetDevice(kDevice), cudaSuccess);
    fetcher_ = OpenFetcher(client_).release();
  }
  static void TearDownTestSuite() {
    delete fetcher_;
    delete client_;
    delete cluster_;
    fetcher_ = nullptr;
    client_ = nullptr;
    cluster_ = nullptr;
  }
  void TearDown() override {
    if (HasFailure() && cluster_ != nullptr) ADD_FAILURE() << cluster_->cluster().Logs();
  }
  static void Reload(const std::string& recipe) {
    ASSERT_TRUE(cluster_->Load(model_path_, recipe).ok());
    ASSERT_TRUE(client_->RefreshManifest().ok());
  }
  static RawCluster* cluster_;
  static client::Client* client_;
  static IpcFetcher* fetcher_;
  static std::vector<TestTensor> tensors_;
  static std::string model_path_;
};
RawCluster* Ipc::cluster_ = nullptr;
client::Client* Ipc::client_ = nullptr;
IpcFetcher* Ipc::fetcher_ = nullptr;
std::vector<TestTensor> Ipc::tensors_;
std::string Ipc::model_path_;

class InPlace : public Ipc, public ::testing::WithParamInterface<FormatCombo> {};

TEST_P(InPlace, EqualsReferenceAndHostStream) {
  ASSERT_NE(fetcher_, nullptr);
  Reload(absl::StrCat("default_spec { ", GetParam().spec, " }"));
  absl::StatusOr<const IpcVersion*> v0 = fetcher_->Acquire(0, {});
  ASSERT_TRUE(v0.ok()) << v0.status();
  EXPECT_EQ((*v0)->version, 0);
  const client::Manifest manifest = client_->manifest();
  int directions = 0;
  for (const IpcTensor& t : (*v0)->tensors) {
    SCOPED_TRACE(absl::StrCat(t.tensor, " ", DirectionName(t.direction), " ", GetParam().name));
    ASSERT_TRUE(t.whole());
    const client::TensorMeta* info = manifest.Find(t.tensor);
    ASSERT_NE(info, nullptr);
    const TestTensor* src = nullptr;
    for (const TestTensor& x : tensors_) {
      if (x.name == t.tensor) src = &x;
    }
    ASSERT_NE(src, nullptr);
    ReferenceTensorState state = InitialReferenceState(info->spec);
    absl::StatusOr<ref::HybridResult> e =
        ReferencePublish(src->values, info->rows, info->cols, info->spec, state);
    ASSERT_TRUE(e.ok()) << e.status();
    const std::optional<QuantizedTensor>& want =
        t.direction == Direction::kRowwise ? e->rowwise : e->columnwise;
    ASSERT_TRUE(want.has_value());
    const QuantizedTensor got = HostCopy(t, t.pieces[0].buffers);
    EXPECT_EQ(got.data, want->data);
    EXPECT_EQ(got.scales, want->scales);
    EXPECT_EQ(got.scale_inv, want->scale_inv);
    // The optional copy into caller-owned memory: the same bytes.
    const Layout& l = t.pieces[0].buffers.layout;
    void* mem = nullptr;
    ASSERT_EQ(cudaMalloc(&mem, l.data_bytes() + l.scale_bytes() + 8), cudaSuccess);
    ASSERT_EQ(cudaMemset(mem, 0xA5, l.data_bytes() + l.scale_bytes() + 8), cudaSuccess);
    gpu_fetch::DeviceDirection dst;
    dst.layout = l;
    dst.data = mem;
    dst.scales = l.scale_bytes() > 0 ? static_cast<char*>(mem) + l.data_bytes() : nullptr;
    dst.scale_inv =
        reinterpret_cast<float*>(static_cast<char*>(mem) + l.data_bytes() + l.scale_bytes());
    dst.amax = dst.scale_inv + 1;
    ASSERT_TRUE(fetcher_->CopyTo(t, dst, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const QuantizedTensor copied = HostCopy(t, dst);
    EXPECT_EQ(copied.data, want->data);
    EXPECT_EQ(copied.scales, want->scales);
    EXPECT_EQ(copied.scale_inv, want->scale_inv);
    cudaFree(mem);
    ++directions;
  }
  EXPECT_GE(directions, static_cast<int>(tensors_.size()));
  // After a step: == the daemon's host Fetch stream of version 1.
  ASSERT_TRUE(cluster_->PushAll(0, "trainer", Grads(tensors_, 100)).ok());
  ASSERT_TRUE(cluster_->WaitForVersion(1).ok());
  absl::StatusOr<const IpcVersion*> v1 = fetcher_->Acquire(1, {});
  ASSERT_TRUE(v1.ok()) << v1.status();
  for (const IpcTensor& t : (*v1)->tensors) {
    SCOPED_TRACE(absl::StrCat(t.tensor, " ", DirectionName(t.direction), " v1"));
    absl::StatusOr<QuantizedTensor> want = cluster_->FetchAssembled(1, t.tensor, t.direction);
    ASSERT_TRUE(want.ok()) << want.status();
    const QuantizedTensor got = HostCopy(t, t.pieces[0].buffers);
    EXPECT_EQ(got.data, want->data);
    EXPECT_EQ(got.scales, want->scales);
    EXPECT_EQ(got.scale_inv, want->scale_inv);
  }
  ASSERT_TRUE(fetcher_->Release().ok());
}

INSTANTIATE_TEST_SUITE_P(Formats, InPlace, ::testing::ValuesIn(GpuCombos()),
                         [](const ::testing::TestParamInfo<FormatCombo>& info) {
                           return info.param.name;
                         });

TEST_F(Ipc, VersionStaysIntactWhileTheNextStepRuns) {
  ASSERT_NE(fetcher_, nullptr);
  Reload("default_spec { rowwise { format: FP8_CURRENT } columnwise { format: FP8_CURRENT } }");
  absl::StatusOr<const IpcVersion*> v0 = fetcher_->Acquire(0, {});
  ASSERT_TRUE(v0.ok()) << v0.status();
  const std::vector<std::vector<uint8_t>> before = Snapshot(**v0);
  ASSERT_TRUE(cluster_->PushAll(0, "trainer", Grads(tensors_, 5)).ok());
  ASSERT_TRUE(cluster_->WaitForVersion(1).ok());
  EXPECT_EQ(Snapshot(**v0), before) << "version 0 changed under the step to 1";
  // The step to 2 reuses version 0's buffers: it waits for the pin.
  ASSERT_TRUE(cluster_->PushAll(1, "trainer", Grads(tensors_, 6)).ok());
  EXPECT_FALSE(cluster_->WaitForVersion(2, absl::Milliseconds(800)).ok())
      << "the step rewrote a pinned version";
  EXPECT_EQ(Snapshot(**v0), before) << "version 0 changed while pinned";
  // Acquiring version 1 releases 0: the step goes on.
  absl::StatusOr<const IpcVersion*> v1 = fetcher_->Acquire(1, {});
  ASSERT_TRUE(v1.ok()) << v1.status();
  ASSERT_TRUE(cluster_->WaitForVersion(2).ok());
  EXPECT_EQ(fetcher_->Acquire(0, {}).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(fetcher_->Acquire(2, {}).ok());
  ASSERT_TRUE(fetcher_->Release().ok());
}

// The hand-over of v+1 through the session's pin page: once a slot's
// version was acquired over RPC, the next versions in that slot are pinned
// with no RPC (page_acquires), read the same bytes as the host stream, and
// hold back the step that would rewrite them like an RPC pin.
TEST_F(Ipc, HandOverGoesThroughThePinPage) {
  ASSERT_NE(fetcher_, nullptr);
  Reload("default_spec { rowwise { format: FP8_CURRENT } columnwise { format: MXFP8 } }");
  const int64_t page0 = fetcher_->page_acquires(), rpc0 = fetcher_->rpc_acquires();
  for (int64_t v = 0; v < 5; ++v) {
    absl::StatusOr<const IpcVersion*> got = fetcher_->Acquire(v, {});
    ASSERT_TRUE(got.ok()) << "v" << v << ": " << got.status();
    ASSERT_EQ((*got)->version, v);
    for (const IpcTensor& t : (*got)->tensors) {
      SCOPED_TRACE(absl::StrCat(t.tensor, " ", DirectionName(t.direction), " v", v));
      absl::StatusOr<QuantizedTensor> want = cluster_->FetchAssembled(v, t.tensor, t.direction);
      ASSERT_TRUE(want.ok()) << want.status();
      const QuantizedTensor q = HostCopy(t, t.pieces[0].buffers);
      EXPECT_EQ(q.data, want->data);
      EXPECT_EQ(q.scales, want->scales);
    }
    // Versions 0 and 1 are the first in their slots (RPC); 2, 3, 4 go
    // through the page.
    EXPECT_EQ(fetcher_->rpc_acquires() - rpc0, std::min<int64_t>(v + 1, 2)) << "v" << v;
    EXPECT_EQ(fetcher_->page_acquires() - page0, std::max<int64_t>(v - 1, 0)) << "v" << v;
    // The step to v+1 rewrites v-1's slot, released by this acquire.
    ASSERT_TRUE(cluster_->PushAll(v, "trainer", Grads(tensors_, 50 + v)).ok());
    ASSERT_TRUE(cluster_->WaitForVersion(v + 1).ok()) << "v" << v;
  }
  // The step to 7 rewrites 5's slot: the page pin of 5 holds it.
  absl::StatusOr<const IpcVersion*> v5 = fetcher_->Acquire(5, {});
  ASSERT_TRUE(v5.ok()) << v5.status();
  const int64_t page_before = fetcher_->page_acquires();
  const std::vector<std::vector<uint8_t>> before = Snapshot(**v5);
  ASSERT_TRUE(cluster_->PushAll(5, "trainer", Grads(tensors_, 60)).ok());
  ASSERT_TRUE(cluster_->WaitForVersion(6).ok());
  ASSERT_TRUE(cluster_->PushAll(6, "trainer", Grads(tensors_, 61)).ok());
  EXPECT_FALSE(cluster_->WaitForVersion(7, absl::Milliseconds(800)).ok())
      << "the step rewrote a page-pinned version";
  EXPECT_EQ(Snapshot(**v5), before) << "version 5 changed while page-pinned";
  absl::StatusOr<const IpcVersion*> v6 = fetcher_->Acquire(6, {});  // releases 5
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_EQ(fetcher_->page_acquires(), page_before + 1);
  ASSERT_TRUE(cluster_->WaitForVersion(7).ok());
  EXPECT_EQ(fetcher_->Acquire(5, {}).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(fetcher_->Release().ok());
}

TEST_F(Ipc, PinExpiresWhenTheTrainerIsKilled) {
  ASSERT_NE(fetcher_, nullptr);
  Reload("default_spec { rowwise { format: MXFP8 } columnwise { format: MXFP8 } }");
  demo::ChildProcesses children;
  demo::ChildOptions o;
  o.name = "ipc_pin_loop";
  o.argv = {"tests/gpu_integration/ipc_pin_loop",
            "--coordinator=" + cluster_->cluster().coordinator_address(), "--lease_ms=1000"};
  o.pipe_stdout = true;
  absl::StatusOr<int> child = children.Start(o);
  ASSERT_TRUE(child.ok()) << child.status();
  std::string line;
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (!absl::StrContains(line, "\n") && absl::Now() < give_up) {
    char c;
    if (read(children.stdout_fd(*child), &c, 1) == 1) line += c;
  }
  ASSERT_TRUE(absl::StartsWith(line, "PINNED 0")) << line;
  ASSERT_TRUE(cluster_->PushAll(0, "trainer", Grads(tensors_, 7)).ok());
  ASSERT_TRUE(cluster_->WaitForVersion(1).ok());
  ASSERT_TRUE(cluster_->PushAll(1, "trainer", Grads(tensors_, 8)).ok());
  // The child renews its lease: the step to 2 waits.
  EXPECT_FALSE(cluster_->WaitForVersion(2, absl::Milliseconds(1500)).ok());
  children.Signal(*child, SIGKILL);
  const absl::Time killed = absl::Now();
  ASSERT_TRUE(cluster_->WaitForVersion(2, absl::Seconds(10)).ok());
  const absl::Duration after = absl::Now() - killed;
  std::printf("IPC_TEST step went on %.2f s after the pinning trainer was killed (lease 1 s)\n",
              absl::ToDoubleSeconds(after));
  EXPECT_LT(after, absl::Seconds(4));
}

// BF16 values (RNE) and their exact FP32 widening.
uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
float FromBf16(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST_F(Ipc, PushInPlaceEqualsHostPush) {
  ASSERT_NE(fetcher_, nullptr);
  const std::string recipe =
      "default_spec { rowwise { format: FP8_CURRENT } columnwise { format: MXFP8 } }";
  // The gradients: BF16 in one buffer (tensors packed back to back), and
  // the same values widened to FP32 for the host stream.
  std::map<std::string, std::vector<float>> wide;
  std::vector<uint16_t> packed;
  std::vector<std::pair<std::string, size_t>> at;
  for (const TestTensor& t : tensors_) {
    at.push_back({t.name, packed.size() * 2});
    std::vector<float>& w = wide[t.name];
    for (float f : RandomValues(t.values.size(), 42, 0.3f)) {
      packed.push_back(ToBf16(f));
      w.push_back(FromBf16(packed.back()));
    }
  }
  Reload(recipe);
  absl::StatusOr<void*> buffer = fetcher_->GradientBuffer(packed.size() * 2);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  char* base = static_cast<char*>(*buffer);
  std::vector<gpu_fetch::IpcGradient> grads;
  for (const auto& [name, offset] : at) {
    grads.push_back({name, client::Gradient::DType::kBf16, base + offset});
  }
  // A NaN: refused, nothing added.
  std::vector<uint16_t> bad = packed;
  bad[packed.size() - 3] = 0x7fc0;
  ASSERT_EQ(cudaMemcpy(base, bad.data(), bad.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(fetcher_->Push(0, grads).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_EQ(cudaMemcpy(base, packed.data(), packed.size() * 2, cudaMemcpyHostToDevice),
            cudaSuccess);
  EXPECT_EQ(fetcher_->Push(3, grads).status().code(), absl::StatusCode::kOutOfRange);  // early
  absl::StatusOr<rpc::PushGradientsResponse> ok = fetcher_->Push(0, grads);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->bytes_received(), static_cast<int64_t>(packed.size() * 2));
  ASSERT_TRUE(cluster_->WaitForVersion(1).ok());
  EXPECT_FALSE(fetcher_->Push(0, grads).ok());  // stale now
  std::map<std::string, std::vector<QuantizedTensor>> in_place;
  for (const TestTensor& t : tensors_) {
    for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
      absl::StatusOr<QuantizedTensor> q = cluster_->FetchAssembled(1, t.name, d);
      ASSERT_TRUE(q.ok()) << q.status();
      in_place[t.name].push_back(*std::move(q));
    }
  }
  // The same push over the host stream, from a fresh load.
  Reload(recipe);
  ASSERT_TRUE(cluster_->PushAll(0, "trainer", wide).ok());
  ASSERT_TRUE(cluster_->WaitForVersion(1).ok());
  for (const TestTensor& t : tensors_) {
    int i = 0;
    for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
      SCOPED_TRACE(absl::StrCat(t.name, " ", DirectionName(d)));
      absl::StatusOr<QuantizedTensor> q = cluster_->FetchAssembled(1, t.name, d);
      ASSERT_TRUE(q.ok()) << q.status();
      EXPECT_EQ(q->data, in_place[t.name][i].data);
      EXPECT_EQ(q->scales, in_place[t.name][i].scales);
      EXPECT_EQ(q->scale_inv, in_place[t.name][i].scale_inv);
      ++i;
    }
  }
}

// Under non_finite: SKIP_STEP a NaN pushed in place is taken, as on the
// host stream and the NCCL device push: the version advances with the
// masters unchanged and the skip counted; the next finite push steps.
TEST_F(Ipc, PushInPlaceNanUnderSkipStepSkipsTheStep) {
  ASSERT_NE(fetcher_, nullptr);
  const std::string spec =
      "default_spec { rowwise { format: FP8_CURRENT } columnwise { format: MXFP8 } } ";
  Reload(spec + "optimizer { kind: ADAMW lr: 0.01 max_grad_norm: 1.0 non_finite: SKIP_STEP }");
  std::vector<uint16_t> packed;
  std::vector<std::pair<std::string, size_t>> at;
  for (const TestTensor& t : tensors_) {
    at.push_back({t.name, packed.size() * 2});
    for (float f : RandomValues(t.values.size(), 43, 0.3f)) packed.push_back(ToBf16(f));
  }
  absl::StatusOr<void*> buffer = fetcher_->GradientBuffer(packed.size() * 2);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  char* base = static_cast<char*>(*buffer);
  std::vector<gpu_fetch::IpcGradient> grads;
  for (const auto& [name, offset] : at) {
    grads.push_back({name, client::Gradient::DType::kBf16, base + offset});
  }
  auto weights = [&](int64_t version) {
    std::vector<std::vector<uint8_t>> out;
    for (const TestTensor& t : tensors_) {
      for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
        absl::StatusOr<QuantizedTensor> q = cluster_->FetchAssembled(version, t.name, d);
        EXPECT_TRUE(q.ok()) << q.status();
        if (!q.ok()) return out;
        out.push_back(q->data);
        out.push_back(q->scales);
      }
    }
    return out;
  };
  auto push = [&](int64_t version, const std::vector<uint16_t>& values) {
    ASSERT_EQ(cudaMemcpy(base, values.data(), values.size() * 2, cudaMemcpyHostToDevice),
              cudaSuccess);
    absl::StatusOr<rpc::PushGradientsResponse> r = fetcher_->Push(version, grads);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(cluster_->WaitForVersion(version + 1).ok());
  };
  push(0, packed);
  const std::vector<std::vector<uint8_t>> w1 = weights(1);
  std::vector<uint16_t> bad = packed;
  bad[bad.size() / 2] = 0x7fc0;  // NaN
  push(1, bad);
  EXPECT_EQ(weights(2), w1);  // masters unchanged
  absl::StatusOr<rpc::DaemonStats> s = cluster_->Stats(0);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->skipped_steps(), 1);
  EXPECT_EQ(s->optimizer_steps(), 1);
  EXPECT_TRUE(std::isnan(s->grad_norm()));
  push(2, packed);
  EXPECT_NE(weights(3), w1);
  s = cluster_->Stats(0);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->skipped_steps(), 1);
  EXPECT_EQ(s->optimizer_steps(), 2);
  EXPECT_GT(s->grad_norm(), 0.0);
  // Back to the suite's default optimizer (the flags') for the tests after.
  Reload(spec);
}

// ---- The figures (docs/BENCHMARKS.md); PARAMD_IPC_BENCH=1 only ----

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

size_t FreeBytes() {
  size_t free = 0, total = 0;
  cudaMemGetInfo(&free, &total);
  return free;
}

TEST_F(Ipc, BenchCoLocated) {
  const char* env = std::getenv("PARAMD_IPC_BENCH");
  if (env == nullptr || std::string(env) != "1") GTEST_SKIP() << "PARAMD_IPC_BENCH=1 only";
  ASSERT_NE(fetcher_, nullptr);
  const int n_tensors = 8;
  const int64_t rows = 8192, cols = 16384;
  std::vector<TestTensor> big;
  for (int i = 0; i < n_tensors; ++i) {
    TestTensor t{absl::StrCat("layers.", i, ".weight"), {rows, cols}, {}};
    t.values.resize(rows * cols);
    uint32_t x = 12345 + i;
    for (float& f : t.values) {
      x = x * 1664525u + 1013904223u;
      f = (static_cast<int32_t>(x >> 8) - (1 << 23)) * (1.0f / (1 << 23)) * 0.05f;
    }
    big.push_back(std::move(t));
  }
  const std::string path = cluster_->cluster().dir() + "/big.safetensors";
  const absl::Time t_write = absl::Now();
  ASSERT_TRUE(WriteModel(path, big).ok());
  big.clear();
  ASSERT_TRUE(fetcher_->Release().ok());
  ASSERT_TRUE(cluster_->Load(model_path_, "default_spec { rowwise { format: IDENTITY_BF16 } }")
                  .ok());  // the small model: the big one's memory is measured from here
  const size_t free0 = FreeBytes();
  ASSERT_TRUE(cluster_
                  ->Load(path,
                         "default_spec { rowwise { format: FP8_CURRENT } "
                         "columnwise { format: FP8_CURRENT } }",
                         absl::Seconds(300))
                  .ok());
  ASSERT_TRUE(client_->RefreshManifest().ok());
  std::printf("IPC_BENCH model written + loaded in %.1f s\n",
              absl::ToDoubleSeconds(absl::Now() - t_write));
  const int64_t params = n_tensors * rows * cols;
  const size_t free1 = FreeBytes();
  absl::StatusOr<const IpcVersion*> v = fetcher_->Acquire(0, {});
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const size_t free2 = FreeBytes();
  // Trainer-owned destination buffers for the optional copy, and the
  // gradient buffer (BF16, the daemon maps it).
  std::vector<gpu_fetch::DeviceDirection> dst;
  int64_t copy_bytes = 0;
  for (const IpcTensor& t : (*v)->tensors) {
    gpu_fetch::DeviceDirection d;
    d.layout = t.pieces[0].buffers.layout;
    ASSERT_EQ(cudaMalloc(&d.data, d.layout.data_bytes()), cudaSuccess);
    if (d.layout.scale_bytes() > 0) {
      ASSERT_EQ(cudaMalloc(&d.scales, d.layout.scale_bytes()), cudaSuccess);
    }
    void* s = nullptr;
    ASSERT_EQ(cudaMalloc(&s, 8), cudaSuccess);
    d.scale_inv = static_cast<float*>(s);
    d.amax = d.scale_inv + 1;
    copy_bytes += d.layout.data_bytes() + d.layout.scale_bytes();
    dst.push_back(d);
  }
  const size_t grad_bytes = static_cast<size_t>(params) * 2;
  const size_t free3 = FreeBytes();
  absl::StatusOr<void*> gbuf = fetcher_->GradientBuffer(grad_bytes);
  ASSERT_TRUE(gbuf.ok()) << gbuf.status();
  ASSERT_EQ(cudaMemset(*gbuf, 0x3c, grad_bytes), cudaSuccess);  // 0x3c3c: a small BF16
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const size_t free4 = FreeBytes();
  std::vector<gpu_fetch::IpcGradient> grads;
  for (int i = 0; i < n_tensors; ++i) {
    grads.push_back({absl::StrCat("layers.", i, ".weight"), client::Gradient::DType::kBf16,
                     static_cast<char*>(*gbuf) + static_cast<size_t>(i) * rows * cols * 2});
  }
  // Baselines: d2d copies of the same bytes between trainer buffers.
  void *a = nullptr, *b = nullptr;
  ASSERT_EQ(cudaMalloc(&a, grad_bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b, grad_bytes), cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  auto time_ms = [&](const std::function<void()>& enqueue) {
    cudaEventRecord(e0, stream);
    enqueue();
    cudaEventRecord(e1, stream);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    return static_cast<double>(ms);
  };
  std::vector<double> copy_base, push_base, acquire_us, copy_ms, push_ms;
  for (int i = 0; i < 5; ++i) {
    copy_base.push_back(time_ms([&] {
      int64_t off = 0;
      for (const gpu_fetch::DeviceDirection& d : dst) {
        cudaMemcpyAsync(static_cast<char*>(b) + off, static_cast<char*>(a) + off,
                        d.layout.data_bytes(), cudaMemcpyDeviceToDevice, stream);
        off += d.layout.data_bytes();
      }
    }));
    push_base.push_back(
        time_ms([&] { cudaMemcpyAsync(b, a, grad_bytes, cudaMemcpyDeviceToDevice, stream); }));
  }
  const int steps = 8;
  const int64_t page_before = fetcher_->page_acquires();
  int64_t version = 0;
  for (int s = 0; s < steps; ++s) {
    const absl::Time p0 = absl::Now();
    absl::StatusOr<rpc::PushGradientsResponse> pushed = fetcher_->Push(version, grads);
    const absl::Time p1 = absl::Now();
    ASSERT_TRUE(pushed.ok()) << pushed.status();
    ASSERT_TRUE(client_->WaitForVersion(version + 1, absl::Seconds(60)).ok());
    const absl::Time h0 = absl::Now();
    absl::StatusOr<const IpcVersion*> next = fetcher_->Acquire(version + 1, {});
    const absl::Time h1 = absl::Now();
    ASSERT_TRUE(next.ok()) << next.status();
    ++version;
    const double c = time_ms([&] {
      for (size_t i = 0; i < dst.size(); ++i) {
        ASSERT_TRUE(fetcher_->CopyTo((*next)->tensors[i], dst[i], stream).ok());
      }
    });
    if (s < 2) continue;  // warm-up (and the first acquire of each slot, over RPC)
    push_ms.push_back(absl::ToDoubleMilliseconds(p1 - p0));
    acquire_us.push_back(absl::ToDoubleMicroseconds(h1 - h0));
    copy_ms.push_back(c);
  }
  // The push's device pass alone (what ApplyCheckedPush runs for a first
  // pusher), here into a scratch accumulator of the same size: the kernel's
  // share of the push's host wall time.
  std::vector<double> write_ms;
  {
    void* acc = nullptr;
    void* flag = nullptr;
    ASSERT_EQ(cudaMalloc(&acc, static_cast<size_t>(params) * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&flag, 4), cudaSuccess);
    for (int i = 0; i < 5; ++i) {
      write_ms.push_back(time_ms([&] {
        for (int t = 0; t < n_tensors; ++t) {
          const size_t off = static_cast<size_t>(t) * rows * cols;
          gpu_backend::LaunchWriteChecked(static_cast<float*>(acc) + off,
                                          static_cast<char*>(*gbuf) + 2 * off, /*bf16=*/true,
                                          rows * cols, static_cast<uint32_t*>(flag), stream);
        }
      }));
    }
    cudaFree(acc);
    cudaFree(flag);
  }
  const int targets = static_cast<int>(dst.size());
  const double acq = Median(acquire_us);
  std::printf("IPC_BENCH params=%lld (%d x %lld x %lld) AdamW FP8 current row+col, %d targets\n",
              static_cast<long long>(params), n_tensors, static_cast<long long>(rows),
              static_cast<long long>(cols), targets);
  std::printf(
      "IPC_BENCH hand v+1 (Acquire after publish, pin page): %.1f us host = %.2f us per "
      "tensor (%.2f per direction), no device copy; %lld of %d acquires through the page\n",
      acq, acq / n_tensors, acq / targets,
      static_cast<long long>(fetcher_->page_acquires() - page_before), steps);
  const double cb = Median(copy_base), cm = Median(copy_ms);
  std::printf(
      "IPC_BENCH optional copy of every direction (%.2f GB): %.3f ms (%.0f GB/s); "
      "d2d copy of the same buffers %.3f ms; ratio %.3f\n",
      copy_bytes / 1e9, cm, copy_bytes / cm / 1e6, cb, cb / cm);
  const double pb = Median(push_base), pm = Median(push_ms);
  // The figure: the gradient's bytes over the push's host wall time
  // (PushGradientsIpc round trip, one pass that checks and writes the FP32
  // accumulator: 2 B read + 4 B written per parameter) vs a d2d copy of the
  // same bytes (2 B read + 2 B written) in this run.
  std::printf(
      "IPC_BENCH push in place of %.2f GB BF16 (one pass: NaN check + FP32 write, host "
      "wall): %.3f ms; d2d copy of the same bytes %.3f ms; ratio %.3f; memory traffic "
      "%.0f GB/s (6 B/param) vs copy %.0f GB/s (4 B/param): ratio %.3f\n",
      grad_bytes / 1e9, pm, pb, pb / pm, params * 6.0 / pm / 1e6, params * 4.0 / pb / 1e6,
      (params * 6.0 / pm) / (params * 4.0 / pb));
  const double wk = Median(write_ms);
  std::printf(
      "IPC_BENCH push's device pass alone (check + FP32 write, 8 launches): %.3f ms = "
      "%.3f of the d2d copy of the gradient's bytes (%.0f GB/s at 6 B/param); the rest "
      "of the push's host wall (%.3f ms) is the call, the rules and the waits\n",
      wk, pb / wk, params * 6.0 / wk / 1e6, pm - wk);
  std::printf(
      "IPC_BENCH device memory: daemon model %.2f B/param (free %zu -> %zu), trainer "
      "weights after Acquire %+.3f B/param (free -> %zu); copy buffers %.2f B/param; "
      "gradient buffer %.2f B/param (free %zu -> %zu)\n",
      static_cast<double>(free0 - free1) / params, free0, free1,
      (static_cast<double>(free1) - static_cast<double>(free2)) / params, free2,
      (static_cast<double>(free2) - static_cast<double>(free3)) / params,
      (static_cast<double>(free3) - static_cast<double>(free4)) / params, free3, free4);
  absl::StatusOr<rpc::DaemonStats> stats = cluster_->Stats(0);
  if (stats.ok()) std::printf("IPC_BENCH daemon stats: %s\n", stats->ShortDebugString().c_str());
  for (gpu_fetch::DeviceDirection& d : dst) {
    cudaFree(d.data);
    if (d.scales) cudaFree(d.scales);
    cudaFree(d.scale_inv);
  }
  cudaFree(a);
  cudaFree(b);
  ASSERT_TRUE(fetcher_->Release().ok());
}

// Last: kills the suite's daemon.
TEST_F(Ipc, ZDaemonKilledWhileMapped) {
  ASSERT_NE(fetcher_, nullptr);
  Reload("default_spec { rowwise { format: NVFP4 } columnwise { format: FP8_BLOCK_1X128 } }");
  absl::StatusOr<const IpcVersion*> v0 = fetcher_->Acquire(0, {});
  ASSERT_TRUE(v0.ok()) << v0.status();
  const std::vector<std::vector<uint8_t>> before = Snapshot(**v0);
  cluster_->cluster().KillDaemon(0);
  const absl::Time killed = absl::Now();
  absl::Status s;
  while (absl::Now() - killed < absl::Seconds(10)) {
    s = fetcher_->Check();
    if (!s.ok()) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  std::printf("IPC_TEST dead daemon noticed %.3f s after the kill: %s\n",
              absl::ToDoubleSeconds(absl::Now() - killed), s.ToString().c_str());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "no longer valid")) << s;
  absl::Status again = fetcher_->Acquire(-1, {}).status();
  EXPECT_EQ(again.code(), absl::StatusCode::kUnavailable) << again;
  EXPECT_FALSE(
      fetcher_->CopyTo((*v0)->tensors[0], (*v0)->tensors[0].pieces[0].buffers, nullptr).ok());
  // The mappings hold the daemon's allocations: still the last bytes.
  EXPECT_EQ(Snapshot(**v0), before);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace testing
}  // namespace paramd
