// The same-GPU calls of the C API (client/c_api_ipc.h) over
// gpu_fetch::IpcFetcher (client/gpu_fetch/ipc_import.h). Without CUDA
// (HPD_WITH_CUDA unset) hpd_ipc_open answers UNIMPLEMENTED and no handle
// can exist.
#define HPD_BUILDING_LIBRARY 1
#include "client/c_api_ipc.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/c_api_internal.h"
#include "common/status_macros.h"
#include "kernels/format.h"
#ifdef HPD_WITH_CUDA
#include "client/gpu_fetch/ipc_import.h"
#endif

struct hpd_ipc {
#ifdef HPD_WITH_CUDA
  std::unique_ptr<paramd::gpu_fetch::IpcFetcher> fetcher;
  std::vector<hpd_ipc_view> views;  // of the acquired version; tensor names point into it
  const paramd::gpu_fetch::IpcVersion* acquired = nullptr;
#endif
};

namespace paramd {
namespace {

absl::Mutex& LiveMu() {
  static absl::Mutex* mu = new absl::Mutex;
  return *mu;
}
absl::flat_hash_set<const hpd_ipc*>& Live() ABSL_EXCLUSIVE_LOCKS_REQUIRED(LiveMu()) {
  static auto* live = new absl::flat_hash_set<const hpd_ipc*>;
  return *live;
}

absl::StatusOr<hpd_ipc*> LiveIpc(hpd_ipc* s) {
  if (s == nullptr) return absl::InvalidArgumentError("ipc is NULL");
  absl::MutexLock lock(&LiveMu());
  if (!Live().contains(s)) {
    return absl::InvalidArgumentError("not a live hpd_ipc handle (closed or foreign)");
  }
  return s;
}

#ifdef HPD_WITH_CUDA
void Refill(hpd_ipc* s) {
  s->views.clear();
  if (s->acquired == nullptr) return;
  for (const gpu_fetch::IpcTensor& t : s->acquired->tensors) {
    for (const gpu_fetch::IpcTensor::Piece& p : t.pieces) {
      hpd_ipc_view v = {};
      v.tensor = t.tensor.c_str();
      v.direction = t.direction == Direction::kRowwise ? HPD_ROWWISE : HPD_COLUMNWISE;
      v.rows = t.rows;
      v.cols = t.cols;
      v.row_begin = p.row_begin;
      v.row_end = p.row_end;
      v.data = p.buffers.data;
      v.data_bytes = p.buffers.layout.data_bytes();
      v.scales = p.buffers.layout.scale_bytes() > 0 ? p.buffers.scales : nullptr;
      v.scale_bytes = p.buffers.layout.scale_bytes();
      v.scale_inv = p.buffers.scale_inv;
      v.amax = p.buffers.amax;
      s->views.push_back(v);
    }
  }
}
#endif

constexpr char kNoCuda[] =
    "same-GPU sessions need libhybrid_paramd.so built with --config=cuda; this build is CPU "
    "only (use hpd_fetch / hpd_push_gradients)";

}  // namespace
}  // namespace paramd

extern "C" {

int32_t hpd_ipc_open(hpd_client* client, int32_t daemon_rank, int32_t device, int64_t lease_ms,
                     hpd_ipc** ipc, hpd_status* status) {
  return paramd::capi::Call(status, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(paramd::client::Client * c, paramd::capi::ClientOf(client));
    if (ipc == nullptr) return absl::InvalidArgumentError("ipc is NULL");
    *ipc = nullptr;
    if (device < 0) return absl::InvalidArgumentError(absl::StrCat("bad CUDA device ", device));
    if (lease_ms < 0) return absl::InvalidArgumentError("lease_ms < 0");
#ifdef HPD_WITH_CUDA
    paramd::gpu_fetch::IpcFetcherOptions o;
    o.device = device;
    if (lease_ms > 0) o.lease = absl::Milliseconds(lease_ms);
    ASSIGN_OR_RETURN(std::unique_ptr<paramd::gpu_fetch::IpcFetcher> f,
                     paramd::gpu_fetch::IpcFetcher::Open(c, daemon_rank, o));
    auto handle = std::make_unique<hpd_ipc>();
    handle->fetcher = std::move(f);
    absl::MutexLock lock(&paramd::LiveMu());
    paramd::Live().insert(handle.get());
    *ipc = handle.release();
    return absl::OkStatus();
#else
    (void)c, (void)daemon_rank;
    return absl::UnimplementedError(paramd::kNoCuda);
#endif
  });
}

int32_t hpd_ipc_close(hpd_ipc* ipc, hpd_status* status) {
  return paramd::capi::Call(status, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(hpd_ipc * s, paramd::LiveIpc(ipc));
    {
      absl::MutexLock lock(&paramd::LiveMu());
      paramd::Live().erase(s);
    }
    delete s;  // releases the pin, unmaps, closes the session
    return absl::OkStatus();
  });
}

int32_t hpd_ipc_acquire(hpd_ipc* ipc, int64_t version, const char* const* tensors,
                        const int32_t* directions, size_t count, int64_t* acquired_version,
                        size_t* num_views, hpd_status* status) {
  return paramd::capi::Call(status, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(hpd_ipc * s, paramd::LiveIpc(ipc));
    if (count > 0 && (tensors == nullptr || directions == nullptr)) {
      return absl::InvalidArgumentError("tensors / directions NULL with count > 0");
    }
#ifdef HPD_WITH_CUDA
    std::vector<std::pair<std::string, paramd::Direction>> targets;
    for (size_t i = 0; i < count; ++i) {
      if (tensors[i] == nullptr) return absl::InvalidArgumentError("a tensor name is NULL");
      if (directions[i] != HPD_ROWWISE && directions[i] != HPD_COLUMNWISE) {
        return absl::InvalidArgumentError(
            absl::StrCat("bad direction ", directions[i], " (0 rowwise, 1 columnwise)"));
      }
      targets.push_back({tensors[i], directions[i] == HPD_ROWWISE
                                         ? paramd::Direction::kRowwise
                                         : paramd::Direction::kColumnwise});
    }
    absl::StatusOr<const paramd::gpu_fetch::IpcVersion*> v = s->fetcher->Acquire(version, targets);
    if (!v.ok()) {
      // The previous version may have been released (Acquire pins first):
      // its views go only if the fetcher no longer holds it.
      if (s->fetcher->acquired_version() < 0) {
        s->acquired = nullptr;
        s->views.clear();
      }
      return v.status();
    }
    s->acquired = *v;
    paramd::Refill(s);
    if (acquired_version != nullptr) *acquired_version = (*v)->version;
    if (num_views != nullptr) *num_views = s->views.size();
    return absl::OkStatus();
#else
    (void)s, (void)version, (void)acquired_version, (void)num_views;
    return absl::UnimplementedError(paramd::kNoCuda);
#endif
  });
}

int32_t hpd_ipc_view_at(hpd_ipc* ipc, size_t index, hpd_ipc_view* view, hpd_status* status) {
  return paramd::capi::Call(status, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(hpd_ipc * s, paramd::LiveIpc(ipc));
    if (view == nullptr) return absl::InvalidArgumentError("view is NULL");
#ifdef HPD_WITH_CUDA
    if (index >= s->views.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("view ", index, " of ", s->views.size(), " (acquire a version first)"));
    }
    *view = s->views[index];
    return absl::OkStatus();
#else
    (void)s, (void)index;
    return absl::UnimplementedError(paramd::kNoCuda);
#endif
  });
}

int32_t hpd_ipc_release(hpd_ipc* ipc, hpd_status* status) {
  return paramd::capi::Call(status, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(hpd_ipc * s, paramd::LiveIpc(ipc));
#ifdef HPD_WITH_CUDA
    s->acquired = nullptr;
    s->views.clear();
    return s->fetcher->Release();
#else
    (void)s;
    return absl::UnimplementedError(paramd::kNoCuda);
#endif
  });
}

int32_t hpd_ipc_gradient_buffer(hpd_ipc* ipc, uint64_t bytes, void** device_ptr,
                                hpd_status* status) {
  return paramd::capi::Call(status, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(hpd_ipc * s, paramd::LiveIpc(ipc));
    if (device_ptr == nullptr) return absl::InvalidArgumentError("device_ptr is NULL");
    if (bytes == 0) return absl::InvalidArgumentError("bytes is 0");
#ifdef HPD_WITH_CUDA
    ASSIGN_OR_RETURN(*device_ptr, s->fetcher->GradientBuffer(bytes));
    return absl::OkStatus();
#else
    (void)s;
    return absl::UnimplementedError(paramd::kNoCuda);
#endif
  });
}

int32_t hpd_ipc_push(hpd_ipc* ipc, int64_t version, const hpd_gradient* gradients, size_t count,
                     hpd_push_result* result, hpd_status* status) {
  return paramd::capi::Call(status, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(hpd_ipc * s, paramd::LiveIpc(ipc));
    if (count > 0 && gradients == nullptr) return absl::InvalidArgumentError("gradients is NULL");
#ifdef HPD_WITH_CUDA
    std::vector<paramd::gpu_fetch::IpcGradient> grads;
    for (size_t i = 0; i < count; ++i) {
      const hpd_gradient& g = gradients[i];
      if (g.tensor == nullptr || g.data == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("gradient ", i, ": NULL tensor or data"));
      }
      if (g.dtype != HPD_GRAD_FP32 && g.dtype != HPD_GRAD_BF16) {
        return absl::InvalidArgumentError(
            absl::StrCat("bad gradient dtype ", g.dtype, " (0 fp32, 1 bf16)"));
      }
      if (!s->fetcher->InGradientBuffer(g.data, g.bytes)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the gradient of ", g.tensor, " does not lie in a hpd_ipc_gradient_buffer"));
      }
      grads.push_back({g.tensor,
                       g.dtype == HPD_GRAD_BF16 ? paramd::client::Gradient::DType::kBf16
                                                : paramd::client::Gradient::DType::kFp32,
                       g.data});
    }
    ASSIGN_OR_RETURN(paramd::rpc::PushGradientsResponse r, s->fetcher->Push(version, grads));
    if (result != nullptr) {
      result->version = version;
      result->bytes_sent = r.bytes_received();
      result->pushers_received = r.pushers_received();
      result->pushers_expected = r.pushers_expected();
    }
    return absl::OkStatus();
#else
    (void)s, (void)version, (void)result;
    return absl::UnimplementedError(paramd::kNoCuda);
#endif
  });
}

int32_t hpd_ipc_stats(hpd_ipc* ipc, int64_t* page_acquires, int64_t* rpc_acquires,
                      hpd_status* status) {
  return paramd::capi::Call(status, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(hpd_ipc * s, paramd::LiveIpc(ipc));
#ifdef HPD_WITH_CUDA
    if (page_acquires != nullptr) *page_acquires = s->fetcher->page_acquires();
    if (rpc_acquires != nullptr) *rpc_acquires = s->fetcher->rpc_acquires();
    return absl::OkStatus();
#else
    (void)s, (void)page_acquires, (void)rpc_acquires;
    return absl::UnimplementedError(paramd::kNoCuda);
#endif
  });
}

}  // extern "C"
