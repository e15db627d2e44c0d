#include "server/device_channel.h"

#include <utility>

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

absl::StatusOr<std::unique_ptr<DeviceChannel>> OpenDeviceChannel(
    const std::string& listen_address) {
  if (!Opener()) {
    return absl::FailedPreconditionError(
        "device fetch needs hybrid-paramd built with --config=cuda and --backend=gpu");
  }
  return Opener()(listen_address);
}

}  // namespace paramd
