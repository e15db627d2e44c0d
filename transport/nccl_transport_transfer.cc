#include "transport/nccl_transport_impl.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/gpu_status.h"
#include "common/scoped_device.h"
#include "common/status_macros.h"

namespace paramd {
namespace nccl_internal {

using transport_internal::StartComm;
using transport_internal::StartPairComm;

namespace {

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

}  // namespace

void NcclTransportImpl::Backoff(int spin) {
  if (spin < 200000) {
    std::this_thread::yield();
  } else {
    absl::SleepFor(absl::Microseconds(100));
  }
}

absl::Status NcclTransportImpl::Poll(Comm& c, cudaEvent_t event, absl::Time deadline,
                                     absl::string_view what) {
  for (int spin = 0;; ++spin) {
    if (shut_down_.load()) return absl::CancelledError(absl::StrCat(what, ": shut down"));
    // A peer's hang-up: a kernel waiting on it would only end at the
    // deadline; the caller retires (aborts) the communicator.
    if (const int gone = GonePeer(c.peers); gone >= 0) return PeerGoneError(what, gone);
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(c.comm, &async);
    if (r != ncclSuccess) async = r;
    if (async != ncclSuccess && async != ncclInProgress) {
      return absl::UnavailableError(absl::StrCat(what, ": NCCL error ", ncclGetErrorString(async)));
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

absl::StatusOr<std::unique_ptr<Comm>> NcclTransportImpl::StartDirectionComm(int peer, int rank,
                                                                            const ncclUniqueId& id,
                                                                            absl::Time deadline) {
  absl::StatusOr<std::unique_ptr<Comm>> c = blocking_pairs_
                                                ? StartPairComm(device_, rank, id, deadline)
                                                : StartComm(device_, 2, rank, id);
  if (c.ok()) (*c)->peers = {peer};
  return c;
}

absl::Status NcclTransportImpl::WaitForGroupSlot(Comm& c, size_t k, size_t groups,
                                                 absl::Time deadline, absl::string_view what) {
  if (groups <= kMaxGroupsInFlight) return absl::OkStatus();
  while (c.group_done.size() < kMaxGroupsInFlight) {
    cudaEvent_t e = nullptr;
    GPU_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    c.group_done.push_back(e);
  }
  if (k < kMaxGroupsInFlight) return absl::OkStatus();
  return Poll(c, c.group_done[k % kMaxGroupsInFlight], deadline, what);
}

absl::Status NcclTransportImpl::GroupEnqueued(Comm& c, size_t k, size_t groups) {
  if (groups <= kMaxGroupsInFlight) return absl::OkStatus();
  return GPU_STATUS(cudaEventRecord(c.group_done[k % kMaxGroupsInFlight], c.stream));
}

absl::Status NcclTransportImpl::Ready(Comm& c, absl::Time deadline) {
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

absl::Status NcclTransportImpl::Enqueued(Comm& c, ncclResult_t r, absl::Time deadline,
                                         absl::string_view what) {
  if (r != ncclSuccess && r != ncclInProgress) {
    return absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
  }
  return Poll(c, nullptr, deadline, what);
}

absl::Status NcclTransportImpl::SendInline(int peer, uint64_t tag,
                                           const std::vector<uint64_t>& sizes,
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

void NcclTransportImpl::ReplyCts(int peer, uint64_t xfer, Cts reply, absl::Time deadline) {
  const uint32_t word = reply;
  // Best effort: if it is lost the sender meets its deadline.
  (void)SendControl(kSyncBox, peer, kCtsTagBase + xfer,
                    absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(&word), 4),
                    std::max(deadline, absl::Now() + absl::Seconds(1)));
}

absl::Status NcclTransportImpl::SendControl(ControlBox box, int peer, uint64_t tag,
                                            absl::Span<const uint8_t> bytes, absl::Time deadline) {
  if (control_ != nullptr && !peers_[peer].control_address.empty()) {
    absl::Status s = control_->Send(peer, box, tag, bytes, deadline);
    // A peer that hung up is not tried again over gRPC.
    if (s.ok() || control_->PeerGone(peer)) return s;
  }
  return (box == kHeaderBox ? header_ : sync_)->Send(peer, tag, bytes, deadline);
}

void NcclTransportImpl::Retire(std::unique_ptr<Comm> comm) {
  if (comm == nullptr) return;
  absl::MutexLock lock(&reap_mu_);
  reapers_.emplace_back([c = std::move(comm)]() mutable { c.reset(); });
}

void NcclTransportImpl::Renew(Direction& d) {
  absl::MutexLock lock(&d.setup_mu);
  d.renew = true;
}

absl::Status NcclTransportImpl::SendNccl(int peer, uint64_t tag, const std::vector<uint64_t>& sizes,
                                         const uint8_t* host, absl::Span<const DeviceBytes> pieces,
                                         cudaEvent_t ready,
                                         absl::Span<const cudaEvent_t> piece_ready,
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

absl::Status NcclTransportImpl::RecvNccl(int peer, const Parsed& p, uint8_t* host,
                                         absl::Span<const MutableDeviceBytes> pieces,
                                         absl::Time deadline) {
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
      const std::vector<std::pair<size_t, size_t>> parts = PartRanges(p.sizes.size(), p.part_ends);
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

}  // namespace nccl_internal
}  // namespace paramd
