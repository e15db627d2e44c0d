// GPU only. What a gpu daemon's Step costs on a large model now that
// publishing copies nothing to the host, and what the (lazy) host copy of a
// version costs when a host Fetch asks for it — the copy every Step used to
// make. One daemon (no all-reduce), the gpu ShardBackend driven directly:
//
//   gpu_backend_step_bench [--tensors=16] [--rows=8192] [--cols=8192]
//                          [--format=mxfp8] [--steps=5]
//
// Prints one line per measurement and a JSON line at the end.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/gpu_backend/bench_model.h"
#include "server/gpu_backend/daemon_backend.h"

ABSL_FLAG(int, tensors, 16, "number of tensors");
ABSL_FLAG(int64_t, rows, 8192, "rows per tensor");
ABSL_FLAG(int64_t, cols, 8192, "cols per tensor");
ABSL_FLAG(std::string, format, "mxfp8", "rowwise and columnwise format (kernels/format.h names)");
ABSL_FLAG(int, steps, 5, "measured steps of each kind");

namespace paramd {
namespace {

using gpu_backend::Median;

int Run() {
  absl::StatusOr<Format> format = ParseFormatName(absl::GetFlag(FLAGS_format));
  if (!format.ok()) {
    std::fprintf(stderr, "%s\n", format.status().ToString().c_str());
    return 2;
  }
  const int n = absl::GetFlag(FLAGS_tensors);
  const int64_t rows = absl::GetFlag(FLAGS_rows), cols = absl::GetFlag(FLAGS_cols);
  OptimizerOptions adamw;
  adamw.lr = 1e-3f;
  adamw.weight_decay = 0.01f;
  absl::StatusOr<std::unique_ptr<ShardBackend>> created =
      gpu_backend::CreateBenchBackend(n, rows, cols, *format, adamw);
  if (!created.ok()) {
    std::fprintf(stderr, "%s\n", created.status().ToString().c_str());
    return 1;
  }
  ShardBackend& backend = **created;
  for (int i = 0; i < n; ++i) {
    absl::Span<float> m = backend.load_master(i);
    for (size_t k = 0; k < m.size(); ++k)
      m[k] = static_cast<float>((k * 2654435761u) % 2001) * 1e-3f - 1.0f;
  }
  const AllReduceMaxFn identity = [](absl::Span<float>) { return absl::OkStatus(); };
  int64_t version = 0;
  // host_grads: the pushes were summed into gradient() (uploaded by the
  // step); else they went through AccumulateGradient (device sum).
  auto step = [&](bool optimizer, bool host_grads = true) -> double {
    if (optimizer && host_grads) {
      for (int i = 0; i < n; ++i) {
        absl::Span<float> g = backend.gradient(i);
        std::fill(g.begin(), g.end(), 1e-3f);
      }
    }
    const absl::Time t0 = absl::Now();
    absl::StatusOr<std::shared_ptr<const PublishedVersion>> v =
        backend.Step(version, optimizer, identity, true);
    const double ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
    if (!v.ok()) {
      std::fprintf(stderr, "step %lld: %s\n", static_cast<long long>(version),
                   v.status().ToString().c_str());
      std::exit(1);
    }
    ++version;
    return ms;
  };
  const double load_ms = step(false);  // uploads the masters
  std::vector<double> republish, optimizer;
  for (int s = 0; s < absl::GetFlag(FLAGS_steps); ++s) republish.push_back(step(false));
  for (int s = 0; s < absl::GetFlag(FLAGS_steps); ++s) optimizer.push_back(step(true));
  // One FP32 push of every shard, summed on the device, then the step.
  std::vector<double> push_ms, device_optimizer;
  {
    const std::vector<float> push(static_cast<size_t>(rows * cols), 1e-3f);
    for (int s = 0; s < absl::GetFlag(FLAGS_steps); ++s) {
      const absl::Time t0 = absl::Now();
      for (int i = 0; i < n; ++i) {
        absl::Status a = backend.AccumulateGradient(i, 0, push, /*last_pusher=*/i + 1 == n);
        if (!a.ok()) {
          std::fprintf(stderr, "%s\n", a.ToString().c_str());
          return 1;
        }
      }
      push_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
      device_optimizer.push_back(step(true, false));
    }
  }
  // The lazy host copy of a version (what every Step used to do): the
  // first into fresh host memory, later ones into the memory of the copy
  // retired two versions before (nobody holds it any more).
  HostBytesFn bytes = backend.host_bytes();
  std::vector<double> copy_ms;
  double again_ms = 0;
  int64_t published = 0;
  for (int c = 0; c < 4; ++c) {
    absl::StatusOr<std::shared_ptr<const PublishedVersion>> meta =
        backend.Step(version++, false, identity, true);
    if (!meta.ok()) return 1;
    absl::Time t0 = absl::Now();
    absl::StatusOr<std::shared_ptr<const PublishedVersion>> host = bytes(*meta);
    copy_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
    t0 = absl::Now();
    absl::StatusOr<std::shared_ptr<const PublishedVersion>> again = bytes(*meta);
    again_ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
    if (!host.ok() || !again.ok()) return 1;
    published = 0;
    for (const PublishedPiece& p : (*host)->pieces)
      published += p.q.data.size() + p.q.scales.size();
  }
  const double copy_cold = copy_ms[0], copy_warm = copy_ms.back();
  const double params = static_cast<double>(n) * rows * cols;
  std::printf("model: %d x [%lld, %lld] = %.3g parameters, %s both directions\n", n,
              static_cast<long long>(rows), static_cast<long long>(cols), params,
              FormatName(*format).data());
  std::printf("first step (uploads masters): %.1f ms\n", load_ms);
  std::printf("republish step (amax + quantize, no host copy): median %.1f ms\n",
              Median(republish));
  std::printf("optimizer step (gradient upload + AdamW + quantize): median %.1f ms\n",
              Median(optimizer));
  std::printf(
      "one FP32 push of every shard summed on the device: median %.1f ms; then the "
      "optimizer step (no accumulator upload): median %.1f ms\n",
      Median(push_ms), Median(device_optimizer));
  std::printf(
      "host copy of one version on its first host fetch (%.3f GB): %.1f ms into fresh "
      "memory (%.1f GB/s), %.1f ms into a retired copy's memory (%.1f GB/s); again "
      "(cached): %.3f ms\n",
      published / 1e9, copy_cold, published / 1e6 / copy_cold, copy_warm,
      published / 1e6 / copy_warm, again_ms);
  std::printf(
      "{\"parameters\": %.0f, \"format\": \"%s\", \"republish_ms\": %.2f, "
      "\"optimizer_step_ms\": %.2f, \"device_push_ms\": %.2f, "
      "\"optimizer_step_after_device_push_ms\": %.2f, \"host_copy_cold_ms\": %.2f, "
      "\"host_copy_warm_ms\": %.2f, \"published_bytes\": %lld}\n",
      params, FormatName(*format).data(), Median(republish), Median(optimizer), Median(push_ms),
      Median(device_optimizer), copy_cold, copy_warm, static_cast<long long>(published));
  return 0;
}

}  // namespace
}  // namespace paramd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return paramd::Run();
}
