#include "transport/nccl_address.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace paramd {

absl::StatusOr<NcclAddress> ParseNcclAddress(absl::string_view address) {
  std::vector<std::string> parts = absl::StrSplit(address, '|');
  if ((parts.size() != 5 && parts.size() != 6) || parts[0] != "nccl") {
    return absl::InvalidArgumentError(absl::StrCat("not an nccl address: '", address, "'"));
  }
  return NcclAddress{parts[1], parts[2], absl::StrCat(parts[3], "|", parts[4]),
                     parts.size() == 6 ? parts[5] : ""};
}

bool NcclP2pDisabledInEnv() {
  const char* v = std::getenv("NCCL_P2P_DISABLE");
  return v != nullptr && std::string(v) == "1";
}

absl::Status CheckNcclPeerGpuUnshared(absl::string_view local,
                                      const std::vector<std::string>& open_peers,
                                      absl::string_view candidate, absl::string_view what,
                                      bool p2p_disabled) {
  ASSIGN_OR_RETURN(NcclAddress me, ParseNcclAddress(local));
  ASSIGN_OR_RETURN(NcclAddress peer, ParseNcclAddress(candidate));
  if (p2p_disabled || peer.gpu == me.gpu) return absl::OkStatus();
  for (const std::string& open : open_peers) {
    ASSIGN_OR_RETURN(NcclAddress other, ParseNcclAddress(open));
    if (other.gpu != peer.gpu) continue;
    std::vector<std::string> gpu = absl::StrSplit(peer.gpu, '|');
    return absl::FailedPreconditionError(absl::StrCat(
        "device fetch: ", what, " is on GPU ", gpu.back(), " of host ", gpu.front(),
        ", like another daemon this trainer already fetches from over NCCL: with two daemon "
        "processes on one GPU, NCCL P2P device fetches delivered wrong bytes (cause not "
        "found, docs/ARCHITECTURE.md, device fetch); run one daemon per GPU, or set "
        "NCCL_P2P_DISABLE=1 in the trainer's environment"));
  }
  return absl::OkStatus();
}

}  // namespace paramd
