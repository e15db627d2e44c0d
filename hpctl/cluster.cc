#include "hpctl/cluster.h"

#include <algorithm>
#include <iostream>

#include "hpctl/address.h"

namespace paramd {
namespace hpctl {

void ClusterOptions::AddTo(OptionParser& opts) {
  opts.AddString("address", &address_, "coordinator address HOST:PORT");
  opts.AddDouble("timeout", &timeout_seconds_, "seconds to wait for the cluster");
}

absl::Status ClusterOptions::Probe() const {
  if (timeout_seconds_ <= 0) return absl::InvalidArgumentError("--timeout must be positive");
  // A refusal or a bad name is known at once; a host that does not answer
  // at all is left to gRPC's wait (up to --timeout).
  return ProbeAddress(address_, std::min(timeout(), absl::Seconds(2)));
}

absl::StatusOr<std::unique_ptr<client::Client>> ClusterOptions::Connect() const {
  if (absl::Status s = Probe(); !s.ok()) return s;
  client::ClientOptions options;
  options.coordinator_address = address_;
  options.role = client::ClientOptions::Role::kObserver;
  options.pusher = false;
  options.name = "hpctl";
  options.connect_timeout = timeout();
  options.call_timeout = timeout();
  return client::Client::Connect(options);
}

int ReportFailure(absl::string_view command, const absl::Status& status) {
  std::cerr << "hpctl " << command << ": " << status << "\n";
  return kExitFailure;
}

}  // namespace hpctl
}  // namespace paramd
