// File: server/gpu_backend/bench_model.h
//
// BENCHMARKS ONLY (gpu_backend_step_bench, gpu_clip_bench): the model they
// step, `tensors` whole tensors "w<i>" of [rows, cols] with `format` in both
// directions, on one gpu daemon backend (a single daemon: no all-reduce),
// masters zero until the caller fills load_master; and the median of a
// sample. Header only.
#ifndef PARAMD_SERVER_GPU_BACKEND_BENCH_MODEL_H_
#define PARAMD_SERVER_GPU_BACKEND_BENCH_MODEL_H_

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "server/gpu_backend/daemon_backend.h"

namespace paramd {
namespace gpu_backend {

inline absl::StatusOr<std::unique_ptr<ShardBackend>> CreateBenchBackend(
    int tensors, int64_t rows, int64_t cols, Format format, const OptimizerOptions& optimizer) {
  std::vector<TensorDef> defs;
  std::vector<ShardDef> shards;
  for (int i = 0; i < tensors; ++i) {
    TensorDef t;
    t.name = absl::StrCat("w", i);
    t.rows = rows;
    t.cols = cols;
    t.spec.rowwise = DefaultQuantSpec(format);
    t.spec.columnwise = DefaultQuantSpec(format);
    defs.push_back(t);
    shards.push_back({i, 0, rows});
  }
  ShardBackendOptions options;
  options.optimizer = optimizer;
  absl::StatusOr<std::unique_ptr<ShardBackend>> backend =
      CreateGpuShardBackend(std::move(defs), std::move(shards), options);
  if (backend.ok()) (*backend)->set_data_plane(nullptr, absl::Seconds(60));  // one daemon
  return backend;
}

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace gpu_backend
}  // namespace paramd

#endif  // PARAMD_SERVER_GPU_BACKEND_BENCH_MODEL_H_
