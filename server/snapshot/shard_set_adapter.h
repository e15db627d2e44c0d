// File: server/snapshot/shard_set_adapter.h
//
// The checkpoint view of the CPU daemon's state (server/step/shard_set.h): what
// server/ needs to implement CheckpointableDaemon (checkpoint/daemon_state.h) in a few
// lines. Call these on the daemon's worker thread (between steps), with
// `published` the version the ShardSet's state produced.
//
//   WithState(v, fn):  post to the worker; there, if latest->version != v
//                      return FailedPrecondition, else
//                      return fn(MakeDaemonStateView(*shards, *latest)).
//   ReadRows(...):     ReadPublishedRows(*shards, *version_v, ...).
//
// Restore needs setters ShardSet does not have yet (optimizer state,
// delayed-scaling state, step count): see docs/CHECKPOINTS.md.
#ifndef PARAMD_SERVER_SNAPSHOT_SHARD_SET_ADAPTER_H_
#define PARAMD_SERVER_SNAPSHOT_SHARD_SET_ADAPTER_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "checkpoint/daemon_state.h"
#include "server/step/optimizer.h"
#include "server/step/shard_set.h"

namespace paramd {
namespace checkpoint {

// Section names of the optimizer moments: AdamW {"exp_avg", "exp_avg_sq"}
// (OptimizerState m, v), SGD {"momentum"} (m).
std::vector<std::string> MomentNames(OptimizerKind kind);

// "kind=adamw lr=0.001 beta1=0.9 ..." (exact float bits in hex): the daemon
// blob, so that a restore can check the optimizer it resumes with.
std::string EncodeOptimizerOptions(const OptimizerOptions& options);
absl::Status DecodeOptimizerOptions(const std::string& text, OptimizerOptions* options);

// The state of `set` that produced `published` (spans point into `set`).
// Per held tensor the TensorState records the step count, and per direction
// the delayed-scaling state (scale, amax history) plus the scale and amax
// `published` was quantized with.
DaemonStateView MakeDaemonStateView(const ShardSet& set, const PublishedVersion& published);

// FP32 rows [row_begin, row_end) of `tensor`: the master of `set`, or the
// dequantized (ref::Dequantize) published copy of one direction of
// `published`. NotFound if no single shard here holds those rows or the
// direction is not published.
absl::Status ReadPublishedRows(const ShardSet& set, const PublishedVersion& published,
                               ExportValuesKind kind, const std::string& tensor, int64_t row_begin,
                               int64_t row_end, absl::Span<float> out);

}  // namespace checkpoint
}  // namespace paramd

#endif  // PARAMD_SERVER_SNAPSHOT_SHARD_SET_ADAPTER_H_
