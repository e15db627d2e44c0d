// File: server/coordinator/model_generation.h
//
// Model generations (docs/ARCHITECTURE.md "Model generations"): every Load
// the coordinator accepts (a safetensors file, pushed weights or a
// checkpoint restore, forced or not) starts a new generation, recorded in
// the manifest (rpc::Manifest.model_generation), in every snapshot and
// checkpoint taken of it and in the coordinator's state file. A recovery
// goes back only to state of the generation it serves: this file decides
// which checkpoints that is and says in words why the others are refused.
//
// Threading: free functions; the ones reading a store block on the file
// system (call them from the coordinator's recovery thread).
#ifndef PARAMD_SERVER_COORDINATOR_MODEL_GENERATION_H_
#define PARAMD_SERVER_COORDINATOR_MODEL_GENERATION_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/checkpoint.pb.h"
#include "proto/paramd.pb.h"

namespace paramd {

// A complete checkpoint as a recovery sees it.
struct CheckpointOfModel {
  std::string path;  // the store, as the operator or the Load named it
  int64_t version = -1;
  int64_t generation = 0;  // 0: not recorded (written before generations)
};

// The model generation checkpoint metadata records (checkpoint::
// kModelGenerationKey); 0 when it records none. DataLoss when the value is
// not a number.
absl::StatusOr<int64_t> CheckpointGeneration(const checkpoint::Manifest& manifest);

// The complete checkpoints a recovery of the model of `served` (the
// coordinator's manifest) may look at: every one of the store `root` ("":
// none) and the one `served` was restored from (Manifest.restored_from),
// wherever it is. A store or checkpoint that cannot be read is left out.
std::vector<CheckpointOfModel> CheckpointsForRecovery(const std::string& root,
                                                      const rpc::Manifest& served);

// Whether a recovery of `served` may restore `checkpoint`: one of the same
// generation (one recording none only while the served model records none
// either: a model loaded before generations were recorded), or exactly the
// checkpoint (store, version) the served generation was restored from.
bool MayRecoverFrom(const CheckpointOfModel& checkpoint, const rpc::Manifest& served);

struct RecoveryCheckpointChoice {
  std::optional<CheckpointOfModel> chosen;  // the newest one MayRecoverFrom
  // Why the newest checkpoint newer than `chosen` (all of them when none
  // is chosen) was refused, e.g. "checkpoint 7 in DIR belongs to another
  // model (generation 1; the cluster serves generation 2, loaded from
  // ...)"; "" when none was.
  std::string refused;
};
RecoveryCheckpointChoice ChooseRecoveryCheckpoint(const std::vector<CheckpointOfModel>& seen,
                                                  const rpc::Manifest& served);

// "generation 2, loaded from /m/b.safetensors": what `served` is, for
// messages.
std::string DescribeGeneration(const rpc::Manifest& served);

}  // namespace paramd

#endif  // PARAMD_SERVER_COORDINATOR_MODEL_GENERATION_H_
