// GPU only. The push + step + fetch loop of one gpu daemon on ONE GPU, whole
// versus pipelined (server/gpu_backend/pipelined_step.h), with each phase
// alone in the same run: default 16 x [8192, 8192] = 1.07 B parameters, FP8
// current scaling rowwise + columnwise, AdamW, one daemon, buckets of
// --bucket_elements (default: each tensor a bucket).
//
//   push  host:   the trainer's BF16 gradients from page-locked host memory
//                 (cudaMemcpyAsync on a stream of their own, per tensor)
//                 into device staging, then the push's add into the FP32
//                 accumulators (GpuShardStore::AddPiece, BF16);
//         device: the BF16 gradients already on the GPU (a same-GPU trainer
//                 pushing in place): the add only.
//   step:         whole: GpuShardStore::Step; pipelined: RunGpuPipelinedStep
//                 with bucket b's add enqueued behind its push's event.
//   fetch host:   every published byte (FP8 rowwise + columnwise) copied to
//                 page-locked host memory on a stream of its own, as an
//                 as_ready reader: pipelined, bucket b's copy waits on the
//                 bucket's ready event only;
//         device: the same bytes copied into device memory (a same-GPU
//                 trainer taking a copy).
// The loop is synchronous (the next push starts after the fetch of the
// version before it). This is not the two-GPU loop (daemon GPU + trainer
// GPU over NVLink) of docs/BENCHMARKS.md: here push and fetch cross PCIe
// (host) or stay in this GPU's memory (device).
//
//   gpu_pipeline_bench [--tensors=16] [--rows=8192] [--cols=8192]
//                      [--push=host|device] [--fetch=host|device]
//                      [--bucket_elements=0] [--loops=8]
//
// Prints the medians and one JSON line.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/gpu_backend/bench_model.h"
#include "server/gpu_backend/daemon_backend.h"
#include "server/gpu_backend/pipelined_step.h"
#include "server/gpu_backend/shard_store.h"
#include "server/step/step_pipeline.h"

ABSL_FLAG(int, tensors, 16, "number of tensors");
ABSL_FLAG(int64_t, rows, 8192, "rows per tensor");
ABSL_FLAG(int64_t, cols, 8192, "cols per tensor");
ABSL_FLAG(std::string, push, "host", "host: BF16 from page-locked host memory; device: in place");
ABSL_FLAG(std::string, fetch, "host", "host: into page-locked host memory; device: a D2D copy");
ABSL_FLAG(int64_t, bucket_elements, 0, "parameters per bucket (0: one tensor per bucket)");
ABSL_FLAG(int, loops, 8, "measured loops per mode (after one warm-up each)");

namespace paramd {
namespace {

using gpu_backend::GpuShardStore;
using gpu_backend::Median;

#define CHECK_CUDA(expr)                                               \
  do {                                                                 \
    cudaError_t e_ = (expr);                                           \
    if (e_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(e_)); \
      return 1;                                                        \
    }                                                                  \
  } while (0)
#define CHECK_OK(expr)                                                \
  do {                                                                \
    absl::Status s_ = (expr);                                         \
    if (!s_.ok()) {                                                   \
      std::fprintf(stderr, "%s: %s\n", #expr, s_.ToString().c_str()); \
      return 1;                                                       \
    }                                                                 \
  } while (0)

struct Bench {
  int n = 0;
  int64_t count = 0;  // per tensor
  bool host_push = true, host_fetch = true;
  GpuShardStore* store = nullptr;
  cudaStream_t push_stream = nullptr, fetch_stream = nullptr;
  std::vector<void*> host_grad;     // [tensor] BF16, page-locked (host push)
  std::vector<void*> staging;       // [tensor] BF16 on the device
  std::vector<cudaEvent_t> pushed;  // [tensor]
  std::vector<void*> fetched;       // [tensor][direction] destination
  std::vector<size_t> fetched_bytes;
  int64_t version = 0;

  // Tensor t's push: H2D into its staging (host), then `stream` waits.
  int PushTensor(int t) {
    if (host_push) {
      CHECK_CUDA(cudaMemcpyAsync(staging[t], host_grad[t], count * 2, cudaMemcpyHostToDevice,
                                 push_stream));
    }
    CHECK_CUDA(cudaEventRecord(pushed[t], push_stream));
    return 0;
  }
  // The push's add of tensor t, behind its bytes.
  int AddTensor(int t) {
    CHECK_CUDA(cudaStreamWaitEvent(store->stream(), pushed[t], 0));
    CHECK_OK(store->AddPiece(t, 0, staging[t], /*bf16=*/true, count, /*last_pusher=*/false));
    return 0;
  }
  // Copies tensor t's published bytes of `v` on the fetch stream.
  int FetchTensor(int64_t v, int t) {
    for (int dir = 0; dir < 2; ++dir) {
      absl::StatusOr<gpu_backend::GpuPublishedDirection> d =
          store->Published(v, t, static_cast<Direction>(dir));
      CHECK_OK(d.status());
      CHECK_CUDA(cudaMemcpyAsync(fetched[2 * t + dir], d->data, d->layout.data_bytes(),
                                 host_fetch ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice,
                                 fetch_stream));
    }
    return 0;
  }
  double Since(absl::Time t0) { return absl::ToDoubleMilliseconds(absl::Now() - t0); }

  // push, step, fetch one after the other, each timed alone.
  int Whole(double* push_ms, double* step_ms, double* fetch_ms, double* loop_ms) {
    const absl::Time t0 = absl::Now();
    for (int t = 0; t < n; ++t) {
      if (PushTensor(t) || AddTensor(t)) return 1;
    }
    CHECK_CUDA(cudaStreamSynchronize(store->stream()));
    *push_ms = Since(t0);
    const absl::Time t1 = absl::Now();
    CHECK_OK(store->Step(++version, true, nullptr, absl::Now() + absl::Seconds(60)));
    *step_ms = Since(t1);
    const absl::Time t2 = absl::Now();
    for (int t = 0; t < n; ++t) {
      if (FetchTensor(version, t)) return 1;
    }
    CHECK_CUDA(cudaStreamSynchronize(fetch_stream));
    *fetch_ms = Since(t2);
    *loop_ms = Since(t0);
    return 0;
  }

  // The pipelined loop; `step_only`: the gradients are already in the
  // accumulators and nothing is fetched (the bucketed step alone).
  int Pipelined(const gpu_backend::GpuPipelineSetup& setup,
                gpu_backend::GpuPipelineScratch& scratch, bool step_only, double* loop_ms) {
    const absl::Time t0 = absl::Now();
    const int64_t v = ++version;
    gpu_backend::GpuBucketHooks hooks;
    int failed = 0;
    if (!step_only) {
      // The trainer streams its gradients in manifest order.
      for (int t = 0; t < n; ++t) {
        if (PushTensor(t)) return 1;
      }
      hooks.await_bucket = [&](const StepBucket& b) -> absl::Status {
        for (int i : b.shards) failed |= AddTensor(i);
        return absl::OkStatus();
      };
      hooks.on_bucket_enqueued = [&](int b, cudaEvent_t ready) {
        failed |= cudaStreamWaitEvent(fetch_stream, ready, 0) != cudaSuccess;
        for (int i : setup.buckets[b].shards) failed |= FetchTensor(v, i);
      };
    }
    bool committed = false;
    CHECK_OK(gpu_backend::RunGpuPipelinedStep(*store, v, setup, hooks, scratch, &committed));
    CHECK_CUDA(cudaStreamSynchronize(fetch_stream));
    *loop_ms = Since(t0);
    return failed;
  }
};

int Run() {
  Bench b;
  b.n = absl::GetFlag(FLAGS_tensors);
  const int64_t rows = absl::GetFlag(FLAGS_rows), cols = absl::GetFlag(FLAGS_cols);
  b.count = rows * cols;
  b.host_push = absl::GetFlag(FLAGS_push) == "host";
  b.host_fetch = absl::GetFlag(FLAGS_fetch) == "host";
  OptimizerOptions o;
  o.lr = 1e-3f;
  o.weight_decay = 0.01f;
  absl::StatusOr<std::unique_ptr<ShardBackend>> created =
      gpu_backend::CreateBenchBackend(b.n, rows, cols, Format::kFp8Current, o);
  CHECK_OK(created.status());
  ShardBackend& backend = **created;
  for (int i = 0; i < b.n; ++i) {
    absl::Span<float> m = backend.load_master(i);
    std::fill(m.begin(), m.end(), 0.25f + 0.01f * i);
  }
  const AllReduceMaxFn identity = [](absl::Span<float>) { return absl::OkStatus(); };
  CHECK_OK(backend.Step(0, false, identity, true).status());
  b.store = gpu_backend::DeviceStoreOf(&backend);
  CHECK_CUDA(cudaStreamCreateWithFlags(&b.push_stream, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&b.fetch_stream, cudaStreamNonBlocking));
  std::vector<uint16_t> pattern(b.count);
  for (int64_t k = 0; k < b.count; ++k) pattern[k] = (k & 1) ? 0x3A83 : 0xBA83;  // +-1e-3
  for (int t = 0; t < b.n; ++t) {
    void* dev = nullptr;
    CHECK_CUDA(cudaMalloc(&dev, b.count * 2));
    CHECK_CUDA(cudaMemcpy(dev, pattern.data(), b.count * 2, cudaMemcpyHostToDevice));
    b.staging.push_back(dev);
    if (b.host_push) {
      void* host = nullptr;
      CHECK_CUDA(cudaHostAlloc(&host, b.count * 2, cudaHostAllocDefault));
      std::memcpy(host, pattern.data(), b.count * 2);
      b.host_grad.push_back(host);
    }
    cudaEvent_t e = nullptr;
    CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    b.pushed.push_back(e);
    for (int dir = 0; dir < 2; ++dir) {
      absl::StatusOr<gpu_backend::GpuPublishedDirection> d =
          b.store->Published(0, t, static_cast<Direction>(dir));
      CHECK_OK(d.status());
      void* dst = nullptr;
      if (b.host_fetch) {
        CHECK_CUDA(cudaHostAlloc(&dst, d->layout.data_bytes(), cudaHostAllocDefault));
      } else {
        CHECK_CUDA(cudaMalloc(&dst, d->layout.data_bytes()));
      }
      b.fetched.push_back(dst);
      b.fetched_bytes.push_back(d->layout.data_bytes());
    }
  }
  std::vector<TensorDef> tensors = backend.tensors();
  gpu_backend::GpuPipelineSetup setup;
  setup.buckets = PlanStepBuckets(tensors, backend.shards(), absl::GetFlag(FLAGS_bucket_elements));
  setup.second_round.assign(setup.buckets.size(), 0);
  setup.deadline = absl::InfiniteFuture();
  gpu_backend::GpuPipelineScratch scratch;

  const int loops = absl::GetFlag(FLAGS_loops);
  std::vector<double> push, step, fetch, whole, piped, piped_step;
  for (int i = 0; i <= loops; ++i) {
    double p, s, f, w, l, ps;
    if (b.Whole(&p, &s, &f, &w)) return 1;
    if (b.Pipelined(setup, scratch, false, &l)) return 1;
    // The bucketed step alone, on gradients already added.
    for (int t = 0; t < b.n; ++t) {
      if (b.PushTensor(t) || b.AddTensor(t)) return 1;
    }
    CHECK_CUDA(cudaStreamSynchronize(b.store->stream()));
    if (b.Pipelined(setup, scratch, true, &ps)) return 1;
    if (i == 0) continue;  // warm-up
    push.push_back(p);
    step.push_back(s);
    fetch.push_back(f);
    whole.push_back(w);
    piped.push_back(l);
    piped_step.push_back(ps);
  }
  size_t fetched = 0;
  for (size_t x : b.fetched_bytes) fetched += x;
  const double params = static_cast<double>(b.n) * b.count;
  const double mp = Median(push), ms = Median(step), mf = Median(fetch);
  const double mw = Median(whole), ml = Median(piped), mps = Median(piped_step);
  std::printf(
      "== %.4g parameters (%d x [%lld, %lld]), FP8 current row + col, AdamW, one daemon, "
      "%zu buckets; push %s (%.3g GB BF16), fetch %s (%.3g GB)\n",
      params, b.n, static_cast<long long>(rows), static_cast<long long>(cols), setup.buckets.size(),
      b.host_push ? "host->GPU" : "in place (same GPU)", params * 2 / 1e9,
      b.host_fetch ? "GPU->host" : "GPU->GPU copy", fetched / 1e9);
  std::printf(
      "alone: push %.3f ms, step %.3f ms (bucketed step %.3f ms), fetch %.3f ms "
      "(sum %.3f ms)\n",
      mp, ms, mps, mf, mp + ms + mf);
  std::printf("loop: whole %.3f ms, pipelined %.3f ms (%.2fx; pipelined / max phase %.2f)\n", mw,
              ml, mw / ml, ml / std::max({mp, ms, mf}));
  std::printf(
      "{\"parameters\": %.0f, \"buckets\": %zu, \"push\": \"%s\", \"fetch\": \"%s\", "
      "\"push_ms\": %.3f, \"step_ms\": %.3f, \"bucketed_step_ms\": %.3f, "
      "\"fetch_ms\": %.3f, \"whole_loop_ms\": %.3f, \"pipelined_loop_ms\": %.3f}\n",
      params, setup.buckets.size(), b.host_push ? "host" : "device",
      b.host_fetch ? "host" : "device", mp, ms, mps, mf, mw, ml);
  std::fflush(stdout);
  return 0;
}

}  // namespace
}  // namespace paramd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return paramd::Run();
}
