#include "transport/nccl_transport.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nccl.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "auth/security.h"
#include "common/gpu_status.h"
#include "common/log.h"
#include "common/scoped_device.h"
#include "common/status_macros.h"
#include "transport/message_transport.h"
#include "transport/nccl_address.h"
#include "transport/nccl_amax_keys.h"
#include "transport/nccl_comm.h"
#include "transport/socket_channel.h"

namespace paramd {
namespace {

using transport_internal::BlockingPairsFromEnv;
using transport_internal::Comm;
using transport_internal::Creation;
using transport_internal::MessageTransport;
using transport_internal::SocketChannel;
using transport_internal::StartComm;
using transport_internal::StartPairComm;

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
bool TraceEnabled() {
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
thread_local absl::Time recv_entered;

// [begin, end) piece ranges of the parts: one part when `ends` is empty.
std::vector<std::pair<size_t, size_t>> PartRanges(size_t npieces,
                                                  const std::vector<uint64_t>& ends) {
  std::vector<std::pair<size_t, size_t>> ranges;
  size_t begin = 0;
  for (uint64_t end : ends) {
    ranges.emplace_back(begin, end);
    begin = end;
  }
  if (ends.empty()) ranges.emplace_back(0, npieces);
  return ranges;
}

using PeerInfo = NcclAddress;

// Where the bytes of a message come from / go to.
struct HostSource {
  const uint8_t* data = nullptr;
};

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

uint64_t GroupTag(absl::Span<const int> group) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (int r : group) {
    h ^= static_cast<uint64_t>(r) + 0x9E3779B97F4A7C15ull;
    h *= 1099511628211ull;
  }
  return kGroupTagBase + (h & ((uint64_t{1} << 56) - 1));
}

class NcclTransportImpl final : public NcclTransport {
 public:
  NcclTransportImpl(int rank, int device, bool blocking_pairs, std::vector<PeerInfo> peers,
                    std::unique_ptr<Transport> header, std::unique_ptr<Transport> sync,
                    std::unique_ptr<SocketChannel> control)
      : rank_(rank),
        device_(device),
        blocking_pairs_(blocking_pairs),
        peers_(std::move(peers)),
        header_(std::move(header)),
        sync_(std::move(sync)),
        control_(std::move(control)) {
    for (size_t i = 0; i < peers_.size(); ++i) {
      send_.push_back(std::make_unique<Direction>());
      recv_.push_back(std::make_unique<Direction>());
    }
  }

  ~NcclTransportImpl() override {
    Shutdown();
    {
      absl::MutexLock lock(&reap_mu_);
      for (std::thread& t : reapers_) t.join();
    }
    ScopedDevice guard(device_);
    if (inline_stream_ != nullptr) cudaStreamDestroy(inline_stream_);
  }

  absl::Status Init() {
    ScopedDevice guard(device_);
    GPU_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&inline_stream_, cudaStreamNonBlocking));
    return absl::OkStatus();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(peers_.size()); }
  absl::string_view backend() const override { return "nccl"; }
  int device() const override { return device_; }

  bool UsesNccl(int peer) const override {
    return peer >= 0 && peer < world_size() && peer != rank_ &&
           peers_[peer].gpu != peers_[rank_].gpu;
  }

  absl::Status Send(int peer, uint64_t tag, absl::Span<const uint8_t> bytes,
                    absl::Time deadline) override {
    RETURN_IF_ERROR(CheckCall(peer, tag, deadline));
    ScopedDevice guard(device_);
    const uint64_t size = bytes.size();
    if (!UsesNccl(peer) || bytes.size() <= kNcclInlineMaxBytes) {
      return SendInline(peer, tag, {size}, bytes, deadline);
    }
    return SendNccl(peer, tag, {size}, bytes.data(), {}, nullptr, {}, deadline);
  }

  absl::StatusOr<size_t> Recv(int peer, uint64_t tag, absl::Span<uint8_t> buffer,
                              absl::Time deadline) override {
    if (TraceEnabled()) recv_entered = absl::Now();
    RETURN_IF_ERROR(CheckPeerAndTag(peer, tag));
    ScopedDevice guard(device_);
    const size_t capacity = sizeof(Header) + 16 * kHostRecvMaxPieces + buffer.size();
    std::unique_ptr<uint8_t[]> message(new uint8_t[capacity]);
    ASSIGN_OR_RETURN(size_t got,
                     header_->Recv(peer, tag, absl::MakeSpan(message.get(), capacity), deadline));
    ASSIGN_OR_RETURN(Parsed p, Parse(message.get(), got));
    if (p.header.total > buffer.size()) {
      if (p.header.kind == kNcclPayload) ReplyCts(peer, p.header.xfer, kCtsRejectSize, deadline);
      return absl::InvalidArgumentError(
          absl::StrCat("message of ", p.header.total, " bytes for a buffer of ", buffer.size()));
    }
    if (p.header.kind == kInline) {
      if (p.header.total > 0) std::memcpy(buffer.data(), p.payload, p.header.total);
      return p.header.total;
    }
    RETURN_IF_ERROR(RecvNccl(peer, p, buffer.data(), {}, deadline));
    return p.header.total;
  }

  absl::Status SendDevice(int peer, uint64_t tag, absl::Span<const DeviceBytes> pieces,
                          cudaEvent_t ready, absl::Time deadline) override {
    RETURN_IF_ERROR(CheckCall(peer, tag, deadline));
    if (pieces.size() > kNcclMaxPieces) {
      return absl::InvalidArgumentError(absl::StrCat(pieces.size(), " pieces"));
    }
    ScopedDevice guard(device_);
    std::vector<uint64_t> sizes;
    for (const DeviceBytes& p : pieces) sizes.push_back(p.size);
    if (UsesNccl(peer)) return SendNccl(peer, tag, sizes, nullptr, pieces, ready, {}, deadline);
    // Same GPU or self: through the host.
    if (ready != nullptr) GPU_RETURN_IF_ERROR(cudaEventSynchronize(ready));
    return SendDeviceInline(peer, tag, pieces, sizes, deadline);
  }

  absl::Status SendDevicePipelined(int peer, uint64_t tag, absl::Span<const DeviceBytes> pieces,
                                   absl::Span<const cudaEvent_t> ready,
                                   absl::Time deadline) override {
    RETURN_IF_ERROR(CheckCall(peer, tag, deadline));
    if (pieces.size() > kNcclMaxPieces || ready.size() != pieces.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(pieces.size(), " pieces, ", ready.size(), " ready events"));
    }
    ScopedDevice guard(device_);
    std::vector<uint64_t> sizes;
    for (const DeviceBytes& p : pieces) sizes.push_back(p.size);
    if (UsesNccl(peer))
      return SendNccl(peer, tag, sizes, nullptr, pieces, nullptr, ready, deadline);
    for (size_t i = 0; i < ready.size(); ++i) {
      if (ready[i] != nullptr && (i == 0 || ready[i] != ready[i - 1])) {
        GPU_RETURN_IF_ERROR(cudaEventSynchronize(ready[i]));
      }
    }
    return SendDeviceInline(peer, tag, pieces, sizes, deadline);
  }

  // Device pieces to a peer on the same GPU (or self), through the host.
  absl::Status SendDeviceInline(int peer, uint64_t tag, absl::Span<const DeviceBytes> pieces,
                                const std::vector<uint64_t>& sizes, absl::Time deadline) {
    size_t total = 0;
    for (uint64_t s : sizes) total += s;
    std::unique_ptr<uint8_t[]> host(new uint8_t[total > 0 ? total : 1]);
    size_t offset = 0;
    for (const DeviceBytes& p : pieces) {
      if (p.size == 0) continue;
      GPU_RETURN_IF_ERROR(cudaMemcpyAsync(host.get() + offset, p.data, p.size,
                                          cudaMemcpyDeviceToHost, inline_stream_));
      offset += p.size;
    }
    GPU_RETURN_IF_ERROR(cudaStreamSynchronize(inline_stream_));
    return SendInline(peer, tag, sizes, absl::MakeConstSpan(host.get(), total), deadline);
  }

  absl::Status RecvDevice(int peer, uint64_t tag, absl::Span<const MutableDeviceBytes> pieces,
                          absl::Time deadline) override {
    if (TraceEnabled()) recv_entered = absl::Now();
    RETURN_IF_ERROR(CheckPeerAndTag(peer, tag));
    if (pieces.size() > kNcclMaxPieces) {
      return absl::InvalidArgumentError(absl::StrCat(pieces.size(), " pieces"));
    }
    ScopedDevice guard(device_);
    size_t total = 0;
    for (const MutableDeviceBytes& p : pieces) total += p.size;
    const size_t capacity =
        sizeof(Header) + 16 * pieces.size() + (UsesNccl(peer) ? kNcclInlineMaxBytes : total);
    std::unique_ptr<uint8_t[]> message(new uint8_t[capacity]);
    ASSIGN_OR_RETURN(size_t got,
                     header_->Recv(peer, tag, absl::MakeSpan(message.get(), capacity), deadline));
    ASSIGN_OR_RETURN(Parsed p, Parse(message.get(), got));
    bool match = p.sizes.size() == pieces.size();
    for (size_t i = 0; match && i < pieces.size(); ++i) match = p.sizes[i] == pieces[i].size;
    if (!match) {
      if (p.header.kind == kNcclPayload) ReplyCts(peer, p.header.xfer, kCtsRejectSize, deadline);
      return absl::InvalidArgumentError(absl::StrCat("message of ", p.sizes.size(), " pieces (",
                                                     p.header.total, " bytes) does not match the ",
                                                     pieces.size(), " receive buffers"));
    }
    if (p.header.kind == kInline) {
      size_t offset = 0;
      for (const MutableDeviceBytes& piece : pieces) {
        if (piece.size == 0) continue;
        GPU_RETURN_IF_ERROR(cudaMemcpyAsync(piece.data, p.payload + offset, piece.size,
                                            cudaMemcpyHostToDevice, inline_stream_));
        offset += piece.size;
      }
      GPU_RETURN_IF_ERROR(cudaStreamSynchronize(inline_stream_));
      return absl::OkStatus();
    }
    return RecvNccl(peer, p, nullptr, pieces, deadline);
  }

  absl::Status AllReduceMax(absl::Span<const int> group, absl::Span<float> values,
                            absl::Time deadline) override {
    RETURN_IF_ERROR(CheckGroup(group));
    if (group.size() == 1) return absl::OkStatus();
    if (!DistinctGpus(group)) return sync_->AllReduceMax(group, values, deadline);
    ScopedDevice guard(device_);
    GroupState& g = GetGroup(group);
    absl::MutexLock lock(&g.mu);
    RETURN_IF_ERROR(EnsureGroupComm(g, group, deadline));
    Comm& c = *g.comm;
    absl::Status s = [&]() -> absl::Status {
      RETURN_IF_ERROR(AgreeOnCount(g, values.size(), deadline));
      const size_t bytes = values.size() * sizeof(float);
      if (bytes == 0) return absl::OkStatus();
      RETURN_IF_ERROR(c.EnsureStaging(bytes, /*host=*/true));
      std::memcpy(c.pinned, values.data(), bytes);
      GPU_RETURN_IF_ERROR(
          cudaMemcpyAsync(c.dev, c.pinned, bytes, cudaMemcpyHostToDevice, c.stream));
      RETURN_IF_ERROR(EnqueueKeyAllReduce(c, c.dev, values.size(), deadline));
      GPU_RETURN_IF_ERROR(
          cudaMemcpyAsync(c.pinned, c.dev, bytes, cudaMemcpyDeviceToHost, c.stream));
      GPU_RETURN_IF_ERROR(cudaEventRecord(c.done, c.stream));
      RETURN_IF_ERROR(Poll(c, c.done, deadline, "all-reduce"));
      std::memcpy(values.data(), c.pinned, bytes);
      return absl::OkStatus();
    }();
    if (!s.ok() && s.code() != absl::StatusCode::kInvalidArgument) Retire(std::move(g.comm));
    return s;
  }

  absl::Status AllReduceMaxDevice(absl::Span<const int> group, float* values, size_t count,
                                  cudaStream_t stream, absl::Time deadline) override {
    RETURN_IF_ERROR(CheckGroup(group));
    if (group.size() == 1) return absl::OkStatus();
    if (!DistinctGpus(group)) {
      return absl::UnimplementedError("device all-reduce over a group with two ranks on one GPU");
    }
    ScopedDevice guard(device_);
    GroupState& g = GetGroup(group);
    absl::MutexLock lock(&g.mu);
    RETURN_IF_ERROR(EnsureGroupComm(g, group, deadline));
    Comm& c = *g.comm;
    absl::Status s = [&]() -> absl::Status {
      RETURN_IF_ERROR(AgreeOnCount(g, count, deadline));
      if (count == 0) return absl::OkStatus();
      GPU_RETURN_IF_ERROR(cudaEventRecord(c.ready, stream));
      GPU_RETURN_IF_ERROR(cudaStreamWaitEvent(c.stream, c.ready, 0));
      RETURN_IF_ERROR(EnqueueKeyAllReduce(c, values, count, deadline));
      GPU_RETURN_IF_ERROR(cudaEventRecord(c.done, c.stream));
      GPU_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, c.done, 0));
      return absl::OkStatus();
    }();
    if (!s.ok() && s.code() != absl::StatusCode::kInvalidArgument) Retire(std::move(g.comm));
    return s;
  }

  absl::Status WaitStream(cudaStream_t stream, absl::Time deadline) override {
    if (shut_down_.load()) return absl::FailedPreconditionError("transport is shut down");
    ScopedDevice guard(device_);
    cudaEvent_t event;
    GPU_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    absl::Status s = GPU_STATUS(cudaEventRecord(event, stream));
    for (int spin = 0; s.ok(); ++spin) {
      cudaError_t q = cudaEventQuery(event);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) {
        s = GPU_STATUS(q);
        break;
      }
      s = GroupAsyncErrors();
      if (!s.ok()) break;
      if (shut_down_.load())
        s = absl::CancelledError("transport shut down");
      else if (absl::Now() >= deadline)
        s = absl::DeadlineExceededError("stream wait");
      if (!s.ok()) break;
      Backoff(spin);
    }
    if (!s.ok()) AbortGroups();
    cudaEventDestroy(event);
    return s;
  }

  absl::Status CanConnect(int peer, absl::Time deadline) override {
    if (shut_down_.load()) return absl::FailedPreconditionError("transport is shut down");
    if (peer < 0 || peer >= world_size()) {
      return absl::InvalidArgumentError(absl::StrCat("peer ", peer));
    }
    return header_->CanConnect(peer, deadline);
  }

  void Shutdown() override {
    if (shut_down_.exchange(true)) return;
    header_->Shutdown();
    sync_->Shutdown();
    if (control_ != nullptr) control_->Close();
    ScopedDevice guard(device_);
    for (auto* directions : {&send_, &recv_}) {
      for (auto& d : *directions) {
        absl::MutexLock lock(&d->mu);
        d->comm.reset();
      }
    }
    AbortGroups();
  }

 private:
  struct Parsed {
    Header header;
    std::vector<uint64_t> sizes;
    std::vector<uint64_t> part_ends;  // empty: one part
    const uint8_t* payload = nullptr;
  };

  static absl::StatusOr<Parsed> Parse(const uint8_t* message, size_t size) {
    Parsed p;
    if (size < sizeof(Header)) return absl::InternalError("short nccl header");
    std::memcpy(&p.header, message, sizeof(Header));
    const Header& h = p.header;
    if (h.magic != kMagic || (h.kind != kInline && h.kind != kNcclPayload) ||
        h.npieces > kNcclMaxPieces || h.nparts > h.npieces ||
        (h.kind == kInline && h.nparts != 0) ||
        size < sizeof(Header) + 8 * (h.npieces + h.nparts)) {
      return absl::InternalError("malformed nccl header");
    }
    p.sizes.resize(h.npieces);
    if (h.npieces > 0) std::memcpy(p.sizes.data(), message + sizeof(Header), 8 * h.npieces);
    p.part_ends.resize(h.nparts);
    if (h.nparts > 0) {
      std::memcpy(p.part_ends.data(), message + sizeof(Header) + 8 * h.npieces, 8 * h.nparts);
      for (size_t k = 0; k < h.nparts; ++k) {
        if (p.part_ends[k] <= (k == 0 ? 0 : p.part_ends[k - 1]) || p.part_ends[k] > h.npieces) {
          return absl::InternalError("malformed nccl part ends");
        }
      }
      if (p.part_ends.back() != h.npieces) return absl::InternalError("malformed nccl part ends");
    }
    uint64_t total = 0;
    for (uint64_t s : p.sizes) total += s;
    const size_t head = sizeof(Header) + 8 * (h.npieces + h.nparts);
    p.payload = message + head;
    const size_t payload = size - head;
    if (total != h.total || (h.kind == kInline && payload != total)) {
      return absl::InternalError("nccl header sizes disagree");
    }
    return p;
  }

  absl::Status CheckPeerAndTag(int peer, uint64_t tag) const {
    if (shut_down_.load()) return absl::FailedPreconditionError("transport is shut down");
    if (peer < 0 || peer >= world_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("peer ", peer, " outside [0, ", world_size(), ")"));
    }
    if (tag > kMaxUserTag) return absl::InvalidArgumentError(absl::StrCat("tag ", tag));
    return absl::OkStatus();
  }

  absl::Status CheckCall(int peer, uint64_t tag, absl::Time deadline) const {
    RETURN_IF_ERROR(CheckPeerAndTag(peer, tag));
    // A peer that hung up gets nothing more (its receives fail in the
    // mailbox the same way).
    if (control_ != nullptr) RETURN_IF_ERROR(control_->PeerStatus(peer));
    if (absl::Now() >= deadline) return absl::DeadlineExceededError("deadline already passed");
    return absl::OkStatus();
  }

  // The first of `ranks` that hung up on the control channel, or -1.
  int GonePeer(const std::vector<int>& ranks) const {
    if (control_ == nullptr) return -1;
    for (int r : ranks) {
      if (control_->PeerGone(r)) return r;
    }
    return -1;
  }

  absl::Status PeerGoneError(absl::string_view what, int peer) const {
    return absl::UnavailableError(absl::StrCat(what, ": ", control_->PeerStatus(peer).message()));
  }

  absl::Status CheckGroup(absl::Span<const int> group) const {
    if (shut_down_.load()) return absl::FailedPreconditionError("transport is shut down");
    bool ok = !group.empty();
    bool mine = false;
    for (size_t i = 0; ok && i < group.size(); ++i) {
      ok = group[i] >= 0 && group[i] < world_size() && (i == 0 || group[i] > group[i - 1]);
      mine |= group[i] == rank_;
    }
    if (!ok || !mine) {
      return absl::InvalidArgumentError(
          "group must be strictly increasing ranks of the world and contain this rank");
    }
    return absl::OkStatus();
  }

  bool DistinctGpus(absl::Span<const int> group) const {
    for (size_t i = 0; i < group.size(); ++i) {
      for (size_t j = i + 1; j < group.size(); ++j) {
        if (peers_[group[i]].gpu == peers_[group[j]].gpu) return false;
      }
    }
    return true;
  }

  // Yield (low latency for the data plane's millisecond transfers) for the
  // first ~200k polls, then sleep in 100 us steps.
  static void Backoff(int spin) {
    if (spin < 200000) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(absl::Microseconds(100));
    }
  }

  // Waits for the communicator to be ready (no pending init or enqueue) and,
  // if `event` is set, for the event; polls ncclCommGetAsyncError.
  absl::Status Poll(Comm& c, cudaEvent_t event, absl::Time deadline, absl::string_view what) {
    for (int spin = 0;; ++spin) {
      if (shut_down_.load()) return absl::CancelledError(absl::StrCat(what, ": shut down"));
      // A peer's hang-up: a kernel waiting on it would only end at the
      // deadline; the caller retires (aborts) the communicator.
      if (const int gone = GonePeer(c.peers); gone >= 0) return PeerGoneError(what, gone);
      ncclResult_t async = ncclSuccess;
      ncclResult_t r = ncclCommGetAsyncError(c.comm, &async);
      if (r != ncclSuccess) async = r;
      if (async != ncclSuccess && async != ncclInProgress) {
        return absl::UnavailableError(
            absl::StrCat(what, ": NCCL error ", ncclGetErrorString(async)));
      }
      if (async == ncclSuccess) {
        if (event == nullptr) return absl::OkStatus();
        cudaError_t q = cudaEventQuery(event);
        if (q == cudaSuccess) return absl::OkStatus();
        if (q != cudaErrorNotReady) return GPU_STATUS(q);
      }
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(what, ": deadline exceeded"));
      }
      Backoff(spin);
    }
  }

  // A direction's communicator with `peer` (rank 0 sends, rank 1
  // receives): blocking with a warm-up at creation (StartPairComm, the
  // default), or non-blocking (PARAMD_NCCL_BLOCKING=0).
  absl::StatusOr<std::unique_ptr<Comm>> StartDirectionComm(int peer, int rank,
                                                           const ncclUniqueId& id,
                                                           absl::Time deadline) {
    absl::StatusOr<std::unique_ptr<Comm>> c = blocking_pairs_
                                                  ? StartPairComm(device_, rank, id, deadline)
                                                  : StartComm(device_, 2, rank, id);
    if (c.ok()) (*c)->peers = {peer};
    return c;
  }

  // Before group k of a message of `groups` groups: waits until at most
  // kMaxGroupsInFlight - 1 of its groups are pending (see there).
  absl::Status WaitForGroupSlot(Comm& c, size_t k, size_t groups, absl::Time deadline,
                                absl::string_view what) {
    if (groups <= kMaxGroupsInFlight) return absl::OkStatus();
    while (c.group_done.size() < kMaxGroupsInFlight) {
      cudaEvent_t e = nullptr;
      GPU_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      c.group_done.push_back(e);
    }
    if (k < kMaxGroupsInFlight) return absl::OkStatus();
    return Poll(c, c.group_done[k % kMaxGroupsInFlight], deadline, what);
  }

  // After group k was enqueued (pairs with WaitForGroupSlot).
  absl::Status GroupEnqueued(Comm& c, size_t k, size_t groups) {
    if (groups <= kMaxGroupsInFlight) return absl::OkStatus();
    return GPU_STATUS(cudaEventRecord(c.group_done[k % kMaxGroupsInFlight], c.stream));
  }

  // Waits until `c` can take operations: its blocking creation (init and
  // warm-up on the helper thread) has finished, or its non-blocking init.
  // On the deadline or a shutdown the creation is abandoned (the helper
  // aborts it) and the caller gets the error, never a hang.
  absl::Status Ready(Comm& c, absl::Time deadline) {
    if (c.creation == nullptr) return Poll(c, nullptr, deadline, "communicator init");
    const std::shared_ptr<Creation> creation = c.creation;  // outlives the lock below
    for (int spin = 0;; ++spin) {
      absl::Status s;
      {
        absl::MutexLock lock(&creation->mu);
        if (creation->done) {
          s = creation->status;
          c.comm = creation->comm;
          creation->comm = nullptr;
        } else if (shut_down_.load()) {
          s = absl::CancelledError("communicator init: shut down");
        } else if (const int gone = GonePeer(c.peers); gone >= 0) {
          s = PeerGoneError("communicator init", gone);
        } else if (absl::Now() >= deadline) {
          s = absl::DeadlineExceededError("communicator init: deadline exceeded");
        } else {
          s = absl::UnknownError("pending");
        }
        if (!creation->done && s.code() != absl::StatusCode::kUnknown) creation->abandoned = true;
        if (creation->done || s.code() != absl::StatusCode::kUnknown) {
          c.creation.reset();
          if (creation->done && !s.ok()) {
            return absl::UnavailableError(absl::StrCat("communicator init: ", s.message()));
          }
          return s;
        }
      }
      Backoff(spin);
    }
  }

  // ncclGroupEnd / a collective may return ncclInProgress on a non-blocking
  // communicator: the operation is enqueued once the async error is success.
  absl::Status Enqueued(Comm& c, ncclResult_t r, absl::Time deadline, absl::string_view what) {
    if (r != ncclSuccess && r != ncclInProgress) {
      return absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
    }
    return Poll(c, nullptr, deadline, what);
  }

  absl::Status SendInline(int peer, uint64_t tag, const std::vector<uint64_t>& sizes,
                          absl::Span<const uint8_t> payload, absl::Time deadline) {
    Header h;
    std::memset(&h.id, 0, sizeof(h.id));
    h.kind = kInline;
    h.npieces = sizes.size();
    h.total = payload.size();
    std::string message(sizeof(Header) + 8 * sizes.size() + payload.size(), '\0');
    std::memcpy(&message[0], &h, sizeof(h));
    if (!sizes.empty()) std::memcpy(&message[sizeof(h)], sizes.data(), 8 * sizes.size());
    if (!payload.empty()) {
      std::memcpy(&message[sizeof(h) + 8 * sizes.size()], payload.data(), payload.size());
    }
    return header_->Send(
        peer, tag,
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(message.data()), message.size()),
        deadline);
  }

  void ReplyCts(int peer, uint64_t xfer, Cts reply, absl::Time deadline) {
    const uint32_t word = reply;
    // Best effort: if it is lost the sender meets its deadline.
    (void)SendControl(kSyncBox, peer, kCtsTagBase + xfer,
                      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(&word), 4),
                      std::max(deadline, absl::Now() + absl::Seconds(1)));
  }

  // A header or clear-to-send of an NCCL transfer: over the socket control
  // channel when both ends have one (one write, ~20 us to the peer's
  // mailbox), else, or if that fails, over the gRPC channel of `box`
  // (a Deliver call, a few hundred us). Ordering: a transfer's header is
  // consumed before its SendNccl returns, so per-tag FIFO holds across the
  // two channels.
  absl::Status SendControl(ControlBox box, int peer, uint64_t tag, absl::Span<const uint8_t> bytes,
                           absl::Time deadline) {
    if (control_ != nullptr && !peers_[peer].control_address.empty()) {
      absl::Status s = control_->Send(peer, box, tag, bytes, deadline);
      // A peer that hung up is not tried again over gRPC.
      if (s.ok() || control_->PeerGone(peer)) return s;
    }
    return (box == kHeaderBox ? header_ : sync_)->Send(peer, tag, bytes, deadline);
  }

  // Aborts a failed communicator on another thread, so that the failing call
  // returns at its deadline instead of after ncclCommAbort (~0.5 s).
  void Retire(std::unique_ptr<Comm> comm) {
    if (comm == nullptr) return;
    absl::MutexLock lock(&reap_mu_);
    reapers_.emplace_back([c = std::move(comm)]() mutable { c.reset(); });
  }

  void Renew(Direction& d) {
    absl::MutexLock lock(&d.setup_mu);
    d.renew = true;
  }

  // `piece_ready` (empty, or one event per piece): piece i leaves after
  // piece_ready[i]; the message moves as one NCCL group per run of pieces
  // with the same event. Else all pieces after `ready`, in one group.
  absl::Status SendNccl(int peer, uint64_t tag, const std::vector<uint64_t>& sizes,
                        const uint8_t* host, absl::Span<const DeviceBytes> pieces,
                        cudaEvent_t ready, absl::Span<const cudaEvent_t> piece_ready,
                        absl::Time deadline) {
    Trace trace;
    trace.Mark();
    Direction& d = *send_[peer];
    Header h;
    h.kind = kNcclPayload;
    h.xfer = next_xfer_.fetch_add(1);
    h.npieces = sizes.size();
    for (uint64_t s : sizes) h.total += s;
    std::vector<uint64_t> part_ends;
    std::vector<cudaEvent_t> part_ready;
    for (size_t i = 0; i < piece_ready.size(); ++i) {
      if (i > 0 && piece_ready[i] != piece_ready[i - 1]) part_ends.push_back(i);
      if (i == 0 || piece_ready[i] != piece_ready[i - 1]) part_ready.push_back(piece_ready[i]);
    }
    if (part_ends.empty()) {
      if (!piece_ready.empty()) ready = piece_ready[0];
      part_ready = {ready};
    } else {
      part_ends.push_back(sizes.size());
    }
    h.nparts = part_ends.size();
    {
      absl::MutexLock lock(&d.setup_mu);
      if (d.renew) {
        GPU_RETURN_IF_ERROR(ncclGetUniqueId(&d.announced_id));
        ++d.announced_gen;
        d.renew = false;
      }
      h.gen = d.announced_gen;
      h.id = d.announced_id;
    }
    std::string message(sizeof(Header) + 8 * (sizes.size() + part_ends.size()), '\0');
    std::memcpy(&message[0], &h, sizeof(h));
    if (!sizes.empty()) std::memcpy(&message[sizeof(h)], sizes.data(), 8 * sizes.size());
    if (!part_ends.empty()) {
      std::memcpy(&message[sizeof(h) + 8 * sizes.size()], part_ends.data(), 8 * part_ends.size());
    }
    RETURN_IF_ERROR(SendControl(
        kHeaderBox, peer, tag,
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(message.data()), message.size()),
        deadline));
    trace.Mark();
    uint32_t cts = 0;
    absl::StatusOr<size_t> got = sync_->Recv(
        peer, kCtsTagBase + h.xfer, absl::MakeSpan(reinterpret_cast<uint8_t*>(&cts), 4), deadline);
    if (!got.ok()) {
      // The receiver may have started a communicator with this id: next
      // time, a fresh one.
      Renew(d);
      return got.status();
    }
    if (*got != 4) return absl::InternalError("bad clear-to-send");
    trace.Mark();
    if (cts == kCtsRejectSize) return absl::OkStatus();  // consumed by the receiver
    absl::MutexLock lock(&d.mu);
    if (cts != kCtsGo || h.gen < d.gen) {
      d.comm.reset();
      Renew(d);
      return absl::UnavailableError(
          absl::StrCat("the communicator to rank ", peer, " was reset; retry"));
    }
    absl::Status s = [&]() -> absl::Status {
      if (d.comm == nullptr || d.gen != h.gen) {
        d.comm.reset();
        ASSIGN_OR_RETURN(d.comm, StartDirectionComm(peer, 0, h.id, deadline));
        d.gen = h.gen;
      }
      Comm& c = *d.comm;
      RETURN_IF_ERROR(Ready(c, deadline));
      std::vector<const void*> src;
      if (host != nullptr) {
        RETURN_IF_ERROR(c.EnsureStaging(h.total, /*host=*/true));
        std::memcpy(c.pinned, host, h.total);
        GPU_RETURN_IF_ERROR(
            cudaMemcpyAsync(c.dev, c.pinned, h.total, cudaMemcpyHostToDevice, c.stream));
        src.push_back(c.dev);
      } else {
        for (const DeviceBytes& p : pieces) src.push_back(p.data);
      }
      const std::vector<std::pair<size_t, size_t>> parts = PartRanges(sizes.size(), part_ends);
      for (size_t k = 0; k < parts.size(); ++k) {
        RETURN_IF_ERROR(WaitForGroupSlot(c, k, parts.size(), deadline, "ncclSend"));
        if (host == nullptr && part_ready[k] != nullptr) {
          GPU_RETURN_IF_ERROR(cudaStreamWaitEvent(c.stream, part_ready[k], 0));
        }
        ncclGroupStart();
        ncclResult_t r = ncclSuccess;
        for (size_t i = parts[k].first; i < parts[k].second && r == ncclSuccess; ++i) {
          if (sizes[i] > 0) r = ncclSend(src[i], sizes[i], ncclUint8, 1, c.comm, c.stream);
        }
        ncclResult_t end = ncclGroupEnd();
        if (r != ncclSuccess && r != ncclInProgress) end = r;
        RETURN_IF_ERROR(Enqueued(c, end, deadline, "ncclSend"));
        RETURN_IF_ERROR(GroupEnqueued(c, k, parts.size()));
      }
      trace.Mark();
      GPU_RETURN_IF_ERROR(cudaEventRecord(c.done, c.stream));
      RETURN_IF_ERROR(Poll(c, c.done, deadline, "ncclSend"));
      trace.Mark();
      trace.Print("send", h.xfer, h.total, static_cast<int>(part_ready.size()));
      return absl::OkStatus();
    }();
    if (!s.ok()) {
      Retire(std::move(d.comm));
      Renew(d);
    }
    return s;
  }

  // `host` (capacity already checked) or `pieces` (sizes already checked).
  absl::Status RecvNccl(int peer, const Parsed& p, uint8_t* host,
                        absl::Span<const MutableDeviceBytes> pieces, absl::Time deadline) {
    Trace trace;
    if (TraceEnabled()) {
      trace.t[0] = recv_entered;
      trace.t[1] = absl::Now();
      trace.n = 2;
    }
    Direction& d = *recv_[peer];
    absl::MutexLock lock(&d.mu);
    if (p.header.gen > d.gen) {
      d.comm.reset();
      absl::StatusOr<std::unique_ptr<Comm>> c = StartDirectionComm(peer, 1, p.header.id, deadline);
      if (!c.ok()) {
        ReplyCts(peer, p.header.xfer, kCtsStale, deadline);
        return c.status();
      }
      d.comm = *std::move(c);
      d.gen = p.header.gen;
    } else if (p.header.gen < d.gen || d.comm == nullptr) {
      ReplyCts(peer, p.header.xfer, kCtsStale, deadline);
      return absl::UnavailableError(
          absl::StrCat("message from rank ", peer, " used a reset communicator; it was dropped"));
    }
    Comm& c = *d.comm;
    // Clear-to-send first, then the receives: posting the receives first
    // (to save half a round trip) hung on the H200s, since completing an
    // ncclGroupEnd on a non-blocking communicator can need the peer inside
    // its matching operation (NCCL connects p2p channels lazily).
    const uint32_t go = kCtsGo;
    absl::Status s =
        SendControl(kSyncBox, peer, kCtsTagBase + p.header.xfer,
                    absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(&go), 4), deadline);
    trace.Mark();
    if (s.ok()) {
      s = [&]() -> absl::Status {
        RETURN_IF_ERROR(Ready(c, deadline));
        std::vector<void*> dst;
        if (host != nullptr) {
          RETURN_IF_ERROR(c.EnsureStaging(p.header.total, /*host=*/true));
          size_t offset = 0;
          for (uint64_t size : p.sizes) {
            dst.push_back(static_cast<uint8_t*>(c.dev) + offset);
            offset += size;
          }
        } else {
          for (const MutableDeviceBytes& piece : pieces) dst.push_back(piece.data);
        }
        // The sender's group structure, part by part.
        const std::vector<std::pair<size_t, size_t>> parts =
            PartRanges(p.sizes.size(), p.part_ends);
        for (size_t k = 0; k < parts.size(); ++k) {
          const auto [begin, end_piece] = parts[k];
          RETURN_IF_ERROR(WaitForGroupSlot(c, k, parts.size(), deadline, "ncclRecv"));
          ncclGroupStart();
          ncclResult_t r = ncclSuccess;
          for (size_t i = begin; i < end_piece && r == ncclSuccess; ++i) {
            if (p.sizes[i] > 0) r = ncclRecv(dst[i], p.sizes[i], ncclUint8, 0, c.comm, c.stream);
          }
          ncclResult_t end = ncclGroupEnd();
          if (r != ncclSuccess && r != ncclInProgress) end = r;
          RETURN_IF_ERROR(Enqueued(c, end, deadline, "ncclRecv"));
          RETURN_IF_ERROR(GroupEnqueued(c, k, parts.size()));
        }
        trace.Mark();
        if (host != nullptr && p.header.total > 0) {
          GPU_RETURN_IF_ERROR(
              cudaMemcpyAsync(c.pinned, c.dev, p.header.total, cudaMemcpyDeviceToHost, c.stream));
        }
        GPU_RETURN_IF_ERROR(cudaEventRecord(c.done, c.stream));
        RETURN_IF_ERROR(Poll(c, c.done, deadline, "ncclRecv"));
        if (host != nullptr && p.header.total > 0) std::memcpy(host, c.pinned, p.header.total);
        trace.Mark();
        trace.Print("recv", p.header.xfer, p.header.total,
                    std::max<int>(1, static_cast<int>(p.part_ends.size())));
        return absl::OkStatus();
      }();
    }
    if (!s.ok()) Retire(std::move(d.comm));
    return s;
  }

  GroupState& GetGroup(absl::Span<const int> group) {
    absl::MutexLock lock(&groups_mu_);
    std::unique_ptr<GroupState>& g = groups_[std::vector<int>(group.begin(), group.end())];
    if (g == nullptr) g = std::make_unique<GroupState>();
    return *g;
  }

  absl::Status EnsureGroupComm(GroupState& g, absl::Span<const int> group, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu) {
    if (g.comm != nullptr) return absl::OkStatus();
    ncclUniqueId id;
    const uint64_t tag = GroupTag(group);
    int index = 0;
    while (group[index] != rank_) ++index;
    if (index == 0) {
      GPU_RETURN_IF_ERROR(ncclGetUniqueId(&id));
      for (size_t i = 1; i < group.size(); ++i) {
        RETURN_IF_ERROR(sync_->Send(
            group[i], tag, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(&id), sizeof(id)),
            deadline));
      }
    } else {
      ASSIGN_OR_RETURN(
          size_t got,
          sync_->Recv(group[0], tag, absl::MakeSpan(reinterpret_cast<uint8_t*>(&id), sizeof(id)),
                      deadline));
      if (got != sizeof(id)) return absl::InternalError("bad group id message");
    }
    ASSIGN_OR_RETURN(g.comm, StartComm(device_, static_cast<int>(group.size()), index, id));
    for (int r : group) {
      if (r != rank_) g.comm->peers.push_back(r);
    }
    g.agreed_count = ~size_t{0};
    absl::Status s = Poll(*g.comm, nullptr, deadline, "group communicator init");
    if (!s.ok()) g.comm.reset();
    return s;
  }

  // All members agree on `count` (else INVALID_ARGUMENT at every member):
  // max over [n, ~n] gives [max n, ~min n]. Skipped when already agreed.
  absl::Status AgreeOnCount(GroupState& g, size_t count, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu) {
    if (g.agreed_count == count) return absl::OkStatus();
    Comm& c = *g.comm;
    RETURN_IF_ERROR(c.EnsureStaging(std::max<size_t>(16, 4 * count), /*host=*/true));
    uint64_t words[2] = {count, ~uint64_t{count}};
    std::memcpy(c.pinned, words, 16);
    GPU_RETURN_IF_ERROR(cudaMemcpyAsync(c.dev, c.pinned, 16, cudaMemcpyHostToDevice, c.stream));
    RETURN_IF_ERROR(Enqueued(c,
                             ncclAllReduce(c.dev, c.dev, 2, ncclUint64, ncclMax, c.comm, c.stream),
                             deadline, "count all-reduce"));
    GPU_RETURN_IF_ERROR(cudaMemcpyAsync(c.pinned, c.dev, 16, cudaMemcpyDeviceToHost, c.stream));
    GPU_RETURN_IF_ERROR(cudaEventRecord(c.done, c.stream));
    RETURN_IF_ERROR(Poll(c, c.done, deadline, "count all-reduce"));
    std::memcpy(words, c.pinned, 16);
    if (words[0] != count || ~words[1] != count) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group members disagree on the all-reduce size (", ~words[1], " .. ", words[0], ")"));
    }
    g.agreed_count = count;
    return absl::OkStatus();
  }

  absl::Status EnqueueKeyAllReduce(Comm& c, void* values, size_t count, absl::Time deadline) {
    GPU_RETURN_IF_ERROR(nccl_internal::LaunchEncodeAmaxKeys(values, count, c.stream));
    RETURN_IF_ERROR(
        Enqueued(c, ncclAllReduce(values, values, count, ncclUint32, ncclMax, c.comm, c.stream),
                 deadline, "amax all-reduce"));
    GPU_RETURN_IF_ERROR(nccl_internal::LaunchDecodeAmaxKeys(values, count, c.stream));
    return absl::OkStatus();
  }

  absl::Status GroupAsyncErrors() {
    absl::MutexLock lock(&groups_mu_);
    for (auto& [members, g] : groups_) {
      if (!g->mu.TryLock()) continue;  // busy: its own call polls it
      absl::Status s;
      if (g->comm != nullptr) {
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(g->comm->comm, &async);
        if (async != ncclSuccess && async != ncclInProgress) {
          s = absl::UnavailableError(
              absl::StrCat("group communicator: ", ncclGetErrorString(async)));
        } else if (const int gone = GonePeer(g->comm->peers); gone >= 0) {
          s = PeerGoneError("group communicator", gone);
        }
      }
      g->mu.Unlock();
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  void AbortGroups() {
    absl::MutexLock lock(&groups_mu_);
    for (auto& [members, g] : groups_) {
      absl::MutexLock group_lock(&g->mu);
      g->comm.reset();
    }
  }

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

class NcclEndpoint final : public TransportEndpoint {
 public:
  NcclEndpoint(int device, bool blocking_pairs, std::string gpu,
               std::unique_ptr<TransportEndpoint> header, std::unique_ptr<TransportEndpoint> sync,
               std::unique_ptr<SocketChannel> control)
      : device_(device),
        blocking_pairs_(blocking_pairs),
        gpu_(std::move(gpu)),
        header_(std::move(header)),
        sync_(std::move(sync)),
        control_(std::move(control)),
        address_(absl::StrCat(
            "nccl|", header_->address(), "|", sync_->address(), "|", gpu_,
            control_ != nullptr ? absl::StrCat("|", control_->address()) : std::string())) {}

  std::string address() const override { return address_; }

  absl::StatusOr<std::unique_ptr<Transport>> Connect(
      int rank, const std::vector<std::string>& addresses) override {
    if (header_ == nullptr) return absl::FailedPreconditionError("endpoint already connected");
    if (rank < 0 || rank >= static_cast<int>(addresses.size()) || addresses[rank] != address()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rank, " does not name this endpoint (", address(), ")"));
    }
    std::vector<PeerInfo> peers;
    std::vector<std::string> header_addresses, sync_addresses, control_addresses;
    for (const std::string& a : addresses) {
      ASSIGN_OR_RETURN(PeerInfo info, ParseNcclAddress(a));
      header_addresses.push_back(info.header_address);
      sync_addresses.push_back(info.sync_address);
      control_addresses.push_back(info.control_address);
      peers.push_back(std::move(info));
    }
    std::unique_ptr<TransportEndpoint> header = std::move(header_);
    std::unique_ptr<TransportEndpoint> sync = std::move(sync_);
    ASSIGN_OR_RETURN(std::unique_ptr<Transport> h, header->Connect(rank, header_addresses));
    ASSIGN_OR_RETURN(std::unique_ptr<Transport> s, sync->Connect(rank, sync_addresses));
    std::unique_ptr<SocketChannel> control = std::move(control_);
    auto* hm = dynamic_cast<MessageTransport*>(h.get());
    auto* sm = dynamic_cast<MessageTransport*>(s.get());
    if (control != nullptr && hm != nullptr && sm != nullptr) {
      control->Start(rank, control_addresses, {hm->shared_mailbox(), sm->shared_mailbox()});
    } else {
      control.reset();
    }
    auto transport =
        std::make_unique<NcclTransportImpl>(rank, device_, blocking_pairs_, std::move(peers),
                                            std::move(h), std::move(s), std::move(control));
    RETURN_IF_ERROR(transport->Init());
    return std::unique_ptr<Transport>(std::move(transport));
  }

 private:
  const int device_;
  const bool blocking_pairs_;
  const std::string gpu_;
  std::unique_ptr<TransportEndpoint> header_;
  std::unique_ptr<TransportEndpoint> sync_;
  std::unique_ptr<SocketChannel> control_;  // null: none
  const std::string address_;
};

absl::Status ProbeNccl() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::UnavailableError("no CUDA device");
  }
  return absl::OkStatus();
}

const TransportRegistration kRegistration("nccl", OpenNcclEndpoint, ProbeNccl);

}  // namespace

absl::StatusOr<std::unique_ptr<TransportEndpoint>> OpenNcclEndpoint(
    const TransportOptions& options) {
  RETURN_IF_ERROR(ProbeNccl());
  // NVLink multicast (NVLS) stays off unless the environment says otherwise.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  int device = 0;
  GPU_RETURN_IF_ERROR(cudaGetDevice(&device));
  char bus[64] = {0};
  GPU_RETURN_IF_ERROR(cudaDeviceGetPCIBusId(bus, sizeof(bus), device));
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  for (char* c = host; *c; ++c) {
    if (*c == '|') *c = '_';
  }
  TransportOptions sync_options = options;
  if (!sync_options.listen_address.empty()) {
    sync_options.listen_address =
        sync_options.listen_address.substr(0, sync_options.listen_address.rfind(':')) + ":0";
  }
  ASSIGN_OR_RETURN(std::unique_ptr<TransportEndpoint> header,
                   OpenTransportEndpoint("host", options));
  ASSIGN_OR_RETURN(std::unique_ptr<TransportEndpoint> sync,
                   OpenTransportEndpoint("host", sync_options));
  // The socket control channel, on the header channel's host. Without it
  // (PARAMD_NCCL_CONTROL=grpc, or it cannot listen) control goes over gRPC.
  std::unique_ptr<SocketChannel> control;
  const char* mode = std::getenv("PARAMD_NCCL_CONTROL");
  if (mode == nullptr || std::string(mode) != "grpc") {
    const std::string& listen = options.listen_address;
    // Connections prove the token of the world's channels (the daemons'
    // cluster secret), read when they are made: it is set after the join.
    transport_internal::SocketChannelOptions control_options;
    control_options.advertise_host = options.advertise_host;
    if (options.security != nullptr && options.security->token != nullptr) {
      control_options.secret = [token = options.security->token] { return token->Get(); };
    }
    absl::StatusOr<std::unique_ptr<SocketChannel>> c = SocketChannel::Listen(
        listen.empty() ? "" : listen.substr(0, listen.rfind(':')), control_options);
    if (c.ok()) control = *std::move(c);
  }
  return std::unique_ptr<TransportEndpoint>(
      std::make_unique<NcclEndpoint>(device, BlockingPairsFromEnv(), absl::StrCat(host, "|", bus),
                                     std::move(header), std::move(sync), std::move(control)));
}

NcclTransport* AsNcclTransport(Transport* transport) {
  return dynamic_cast<NcclTransport*>(transport);
}

}  // namespace paramd
