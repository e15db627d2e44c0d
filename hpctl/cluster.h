// File: hpctl/cluster.h
//
// What the hpctl commands that talk to a running cluster (status, load,
// fetch, step, checkpoint, export) share: the --address / --timeout
// options, the security options (--tls_ca, --tls_cert, --tls_key,
// --tls_server_name, --auth_token_file; docs/SECURITY.md), the
// environment defaults HPCTL_ADDRESS (else PARAMD_COORDINATOR),
// HPCTL_TLS_CA and HPCTL_TOKEN_FILE, connecting as an observer, and
// reporting a failed Status the hpctl way.
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
#include "auth/security.h"
#include "client/client.h"
#include "hpctl/command.h"

namespace paramd {
namespace hpctl {

class ClusterOptions {
 public:
  // Adds --address, --timeout and the security options to `opts`; the
  // values are read after opts.Parse(). Defaults of --address, --tls_ca and
  // --auth_token_file come from $HPCTL_ADDRESS (else $PARAMD_COORDINATOR),
  // $HPCTL_TLS_CA and $HPCTL_TOKEN_FILE; a flag given wins, even empty
  // (`--tls_ca=`: plaintext whatever $HPCTL_TLS_CA says).
  void AddTo(OptionParser& opts);

  absl::Duration timeout() const { return absl::Seconds(timeout_seconds_); }
  const std::string& address() const { return address_; }

  // Fails fast (within ~2 s, auth/endpoint_probe.h) if --address cannot
  // work: no port (INVALID_ARGUMENT), a name that does not resolve or a
  // refused connection (UNAVAILABLE), a TLS server without --tls_ca or a
  // plaintext one with it, an untrusted certificate, a missing client
  // certificate (FAILED_PRECONDITION), each in words.
  absl::Status Probe() const;

  // The client options of the security flags: TLS files and the token
  // (read from --auth_token_file: a bare token, or the `operator` line of
  // a `ROLE TOKEN` file). Errors name the flag's file.
  absl::Status ApplySecurity(client::ClientOptions* options) const;
  // The same for a raw channel (checkpoint, export).
  absl::StatusOr<auth::ChannelSecurity> Security() const;

  // Probe(), then connects as an observer (no rank, no pushes). UNAVAILABLE
  // if the coordinator cannot be reached within the timeout.
  absl::StatusOr<std::unique_ptr<client::Client>> Connect() const;

 private:
  std::string address_ = "127.0.0.1:7070";
  double timeout_seconds_ = 30;
  auth::TlsFiles tls_;
  std::string token_file_;
};

// The committed version; when the cluster holds no model yet, says so on
// stderr and waits up to `timeout` for one (a load may be running), then
// FAILED_PRECONDITION "no model ... hpctl load" instead of a bare deadline.
absl::StatusOr<int64_t> CommittedVersion(client::Client& client, absl::Duration timeout,
                                         absl::string_view command);

// Prints "hpctl <command>: <status>" to stderr and returns kExitFailure.
int ReportFailure(absl::string_view command, const absl::Status& status);

}  // namespace hpctl
}  // namespace paramd

#endif  // PARAMD_HPCTL_CLUSTER_H_
