// File: checkpoint/daemon_state.h
//
// The seam between a daemon's compute state and the checkpoint code: what
// a daemon shows the checkpoint service (CheckpointableDaemon, implemented
// by server/ over its ShardSet) and what it gets back on restore
// (RestoredDaemonState, see restore.h). Nothing here knows about gRPC.
//
// Consistency contract: WithState(v, fn) calls fn with the state that
// produced published version v (the FP32 masters and optimizer moments after
// the step to v, the scaling state whose scales quantized v, the optimizer
// step count) and guarantees that no step commits a newer state while fn
// runs. A daemon that is not at v answers NotAtVersion: Aborted when it
// has moved past v (callers asking for "the committed version" retry with
// the new one), FailedPrecondition when it is not there yet or not loaded.
#ifndef PARAMD_CHECKPOINT_DAEMON_STATE_H_
#define PARAMD_CHECKPOINT_DAEMON_STATE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "proto/checkpoint.pb.h"

namespace paramd {
namespace checkpoint {

// One row range a daemon holds. Spans point into the daemon's state and are
// valid only inside WithState's callback.
struct PieceView {
  std::string tensor;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  int64_t cols = 0;
  absl::Span<const float> master;  // (row_end - row_begin) * cols
  // Optimizer moments with the same shape: AdamW "exp_avg", "exp_avg_sq";
  // SGD "momentum". Empty spans (state not allocated yet) are saved as zeros.
  std::vector<std::pair<std::string, absl::Span<const float>>> moments;
};

struct DaemonStateView {
  int64_t version = -1;
  // The model generation of the model this state belongs to (the loaded
  // manifest's model_generation; 0 if none was recorded). A shard written
  // for a checkpoint of another generation's manifest is refused.
  int64_t model_generation = 0;
  std::vector<PieceView> pieces;
  // Per tensor held here: optimizer step count and scaling state.
  std::map<std::string, TensorState> tensor_states;
  // Daemon-wide opaque state (e.g. serialized optimizer options), the same
  // on every daemon; saved as the "daemon" blob, restored as is.
  std::string daemon_blob;
};

// What a directional export reads: the master, or a dequantized published copy.
enum class ExportValuesKind : uint8_t { kMaster = 0, kRowwise = 1, kColumnwise = 2 };

// WithState's refusal of version `wanted` by a daemon at version `at`:
// Aborted if the daemon has moved past it (a retry with the newer committed
// version can succeed), else FailedPrecondition.
inline absl::Status NotAtVersion(int64_t at, int64_t wanted) {
  const std::string message = absl::StrCat("daemon is at version ", at, ", not ", wanted);
  return at > wanted ? absl::AbortedError(message) : absl::FailedPreconditionError(message);
}

class CheckpointableDaemon {
 public:
  virtual ~CheckpointableDaemon() = default;

  // See the file comment. Blocks until the state is available; fn runs on
  // the caller's thread.
  virtual absl::Status WithState(int64_t version,
                                 const std::function<absl::Status(const DaemonStateView&)>& fn) = 0;

  // FP32 rows [row_begin, row_end) of `tensor` at published version
  // `version` into `out`: the master (then `version` must be the current
  // one, as for WithState) or a published copy dequantized (ref::Dequantize)
  // — the values a trainer computed with. NotFound for a tensor or rows this
  // daemon does not hold or a version it no longer keeps.
  virtual absl::Status ReadRows(int64_t version, ExportValuesKind kind, const std::string& tensor,
                                int64_t row_begin, int64_t row_end, absl::Span<float> out) = 0;

  // The rank this daemon holds (-1: none yet, or not known to this
  // implementation). A shard is written only under the writer's own rank.
  virtual int rank() const { return -1; }
};

}  // namespace checkpoint
}  // namespace paramd

#endif  // PARAMD_CHECKPOINT_DAEMON_STATE_H_
