// The CUDA exporter of same-GPU sessions (server/ipc/ipc_service.h): the
// gpu backend's published buffers live in exportable VMM allocations
// (GpuShardStore::exported_regions, ipc/cuda_vmm.h), handed out as
// POSIX file descriptors; a trainer's gradient buffer comes the other way
// and is read in place by one pass that checks it and writes it (the first
// push into a zero accumulator) or by the check and add kernels
// (push_apply.h ApplyCheckedPush). Registers itself when linked (alwayslink; hybrid-paramd
// under --config=cuda).
//
// Why VMM handles and not cudaIpcGetMemHandle: a legacy IPC mapping is
// undefined once the exporting process frees the memory (cudaFree, or
// exit), so a trainer could read freed memory after a daemon died or
// reloaded; a VMM allocation is reference counted by the driver and lives
// until the last process unmaps it. The fds need a Unix socket
// (ipc/fd_socket.h); both processes run as one user on one machine.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/gpu_status.h"
#include "common/status_macros.h"
#include "ipc/cuda_vmm.h"
#include "server/gpu_backend/daemon_backend.h"
#include "server/gpu_backend/push_apply.h"
#include "server/gpu_backend/shard_store.h"
#include "server/ipc/ipc_service.h"

namespace paramd {
namespace gpu_backend {
namespace {

// The gpu backend's device (daemon_backend.cc creates its store on device 0).
constexpr int kDevice = 0;

absl::StatusOr<GpuShardStore*> StoreOf(ShardBackend& backend) {
  GpuShardStore* store = DeviceStoreOf(&backend);
  if (store == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("same-GPU sessions need the gpu backend; this model runs on the ",
                     backend.name(), " backend (fetch over gRPC instead)"));
  }
  if (store->exported_regions().empty()) {
    return absl::FailedPreconditionError(
        "this daemon's GPU has no exportable memory (CUDA VMM with POSIX file descriptors); "
        "fetch over NCCL instead");
  }
  return store;
}

class GpuIpcExporter : public ipc::IpcExporter {
 public:
  ~GpuIpcExporter() override {
    ScopedDevice guard(kDevice);
    if (flag_ != nullptr) cudaFree(flag_);
  }

  absl::StatusOr<std::string> DeviceUuid() override {
    cudaDeviceProp prop;
    GPU_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, kDevice));
    return std::string(prop.uuid.bytes, sizeof(prop.uuid.bytes));
  }

  absl::Status Export(ShardBackend& backend, std::vector<int>* fds,
                      std::vector<uint64_t>* sizes) override {
    ASSIGN_OR_RETURN(GpuShardStore * store, StoreOf(backend));
    for (const std::unique_ptr<ipc::VmmBuffer>& r : store->exported_regions()) {
      ASSIGN_OR_RETURN(int fd, r->Export());
      fds->push_back(fd);
      sizes->push_back(r->size());
    }
    return absl::OkStatus();
  }

  absl::StatusOr<ipc::IpcDirectionRefs> Describe(ShardBackend& backend, int64_t version, int shard,
                                                 Direction direction) override {
    ASSIGN_OR_RETURN(GpuShardStore * store, StoreOf(backend));
    ASSIGN_OR_RETURN(GpuPublishedDirection d, store->Published(version, shard, direction));
    if (!d.present) return absl::FailedPreconditionError("direction not published");
    const auto& regions = store->exported_regions();
    auto ref = [&](const void* p) -> absl::StatusOr<ipc::IpcBufferRef> {
      const uintptr_t at = reinterpret_cast<uintptr_t>(p);
      for (size_t i = 0; i < regions.size(); ++i) {
        const uintptr_t base = reinterpret_cast<uintptr_t>(regions[i]->data());
        if (at >= base && at < base + regions[i]->size()) {
          return ipc::IpcBufferRef{static_cast<uint32_t>(i), at - base};
        }
      }
      return absl::InternalError("a published buffer outside the exported regions");
    };
    ipc::IpcDirectionRefs r;
    ASSIGN_OR_RETURN(r.data, ref(d.data));
    r.data_bytes = d.layout.data_bytes();
    r.scale_bytes = d.layout.scale_bytes();
    if (r.scale_bytes > 0) {
      ASSIGN_OR_RETURN(r.scales, ref(d.scales));
    }
    ASSIGN_OR_RETURN(r.scale_inv, ref(d.scale_inv));
    ASSIGN_OR_RETURN(r.amax, ref(d.amax));
    return r;
  }

  absl::StatusOr<int> SlotOf(ShardBackend& backend, int64_t version) override {
    ASSIGN_OR_RETURN(GpuShardStore * store, StoreOf(backend));
    return store->SlotOf(version);
  }

  absl::Status ImportBuffer(uint64_t session, uint64_t id, int fd, uint64_t bytes) override {
    ScopedDevice guard(kDevice);
    ASSIGN_OR_RETURN(ipc::VmmBuffer b, ipc::VmmBuffer::Import(fd, bytes, kDevice));
    absl::MutexLock lock(&mu_);
    buffers_[{session, id}] = std::make_unique<ipc::VmmBuffer>(std::move(b));
    return absl::OkStatus();
  }

  void DropSession(uint64_t session) override {
    ScopedDevice guard(kDevice);
    absl::MutexLock lock(&mu_);  // never beside a push's reads (they hold mu_)
    for (auto it = buffers_.lower_bound({session, 0});
         it != buffers_.end() && it->first.first == session;) {
      it = buffers_.erase(it);
    }
  }

  // The buffers only: the NaN/Inf check runs in ApplyPush's one pass
  // (push_apply.h ApplyCheckedPush), under the daemon's push lock, where a
  // refusal still adds nothing.
  absl::Status CheckPush(uint64_t session, ShardBackend& backend,
                         absl::Span<const ipc::IpcPushPiece> pieces) override {
    ASSIGN_OR_RETURN(GpuShardStore * store, StoreOf(backend));
    (void)store;
    absl::MutexLock lock(&mu_);
    return SourcesLocked(session, pieces).status();
  }

  absl::Status ApplyPush(uint64_t session, ShardBackend& backend,
                         absl::Span<const ipc::IpcPushPiece> pieces) override {
    ASSIGN_OR_RETURN(GpuShardStore * store, StoreOf(backend));
    ScopedDevice guard(kDevice);
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(std::vector<DevicePushSource> sources, SourcesLocked(session, pieces));
    if (flag_ == nullptr) {
      void* p = nullptr;
      GPU_RETURN_IF_ERROR(cudaMalloc(&p, sizeof(uint32_t)));
      flag_ = static_cast<uint32_t*>(p);
    }
    // Returns once the work ran: the trainer may reuse its buffer then.
    // As the host stream: SKIP_STEP takes NaN/Inf (the step then skips).
    return ApplyCheckedPush(*store, sources, flag_, !store->takes_non_finite());
  }

 private:
  absl::StatusOr<std::vector<DevicePushSource>> SourcesLocked(
      uint64_t session, absl::Span<const ipc::IpcPushPiece> pieces)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<DevicePushSource> out;
    for (const ipc::IpcPushPiece& p : pieces) {
      auto it = buffers_.find({session, p.buffer});
      if (it == buffers_.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("gradient buffer ", p.buffer, " is not registered with this session"));
      }
      const uint64_t elem = p.bf16 ? 2 : 4;
      if (p.buffer_offset % elem != 0 ||
          p.buffer_offset + static_cast<uint64_t>(p.count) * elem > it->second->size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "gradient [", p.buffer_offset, ", +", p.count * elem, ") bytes lies outside buffer ",
            p.buffer, " (", it->second->size(), " bytes) or is misaligned"));
      }
      out.push_back({p.shard, p.offset, p.count, p.bf16,
                     static_cast<const char*>(it->second->data()) + p.buffer_offset});
    }
    return out;
  }

  absl::Mutex mu_;
  std::map<std::pair<uint64_t, uint64_t>, std::unique_ptr<ipc::VmmBuffer>> buffers_
      ABSL_GUARDED_BY(mu_);
  uint32_t* flag_ ABSL_GUARDED_BY(mu_) = nullptr;
};

const bool kRegistered =
    ipc::RegisterIpcExporterFactory([]() -> absl::StatusOr<std::unique_ptr<ipc::IpcExporter>> {
      int count = 0;
      if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        cudaGetLastError();
        return absl::FailedPreconditionError(
            "same-GPU sessions: no CUDA device visible to this daemon");
      }
      return std::unique_ptr<ipc::IpcExporter>(new GpuIpcExporter());
    });

}  // namespace
}  // namespace gpu_backend
}  // namespace paramd
