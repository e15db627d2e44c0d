#include "hpctl/cluster.h"

#include <iostream>

namespace paramd {
namespace hpctl {

void ClusterOptions::AddTo(OptionParser& opts) {
  opts.AddString("address", &address_, "coordinator address HOST:PORT");
  opts.AddDouble("timeout", &timeout_seconds_, "seconds to wait for the cluster");
}

absl::StatusOr<std::unique_ptr<client::Client>> ClusterOptions::Connect() const {
  if (timeout_seconds_ <= 0) return absl::InvalidArgumentError("--timeout must be positive");
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
