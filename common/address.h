// File: common/address.h
//
// A quick look at a coordinator address before a client (hpctl, the client
// library) waits on gRPC, so that an address that cannot work fails at once
// or says why: no port, a name that does not resolve, a refused connection.
//
// Pure functions; thread-safe. ProbeAddress blocks for at most `timeout`
// (plus the resolver's own time).
#ifndef PARAMD_COMMON_ADDRESS_H_
#define PARAMD_COMMON_ADDRESS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace paramd {

struct HostPort {
  std::string host;  // without brackets for IPv6 literals
  int port = 0;
};

// "HOST:PORT" or "[IPV6]:PORT" with PORT in 1..65535. InvalidArgument
// naming what is wrong otherwise. Addresses with a gRPC scheme
// ("dns:///...", "ipv4:...", "unix:...") are not parsed: NotFound, and
// callers leave them to gRPC.
absl::StatusOr<HostPort> ParseHostPort(absl::string_view address);

// OK for a HOST:PORT address or one with a gRPC scheme (left to gRPC);
// ParseHostPort's InvalidArgument, naming what is wrong, otherwise. What a
// flag or option that takes an address checks before anything waits on it.
absl::Status CheckAddress(absl::string_view address);

// A TCP connection to a HOST:PORT address (a blocking, close-on-exec
// socket the caller closes): the host resolved and each of its addresses
// tried for up to `timeout` in all. UNAVAILABLE with the reason if every
// address failed definitively (as ProbeAddress), DEADLINE_EXCEEDED if some
// address neither connected nor refused in time, ParseHostPort's errors
// for a malformed address or one with a gRPC scheme (NotFound).
absl::StatusOr<int> ConnectTcp(absl::string_view address, absl::Duration timeout);

// Resolves the host and tries a TCP connection to each of its addresses for
// up to `timeout` in all. OK if one connects, or if none answered either
// way within the timeout (a slow network: gRPC's own wait decides).
// UNAVAILABLE with the reason ("cannot resolve host 'x': ...", "connection
// refused by 127.0.0.1:1", ...) if every address failed definitively;
// InvalidArgument for a malformed address. Addresses with a gRPC scheme are
// not probed (OK).
absl::Status ProbeAddress(absl::string_view address, absl::Duration timeout);

}  // namespace paramd

#endif  // PARAMD_COMMON_ADDRESS_H_
