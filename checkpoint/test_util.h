// File: checkpoint/test_util.h
//
// Test-only: a synthetic model (deterministic FP32 values, special values
// included), a simple row-range plan, and a writer that checkpoints the model
// as `world` daemons and a coordinator would. Used by the store tests, the
// crash tests and //checkpoint:bench.
#ifndef PARAMD_CHECKPOINT_TEST_UTIL_H_
#define PARAMD_CHECKPOINT_TEST_UTIL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "checkpoint/store.h"
#include "proto/checkpoint.pb.h"

namespace paramd {
namespace checkpoint {
namespace testing {

// A fresh directory under $TEST_TMPDIR (or /tmp), named `prefix`.XXXXXX.
std::string MakeTestDir(const std::string& prefix);

// The optimizer moments the fake model saves beside its masters.
inline const std::vector<std::string>& FakeMomentNames() {
  static const auto* names = new std::vector<std::string>{"exp_avg", "exp_avg_sq"};
  return *names;
}

// Tensors named "layer<i>.weight" etc. with the given [rows, cols].
std::vector<TensorInfo> FakeTensors(const std::vector<std::pair<int64_t, int64_t>>& shapes);

// Value of element (row, col) of section `section` of tensor `tensor`, for
// model `seed`. Deterministic; includes NaN with payloads, +-Inf, -0 and
// subnormals so that byte comparisons catch any conversion.
float FakeValue(uint64_t seed, const std::string& tensor, const std::string& section, int64_t row,
                int64_t col);
// Rows [row_begin, row_end) of it.
std::vector<float> FakeRows(uint64_t seed, const TensorInfo& tensor, const std::string& section,
                            int64_t row_begin, int64_t row_end);
// A TensorState with an amax history that depends on (seed, tensor).
TensorState FakeState(uint64_t seed, const std::string& tensor);

// Row ranges per daemon: each tensor cut into `world` near-equal row ranges
// (rows < world: whole, on daemon index % world). result[rank] = pieces.
std::vector<std::vector<PieceInfo>> SimplePlan(const std::vector<TensorInfo>& tensors, int world);

// Writes version `version` of model `seed` as `world` daemons (one after the
// other, in this process) and commits the manifest.
absl::Status WriteFakeCheckpoint(const CheckpointStore& store, uint64_t version, uint64_t seed,
                                 const std::vector<TensorInfo>& tensors, int world);

// The same with an explicit plan: plan[rank] = the pieces daemon `rank` holds.
using PiecePlan = std::vector<std::vector<PieceInfo>>;
absl::Status WriteFakeCheckpoint(const CheckpointStore& store, uint64_t version, uint64_t seed,
                                 const std::vector<TensorInfo>& tensors, const PiecePlan& plan);

// Checks that `version` in `store` holds model `seed` exactly (every byte of
// every section, restored through a plan for `restore_world` daemons, or
// through `plan`).
absl::Status CheckFakeCheckpoint(const CheckpointStore& store, uint64_t version, uint64_t seed,
                                 const std::vector<TensorInfo>& tensors, int restore_world);
absl::Status CheckFakeCheckpoint(const CheckpointStore& store, uint64_t version, uint64_t seed,
                                 const std::vector<TensorInfo>& tensors, const PiecePlan& plan);

// Writes `manifest` to `path` in the MANIFEST format (magic, length,
// XXH3-64, payload) without any of CommitManifest's checks: a crafted
// manifest, for tests of what readers refuse.
absl::Status WriteManifestUnchecked(const std::string& path, const Manifest& manifest);

}  // namespace testing
}  // namespace checkpoint
}  // namespace paramd

#endif  // PARAMD_CHECKPOINT_TEST_UTIL_H_
