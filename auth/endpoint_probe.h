// File: auth/endpoint_probe.h
//
// What a client meets at a server's address, found out within a second or
// two before it waits on gRPC (which would only report, after its whole
// timeout, that it could not connect): a refused or unresolvable address,
// a TLS server spoken to in plaintext, a plaintext server spoken to with
// TLS, a certificate the client's CA did not sign or that is issued for
// another name, a server that wants a client certificate. hpctl and the
// client library (and so the C API and the Python client) call it before
// they connect.
//
// How: a TCP connection (common/address.h ConnectTcp); with TLS, an
// OpenSSL handshake with the client's CA, certificate and server name,
// then the HTTP/2 preface exchanged over it; in plaintext, the HTTP/2
// preface sent and the server's SETTINGS frame awaited. When that fails, a
// second connection tries the other protocol, so that a message says what
// the server speaks rather than guessing it from a failure.
//
// Thread-safe (no state); blocks for at most about `timeout`.
#ifndef PARAMD_AUTH_ENDPOINT_PROBE_H_
#define PARAMD_AUTH_ENDPOINT_PROBE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "auth/security.h"

namespace paramd {
namespace auth {

// How the messages name the client's settings, for the program that asks.
struct ProbeNames {
  // Where the client's CA came from, e.g. "--tls_ca=ca.pem" or
  // "HPCTL_TLS_CA=ca.pem".
  std::string ca = "the given TLS CA";
  // How to give a CA, for a TLS server spoken to in plaintext.
  std::string give_ca = "give the CA that signed its certificate";
  // How to name the server in its certificate instead of the address's host.
  std::string server_name = "the TLS server name";
};

// OK: the server answered in the client's protocol (a verified TLS
// handshake and HTTP/2, or plaintext HTTP/2), or nothing could be told in
// time (a slow network: gRPC's own wait decides). Addresses with a gRPC
// scheme ("dns:///...", "unix:...") are not probed (OK).
// UNAVAILABLE: no TCP connection (refused, unresolvable), with the reason
// (common/address.h ProbeAddress's message).
// FAILED_PRECONDITION: client and server disagree, which waiting will not
// mend, in words:
//   "HOST:PORT speaks TLS, but this client speaks plaintext: <give_ca>"
//   "HOST:PORT speaks plaintext, but a TLS CA was given (<ca>): ..."
//   "TLS handshake with HOST:PORT failed: the server's certificate is not
//    signed by <ca> (<OpenSSL's reason>)"
//   "... the server's certificate is not issued for NAME ..."
//   "... the server requires a client certificate ..." / refused ours.
// InvalidArgument: a malformed address or unusable PEM contents.
absl::Status ProbeEndpoint(const std::string& address, const TlsConfig& tls, absl::Duration timeout,
                           const ProbeNames& names = {});

}  // namespace auth
}  // namespace paramd

#endif  // PARAMD_AUTH_ENDPOINT_PROBE_H_
