#include "server/backend/select.h"

#include "absl/strings/str_cat.h"
#include "transport/transport.h"

namespace paramd {

absl::StatusOr<DaemonBackend> ChooseDaemonBackend(absl::string_view flag) {
  if (flag == "cpu") return DaemonBackend::kCpu;
  if (flag != "auto" && flag != "gpu") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend must be auto, gpu or cpu, not '", flag, "'"));
  }
  const absl::Status probe = ProbeTransport("nccl");
  if (probe.ok()) return DaemonBackend::kGpu;
  if (flag == "auto") return DaemonBackend::kCpu;
  return absl::FailedPreconditionError(
      absl::StrCat("--backend=gpu but the GPU backend cannot run here: ", probe.message()));
}

}  // namespace paramd
