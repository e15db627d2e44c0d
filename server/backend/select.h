// File: server/backend/select.h
//
// Which backend `hybrid-paramd` runs: the seam for the daemon's --backend
// flag. Host code only (no CUDA): it asks the transport registry
// whether the "nccl" backend is linked in (builds with --config=cuda link
// //transport:nccl) and can see a GPU.
//
//   "auto" -> kGpu when ProbeTransport("nccl") passes, else kCpu
//   "gpu"  -> kGpu, or FAILED_PRECONDITION saying why not
//   "cpu"  -> kCpu
// Anything else is INVALID_ARGUMENT.
#ifndef PARAMD_SERVER_BACKEND_SELECT_H_
#define PARAMD_SERVER_BACKEND_SELECT_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace paramd {

enum class DaemonBackend { kCpu, kGpu };

absl::StatusOr<DaemonBackend> ChooseDaemonBackend(absl::string_view flag);

}  // namespace paramd

#endif  // PARAMD_SERVER_BACKEND_SELECT_H_
