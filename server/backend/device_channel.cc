#include "server/backend/device_channel.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "auth/security.h"

namespace paramd {
namespace {

DeviceChannelOpener& Opener() {
  static DeviceChannelOpener* opener = new DeviceChannelOpener();
  return *opener;
}

}  // namespace

bool RegisterDeviceChannelOpener(DeviceChannelOpener opener) {
  if (!Opener()) Opener() = std::move(opener);
  return true;
}

absl::StatusOr<std::unique_ptr<DeviceChannel>> OpenDeviceChannel(const std::string& listen_address,
                                                                 const std::string& advertise_host,
                                                                 const std::string& secret) {
  if (!Opener()) {
    return absl::FailedPreconditionError(
        "device fetch needs hybrid-paramd built with --config=cuda and --backend=gpu");
  }
  if (secret.empty()) return absl::InternalError("a device channel needs its secret");
  return Opener()(listen_address, advertise_host, secret);
}

absl::Status CheckDeviceChannelSecret(const std::string& presented, const std::string& expected,
                                      uint64_t channel) {
  if (auth::SecretMatches(presented, expected)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "device channel ", channel, ": ",
      presented.empty() ? "no channel_secret" : "wrong channel_secret",
      " (the secret of the channel's first DeviceChannelEvent; only the channel's opener "
      "may use it)"));
}

}  // namespace paramd
