// File: transport/transport.h
//
// The data plane: a small `Transport` interface that moves
// bytes between the ranks of a world (daemons and trainers) and all-reduces
// the daemons' packed amax vector, plus a registry that opens backends by
// name ("local", "host", later "nccl"). Every backend passes one conformance
// suite (transport/conformance_test_lib.h); "local" is the reference.
//
// Joining a world takes two steps, because a process learns its rank and its
// peers' addresses only after it has told the coordinator its own:
//
//   ASSIGN_OR_RETURN(auto endpoint, OpenTransportEndpoint("host", options));
//   ... Join(coordinator, endpoint->address()) -> rank, address book ...
//   ASSIGN_OR_RETURN(std::unique_ptr<Transport> t, endpoint->Connect(rank, book));
//
// Status codes are chosen by what a retry should do (absl/status/status.h):
//   DEADLINE_EXCEEDED   the deadline passed first. Retry with a later one.
//   UNAVAILABLE         the peer is gone or not reachable (yet). Retry later,
//                       or ask the coordinator for the new world.
//   INVALID_ARGUMENT    bad peer, tag or group; a message larger than the
//                       receive buffer; group members disagreeing on an
//                       all-reduce size. Retrying the same call cannot help.
//   FAILED_PRECONDITION this transport was shut down.
//   CANCELLED           a call blocked in this transport when it shut down.
//   NOT_FOUND           (registry) no backend of that name is linked in.
#ifndef PARAMD_TRANSPORT_TRANSPORT_H_
#define PARAMD_TRANSPORT_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace paramd {
namespace auth {  // auth/security.h (kept out of this header: no gRPC here)
class Authenticator;
struct ChannelSecurity;
}  // namespace auth

// Tags above this are reserved for the transports' own collectives.
inline constexpr uint64_t kMaxUserTag = (uint64_t{1} << 63) - 1;

// One process's view of a world of `world_size()` ranks.
//
// Threading: every method may be called from any thread, concurrently with
// any other, except the destructor. Messages between one (sender, receiver,
// tag) triple arrive in the order their Sends returned; different tags and
// different senders are independent. With several Recvs outstanding for the
// same (peer, tag), which one gets which message is unspecified.
//
// Blocking: every call that can wait takes an absolute `deadline`
// (absl::InfiniteFuture() to wait forever) and returns DEADLINE_EXCEEDED
// once it passes; a peer known to be gone gives UNAVAILABLE without waiting
// for the deadline. No call hangs past its deadline.
//
// Ownership: Send and AllReduceMax do not retain the caller's buffers after
// they return; Recv writes into the caller's buffer only before it returns.
class Transport {
 public:
  // Shuts down (see Shutdown) if that was not done yet.
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // The registry name of the backend: "local", "host", ...
  virtual absl::string_view backend() const = 0;

  // Sends `bytes` (any size, 0 included) to `peer` (which may be rank()).
  // Returns once the bytes are handed over: the caller may reuse the buffer.
  // Backends may buffer the message at the receiver (local, host) or wait
  // for the matching Recv (NCCL-like); portable callers therefore post the
  // Recv concurrently (another thread or process) rather than after their
  // own Send. A deadline already in the past gives DEADLINE_EXCEEDED. After
  // an error other than INVALID_ARGUMENT or FAILED_PRECONDITION the message
  // may or may not have been delivered: protocols above treat a failed Send
  // as the end of the exchange, not as a reason to resend.
  // INVALID_ARGUMENT for a peer outside [0, world_size) or tag > kMaxUserTag.
  virtual absl::Status Send(int peer, uint64_t tag, absl::Span<const uint8_t> bytes,
                            absl::Time deadline) = 0;

  // Receives the next message from `peer` with `tag` into `buffer` and
  // returns its size. A message larger than the buffer is consumed and gives
  // INVALID_ARGUMENT (portable code sizes buffers exactly; backends that
  // cannot detect a mismatch say so in their conformance capabilities). A
  // message already queued is returned even if the deadline has passed, so
  // a past deadline polls. UNAVAILABLE once `peer` has shut down and nothing
  // from it is queued.
  virtual absl::StatusOr<size_t> Recv(int peer, uint64_t tag, absl::Span<uint8_t> buffer,
                                      absl::Time deadline) = 0;

  // Element-wise maximum of `values` over the ranks of `group`, in place on
  // every member. `group` is strictly increasing, contains rank(), and every
  // member passes the same group and the same values.size() (else
  // INVALID_ARGUMENT, reported to all members). Max follows FORMATS.md's
  // amax rule: NaN is ignored (NaN only where every member has NaN), Inf
  // participates, and +0 wins over -0, so the result does not depend on the
  // order of members. Members call collectives on one group in the same
  // order, one at a time per group; different groups may run concurrently.
  // After a failed collective the group's state is undefined: rebuild the
  // world.
  virtual absl::Status AllReduceMax(absl::Span<const int> group, absl::Span<float> values,
                                    absl::Time deadline) = 0;

  // Returns once every member of `group` has entered the barrier. Same
  // rules as AllReduceMax (it is an all-reduce of nothing).
  absl::Status Barrier(absl::Span<const int> group, absl::Time deadline) {
    return AllReduceMax(group, {}, deadline);
  }

  // Probes whether `peer` can be reached now (NCCL's canConnect, per peer):
  // OK, UNAVAILABLE, DEADLINE_EXCEEDED, or FAILED_PRECONDITION if the peer
  // answers with another rank (the address book is wrong).
  virtual absl::Status CanConnect(int peer, absl::Time deadline) = 0;

  // Leaves the world: peers' pending and later Recvs from this rank fail
  // with UNAVAILABLE once they have taken what was already sent; calls
  // blocked here return CANCELLED; later calls FAILED_PRECONDITION.
  // Idempotent; blocks briefly (bounded) to tell the peers.
  virtual void Shutdown() = 0;
};

// What every backend may need to open an endpoint. Fields a backend does
// not use are ignored.
struct TransportOptions {
  // host: "ip:port" to listen on (port 0 picks a free one); "" means
  // "127.0.0.1:0". local: the name of the in-process fabric to join ("" =
  // "default"); processes sharing a fabric name see each other's endpoints.
  std::string listen_address;
  // host, nccl: the host peers dial when listen_address's host is a
  // wildcard (0.0.0.0, ::): a daemon passes the host of its
  // --advertise_address, the name other machines know it by (a Kubernetes
  // pod's DNS name, not its hostname). "" = this machine's hostname.
  std::string advertise_host;
  // host: bytes per streamed chunk, 1 .. 3 MiB.
  int64_t chunk_bytes = int64_t{1} << 20;
  // host: who may call the endpoint's DataPlane service (auth/security.h:
  // cluster-internal, so a cluster secret; null = anyone) and how its
  // channels to the peers authenticate (TLS, bearer token: the cluster
  // secret, which a daemon sets once it has joined). A peer's UNAUTHENTICATED
  // is retried until the call's deadline: it may not have read its own Join
  // reply yet.
  std::shared_ptr<auth::Authenticator> authenticator;
  std::shared_ptr<const auth::ChannelSecurity> security;  // null = plaintext, no token
};

// A process's presence on the data plane before it knows its rank.
// Messages sent to it before Connect are kept and delivered after.
class TransportEndpoint {
 public:
  // Closes the endpoint unless Connect handed it to a Transport.
  virtual ~TransportEndpoint() = default;

  // What peers need to reach this endpoint ("127.0.0.1:34567" for host);
  // publish it through the coordinator.
  virtual std::string address() const = 0;

  // Joins the world as `rank`; addresses[r] is rank r's address() and
  // addresses[rank] must be this endpoint's. Callable once (then
  // FAILED_PRECONDITION). May block until all ranks connect (NCCL-like
  // backends): in-process worlds call it from one thread per rank.
  virtual absl::StatusOr<std::unique_ptr<Transport>> Connect(
      int rank, const std::vector<std::string>& addresses) = 0;
};

// ---- Registry ----

using TransportOpener =
    std::function<absl::StatusOr<std::unique_ptr<TransportEndpoint>>(const TransportOptions&)>;
using TransportProbe = std::function<absl::Status()>;

// Registers a backend when constructed. Define one at namespace scope in the
// backend's .cc and build it with alwayslink = 1:
//   const TransportRegistration kRegistration("host", OpenHostEndpoint);
// `probe` says whether the backend can work on this machine (e.g. a GPU for
// "nccl"); null means always. A second registration of a name is ignored.
class TransportRegistration {
 public:
  TransportRegistration(absl::string_view name, TransportOpener open,
                        TransportProbe probe = nullptr);
};

// Opens an endpoint of backend `name`. NOT_FOUND if no such backend is
// linked in (the message lists those that are), else the backend's status.
absl::StatusOr<std::unique_ptr<TransportEndpoint>> OpenTransportEndpoint(
    absl::string_view name, const TransportOptions& options = {});

// OK if backend `name` is linked in and its probe passes; NOT_FOUND or the
// probe's status otherwise.
absl::Status ProbeTransport(absl::string_view name);

// Names of the linked-in backends, sorted.
std::vector<std::string> RegisteredTransports();

// A whole world inside this process, for tests: opens `world_size`
// endpoints of backend `name`, then connects rank r to endpoint r (one
// thread per rank). Result index = rank.
absl::StatusOr<std::vector<std::unique_ptr<Transport>>> ConnectInProcessWorld(
    absl::string_view name, int world_size, const TransportOptions& options = {});

// The address peers dial for a listener bound to `listen_host`:`port`: a
// wildcard host ("0.0.0.0", "::", "[::]", "") is replaced by
// `advertise_host`, or by this machine's hostname when that is empty; an
// IPv6 literal is bracketed.
std::string AdvertisedAddress(absl::string_view listen_host, int port,
                              absl::string_view advertise_host);

// The element-wise maximum AllReduceMax computes (see there).
float MaxIgnoringNan(float a, float b);

}  // namespace paramd

#endif  // PARAMD_TRANSPORT_TRANSPORT_H_
