// The NCCL implementation of server/device_channel.h: one NCCL transport
// endpoint per channel on the gpu backend's device; Send = ServeFetch
// (fetch_server.h) from the backend's GpuShardStore.
#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/gpu_status.h"
#include "common/status_macros.h"
#include "server/device_channel.h"
#include "server/gpu_backend/daemon_backend.h"
#include "server/gpu_backend/fetch_server.h"
#include "transport/nccl_transport.h"

namespace paramd {
namespace gpu_backend {
namespace {

// The gpu backend's device (daemon_backend.cc creates its store on device 0).
constexpr int kDevice = 0;

class NcclDeviceChannel : public DeviceChannel {
 public:
  explicit NcclDeviceChannel(std::unique_ptr<TransportEndpoint> endpoint)
      : endpoint_(std::move(endpoint)), address_(endpoint_->address()) {}
  ~NcclDeviceChannel() override { Shutdown(); }

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

  absl::Status Send(ShardBackend& backend, int64_t version,
                    absl::Span<const DeviceFetchItem> items, uint64_t tag,
                    absl::Time deadline) override {
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
};

absl::StatusOr<std::unique_ptr<DeviceChannel>> OpenNcclDeviceChannel(
    const std::string& listen_address) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("device fetch: no CUDA device visible to this daemon");
  }
  GPU_RETURN_IF_ERROR(cudaSetDevice(kDevice));
  TransportOptions options;
  options.listen_address = listen_address;
  ASSIGN_OR_RETURN(std::unique_ptr<TransportEndpoint> endpoint, OpenNcclEndpoint(options));
  return std::unique_ptr<DeviceChannel>(new NcclDeviceChannel(std::move(endpoint)));
}

const bool kRegistered = RegisterDeviceChannelOpener(OpenNcclDeviceChannel);

}  // namespace
}  // namespace gpu_backend
}  // namespace paramd
