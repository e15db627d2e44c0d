// File: transport/nccl_address.h
//
// The "nccl" backend's endpoint addresses, without CUDA (so that CPU code
// and tests can read them): "nccl|<header addr>|<sync addr>|<hostname>|<pci
// bus id>|<control addr>" (the last field absent without a control
// channel), and the shared-GPU guard of device fetch built on them.
#ifndef PARAMD_TRANSPORT_NCCL_ADDRESS_H_
#define PARAMD_TRANSPORT_NCCL_ADDRESS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace paramd {

struct NcclAddress {
  std::string header_address;
  std::string sync_address;
  std::string gpu;              // "<hostname>|<pci bus id>": one GPU of one machine
  std::string control_address;  // "" = none (gRPC control only)
};

// INVALID_ARGUMENT if `address` is not an nccl address.
absl::StatusOr<NcclAddress> ParseNcclAddress(absl::string_view address);

// Whether NCCL_P2P_DISABLE=1 is set in this process's environment.
bool NcclP2pDisabledInEnv();

// The guard against the corruption seen with two daemon PROCESSES on one
// GPU fetched from over NCCL P2P by one trainer (docs/ARCHITECTURE.md,
// device fetch; cause not found: raw NCCL and the transport alone were
// clean in transport/nccl_shared_gpu_repro.cc): this process (endpoint
// `local`) already reaches the peers `open_peers` (their nccl addresses);
// would adding `candidate` give it two NCCL peers on one GPU? Peers on the
// local GPU do not count (their bytes go inline, not over NCCL).
// FAILED_PRECONDITION naming both peers' GPU, unless `p2p_disabled`
// (NCCL_P2P_DISABLE=1: NCCL does not import peer memory then);
// INVALID_ARGUMENT for an address that does not parse. `what` names the
// candidate in the message (e.g. "daemon 1 at 127.0.0.1:5000").
absl::Status CheckNcclPeerGpuUnshared(absl::string_view local,
                                      const std::vector<std::string>& open_peers,
                                      absl::string_view candidate, absl::string_view what,
                                      bool p2p_disabled);

}  // namespace paramd

#endif  // PARAMD_TRANSPORT_NCCL_ADDRESS_H_
