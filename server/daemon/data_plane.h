// File: server/daemon/data_plane.h
//
// The daemons' side of the data plane: the packed amax all-reduce (MAX)
// every step needs, over a Transport of //transport ("host" between
// processes, "local" inside one, "nccl" between GPU daemons: linked only
// under --config=cuda; the gpu backend then all-reduces its device amax
// vector on the transport() with no host round trip, see
// ShardBackend::set_data_plane). A daemon opens its endpoint before it
// joins (the endpoint's address goes into the Join request), then connects
// once the coordinator's rendezvous gives it its rank and the address book.
// The daemons form the world 0..num_daemons-1; with one daemon the
// all-reduce is the identity and nothing is connected.
//
// Threading: Open/Connect from one thread; the AllReduceMaxFn returned by
// Connect is called from one thread at a time (the daemon's worker) and
// stays valid while this object lives.
#ifndef PARAMD_SERVER_DAEMON_DATA_PLANE_H_
#define PARAMD_SERVER_DAEMON_DATA_PLANE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/paramd.pb.h"
#include "server/step/shard_set.h"
#include "transport/transport.h"

namespace paramd {

class DaemonDataPlane {
 public:
  // Opens an endpoint of backend `transport` ("host", "local", "nccl")
  // with `options` (where it listens and what it advertises, who may call
  // it, TLS and the token of its channels: TransportOptions). A daemon
  // passes the same options to every endpoint it opens, a recovery's
  // included. NOT_FOUND for a backend that is not linked in.
  static absl::StatusOr<std::unique_ptr<DaemonDataPlane>> Open(const std::string& transport,
                                                               const TransportOptions& options,
                                                               absl::Duration step_timeout);
  ~DaemonDataPlane();

  // Give this to the coordinator as JoinRequest.data_plane_address.
  std::string address() const { return address_; }

  // Connects daemon `rank` to daemons 0..num_daemons-1 of `data_plane`.
  // FAILED_PRECONDITION if the coordinator's transport differs from ours;
  // INVALID_ARGUMENT for a rank outside the daemons or a missing address.
  // The returned function fails (UNAVAILABLE / DEADLINE_EXCEEDED after
  // step_timeout) when a peer is gone, never hangs.
  absl::StatusOr<AllReduceMaxFn> Connect(const rpc::DataPlane& data_plane, int rank);

  // After Connect: waits until every peer's endpoint answers
  // (Transport::CanConnect), retrying every 50 ms while one is unreachable
  // or slow (a daemon that is still starting, or not scheduled on a loaded
  // machine, may miss the transport's short connect timeout; a failed
  // collective cannot be retried, a probe can). UNAVAILABLE naming the peer
  // once `deadline` passes; FAILED_PRECONDITION at once after Shutdown.
  absl::Status AwaitPeers(absl::Time deadline);

  // Leaves the world (peers blocked in an all-reduce with us fail).
  void Shutdown();

  // The connected transport (owned; valid while this object lives), or null
  // before Connect and with a single daemon (nothing to reduce).
  Transport* transport() const { return transport_.get(); }

 private:
  DaemonDataPlane() = default;

  std::string transport_name_;
  absl::Duration step_timeout_;
  std::string address_;
  std::vector<std::string> peer_addresses_;  // the world's, by rank (Connect)
  std::unique_ptr<TransportEndpoint> endpoint_;
  std::unique_ptr<Transport> transport_;
};

}  // namespace paramd

#endif  // PARAMD_SERVER_DAEMON_DATA_PLANE_H_
