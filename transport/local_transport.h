// File: transport/local_transport.h
//
// The "local" backend: every rank of the world lives in this process, and a
// message is a copy into the receiver's mailbox. It is the reference
// implementation of the Transport contract and the data plane of unit tests
// above the transport (server/, client/).
//
// Endpoints meet on a named in-process fabric (TransportOptions::
// listen_address, "" = "default"); an endpoint's address is
// "local:<fabric>/<id>". Send never waits for the receiver; Recv waits on a
// condition variable until the message, the sender's Shutdown, or the
// deadline. Registered as "local" (link //transport:local, alwayslink).
#ifndef PARAMD_TRANSPORT_LOCAL_TRANSPORT_H_
#define PARAMD_TRANSPORT_LOCAL_TRANSPORT_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace paramd {

// Same as OpenTransportEndpoint("local", options).
absl::StatusOr<std::unique_ptr<TransportEndpoint>> OpenLocalEndpoint(
    const TransportOptions& options = {});

// A connected world of `world_size` local transports on a private fabric
// (no other endpoint can reach it). Result index = rank.
absl::StatusOr<std::vector<std::unique_ptr<Transport>>> CreateLocalWorld(int world_size);

}  // namespace paramd

#endif  // PARAMD_TRANSPORT_LOCAL_TRANSPORT_H_
