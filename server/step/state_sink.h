// File: server/step/state_sink.h
//
// Where a restore (a checkpoint's or a buddy's snapshot, server/snapshot/)
// writes a daemon's saved state: masters, optimizer moments, step counts and
// per-tensor delayed-scaling state, in the sink's own shard order. ShardSet
// is one (the cpu backend's state, or the gpu backend's host mirror); the
// gpu backend's sink writes straight into device memory, so a restore costs
// one host-to-device copy of the state instead of a mirror built, filled
// and uploaded.
//
// Threading: the daemon's worker, with no step running (the caller's
// contract, as for ShardBackend::host_state()).
#ifndef PARAMD_SERVER_STEP_STATE_SINK_H_
#define PARAMD_SERVER_STEP_STATE_SINK_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/format.h"
#include "server/step/optimizer.h"

namespace paramd {

struct TensorDef;
struct ShardDef;

class ShardStateSink {
 public:
  virtual ~ShardStateSink() = default;

  virtual const std::vector<TensorDef>& tensors() const = 0;
  virtual const std::vector<ShardDef>& shards() const = 0;
  virtual const OptimizerOptions& optimizer() const = 0;

  // The saved run's config (its kind is the sink's: the caller checks).
  virtual absl::Status RestoreOptimizer(const OptimizerOptions& optimizer) = 0;
  // Shard `shard`'s masters, row-major; INVALID_ARGUMENT unless `values`
  // has exactly the shard's element count.
  virtual absl::Status RestoreMaster(int shard, absl::Span<const float> values) = 0;
  // Its optimizer moments (AdamW m and v; SGD: the momentum buffer in `m`),
  // each empty (none saved) or of the shard's element count.
  virtual absl::Status RestoreOptimizerState(int shard, absl::Span<const float> m,
                                             absl::Span<const float> v) = 0;
  virtual absl::Status RestoreDelayedState(int tensor, Direction d, DelayedScalingState state) = 0;
  // The optimizer's and the skipped steps' counts; a negative one is left
  // as it is.
  virtual absl::Status RestoreStepCounts(int64_t optimizer_steps, int64_t skipped_steps) = 0;
};

}  // namespace paramd

#endif  // PARAMD_SERVER_STEP_STATE_SINK_H_
