// File: transport/nccl_transport.h
//
// The "nccl" backend: bulk bytes between GPUs over NCCL,
// control over gRPC. Registered as "nccl" (link //transport:nccl,
// alwayslink; --config=cuda only). Passes the conformance suite
// (transport/nccl_test.cc) with detects_size_mismatch = true and
// buffered_sends = false.
//
// How it works. An endpoint binds to the CUDA device that is current on the
// thread calling OpenNcclEndpoint and opens two "host" endpoints: a header
// channel (carries, per user tag, a small header naming the message's size,
// pieces and communicator generation; small messages ride inline in it) and
// a sync channel (clear-to-send replies and NCCL unique ids), plus a socket
// control channel (transport/socket_channel.h: one TCP connection per
// direction, one write per message) that carries the headers and
// clear-to-sends of NCCL transfers into the same mailboxes in ~20 us instead
// of a gRPC Deliver call's few hundred (falls back to gRPC if a peer has
// none or it fails, but not for a peer that hung up; PARAMD_NCCL_CONTROL=grpc
// at endpoint open turns it off). A message larger than kNcclInlineMaxBytes
// between ranks on DIFFERENT GPUs goes:
//   sender: header on (peer, tag) -> waits for the receiver's clear-to-send
//   receiver: Recv matches the header -> clear-to-send -> ncclRecv
//   sender: ncclSend (one group per message, one ncclSend per piece)
// on a 2-rank communicator dedicated to that (sender -> receiver) direction,
// so the order of NCCL operations on it is the receiver's order and the two
// directions of a pair never wait on each other. Communicators are created
// lazily (the unique id travels in the first header).
//
// Direction communicators are BLOCKING by default (ncclConfig_t::blocking =
// 1; PARAMD_NCCL_BLOCKING=0 at endpoint open gives the earlier non-blocking
// ones, which end every group on a new NCCL thread, ~250 us per
// side: FP8 cold fetch ratio to raw NCCL 0.90-0.94 blocking against
// 0.86-0.92 non-blocking, same-run A/B in docs/BENCHMARKS.md).
// Non-blocking ones are what keeps a dead peer from hanging a call; the
// blocking ones keep that promise this way
// (docs/ARCHITECTURE.md, "Transport communicators"): a detached helper
// thread runs the init and one 16-byte warm-up transfer that connects
// every p2p channel of the direction (NCCL connects them lazily, inside
// the first ncclGroupEnd that uses them, which then waits for the peer);
// the caller waits for the helper against its deadline (on the deadline,
// a shutdown or the peer's hang-up it gives up and the helper aborts the
// communicator when NCCL returns; a helper whose peer never joins stays
// blocked in the init, a leaked thread, never a caller's hang). After the
// warm-up a transfer's ncclGroupEnd only enqueues; the cases where it
// could still wait (NCCL's work FIFO or the stream's launch queue full of
// work stuck on a dead peer) are kept out by enqueuing at most 64 groups
// of a message ahead of their completion. The amax group communicators
// stay non-blocking (init and enqueue polled with ncclCommGetAsyncError).
// Either way every wait for the GPU polls ncclCommGetAsyncError and a CUDA
// event against the caller's deadline, and a deadline, shutdown, NCCL
// error or hang-up of the peer aborts the communicator (ncclCommAbort, on
// a reaper thread: the watchdog that frees a kernel stuck on a dead peer).
// The next message on that direction starts a new generation with a fresh
// id, so a pair recovers after a failed transfer.
//
// A peer's hang-up fails its transfers at once. The control channel holds
// a TCP connection from every peer from the start; when one ends (EOF or
// reset: the peer's process died or its transport shut down), that peer is
// dead for this transport: Recv/RecvDevice from it with nothing queued and
// every Send/SendDevice to it fail at once with UNAVAILABLE naming the
// peer, and a transfer with it in progress (waiting for its clear-to-send,
// its header, the communicator's creation or the GPU) fails within a poll
// and aborts the pair communicator; group communicators with it fail in
// AllReduceMax and WaitStream. A dead peer is not revived: open a new
// world (the device channels do). Without a control channel
// (PARAMD_NCCL_CONTROL=grpc) only the deadline and the host channel's
// goodbye tell.
//
// Ranks on the SAME GPU (and messages to self) cannot share an NCCL
// communicator (NCCL refuses duplicate GPUs): their bytes go inline over the
// header channel. AllReduceMax runs on an NCCL communicator of the group
// (created lazily, id sent by the group's lowest rank over the sync channel)
// when all members are on distinct GPUs, else over the host channel. The
// NCCL all-reduce maps floats to order-preserving integer keys so that NaN,
// +0/-0 and Inf follow FORMATS.md's amax rule exactly (ncclMax on floats
// does not define them).
//
// PARAMD_NCCL_TRACE=1 prints one stderr line per NCCL transfer and side
// with the times of its phases (header, clear-to-send, enqueued, done).
//
// Two daemon PROCESSES on one GPU fetched from over NCCL P2P by one
// trainer gave wrong bytes in daemon_fetch_test; the same shape with raw
// NCCL or this transport alone was clean (transport/nccl_shared_gpu_repro.cc,
// docs/ARCHITECTURE.md, device fetch). The device fetcher refuses that case
// (transport/nccl_address.h) unless NCCL_P2P_DISABLE=1.
//
// Addresses look like "nccl|<header addr>|<sync addr>|<hostname>|<pci bus
// id>|<control addr>" (the last field absent without a control channel;
// transport/nccl_address.h parses them).
#ifndef PARAMD_TRANSPORT_NCCL_TRANSPORT_H_
#define PARAMD_TRANSPORT_NCCL_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "transport/transport.h"

namespace paramd {

// Messages up to this size travel inline over the header channel.
inline constexpr size_t kNcclInlineMaxBytes = 64;
// Pieces of one device message.
inline constexpr size_t kNcclMaxPieces = 4096;

// A device buffer to send / to receive into (device pointers of the
// transport's device).
struct DeviceBytes {
  const void* data = nullptr;
  size_t size = 0;
};
struct MutableDeviceBytes {
  void* data = nullptr;
  size_t size = 0;
};

// The NCCL transport's device-memory API, beside the host-memory Transport
// contract (same threading, deadline and status rules as there).
class NcclTransport : public Transport {
 public:
  // The CUDA device this rank runs on.
  virtual int device() const = 0;

  // Whether bytes to `peer` move over NCCL (a different GPU) rather than
  // inline over gRPC (self, same GPU).
  virtual bool UsesNccl(int peer) const = 0;

  // Sends the device buffers `pieces` to `peer` as one message: one NCCL
  // group with one ncclSend per piece. Waits (on the transport's stream, not
  // the host) for `ready` first when it is not null. Returns once the bytes
  // have left the buffers. INVALID_ARGUMENT for more than kNcclMaxPieces.
  virtual absl::Status SendDevice(int peer, uint64_t tag, absl::Span<const DeviceBytes> pieces,
                                  cudaEvent_t ready, absl::Time deadline) = 0;

  // Like SendDevice, but piece i may leave as soon as `ready[i]` (one event
  // per piece; null: no wait) has completed, without waiting for the
  // others: after one header / clear-to-send exchange the message is
  // enqueued as consecutive NCCL groups, one per run of pieces with the same
  // event, each behind its event on the transport's stream (the receiver
  // posts the same groups; RecvDevice and Recv receive it like any message).
  // For sending tensors while later ones are still being produced (a step's
  // per-tensor quantization) at the control cost of one message.
  // INVALID_ARGUMENT if ready.size() != pieces.size().
  virtual absl::Status SendDevicePipelined(int peer, uint64_t tag,
                                           absl::Span<const DeviceBytes> pieces,
                                           absl::Span<const cudaEvent_t> ready,
                                           absl::Time deadline) = 0;

  // Receives one message from `peer` into `pieces`, whose sizes must equal
  // the sender's pieces one for one (else INVALID_ARGUMENT; the message is
  // consumed and the sender's call succeeds). Returns once the bytes are in
  // device memory: any stream may read them after.
  virtual absl::Status RecvDevice(int peer, uint64_t tag,
                                  absl::Span<const MutableDeviceBytes> pieces,
                                  absl::Time deadline) = 0;

  // AllReduceMax over `count` device floats at `values`, ordered after the
  // work enqueued so far on `stream`; `stream` waits for the result. Only
  // ENQUEUES the collective (the group's communicator is created, blocking,
  // on first use): errors and hangs surface in WaitStream. Groups with two
  // members on one GPU are UNIMPLEMENTED here (use AllReduceMax).
  virtual absl::Status AllReduceMaxDevice(absl::Span<const int> group, float* values, size_t count,
                                          cudaStream_t stream, absl::Time deadline) = 0;

  // Waits until the work enqueued on `stream` so far completes, polling the
  // async errors of this transport's group communicators; on an NCCL error
  // or the deadline it aborts them (UNAVAILABLE / DEADLINE_EXCEEDED; the
  // next collective rebuilds them, every member must then do the same).
  virtual absl::Status WaitStream(cudaStream_t stream, absl::Time deadline) = 0;
};

// Opens an endpoint on the current CUDA device. Same as
// OpenTransportEndpoint("nccl", options). UNAVAILABLE without a GPU.
absl::StatusOr<std::unique_ptr<TransportEndpoint>> OpenNcclEndpoint(
    const TransportOptions& options = {});

// The NCCL API of `transport`, or null if it is another backend.
NcclTransport* AsNcclTransport(Transport* transport);

}  // namespace paramd

#endif  // PARAMD_TRANSPORT_NCCL_TRANSPORT_H_
