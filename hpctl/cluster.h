// File: hpctl/cluster.h
//
// What the hpctl commands that talk to a running cluster (status, load,
// fetch, step, checkpoint, export) share: the --address / --timeout options, connecting as an
// observer, and reporting a failed Status the hpctl way.
//
// Not thread-safe (one per invocation, like OptionParser).
#ifndef PARAMD_HPCTL_CLUSTER_H_
#define PARAMD_HPCTL_CLUSTER_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "hpctl/command.h"

namespace paramd {
namespace hpctl {

class ClusterOptions {
 public:
  // Adds --address and --timeout to `opts`; the values are read after
  // opts.Parse().
  void AddTo(OptionParser& opts);

  absl::Duration timeout() const { return absl::Seconds(timeout_seconds_); }
  const std::string& address() const { return address_; }

  // Fails fast (within ~2 s, see hpctl/address.h) if --address cannot
  // work: no port (INVALID_ARGUMENT), a name that does not resolve or a
  // refused connection (UNAVAILABLE), each with the reason.
  absl::Status Probe() const;

  // Probe(), then connects as an observer (no rank, no pushes). UNAVAILABLE
  // if the coordinator cannot be reached within the timeout.
  absl::StatusOr<std::unique_ptr<client::Client>> Connect() const;

 private:
  std::string address_ = "127.0.0.1:7070";
  double timeout_seconds_ = 30;
};

// Prints "hpctl <command>: <status>" to stderr and returns kExitFailure.
int ReportFailure(absl::string_view command, const absl::Status& status);

}  // namespace hpctl
}  // namespace paramd

#endif  // PARAMD_HPCTL_CLUSTER_H_
