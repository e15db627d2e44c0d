#include "hpctl/cluster.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "auth/endpoint_probe.h"
#include "common/status_macros.h"

namespace paramd {
namespace hpctl {

namespace {

// The value of environment variable `name`, or "" when unset or empty.
std::string Env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "";
}

}  // namespace

void ClusterOptions::AddTo(OptionParser& opts) {
  for (const char* name : {"HPCTL_ADDRESS", "PARAMD_COORDINATOR"}) {
    if (!Env(name).empty()) {
      address_ = Env(name);
      break;
    }
  }
  if (!Env("HPCTL_TOKEN_FILE").empty()) token_file_ = Env("HPCTL_TOKEN_FILE");
  if (!Env("HPCTL_TLS_CA").empty()) tls_.ca = Env("HPCTL_TLS_CA");
  opts.AddString("address", &address_,
                 "coordinator address HOST:PORT (default $HPCTL_ADDRESS, else "
                 "$PARAMD_COORDINATOR, else 127.0.0.1:7070)");
  opts.AddDouble("timeout", &timeout_seconds_, "seconds to wait for the cluster");
  opts.AddString("tls_ca", &tls_.ca,
                 "PEM CA that signed the servers' certificates: talk TLS (docs/SECURITY.md); "
                 "default $HPCTL_TLS_CA (--tls_ca= talks plaintext despite it)");
  opts.AddString("tls_cert", &tls_.cert, "PEM client certificate (servers requiring mutual TLS)");
  opts.AddString("tls_key", &tls_.key, "PEM private key of --tls_cert");
  opts.AddString("tls_server_name", &tls_.server_name,
                 "name the servers' certificates carry (default: the host of the address)");
  opts.AddString("auth_token_file", &token_file_,
                 "file with the bearer token (a bare token, or `ROLE TOKEN` lines: the operator "
                 "one is used); default $HPCTL_TOKEN_FILE");
}

absl::Status ClusterOptions::ApplySecurity(client::ClientOptions* options) const {
  options->tls = tls_;
  if (!token_file_.empty()) {
    ASSIGN_OR_RETURN(options->token, auth::LoadClientToken(token_file_, auth::Role::kOperator));
  }
  return absl::OkStatus();
}

absl::StatusOr<auth::ChannelSecurity> ClusterOptions::Security() const {
  client::ClientOptions options;
  RETURN_IF_ERROR(ApplySecurity(&options));
  auth::ChannelSecurity security;
  ASSIGN_OR_RETURN(security.tls, auth::LoadTls(options.tls));
  security.token = std::make_shared<auth::BearerToken>(options.token);
  return security;
}

absl::Status ClusterOptions::Probe() const {
  if (timeout_seconds_ <= 0) return absl::InvalidArgumentError("--timeout must be positive");
  ASSIGN_OR_RETURN(const auth::TlsConfig tls, auth::LoadTls(tls_));
  auth::ProbeNames names;
  const bool ca_from_environment = !tls_.ca.empty() && tls_.ca == Env("HPCTL_TLS_CA");
  names.ca = absl::StrCat(ca_from_environment ? "HPCTL_TLS_CA=" : "--tls_ca=", tls_.ca);
  names.give_ca = "give --tls_ca=CA.pem (or set HPCTL_TLS_CA), the CA that signed its certificate";
  names.server_name = "--tls_server_name";
  // A refusal, a bad name or a TLS mistake is known at once; a host that
  // does not answer at all is left to gRPC's wait (up to --timeout).
  return auth::ProbeEndpoint(address_, tls, std::min(timeout(), absl::Seconds(2)), names);
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
  RETURN_IF_ERROR(ApplySecurity(&options));
  return client::Client::Connect(options);
}

absl::StatusOr<int64_t> CommittedVersion(client::Client& client, absl::Duration timeout,
                                         absl::string_view command) {
  if (client.manifest().committed_version >= 0) return client.manifest().committed_version;
  std::cerr << "hpctl " << command << ": the cluster holds no model yet; waiting up to "
            << absl::FormatDuration(timeout) << " (--timeout) for one\n";
  absl::StatusOr<int64_t> committed = client.WaitForVersion(0, timeout);
  if (absl::IsDeadlineExceeded(committed.status())) {
    return absl::FailedPreconditionError(
        absl::StrCat("no model was loaded within ", absl::FormatDuration(timeout),
                     ": load one first (`hpctl load MODEL`, or hybrid-paramd --model)"));
  }
  return committed;
}

int ReportFailure(absl::string_view command, const absl::Status& status) {
  std::cerr << "hpctl " << command << ": " << status << "\n";
  return kExitFailure;
}

}  // namespace hpctl
}  // namespace paramd
