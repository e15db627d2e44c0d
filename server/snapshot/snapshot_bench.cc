// What an in-memory snapshot costs the cpu backend (docs/BENCHMARKS.md
// "Recovery"): one daemon's shards of --params parameters (AdamW, FP8
// delayed rowwise + MXFP8 columnwise), a step, then a snapshot as the
// daemon takes it (SnapshotKeeper::AfterPublish on the worker) followed at
// once by the next step's BeforeChange: the worst case, where the next step
// is ready before the copy is done. Prints the capture on the worker, the
// next step's wait, their sum (the blocking time), the copy on the snapshot
// thread and a step for comparison.
//
//   bazel run -c opt //server/snapshot:snapshot_bench -- --params=67108864 --runs=3
#include <cstdio>
#include <memory>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "kernels/format.h"
#include "server/backend/shard_backend.h"
#include "server/snapshot/snapshot.h"

ABSL_FLAG(int64_t, params, int64_t{1} << 26, "parameters of the daemon's shards");
ABSL_FLAG(int, runs, 3, "snapshots taken");

namespace paramd {
namespace {

int Main() {
  const int64_t cols = 4096;
  const int64_t rows_per_tensor = 4096;
  const int64_t tensors =
      std::max<int64_t>(1, absl::GetFlag(FLAGS_params) / (cols * rows_per_tensor));
  std::vector<TensorDef> defs;
  std::vector<ShardDef> shards;
  for (int64_t t = 0; t < tensors; ++t) {
    TensorDef d;
    d.name = "layer" + std::to_string(t) + ".weight";
    d.rows = rows_per_tensor;
    d.cols = cols;
    d.spec.rowwise = DefaultQuantSpec(Format::kFp8Delayed);
    d.spec.columnwise = DefaultQuantSpec(Format::kMxfp8);
    defs.push_back(d);
    shards.push_back({static_cast<int>(t), 0, rows_per_tensor});
  }
  OptimizerOptions adam;
  auto backend = CreateShardBackend(DaemonBackend::kCpu, defs, shards, {adam, absl::Seconds(600)});
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
    return 1;
  }
  ShardBackend& b = **backend;
  const AllReduceMaxFn alone = [](absl::Span<float>) { return absl::OkStatus(); };
  SnapshotOptions options;
  options.every_steps = 1;
  SnapshotKeeper keeper(options);
  keeper.SetModel(0, {"unused"}, ShardLayoutHash(b.tensors(), b.shards()), 1);
  for (size_t i = 0; i < b.shards().size(); ++i) {
    absl::Span<float> m = b.load_master(static_cast<int>(i));
    for (size_t k = 0; k < m.size(); ++k) m[k] = 0.001f * static_cast<float>(k % 997);
  }
  if (!b.Step(0, false, alone, true).ok()) return 1;
  std::printf("params %lld (%lld tensors of %lld x %lld), state %.2f GiB\n",
              static_cast<long long>(tensors * rows_per_tensor * cols),
              static_cast<long long>(tensors), static_cast<long long>(rows_per_tensor),
              static_cast<long long>(cols), tensors * rows_per_tensor * cols * 12.0 / (1 << 30));
  for (int run = 0; run < absl::GetFlag(FLAGS_runs); ++run) {
    const absl::Time s0 = absl::Now();
    auto v = b.Step(run + 1, true, alone, true);
    const double step = absl::ToDoubleSeconds(absl::Now() - s0);
    if (!v.ok()) return 1;
    const absl::Time c0 = absl::Now();
    keeper.AfterPublish(b, **v);
    const double capture = absl::ToDoubleSeconds(absl::Now() - c0);
    const absl::Time w0 = absl::Now();
    keeper.BeforeChange();  // the next step, ready at once
    const double wait = absl::ToDoubleSeconds(absl::Now() - w0);
    rpc::DaemonStats stats;
    keeper.FillStats(&stats);
    std::printf(
        "run %d: step %.3f s; snapshot capture %.4f s + next step's wait %.3f s = "
        "blocking %.3f s; copy %.3f s (%.2f GB/s)\n",
        run, step, capture, wait, stats.snapshot_block_seconds(), stats.snapshot_copy_seconds(),
        stats.snapshot_bytes() / 1e9 / std::max(1e-9, stats.snapshot_copy_seconds()));
  }
  return 0;
}

}  // namespace
}  // namespace paramd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return paramd::Main();
}
