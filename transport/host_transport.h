// File: transport/host_transport.h
//
// The "host" backend: bytes between processes over gRPC (proto/
// transport.proto), for machines without a GPU (CI, the demo). Registered
// as "host" (link //transport:host, alwayslink).
//
// Each endpoint runs a DataPlane gRPC server (callback API) on
// TransportOptions::listen_address ("" = "127.0.0.1:0"; port 0 picks a free
// port, which address() then reports; a wildcard host is advertised as this
// machine's hostname). After Connect it holds one channel per peer address.
//
// Send streams the message to the peer's server in chunks of chunk_bytes
// (client-streaming Deliver) and returns once the peer has queued it in its
// mailbox; so messages are buffered at the receiver until a Recv takes
// them, and Send never waits for the Recv. An unreachable peer gives
// UNAVAILABLE at once (no wait-for-ready; reconnect backoff is capped at
// 1 s so a peer that comes up is reached soon after). Shutdown tells every
// peer (Goodbye RPC, at most ~0.5 s) so their Recvs from this rank fail with
// UNAVAILABLE instead of waiting for their deadline; a peer that dies
// without saying goodbye is seen as DEADLINE_EXCEEDED by Recv and as
// UNAVAILABLE by Send.
//
// A failed Send may or may not have reached the peer (the reply can be lost
// after delivery); the data-plane protocols above (fetch plans, all-reduce)
// treat a failure as the end of the world, not as a reason to resend.
#ifndef PARAMD_TRANSPORT_HOST_TRANSPORT_H_
#define PARAMD_TRANSPORT_HOST_TRANSPORT_H_

#include <memory>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace paramd {

// Starts the endpoint's server. Same as OpenTransportEndpoint("host",
// options). INVALID_ARGUMENT for chunk_bytes outside 1 .. 3 MiB or an
// address without a port; UNAVAILABLE if the address cannot be bound.
absl::StatusOr<std::unique_ptr<TransportEndpoint>> OpenHostEndpoint(
    const TransportOptions& options = {});

}  // namespace paramd

#endif  // PARAMD_TRANSPORT_HOST_TRANSPORT_H_
