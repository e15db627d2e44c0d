// GPU only. The step-time cost of the global gradient norm + clipping on a
// gpu daemon: the same model (default 16 x [8192, 8192] = 1.07 B
// parameters, AdamW, one daemon) stepped with clipping off and on in the
// same process, the modes alternating step by step (SetOptimizer between
// steps), for each format of --formats (both
// directions; fp8_current steps with the two-kernel path, fp8_delayed and
// mxfp8 with the one-pass AdamW + quantize). Before each step every shard
// gets one gradient through the device push's add (GpuShardStore::AddPiece
// from device memory, as an NCCL push) as the last pusher, so with
// clipping on the norm's row sums ride in that add; "on, unfused" pushes
// as a non-last pusher instead, so the step takes the row sums itself (the
// cost when the last push's rows are not whole).
//
//   gpu_clip_bench [--tensors=16] [--rows=8192] [--cols=8192] [--steps=5]
//                  [--formats=fp8_current,fp8_delayed]
//
// Prints per format the medians and one JSON line.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "server/gpu_backend/bench_model.h"
#include "server/gpu_backend/daemon_backend.h"
#include "server/gpu_backend/shard_store.h"

ABSL_FLAG(int, tensors, 16, "number of tensors");
ABSL_FLAG(int64_t, rows, 8192, "rows per tensor");
ABSL_FLAG(int64_t, cols, 8192, "cols per tensor");
ABSL_FLAG(std::string, formats, "fp8_current,fp8_delayed",
          "comma-separated formats (both directions), one measurement each");
ABSL_FLAG(int, steps, 5, "measured steps per mode (after one warm-up step each)");

namespace paramd {
namespace {

using gpu_backend::Median;

struct Result {
  std::vector<double> step_ms, push_ms, device_ms, norm_ms;
  double grad_norm = -1;
  float clip = 1;
  int64_t one_pass_steps = 0;
};

enum Mode { kOff = 0, kOn = 1, kOnUnfused = 2 };

// One backend, the modes alternating step by step (SetOptimizer turns
// clipping on and off between steps, as Daemon.SetOptimizer would).
int Measure(Format format, const float* device_grad, Result out[3]) {
  const int n = absl::GetFlag(FLAGS_tensors);
  const int64_t rows = absl::GetFlag(FLAGS_rows), cols = absl::GetFlag(FLAGS_cols);
  ShardBackendOptions options;  // clipping set per step below
  options.optimizer.lr = 1e-3f;
  options.optimizer.weight_decay = 0.01f;
  absl::StatusOr<std::unique_ptr<ShardBackend>> created =
      gpu_backend::CreateBenchBackend(n, rows, cols, format, options.optimizer);
  if (!created.ok()) {
    std::fprintf(stderr, "%s\n", created.status().ToString().c_str());
    return 1;
  }
  ShardBackend& backend = **created;
  for (int i = 0; i < n; ++i) {
    absl::Span<float> m = backend.load_master(i);
    std::fill(m.begin(), m.end(), 0.25f + 0.01f * i);  // the values do not change the cost
  }
  const AllReduceMaxFn identity = [](absl::Span<float>) { return absl::OkStatus(); };
  int64_t version = 0;
  if (!backend.Step(version++, false, identity, true).ok()) return 1;
  gpu_backend::GpuShardStore* store = gpu_backend::DeviceStoreOf(&backend);
  const int steps = 3 * (absl::GetFlag(FLAGS_steps) + 1);  // the first of each mode: warm-up
  for (int s = 0; s < steps; ++s) {
    const int mode = s % 3;
    OptimizerOptions o = options.optimizer;
    o.max_grad_norm = mode == kOff ? 0.0f : 1.0f;
    if (absl::Status set = backend.SetOptimizer(o); !set.ok()) {
      std::fprintf(stderr, "%s\n", set.ToString().c_str());
      return 1;
    }
    absl::Time t0 = absl::Now();
    for (int i = 0; i < n; ++i) {
      absl::Status added = store->AddPiece(i, 0, device_grad, /*bf16=*/false, rows * cols,
                                           /*last_pusher=*/mode != kOnUnfused);
      if (!added.ok()) {
        std::fprintf(stderr, "%s\n", added.ToString().c_str());
        return 1;
      }
    }
    cudaStreamSynchronize(store->stream());
    const double push_ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
    t0 = absl::Now();
    absl::StatusOr<std::shared_ptr<const PublishedVersion>> v =
        backend.Step(version++, true, identity, true);
    const double ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
    if (!v.ok()) {
      std::fprintf(stderr, "%s\n", v.status().ToString().c_str());
      return 1;
    }
    if (s < 3) continue;
    Result& r = out[mode];
    r.push_ms.push_back(push_ms);
    r.step_ms.push_back(ms);
    r.device_ms.push_back(store->last_timings().total_ms);
    r.norm_ms.push_back(store->last_timings().grad_norm_ms);
    r.grad_norm = (*v)->report.grad_norm;
    r.clip = (*v)->report.clip_factor;
  }
  out[kOn].one_pass_steps = store->one_pass_steps();
  return 0;
}

int Run() {
  const int64_t count = absl::GetFlag(FLAGS_rows) * absl::GetFlag(FLAGS_cols);
  // One gradient in device memory, added to every shard (as a device push).
  const std::vector<float> host(static_cast<size_t>(count), 1e-3f);
  void* device_grad = nullptr;
  if (cudaMalloc(&device_grad, count * sizeof(float)) != cudaSuccess ||
      cudaMemcpy(device_grad, host.data(), count * sizeof(float), cudaMemcpyHostToDevice) !=
          cudaSuccess) {
    std::fprintf(stderr, "gradient buffer: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  const double params = static_cast<double>(absl::GetFlag(FLAGS_tensors)) * count;
  const std::vector<std::string> names = absl::StrSplit(absl::GetFlag(FLAGS_formats), ',');
  for (const std::string& name : names) {
    absl::StatusOr<Format> format = ParseFormatName(name);
    if (!format.ok()) {
      std::fprintf(stderr, "%s\n", format.status().ToString().c_str());
      return 2;
    }
    Result r[3];
    if (int rc = Measure(*format, static_cast<float*>(device_grad), r); rc != 0) return rc;
    const Result& off = r[kOff];
    const Result& on = r[kOn];
    const Result& unfused = r[kOnUnfused];
    const double s_off = Median(off.step_ms), s_on = Median(on.step_ms);
    const double s_un = Median(unfused.step_ms);
    const double p_off = Median(off.push_ms), p_on = Median(on.push_ms);
    std::printf("== %.4g parameters, %s both directions, AdamW (%s), one daemon\n", params,
                name.c_str(), on.one_pass_steps > 0 ? "one-pass step" : "two-kernel step");
    std::printf(
        "step: clipping off %.3f ms, on %.3f ms (%+.3f ms, %+.2f%%; the norm %.3f ms), "
        "on with the row sums in the step %.3f ms (%+.2f%%)\n",
        s_off, s_on, s_on - s_off, 100.0 * (s_on - s_off) / s_off, Median(on.norm_ms), s_un,
        100.0 * (s_un - s_off) / s_off);
    std::printf("device step (first launch to done): off %.3f ms, on %.3f ms\n",
                Median(off.device_ms), Median(on.device_ms));
    std::printf(
        "last pusher's device add of every shard: off %.3f ms, on (+ row sums) %.3f ms "
        "(%+.3f ms)\n",
        p_off, p_on, p_on - p_off);
    // What clipping costs a training step: its step and the last push's add.
    const double cost = (s_on + p_on) - (s_off + p_off);
    std::printf("clipping cost: %.2f%% of the step, %.2f%% of push + step (%+.3f ms of %.3f)\n",
                100.0 * (s_on - s_off) / s_off, 100.0 * cost / (s_off + p_off), cost,
                s_off + p_off);
    std::printf("grad norm %.6g, clip factor %.6g\n", on.grad_norm, on.clip);
    std::printf(
        "{\"format\": \"%s\", \"parameters\": %.0f, \"one_pass\": %s, "
        "\"step_off_ms\": %.3f, \"step_on_ms\": %.3f, \"step_on_unfused_ms\": %.3f, "
        "\"norm_ms\": %.3f, \"device_step_off_ms\": %.3f, \"device_step_on_ms\": %.3f, "
        "\"push_off_ms\": %.3f, \"push_on_ms\": %.3f, \"step_cost\": %.4f, "
        "\"push_step_cost\": %.4f}\n",
        name.c_str(), params, on.one_pass_steps > 0 ? "true" : "false", s_off, s_on, s_un,
        Median(on.norm_ms), Median(off.device_ms), Median(on.device_ms), p_off, p_on,
        (s_on - s_off) / s_off, cost / (s_off + p_off));
    std::fflush(stdout);
  }
  cudaFree(device_grad);
  return 0;
}

}  // namespace
}  // namespace paramd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return paramd::Run();
}
