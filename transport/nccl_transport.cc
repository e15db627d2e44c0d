#include "transport/nccl_transport_impl.h"

#include <unistd.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "auth/security.h"
#include "common/gpu_status.h"
#include "common/scoped_device.h"
#include "common/status_macros.h"
#include "transport/message_transport.h"

namespace paramd {
namespace nccl_internal {

NcclTransportImpl::NcclTransportImpl(int rank, int device, bool blocking_pairs,
                                     std::vector<PeerInfo> peers, std::unique_ptr<Transport> header,
                                     std::unique_ptr<Transport> sync,
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

NcclTransportImpl::~NcclTransportImpl() {
  Shutdown();
  {
    absl::MutexLock lock(&reap_mu_);
    for (std::thread& t : reapers_) t.join();
  }
  ScopedDevice guard(device_);
  if (inline_stream_ != nullptr) cudaStreamDestroy(inline_stream_);
}

absl::Status NcclTransportImpl::Init() {
  ScopedDevice guard(device_);
  GPU_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&inline_stream_, cudaStreamNonBlocking));
  return absl::OkStatus();
}

absl::Status NcclTransportImpl::Send(int peer, uint64_t tag, absl::Span<const uint8_t> bytes,
                                     absl::Time deadline) {
  RETURN_IF_ERROR(CheckCall(peer, tag, deadline));
  ScopedDevice guard(device_);
  const uint64_t size = bytes.size();
  if (!UsesNccl(peer) || bytes.size() <= kNcclInlineMaxBytes) {
    return SendInline(peer, tag, {size}, bytes, deadline);
  }
  return SendNccl(peer, tag, {size}, bytes.data(), {}, nullptr, {}, deadline);
}

absl::StatusOr<size_t> NcclTransportImpl::Recv(int peer, uint64_t tag, absl::Span<uint8_t> buffer,
                                               absl::Time deadline) {
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

absl::Status NcclTransportImpl::SendDevice(int peer, uint64_t tag,
                                           absl::Span<const DeviceBytes> pieces, cudaEvent_t ready,
                                           absl::Time deadline) {
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

absl::Status NcclTransportImpl::SendDevicePipelined(int peer, uint64_t tag,
                                                    absl::Span<const DeviceBytes> pieces,
                                                    absl::Span<const cudaEvent_t> ready,
                                                    absl::Time deadline) {
  RETURN_IF_ERROR(CheckCall(peer, tag, deadline));
  if (pieces.size() > kNcclMaxPieces || ready.size() != pieces.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(pieces.size(), " pieces, ", ready.size(), " ready events"));
  }
  ScopedDevice guard(device_);
  std::vector<uint64_t> sizes;
  for (const DeviceBytes& p : pieces) sizes.push_back(p.size);
  if (UsesNccl(peer)) return SendNccl(peer, tag, sizes, nullptr, pieces, nullptr, ready, deadline);
  for (size_t i = 0; i < ready.size(); ++i) {
    if (ready[i] != nullptr && (i == 0 || ready[i] != ready[i - 1])) {
      GPU_RETURN_IF_ERROR(cudaEventSynchronize(ready[i]));
    }
  }
  return SendDeviceInline(peer, tag, pieces, sizes, deadline);
}

absl::Status NcclTransportImpl::SendDeviceInline(int peer, uint64_t tag,
                                                 absl::Span<const DeviceBytes> pieces,
                                                 const std::vector<uint64_t>& sizes,
                                                 absl::Time deadline) {
  size_t total = 0;
  for (uint64_t s : sizes) total += s;
  std::unique_ptr<uint8_t[]> host(new uint8_t[total > 0 ? total : 1]);
  size_t offset = 0;
  for (const DeviceBytes& p : pieces) {
    if (p.size == 0) continue;
    GPU_RETURN_IF_ERROR(cudaMemcpyAsync(host.get() + offset, p.data, p.size, cudaMemcpyDeviceToHost,
                                        inline_stream_));
    offset += p.size;
  }
  GPU_RETURN_IF_ERROR(cudaStreamSynchronize(inline_stream_));
  return SendInline(peer, tag, sizes, absl::MakeConstSpan(host.get(), total), deadline);
}

absl::Status NcclTransportImpl::RecvDevice(int peer, uint64_t tag,
                                           absl::Span<const MutableDeviceBytes> pieces,
                                           absl::Time deadline) {
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

absl::Status NcclTransportImpl::CanConnect(int peer, absl::Time deadline) {
  if (shut_down_.load()) return absl::FailedPreconditionError("transport is shut down");
  if (peer < 0 || peer >= world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("peer ", peer));
  }
  return header_->CanConnect(peer, deadline);
}

void NcclTransportImpl::Shutdown() {
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

absl::StatusOr<NcclTransportImpl::Parsed> NcclTransportImpl::Parse(const uint8_t* message,
                                                                   size_t size) {
  Parsed p;
  if (size < sizeof(Header)) return absl::InternalError("short nccl header");
  std::memcpy(&p.header, message, sizeof(Header));
  const Header& h = p.header;
  if (h.magic != kMagic || (h.kind != kInline && h.kind != kNcclPayload) ||
      h.npieces > kNcclMaxPieces || h.nparts > h.npieces || (h.kind == kInline && h.nparts != 0) ||
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

absl::Status NcclTransportImpl::CheckPeerAndTag(int peer, uint64_t tag) const {
  if (shut_down_.load()) return absl::FailedPreconditionError("transport is shut down");
  if (peer < 0 || peer >= world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer ", peer, " outside [0, ", world_size(), ")"));
  }
  if (tag > kMaxUserTag) return absl::InvalidArgumentError(absl::StrCat("tag ", tag));
  return absl::OkStatus();
}

absl::Status NcclTransportImpl::CheckCall(int peer, uint64_t tag, absl::Time deadline) const {
  RETURN_IF_ERROR(CheckPeerAndTag(peer, tag));
  // A peer that hung up gets nothing more (its receives fail in the
  // mailbox the same way).
  if (control_ != nullptr) RETURN_IF_ERROR(control_->PeerStatus(peer));
  if (absl::Now() >= deadline) return absl::DeadlineExceededError("deadline already passed");
  return absl::OkStatus();
}

int NcclTransportImpl::GonePeer(const std::vector<int>& ranks) const {
  if (control_ == nullptr) return -1;
  for (int r : ranks) {
    if (control_->PeerGone(r)) return r;
  }
  return -1;
}

absl::Status NcclTransportImpl::PeerGoneError(absl::string_view what, int peer) const {
  return absl::UnavailableError(absl::StrCat(what, ": ", control_->PeerStatus(peer).message()));
}

absl::Status NcclTransportImpl::CheckGroup(absl::Span<const int> group) const {
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

bool NcclTransportImpl::DistinctGpus(absl::Span<const int> group) const {
  for (size_t i = 0; i < group.size(); ++i) {
    for (size_t j = i + 1; j < group.size(); ++j) {
      if (peers_[group[i]].gpu == peers_[group[j]].gpu) return false;
    }
  }
  return true;
}

}  // namespace nccl_internal

namespace {

using nccl_internal::NcclTransportImpl;
using nccl_internal::PeerInfo;
using transport_internal::BlockingPairsFromEnv;
using transport_internal::MessageTransport;
using transport_internal::SocketChannel;

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
