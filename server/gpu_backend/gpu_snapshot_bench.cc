// GPU only. What an in-memory snapshot (server/snapshot/snapshot.h) costs the step of
// one gpu daemon backend, and what restoring from it costs, at 1.07 B
// parameters by default (16 x [8192, 8192], AdamW, FP8 current both ways):
//
//   gpu_snapshot_bench [--tensors=16] [--rows=8192] [--cols=8192]
//                      [--every=4] [--rounds=2] [--restore=true]
//   PARAMD_GPU_SNAPSHOT_SPARE=0 gpu_snapshot_bench ...   (live-buffer capture)
//
// Each round: every-1 plain optimizer steps, the snapshot step, its capture
// (SnapshotKeeper::AfterPublish, on this thread as on the daemon's
// worker), the next step (BeforeStep, then Step: with the device spare it
// waits for the spare's copy on the device), then the rest of the copy to
// the host. The step's block is capture + wait before the next step + how
// much longer that step took than the median plain step. Steps push
// nothing (zero accumulators: the same device work as a pushed step).
// Prints one line per measurement and a JSON line at the end.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/gpu_backend/bench_model.h"
#include "server/gpu_backend/daemon_backend.h"
#include "server/snapshot/snapshot.h"

ABSL_FLAG(int, tensors, 16, "number of tensors");
ABSL_FLAG(int64_t, rows, 8192, "rows per tensor");
ABSL_FLAG(int64_t, cols, 8192, "cols per tensor");
ABSL_FLAG(int, every, 4, "a snapshot every N steps");
ABSL_FLAG(int, rounds, 2, "snapshots measured");
ABSL_FLAG(bool, restore, true,
          "also time a restore from the last snapshot (the daemon's path: straight to the device)");
ABSL_FLAG(bool, restore_mirror, false,
          "then also time the same restore through the host mirror (host_state()), for comparison");

namespace paramd {
namespace {

using gpu_backend::Median;

double Ms(absl::Time start) { return absl::ToDoubleMilliseconds(absl::Now() - start); }

int Run() {
  const int n = absl::GetFlag(FLAGS_tensors);
  const int64_t rows = absl::GetFlag(FLAGS_rows), cols = absl::GetFlag(FLAGS_cols);
  const int every = std::max(1, absl::GetFlag(FLAGS_every));
  OptimizerOptions adamw;
  adamw.lr = 1e-3f;
  adamw.weight_decay = 0.01f;
  absl::StatusOr<std::unique_ptr<ShardBackend>> created =
      gpu_backend::CreateBenchBackend(n, rows, cols, Format::kFp8Current, adamw);
  if (!created.ok()) {
    std::fprintf(stderr, "%s\n", created.status().ToString().c_str());
    return 1;
  }
  ShardBackend& backend = **created;
  for (int i = 0; i < n; ++i) {
    absl::Span<float> m = backend.load_master(i);
    for (size_t k = 0; k < m.size(); ++k) {
      m[k] = static_cast<float>((k * 2654435761u) % 2001) * 1e-3f - 1.0f;
    }
  }
  const AllReduceMaxFn identity = [](absl::Span<float>) { return absl::OkStatus(); };
  int64_t version = 0;
  std::shared_ptr<const PublishedVersion> last;
  auto step = [&](bool optimizer) -> double {
    const absl::Time start = absl::Now();
    auto p = backend.Step(version + 1, optimizer, identity, true);
    if (!p.ok()) {
      std::fprintf(stderr, "step: %s\n", p.status().ToString().c_str());
      std::exit(1);
    }
    ++version;
    last = *p;
    return Ms(start);
  };
  const int64_t params = backend.memory().parameters;
  std::printf("model: %d x [%lld, %lld] = %lld parameters, AdamW, FP8 current\n", n,
              static_cast<long long>(rows), static_cast<long long>(cols),
              static_cast<long long>(params));
  step(false);                             // version 1 (uploads the masters)
  for (int i = 0; i < 2; ++i) step(true);  // warm-up (sizes the moments)

  SnapshotOptions options;
  options.every_steps = every;
  SnapshotKeeper keeper(options);
  keeper.SetModel(0, {"127.0.0.1:1"}, ShardLayoutHash(backend.tensors(), backend.shards()),
                  /*model_generation=*/1);

  std::vector<double> plain, capture, wait_before, after, rest;
  for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
    while ((version + 1) % every != 0) {
      keeper.BeforeStep();
      plain.push_back(step(true));
    }
    keeper.BeforeStep();
    plain.push_back(step(true));  // the snapshot's version
    absl::Time t = absl::Now();
    keeper.AfterPublish(backend, *last);
    capture.push_back(Ms(t));
    t = absl::Now();
    keeper.BeforeStep();
    wait_before.push_back(Ms(t));
    after.push_back(step(true));
    t = absl::Now();
    keeper.BeforeChange();  // the rest of the copy
    rest.push_back(Ms(t));
  }
  rpc::DaemonStats stats;
  keeper.FillStats(&stats);
  const double median = Median(plain);
  double worst_block = 0;
  for (size_t r = 0; r < capture.size(); ++r) {
    const double block = capture[r] + wait_before[r] + std::max(0.0, after[r] - median);
    worst_block = std::max(worst_block, block);
    std::printf(
        "snapshot %zu: capture %.3f ms, wait before the next step %.3f ms, that step "
        "%.2f ms (median %.2f), copy left after it %.0f ms\n",
        r, capture[r], wait_before[r], after[r], median, rest[r]);
  }
  const BackendMemory memory = backend.memory();
  std::printf(
      "capture: %s; copy to the host %.3f s (%lld MiB); worst block of the step %.3f ms; "
      "device %.2f B/param with the spare\n",
      stats.snapshot_capture().c_str(), stats.snapshot_copy_seconds(),
      static_cast<long long>(stats.snapshot_bytes() >> 20), worst_block,
      memory.device_bytes_per_parameter());

  double host_state_ms = 0, restore_ms = 0, republish_ms = 0;
  double mirror_ms = 0, into_mirror_ms = 0, mirror_republish_ms = 0;
  if (absl::GetFlag(FLAGS_restore)) {
    std::shared_ptr<const DaemonSnapshot> snap = keeper.Find(0, stats.snapshot_version(),
                                                             /*model_generation=*/1);
    if (snap == nullptr) {
      std::fprintf(stderr, "no snapshot held\n");
      return 1;
    }
    // `sink` = null: through the host mirror.
    auto restore = [&](ShardStateSink* sink, double* prepare, double* into, double* republish) {
      absl::Time t = absl::Now();
      if (sink == nullptr) sink = backend.host_state();
      *prepare = Ms(t);
      if (sink == nullptr) return false;
      t = absl::Now();
      auto delayed = RestoreSnapshot(*snap, *sink);
      *into = Ms(t);
      if (!delayed.ok()) {
        std::fprintf(stderr, "restore: %s\n", delayed.status().ToString().c_str());
        return false;
      }
      t = absl::Now();
      auto p = backend.Step(snap->header.version(), false, identity, false);
      absl::Status applied = ApplyDelayedStates(*delayed, *backend.state_sink());
      *republish = Ms(t);
      if (!p.ok() || !applied.ok()) {
        std::fprintf(stderr, "republish: %s %s\n", p.status().ToString().c_str(),
                     applied.ToString().c_str());
        return false;
      }
      return true;
    };
    if (!restore(backend.state_sink(), &host_state_ms, &restore_ms, &republish_ms)) return 1;
    std::printf("restore from the snapshot, straight to the device: %.0f ms, republish %.0f ms\n",
                restore_ms, republish_ms);
    if (absl::GetFlag(FLAGS_restore_mirror)) {
      if (!restore(nullptr, &mirror_ms, &into_mirror_ms, &mirror_republish_ms)) return 1;
      std::printf(
          "the same through the host mirror: mirror %.0f ms, into it %.0f ms, upload + "
          "republish %.0f ms\n",
          mirror_ms, into_mirror_ms, mirror_republish_ms);
    }
  }
  std::printf(
      "{\"parameters\": %lld, \"capture\": \"%s\", \"step_ms\": %.3f, \"worst_block_ms\": %.3f, "
      "\"capture_ms\": %.3f, \"copy_s\": %.3f, \"device_bytes_per_param\": %.2f, "
      "\"restore_ms\": %.0f, \"republish_ms\": %.0f, \"mirror_restore_ms\": %.0f}\n",
      static_cast<long long>(params), stats.snapshot_capture().c_str(), median, worst_block,
      Median(capture), stats.snapshot_copy_seconds(), memory.device_bytes_per_parameter(),
      restore_ms, republish_ms, mirror_ms + into_mirror_ms + mirror_republish_ms);
  return 0;
}

}  // namespace
}  // namespace paramd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return paramd::Run();
}
