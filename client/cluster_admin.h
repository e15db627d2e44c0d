// File: client/cluster_admin.h
//
// What a training script or an operator asks of the whole cluster beside
// fetch and push: a committed version read back from the daemons (its FP32
// masters as BF16 or FP32, or its published copies dequantized), and the
// coordinator's checkpoint calls. `hpctl export` writes the first as
// safetensors; the C API (Python's Client.state_dict, export, checkpoint,
// describe_checkpoint) uses both.
//
//   ASSIGN_OR_RETURN(client::VersionReader r, client::OpenVersion(c, {}));
//   for (const checkpoint::ExportTensor& t : r.tensors) {
//     RETURN_IF_ERROR(r.source->StreamTensor(t, checkpoint::ExportDtype::kBf16, sink));
//   }
//
// Threading: the functions block on the network; a VersionReader streams
// one tensor at a time (its ExportSource's rule). The Client must outlive
// what is returned.
#ifndef PARAMD_CLIENT_CLUSTER_ADMIN_H_
#define PARAMD_CLIENT_CLUSTER_ADMIN_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "checkpoint/export.h"
#include "checkpoint/remote_export.h"
#include "client/client.h"
#include "proto/checkpoint_service.pb.h"

namespace paramd {
namespace client {

struct OpenVersionOptions {
  int64_t version = -1;  // -1: the committed version
  checkpoint::ExportValuesKind values = checkpoint::ExportValuesKind::kMaster;
  // Where the daemons look for a checkpoint of `version` they no longer hold
  // in memory (below their --checkpoint_dir).
  std::string checkpoint_dir;
  absl::Duration timeout = absl::Seconds(30);  // of the manifest refresh
};

// Every tensor of one committed version, in manifest order, and the source
// that streams their rows from the daemons holding them.
struct VersionReader {
  uint64_t version = 0;
  std::vector<checkpoint::ExportTensor> tensors;
  std::unique_ptr<checkpoint::ExportSource> source;
  // The model's frozen buffers with their data (the same in every version).
  std::vector<FrozenTensor> frozen;
};

// FAILED_PRECONDITION when no model is loaded or `version` is not committed
// yet; the manifest refresh's errors.
absl::StatusOr<VersionReader> OpenVersion(Client& client, const OpenVersionOptions& options);

struct ExportVersionResult {
  uint64_t version = 0;
  checkpoint::ExportResult files;
  // Files of an older export removed first (overwrite).
  std::vector<std::string> removed;
};

// Writes `options.version` as safetensors into `export_options.out_dir`
// (checkpoint/export.h). The directory must be new or empty unless
// `overwrite`, which removes an older export's files (checkpoint/
// export_dir.h) only once the cluster has answered, so that an export that
// cannot start leaves the older one in place.
absl::StatusOr<ExportVersionResult> ExportVersion(Client& client, const OpenVersionOptions& options,
                                                  const checkpoint::ExportOptions& export_options,
                                                  bool overwrite);

// CheckpointCoordinator.Checkpoint / ListCheckpoints / DescribeCheckpoint
// on the client's coordinator, with the client's TLS and token. The RPC's
// status (with the coordinator's address) on failure.
absl::StatusOr<checkpoint::CheckpointResponse> Checkpoint(
    Client& client, const checkpoint::CheckpointRequest& request, absl::Duration timeout);
absl::StatusOr<checkpoint::ListCheckpointsResponse> ListCheckpoints(
    Client& client, const checkpoint::ListCheckpointsRequest& request, absl::Duration timeout);
absl::StatusOr<checkpoint::DescribeCheckpointResponse> DescribeCheckpoint(
    Client& client, const checkpoint::DescribeCheckpointRequest& request, absl::Duration timeout);

}  // namespace client
}  // namespace paramd

#endif  // PARAMD_CLIENT_CLUSTER_ADMIN_H_
