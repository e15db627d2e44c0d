// File: server/gpu_backend/host_copies.h
//
// HostCopies: the host bytes of the gpu backend's published versions
// (ShardBackend::host_bytes), used by server/gpu_backend/daemon_backend.cc.
#ifndef PARAMD_SERVER_GPU_BACKEND_HOST_COPIES_H_
#define PARAMD_SERVER_GPU_BACKEND_HOST_COPIES_H_

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/gpu_status.h"
#include "common/status_macros.h"
#include "server/gpu_backend/shard_store.h"
#include "server/step/shard_set.h"

namespace paramd {
namespace gpu_backend {

// A blocking device-to-host copy (nothing for 0 bytes).
inline absl::Status CopyToHostBytes(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  GPU_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

// The host bytes of published versions, copied from the device on the first
// request (ShardBackend::host_bytes). Shared by the backend and by the
// HostBytesFn it hands out, so a fetch may finish after the backend is gone
// (the store, and its device buffers, live as long as this).
//
// Threading: Get from any thread; Add/Retire from the step thread. The
// device-to-host copy of a version runs outside the mutex, marked on its
// entry (copying): Retire of a version (before a step rewrites its device
// slot) waits for that version's copy only, so a slow first host fetch of
// the latest version does not hold up the step that retires the older one.
// A retired version is erased under the mutex: no copy of it starts after.
class HostCopies {
 public:
  // `copy_delay_ms` > 0 (test hook PARAMD_GPU_HOST_COPY_DELAY_MS): every
  // copy to the host takes that much longer, as a large model's does.
  HostCopies(std::shared_ptr<GpuShardStore> store, int64_t copy_delay_ms)
      : store_(std::move(store)), copy_delay_ms_(copy_delay_ms) {}

  // `meta` (pieces without bytes, or with all of them: a pipelined step's
  // version, handed out as is) was just published; `device[k]` holds the
  // device buffers of meta->pieces[k].
  void Add(std::shared_ptr<const PublishedVersion> meta,
           std::vector<GpuPublishedDirection> device) {
    auto e = std::make_shared<Entry>();
    e->has_bytes = !meta->pieces.empty();
    for (size_t k = 0; k < meta->pieces.size() && k < device.size(); ++k) {
      e->has_bytes &= meta->pieces[k].q.data.size() == device[k].layout.data_bytes() &&
                      meta->pieces[k].q.scales.size() == device[k].layout.scale_bytes();
    }
    e->meta = std::move(meta);
    e->device = std::move(device);
    absl::MutexLock lock(&mu_);
    entries_[e->meta->version] = std::move(e);
  }

  // The device slot of `version` is about to be rewritten: waits for a copy
  // of it in progress, then forgets it. Its host copy, when nobody holds it
  // any more, keeps its (already faulted-in) memory for a later copy.
  void Retire(int64_t version) {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(version);
    if (it == entries_.end()) return;
    std::shared_ptr<Entry> e = it->second;
    while (e->copying) copied_.Wait(&mu_);
    e->retired = true;
    if (e->bytes != nullptr && e->bytes.use_count() == 1) spare_ = std::move(e->bytes);
    e->bytes = nullptr;
    entries_.erase(version);
  }

  absl::StatusOr<std::shared_ptr<const PublishedVersion>> Get(
      const std::shared_ptr<const PublishedVersion>& meta) {
    std::shared_ptr<Entry> e;
    std::shared_ptr<PublishedVersion> copy;
    {
      absl::MutexLock lock(&mu_);
      auto it = entries_.find(meta->version);
      if (it == entries_.end() || it->second->meta != meta) return NotHeld(meta->version);
      e = it->second;
      if (e->has_bytes) return e->meta;
      // Another request is copying this version: share its copy (or, if it
      // failed, try again).
      while (e->copying) copied_.Wait(&mu_);
      if (e->retired) return NotHeld(meta->version);
      if (e->bytes != nullptr) return e->bytes;
      e->copying = true;
      copy = std::move(spare_);
      spare_ = nullptr;
    }
    absl::Status s = CopyToHost(*e, copy);
    absl::MutexLock lock(&mu_);
    e->copying = false;
    copied_.SignalAll();
    RETURN_IF_ERROR(s);
    e->bytes = std::move(copy);
    return e->bytes;
  }

 private:
  struct Entry {
    std::shared_ptr<const PublishedVersion> meta;
    bool has_bytes = false;  // meta carries its bytes
    std::vector<GpuPublishedDirection> device;
    // Written under mu_; the copy itself runs without it while `copying`.
    std::shared_ptr<PublishedVersion> bytes;  // null until requested
    bool copying = false;
    bool retired = false;
  };

  static absl::Status NotHeld(int64_t version) {
    return absl::NotFoundError(absl::StrCat(
        "version ", version,
        " is no longer held on the device (the gpu backend keeps the two latest versions)"));
  }

  // The bytes of `e` into `copy`: a retired copy's buffers when it has the
  // same pieces (same shards, same layouts: resize keeps them), else new.
  // Called with e.copying set (so e's slot is not rewritten meanwhile).
  absl::Status CopyToHost(const Entry& e, std::shared_ptr<PublishedVersion>& copy) {
    if (copy != nullptr && copy->pieces.size() == e.meta->pieces.size()) {
      for (size_t k = 0; k < copy->pieces.size(); ++k) {
        std::vector<uint8_t> data = std::move(copy->pieces[k].q.data);
        std::vector<uint8_t> scales = std::move(copy->pieces[k].q.scales);
        copy->pieces[k] = e.meta->pieces[k];
        copy->pieces[k].q.data = std::move(data);
        copy->pieces[k].q.scales = std::move(scales);
      }
      copy->version = e.meta->version;
      copy->tensors = e.meta->tensors;
      copy->report = e.meta->report;
    } else {
      copy = std::make_shared<PublishedVersion>(*e.meta);
    }
    if (copy_delay_ms_ > 0) absl::SleepFor(absl::Milliseconds(copy_delay_ms_));
    ScopedDevice guard(store_->device());
    for (size_t k = 0; k < copy->pieces.size(); ++k) {
      PublishedPiece& p = copy->pieces[k];
      const GpuPublishedDirection& d = e.device[k];
      p.q.data.resize(d.layout.data_bytes());
      RETURN_IF_ERROR(CopyToHostBytes(p.q.data.data(), d.data, p.q.data.size()));
      p.q.scales.resize(d.layout.scale_bytes());
      if (d.scales != nullptr) {
        RETURN_IF_ERROR(CopyToHostBytes(p.q.scales.data(), d.scales, p.q.scales.size()));
      }
    }
    return absl::OkStatus();
  }

  const std::shared_ptr<GpuShardStore> store_;
  const int64_t copy_delay_ms_;
  absl::Mutex mu_;
  absl::CondVar copied_;  // an entry's copying went false
  std::map<int64_t, std::shared_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<PublishedVersion> spare_ ABSL_GUARDED_BY(mu_);  // a retired host copy
};

}  // namespace gpu_backend
}  // namespace paramd

#endif  // PARAMD_SERVER_GPU_BACKEND_HOST_COPIES_H_
