// File: transport/nccl_transport_impl.h
//
// INTERNAL to the "nccl" backend: the transport class behind
// nccl_transport.h and the wire structures its three source files share.
//   nccl_transport.cc           construction, the Transport calls (host and
//                               device send/receive), argument checks,
//                               the endpoint and its registration
//   nccl_transport_transfer.cc  one point-to-point transfer: header,
//                               clear-to-send, NCCL groups, communicator
//                               readiness and retirement
//   nccl_transport_group.cc     group communicators: the amax all-reduce and
//                               stream waits that watch them
// Threading: nccl_transport.h's contract. Each Direction's `mu` is held for
// a whole transfer in that direction; a GroupState's `mu` for a whole
// collective; `groups_mu_` only to find or walk the group table.
#ifndef PARAMD_TRANSPORT_NCCL_TRANSPORT_IMPL_H_
#define PARAMD_TRANSPORT_NCCL_TRANSPORT_IMPL_H_

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>
#include <nccl.h>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/log.h"
#include "transport/nccl_address.h"
#include "transport/nccl_comm.h"
#include "transport/nccl_transport.h"
#include "transport/socket_channel.h"

namespace paramd {
namespace nccl_internal {

using transport_internal::Comm;
using transport_internal::Creation;
using transport_internal::SocketChannel;

constexpr uint32_t kMagic = 0x324C4343;  // "CCL2" (headers with part ends)
enum Kind : uint32_t { kInline = 1, kNcclPayload = 2 };
enum Cts : uint32_t { kCtsGo = 1, kCtsRejectSize = 2, kCtsStale = 3 };

// Sync-channel tags (the sync channel carries no user tags).
constexpr uint64_t kCtsTagBase = uint64_t{1} << 60;
constexpr uint64_t kGroupTagBase = uint64_t{2} << 60;
// Host Recv accepts device-sent messages of up to this many pieces.
constexpr size_t kHostRecvMaxPieces = 16;
// NCCL groups of one message enqueued on a communicator and not yet
// completed, at most. A blocking ncclGroupEnd on connected channels does
// not wait for the peer, except when the communicator's work FIFO
// (NCCL_WORK_FIFO_BYTES, 1 MiB by default) is full of work that kernels
// stuck on a dead peer have not consumed (NCCL's waitWorkFifoAvailable
// then spins until an abort) or the stream's launch queue is full of such
// kernels. One group's work is ~48 bytes per piece (ncclDevWorkP2p), so
// 64 groups of a message of at most kNcclMaxPieces pieces stay far below
// both: before group k the caller waits (polled, against its deadline) for
// group k - 64 to complete.
constexpr size_t kMaxGroupsInFlight = 64;
// The control channel's mailboxes: the header channel's and the sync
// channel's (frames land where a gRPC message of that channel would).
enum ControlBox : uint32_t { kHeaderBox = 0, kSyncBox = 1 };

// Followed by uint64 sizes[npieces], then uint64 part_ends[nparts], then
// (kInline) the payload. A kNcclPayload message with nparts > 1 moves as
// nparts consecutive NCCL groups on both sides (part k = pieces
// [part_ends[k-1], part_ends[k])); else as one group.
struct Header {
  uint32_t magic = kMagic;
  uint32_t kind = kInline;
  uint64_t xfer = 0;  // sender's transfer id: the clear-to-send tag
  uint64_t gen = 0;   // generation of the direction's communicator
  uint64_t npieces = 0;
  uint64_t total = 0;
  ncclUniqueId id;  // the communicator of generation `gen`
  uint64_t nparts = 0;
};

// PARAMD_NCCL_TRACE=1: one stderr line per NCCL transfer and side with the
// times (us from the call) of its phases, for finding where a transfer's
// fixed cost goes. Printed after the transfer, so it costs little.
inline bool TraceEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("PARAMD_NCCL_TRACE");
    return v != nullptr && std::string(v) == "1";
  }();
  return enabled;
}

// Phase times of one transfer; t[0] is the call.
struct Trace {
  absl::Time t[5];
  int n = 0;
  void Mark() {
    if (TraceEnabled() && n < 5) t[n++] = absl::Now();
  }
  void Print(const char* side, uint64_t xfer, uint64_t total, int parts) const {
    if (!TraceEnabled() || n < 5) return;
    auto us = [&](int i) { return absl::ToDoubleMicroseconds(t[i] - t[0]); };
    LogInfo("nccl-trace",
            absl::StrFormat("%s xfer %llu bytes %llu parts %d start %lld: %s %.1f  %s %.1f  "
                            "enqueued %.1f  done %.1f us",
                            side, static_cast<unsigned long long>(xfer),
                            static_cast<unsigned long long>(total), parts,
                            static_cast<long long>(absl::ToUnixMicros(t[0])),
                            side[0] == 's' ? "header-sent" : "header-in", us(1),
                            side[0] == 's' ? "cts-in" : "cts-sent", us(2), us(3), us(4)));
  }
};

// When the current thread entered Recv/RecvDevice (for the trace).
inline thread_local absl::Time recv_entered;

using PeerInfo = NcclAddress;

struct Direction {
  // Sender side: the generation announced in headers (and its id).
  absl::Mutex setup_mu;
  uint64_t announced_gen ABSL_GUARDED_BY(setup_mu) = 0;
  ncclUniqueId announced_id ABSL_GUARDED_BY(setup_mu);
  bool renew ABSL_GUARDED_BY(setup_mu) = true;
  // Held for a whole transfer; never taken while holding setup_mu.
  absl::Mutex mu;
  uint64_t gen ABSL_GUARDED_BY(mu) = 0;
  std::unique_ptr<Comm> comm ABSL_GUARDED_BY(mu);
};

struct GroupState {
  absl::Mutex mu;
  std::unique_ptr<Comm> comm ABSL_GUARDED_BY(mu);
  size_t agreed_count ABSL_GUARDED_BY(mu) = ~size_t{0};
};

class NcclTransportImpl final : public NcclTransport {
 public:
  NcclTransportImpl(int rank, int device, bool blocking_pairs, std::vector<PeerInfo> peers,
                    std::unique_ptr<Transport> header, std::unique_ptr<Transport> sync,
                    std::unique_ptr<SocketChannel> control);

  ~NcclTransportImpl() override;

  absl::Status Init();

  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(peers_.size()); }
  absl::string_view backend() const override { return "nccl"; }
  int device() const override { return device_; }

  bool UsesNccl(int peer) const override {
    return peer >= 0 && peer < world_size() && peer != rank_ &&
           peers_[peer].gpu != peers_[rank_].gpu;
  }

  absl::Status Send(int peer, uint64_t tag, absl::Span<const uint8_t> bytes,
                    absl::Time deadline) override;

  absl::StatusOr<size_t> Recv(int peer, uint64_t tag, absl::Span<uint8_t> buffer,
                              absl::Time deadline) override;

  absl::Status SendDevice(int peer, uint64_t tag, absl::Span<const DeviceBytes> pieces,
                          cudaEvent_t ready, absl::Time deadline) override;

  absl::Status SendDevicePipelined(int peer, uint64_t tag, absl::Span<const DeviceBytes> pieces,
                                   absl::Span<const cudaEvent_t> ready,
                                   absl::Time deadline) override;

  // Device pieces to a peer on the same GPU (or self), through the host.
  absl::Status SendDeviceInline(int peer, uint64_t tag, absl::Span<const DeviceBytes> pieces,
                                const std::vector<uint64_t>& sizes, absl::Time deadline);

  absl::Status RecvDevice(int peer, uint64_t tag, absl::Span<const MutableDeviceBytes> pieces,
                          absl::Time deadline) override;

  absl::Status AllReduceMax(absl::Span<const int> group, absl::Span<float> values,
                            absl::Time deadline) override;

  absl::Status AllReduceMaxDevice(absl::Span<const int> group, float* values, size_t count,
                                  cudaStream_t stream, absl::Time deadline) override;

  absl::Status WaitStream(cudaStream_t stream, absl::Time deadline) override;

  absl::Status CanConnect(int peer, absl::Time deadline) override;

  void Shutdown() override;

 private:
  struct Parsed {
    Header header;
    std::vector<uint64_t> sizes;
    std::vector<uint64_t> part_ends;  // empty: one part
    const uint8_t* payload = nullptr;
  };

  static absl::StatusOr<Parsed> Parse(const uint8_t* message, size_t size);

  absl::Status CheckPeerAndTag(int peer, uint64_t tag) const;

  absl::Status CheckCall(int peer, uint64_t tag, absl::Time deadline) const;

  // The first of `ranks` that hung up on the control channel, or -1.
  int GonePeer(const std::vector<int>& ranks) const;

  absl::Status PeerGoneError(absl::string_view what, int peer) const;

  absl::Status CheckGroup(absl::Span<const int> group) const;

  bool DistinctGpus(absl::Span<const int> group) const;

  // Yield (low latency for the data plane's millisecond transfers) for the
  // first ~200k polls, then sleep in 100 us steps.
  static void Backoff(int spin);

  // Waits for the communicator to be ready (no pending init or enqueue) and,
  // if `event` is set, for the event; polls ncclCommGetAsyncError.
  absl::Status Poll(Comm& c, cudaEvent_t event, absl::Time deadline, absl::string_view what);

  // A direction's communicator with `peer` (rank 0 sends, rank 1
  // receives): blocking with a warm-up at creation (StartPairComm, the
  // default), or non-blocking (PARAMD_NCCL_BLOCKING=0).
  absl::StatusOr<std::unique_ptr<Comm>> StartDirectionComm(int peer, int rank,
                                                           const ncclUniqueId& id,
                                                           absl::Time deadline);

  // Before group k of a message of `groups` groups: waits until at most
  // kMaxGroupsInFlight - 1 of its groups are pending (see there).
  absl::Status WaitForGroupSlot(Comm& c, size_t k, size_t groups, absl::Time deadline,
                                absl::string_view what);

  // After group k was enqueued (pairs with WaitForGroupSlot).
  absl::Status GroupEnqueued(Comm& c, size_t k, size_t groups);

  // Waits until `c` can take operations: its blocking creation (init and
  // warm-up on the helper thread) has finished, or its non-blocking init.
  // On the deadline or a shutdown the creation is abandoned (the helper
  // aborts it) and the caller gets the error, never a hang.
  absl::Status Ready(Comm& c, absl::Time deadline);

  // ncclGroupEnd / a collective may return ncclInProgress on a non-blocking
  // communicator: the operation is enqueued once the async error is success.
  absl::Status Enqueued(Comm& c, ncclResult_t r, absl::Time deadline, absl::string_view what);

  absl::Status SendInline(int peer, uint64_t tag, const std::vector<uint64_t>& sizes,
                          absl::Span<const uint8_t> payload, absl::Time deadline);

  void ReplyCts(int peer, uint64_t xfer, Cts reply, absl::Time deadline);

  // A header or clear-to-send of an NCCL transfer: over the socket control
  // channel when both ends have one (one write, ~20 us to the peer's
  // mailbox), else, or if that fails, over the gRPC channel of `box`
  // (a Deliver call, a few hundred us). Ordering: a transfer's header is
  // consumed before its SendNccl returns, so per-tag FIFO holds across the
  // two channels.
  absl::Status SendControl(ControlBox box, int peer, uint64_t tag, absl::Span<const uint8_t> bytes,
                           absl::Time deadline);

  // Aborts a failed communicator on another thread, so that the failing call
  // returns at its deadline instead of after ncclCommAbort (~0.5 s).
  void Retire(std::unique_ptr<Comm> comm);

  void Renew(Direction& d);

  // `piece_ready` (empty, or one event per piece): piece i leaves after
  // piece_ready[i]; the message moves as one NCCL group per run of pieces
  // with the same event. Else all pieces after `ready`, in one group.
  absl::Status SendNccl(int peer, uint64_t tag, const std::vector<uint64_t>& sizes,
                        const uint8_t* host, absl::Span<const DeviceBytes> pieces,
                        cudaEvent_t ready, absl::Span<const cudaEvent_t> piece_ready,
                        absl::Time deadline);

  // `host` (capacity already checked) or `pieces` (sizes already checked).
  absl::Status RecvNccl(int peer, const Parsed& p, uint8_t* host,
                        absl::Span<const MutableDeviceBytes> pieces, absl::Time deadline);

  GroupState& GetGroup(absl::Span<const int> group);

  // The body of a group all-reduce of `count` values: on the group's
  // communicator (created on first use), under its lock, once every member
  // agreed on `count` (skipped when it is 0). A failure other than
  // INVALID_ARGUMENT retires the communicator.
  absl::Status OnGroupComm(absl::Span<const int> group, size_t count, absl::Time deadline,
                           absl::FunctionRef<absl::Status(Comm&)> reduce);

  absl::Status EnsureGroupComm(GroupState& g, absl::Span<const int> group, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);

  // All members agree on `count` (else INVALID_ARGUMENT at every member):
  // max over [n, ~n] gives [max n, ~min n]. Skipped when already agreed.
  absl::Status AgreeOnCount(GroupState& g, size_t count, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);

  absl::Status EnqueueKeyAllReduce(Comm& c, void* values, size_t count, absl::Time deadline);

  absl::Status GroupAsyncErrors();

  void AbortGroups();

  const int rank_;
  const int device_;
  // Direction communicators blocking (StartPairComm) or not (StartComm).
  const bool blocking_pairs_;
  const std::vector<PeerInfo> peers_;
  const std::unique_ptr<Transport> header_;
  const std::unique_ptr<Transport> sync_;
  // Null when this rank has no socket control channel.
  const std::unique_ptr<SocketChannel> control_;
  std::atomic<bool> shut_down_{false};
  std::atomic<uint64_t> next_xfer_{0};
  absl::Mutex reap_mu_;
  std::vector<std::thread> reapers_ ABSL_GUARDED_BY(reap_mu_);
  cudaStream_t inline_stream_ = nullptr;
  std::vector<std::unique_ptr<Direction>> send_;
  std::vector<std::unique_ptr<Direction>> recv_;
  absl::Mutex groups_mu_;
  std::map<std::vector<int>, std::unique_ptr<GroupState>> groups_ ABSL_GUARDED_BY(groups_mu_);
};

}  // namespace nccl_internal
}  // namespace paramd

#endif  // PARAMD_TRANSPORT_NCCL_TRANSPORT_IMPL_H_
