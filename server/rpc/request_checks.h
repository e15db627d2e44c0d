// File: server/rpc/request_checks.h
//
// Validation of untrusted RPC requests to the coordinator and the daemons,
// as pure functions of the request and the limits (no server state), so
// that every handler refuses the same things the same way and the checks
// can be fuzzed alone (fuzz/request_checks_fuzz.cc). A handler calls these
// first; on error it answers with the status and changes nothing.
//
// Each limit is a hybrid-paramd flag (server/main.cc); docs/SECURITY.md
// ("Input limits and validation") lists them with their defaults.
//
// Thread-safe, pure functions.
#ifndef PARAMD_SERVER_RPC_REQUEST_CHECKS_H_
#define PARAMD_SERVER_RPC_REQUEST_CHECKS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/names.h"
#include "proto/paramd.pb.h"

namespace paramd {

struct RequestLimits {
  // --max_tensor_name_bytes: common/names.h.
  int64_t max_tensor_name_bytes = kDefaultMaxTensorNameBytes;
  // --max_tensors: tensors per model (RESOURCE_EXHAUSTED above it).
  int64_t max_tensors = 100000;
  // --max_tensor_dims: dimensions of one tensor's shape.
  int64_t max_tensor_dims = 8;
  // --min_chunk_bytes: the smallest FetchRequest.max_chunk_bytes accepted
  // (0 still means the server's default).
  int64_t min_chunk_bytes = 4096;
  // Files a request may name (a Load's safetensors or checkpoint path,
  // LoadShards' paths) are read only from below one of these
  // (common/file_util.h ResolveBelow; --model_root, plus --checkpoint_dir).
  // Empty: no confinement (--model_root unset).
  std::vector<std::string> file_roots;
  // --max_pushers_per_version: distinct pushers one daemon counts for one
  // version (matters with --expected_pushers=0, which sets no bound).
  int64_t max_pushers_per_version = 4096;
  // --max_parked_fetches_per_client: Fetch calls of one client address
  // waiting on one daemon for a version not yet published.
  int64_t max_parked_fetches_per_client = 256;
  // --memory_budget_bytes: what one daemon's shards may need (estimated by
  // EstimateDaemonBytes); 0 = no check.
  int64_t memory_budget_bytes = 0;
  // --max_frozen_bytes: the data of a model's frozen buffers in all (the
  // coordinator keeps them in memory and in every checkpoint manifest).
  int64_t max_frozen_bytes = 16 << 20;
};

// The host bytes daemon `rank` needs for its shards of `manifest`, by a
// conservative estimate per parameter: FP32 master, gradient accumulator
// and optimizer state (16 bytes, AdamW), plus two published versions of
// each used direction (4 bytes FP32, 2 BF16, 1 FP8/MXFP8 and blockwise,
// 1 NVFP4, scales included). Saturates instead of overflowing.
int64_t EstimateDaemonBytes(const rpc::Manifest& manifest, int rank);

// ResourceExhausted if some daemon of `manifest` (each rank that owns a
// piece) would need more than limits.memory_budget_bytes.
absl::Status CheckMemoryBudget(const rpc::Manifest& manifest, const RequestLimits& limits);

// Declared tensors (LoadRequest.tensors, or the header of the safetensors
// file a Load names): count, names (unique, CheckTensorName), shapes (0 to
// max_tensor_dims dimensions, each >= 1, bytes without int64 overflow). InvalidArgument, or
// ResourceExhausted for too many tensors.
absl::Status CheckTensorDecls(const std::vector<rpc::TensorDecl>& tensors,
                              const RequestLimits& limits);

// The file paths of a Load or LoadShards (safetensors_path,
// checkpoint_path; empty ones pass): CheckClientPath (common/names.h), at
// most 4096 bytes and no control character. Checked before a path is
// resolved, opened, stored or logged.
absl::Status CheckSourcePaths(absl::string_view safetensors_path,
                              absl::string_view checkpoint_path);

// Frozen buffers (LoadRequest.frozen, or a safetensors file's
// non-floating tensors; proto/frozen.proto): names by the name rule,
// unique, none of them one of `tensors`; a safetensors dtype; 0 to
// max_tensor_dims dimensions, each >= 0; data of exactly the shape's
// bytes, the bytes of all at most max_frozen_bytes (RESOURCE_EXHAUSTED
// naming --max_frozen_bytes). `check_data` false checks the declared
// sizes only (before the data is read).
absl::Status CheckFrozenTensors(const google::protobuf::RepeatedPtrField<FrozenTensor>& frozen,
                                const std::vector<rpc::TensorDecl>& tensors,
                                const RequestLimits& limits, bool check_data = true);

// The bytes of one frozen buffer's shape (InvalidArgument for a bad dtype
// or a shape that overflows).
absl::StatusOr<int64_t> FrozenTensorBytes(const FrozenTensor& frozen);

// Coordinator.Load before anything is read: exactly one source, declared
// tensors through CheckTensorDecls, checkpoint_version >= -1, frozen
// buffers (CheckFrozenTensors) only beside declared tensors.
absl::Status CheckLoadRequest(const rpc::LoadRequest& request, const RequestLimits& limits);

// Daemon.LoadShards: a manifest with at least one tensor, names and counts
// as above, rows/cols >= 1, pieces inside their tensors, daemon_rank >= 0,
// expected_pushers >= 0, at most one source (CheckSourcePaths). An empty or invalid manifest
// is InvalidArgument (and the loaded model stays as it was).
absl::Status CheckLoadShardsRequest(const rpc::LoadShardsRequest& request,
                                    const RequestLimits& limits);

// Daemon.Fetch: version >= -1 (-1 = latest), max_chunk_bytes 0 or >=
// min_chunk_bytes, directions known.
absl::Status CheckFetchRequest(const rpc::FetchRequest& request, const RequestLimits& limits);

// Daemon.Step: version >= 0 (the published version to step from).
absl::Status CheckDaemonStepRequest(const rpc::DaemonStepRequest& request);

}  // namespace paramd

#endif  // PARAMD_SERVER_RPC_REQUEST_CHECKS_H_
