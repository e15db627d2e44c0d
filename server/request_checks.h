// File: server/request_checks.h
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
#ifndef PARAMD_SERVER_REQUEST_CHECKS_H_
#define PARAMD_SERVER_REQUEST_CHECKS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
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
};

// Declared tensors (LoadRequest.tensors, or the header of the safetensors
// file a Load names): count, names (unique, CheckTensorName), shapes (0 to
// max_tensor_dims dimensions, each >= 1, bytes without int64 overflow). InvalidArgument, or ResourceExhausted for too many tensors.
absl::Status CheckTensorDecls(const std::vector<rpc::TensorDecl>& tensors,
                              const RequestLimits& limits);

// Coordinator.Load before anything is read: exactly one source, declared
// tensors through CheckTensorDecls, checkpoint_version >= -1.
absl::Status CheckLoadRequest(const rpc::LoadRequest& request, const RequestLimits& limits);

// Daemon.LoadShards: a manifest with at least one tensor, names and counts
// as above, rows/cols >= 1, pieces inside their tensors, daemon_rank >= 0,
// expected_pushers >= 0, at most one source. An empty or invalid manifest
// is InvalidArgument (and the loaded model stays as it was).
absl::Status CheckLoadShardsRequest(const rpc::LoadShardsRequest& request,
                                    const RequestLimits& limits);

// Daemon.Fetch: version >= -1 (-1 = latest), max_chunk_bytes 0 or >=
// min_chunk_bytes, directions known.
absl::Status CheckFetchRequest(const rpc::FetchRequest& request, const RequestLimits& limits);

// Daemon.Step: version >= 0 (the published version to step from).
absl::Status CheckDaemonStepRequest(const rpc::DaemonStepRequest& request);

}  // namespace paramd

#endif  // PARAMD_SERVER_REQUEST_CHECKS_H_
