// The NCCL implementation of server/backend/device_channel.h: one NCCL transport
// endpoint per channel on the gpu backend's device; Send = ServeFetch
// (fetch_server.h) from the backend's GpuShardStore; ReceivePush /
// ApplyPush = RecvDevice into stream-ordered staging, then LaunchAccumulate
// (accumulate.h) on the store's stream.
#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/gpu_status.h"
#include "common/status_macros.h"
#include "server/backend/device_channel.h"
#include "server/gpu_backend/accumulate.h"
#include "server/gpu_backend/daemon_backend.h"
#include "server/gpu_backend/fetch_server.h"
#include "server/gpu_backend/finite_check.h"
#include "server/gpu_backend/push_apply.h"
#include "transport/channel_secret.h"
#include "transport/nccl_transport.h"

namespace paramd {
namespace gpu_backend {
namespace {

// The gpu backend's device (daemon_backend.cc creates its store on device 0).
constexpr int kDevice = 0;
// Staging offset alignment of each pushed piece (the BF16 accumulate kernel
// loads 16 bytes at a time).
constexpr size_t kStagingAlign = 256;

// One received push: one stream-ordered allocation holding every piece.
// Freed (cudaFreeAsync) on `free_stream`: the store's stream once ApplyPush
// enqueued adds reading it, else the channel's stream.
class NcclStagedPush : public StagedDevicePush {
 public:
  ~NcclStagedPush() override {
    if (base == nullptr) return;
    ScopedDevice guard(kDevice);
    cudaFreeAsync(base, free_stream);
    cudaGetLastError();
  }
  void* base = nullptr;
  cudaStream_t free_stream = nullptr;
  std::vector<DevicePushPiece> pieces;
  std::vector<size_t> offsets;  // of each piece in `base`

  std::vector<DevicePushSource> Sources() const {
    std::vector<DevicePushSource> out;
    for (size_t i = 0; i < pieces.size(); ++i) {
      out.push_back({pieces[i].shard, pieces[i].offset, pieces[i].count, pieces[i].bf16,
                     static_cast<const char*>(base) + offsets[i]});
    }
    return out;
  }
};

class NcclDeviceChannel : public DeviceChannel {
 public:
  explicit NcclDeviceChannel(std::unique_ptr<TransportEndpoint> endpoint)
      : endpoint_(std::move(endpoint)), address_(endpoint_->address()) {}
  ~NcclDeviceChannel() override {
    Shutdown();
    ScopedDevice guard(kDevice);
    if (flag_ != nullptr) cudaFree(flag_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  std::string address() const override { return address_; }
  int device() const override { return kDevice; }

  absl::Status Connect(const std::string& trainer_address) override {
    if (endpoint_ == nullptr) return absl::FailedPreconditionError("channel already connected");
    GPU_RETURN_IF_ERROR(cudaSetDevice(kDevice));
    std::unique_ptr<TransportEndpoint> endpoint = std::move(endpoint_);
    ASSIGN_OR_RETURN(std::unique_ptr<Transport> t,
                     endpoint->Connect(0, {address_, trainer_address}));
    NcclTransport* nccl = AsNcclTransport(t.get());
    if (nccl == nullptr) return absl::InternalError("the channel's transport is not nccl");
    absl::MutexLock lock(&mu_);
    if (shut_down_) {
      t->Shutdown();
      return absl::CancelledError("channel closed");
    }
    transport_ = std::move(t);
    nccl_ = nccl;
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<StagedDevicePush>> ReceivePush(
      absl::Span<const DevicePushPiece> pieces, uint64_t tag, absl::Time deadline,
      bool accept_non_finite) override {
    NcclTransport* nccl;
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) return absl::CancelledError("channel closed");
      if (nccl_ == nullptr) return absl::FailedPreconditionError("channel not connected");
      nccl = nccl_;
    }
    GPU_RETURN_IF_ERROR(cudaSetDevice(kDevice));
    if (stream_ == nullptr) {
      GPU_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    }
    auto staged = std::make_unique<NcclStagedPush>();
    staged->free_stream = stream_;
    staged->pieces.assign(pieces.begin(), pieces.end());
    size_t total = 0;
    std::vector<size_t> sizes;
    for (const DevicePushPiece& p : pieces) {
      if (p.count <= 0) return absl::InvalidArgumentError("empty device push piece");
      staged->offsets.push_back(total);
      sizes.push_back(static_cast<size_t>(p.count) * (p.bf16 ? 2 : 4));
      total += (sizes.back() + kStagingAlign - 1) / kStagingAlign * kStagingAlign;
    }
    if (total == 0) return staged;
    GPU_RETURN_IF_ERROR(cudaMallocAsync(&staged->base, total, stream_));
    GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));  // allocated before NCCL writes
    std::vector<MutableDeviceBytes> targets;
    for (size_t i = 0; i < pieces.size(); ++i) {
      targets.push_back({static_cast<char*>(staged->base) + staged->offsets[i], sizes[i]});
    }
    // On error `staged` is destroyed: nothing was added anywhere.
    RETURN_IF_ERROR(nccl->RecvDevice(/*peer=*/1, tag, targets, deadline));
    if (accept_non_finite) return std::unique_ptr<StagedDevicePush>(std::move(staged));
    // NaN/Inf are refused, as on the host stream (one wait per push).
    if (flag_ == nullptr) {
      void* p = nullptr;
      GPU_RETURN_IF_ERROR(cudaMalloc(&p, sizeof(uint32_t)));
      flag_ = static_cast<uint32_t*>(p);
    }
    RETURN_IF_ERROR(CheckPushFinite(staged->Sources(), flag_, stream_));
    return std::unique_ptr<StagedDevicePush>(std::move(staged));
  }

  // The adds of push_apply.h: the last pusher's whole rows take the
  // gradient norm's row sums in their add.
  absl::Status ApplyPush(ShardBackend& backend, StagedDevicePush& staged_base,
                         bool last_pusher) override {
    GpuShardStore* store = DeviceStoreOf(&backend);
    if (store == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("device push needs the gpu backend; this model runs on the ", backend.name(),
                       " backend"));
    }
    auto& staged = static_cast<NcclStagedPush&>(staged_base);
    if (staged.base == nullptr) return absl::OkStatus();
    // From here on the staging is read on the store's stream.
    staged.free_stream = store->stream();
    return EnqueuePushAdds(*store, staged.Sources(), last_pusher);
  }

  absl::Status Send(ShardBackend& backend, int64_t version, absl::Span<const DeviceFetchItem> items,
                    uint64_t tag, absl::Time deadline, bool in_flight) override {
    GpuShardStore* store = DeviceStoreOf(&backend);
    if (store == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("device fetch needs the gpu backend; this model runs on the ",
                       backend.name(), " backend"));
    }
    NcclTransport* nccl;
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) return absl::CancelledError("channel closed");
      if (nccl_ == nullptr) return absl::FailedPreconditionError("channel not connected");
      nccl = nccl_;
    }
    GPU_RETURN_IF_ERROR(cudaSetDevice(store->device()));
    std::vector<FetchItem> fetch_items;
    fetch_items.reserve(items.size());
    for (const DeviceFetchItem& i : items) fetch_items.push_back({i.shard, i.direction});
    // A step in flight: each tensor leaves once quantized (the daemon calls
    // this only after the step's enqueue, so the events are this step's).
    if (in_flight) {
      return ServeFetchPipelined(*nccl, /*trainer=*/1, tag, *store, version, fetch_items, deadline);
    }
    // Published buffers are complete: Step() waited for the step's work
    // before publishing, so no event to wait on.
    return ServeFetch(*nccl, /*trainer=*/1, tag, *store, version, fetch_items,
                      /*per_item=*/false, deadline);
  }

  void Shutdown() override {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    if (transport_) transport_->Shutdown();
  }

 private:
  std::unique_ptr<TransportEndpoint> endpoint_;  // until Connect
  const std::string address_;
  absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<Transport> transport_ ABSL_GUARDED_BY(mu_);
  NcclTransport* nccl_ ABSL_GUARDED_BY(mu_) = nullptr;
  cudaStream_t stream_ = nullptr;  // staging allocations (the serial worker's)
  uint32_t* flag_ = nullptr;       // device: the non-finite check's result
};

absl::StatusOr<std::unique_ptr<DeviceChannel>> OpenNcclDeviceChannel(
    const std::string& listen_address, const std::string& advertise_host,
    const std::string& secret) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("device fetch: no CUDA device visible to this daemon");
  }
  GPU_RETURN_IF_ERROR(cudaSetDevice(kDevice));
  TransportOptions options;
  options.listen_address = listen_address;
  options.advertise_host = advertise_host;
  // Only the trainer that was handed `secret` may talk to this endpoint.
  ASSIGN_OR_RETURN(std::unique_ptr<TransportEndpoint> endpoint,
                   OpenNcclEndpoint(ChannelSecret(secret).Apply(options)));
  return std::unique_ptr<DeviceChannel>(new NcclDeviceChannel(std::move(endpoint)));
}

const bool kRegistered = RegisterDeviceChannelOpener(OpenNcclDeviceChannel);

}  // namespace
}  // namespace gpu_backend
}  // namespace paramd
