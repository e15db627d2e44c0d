// File: checkpoint/remote_export.h
//
// The ExportSource of `hpctl export`: each tensor's rows are streamed from
// the daemons that hold them (CheckpointDaemon.ExportRows), already
// converted to BF16 (or FP32) by the daemons, piece after piece in row
// order. See export.h for the writer it feeds.
//
// Threading: one StreamTensor at a time (ExportSafetensors's thread). Blocks
// on the network; a dead daemon gives UNAVAILABLE (or DEADLINE_EXCEEDED at
// the per-piece timeout), never a hang.
#ifndef PARAMD_CHECKPOINT_REMOTE_EXPORT_H_
#define PARAMD_CHECKPOINT_REMOTE_EXPORT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "auth/security.h"
#include "checkpoint/daemon_state.h"
#include "checkpoint/export.h"

namespace paramd {
namespace checkpoint {

// Rows [row_begin, row_end) of a tensor, served by the daemon at `address`.
struct RemotePiece {
  int64_t row_begin = 0;
  int64_t row_end = 0;
  std::string address;
};

struct RemoteExportOptions {
  uint64_t version = 0;
  ExportValuesKind values = ExportValuesKind::kMaster;
  // Where daemons look for a checkpoint of `version` if they no longer hold
  // it in memory (relative to their --checkpoint_dir).
  std::string checkpoint_dir;
  // Deadline of the stream of one piece.
  absl::Duration piece_timeout = absl::Minutes(10);
  int64_t max_chunk_bytes = 0;  // 0: the daemon's default (4 MiB)
  // TLS and token of the channels to the daemons (auth/security.h).
  auth::ChannelSecurity security;
};

// `pieces`: for every tensor to export, its pieces in row order covering
// all rows (as in the cluster manifest).
std::unique_ptr<ExportSource> NewRemoteExportSource(
    std::map<std::string, std::vector<RemotePiece>> pieces, RemoteExportOptions options);

}  // namespace checkpoint
}  // namespace paramd

#endif  // PARAMD_CHECKPOINT_REMOTE_EXPORT_H_
