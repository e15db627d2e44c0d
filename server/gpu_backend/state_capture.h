// File: server/gpu_backend/state_capture.h
//
// Snapshot capture of a GpuShardStore's masters and optimizer moments
// (ShardBackend::CaptureState, server/snapshot/snapshot.h), kept off the step's
// critical path:
//
//   spare (the default where the device has room): right after a step, on
//   the step thread, a side stream waits for an event recorded on the
//   store's stream and copies every master and moment into one device
//   allocation of the same size (the spare: 8 B/param with SGD momentum,
//   12 with AdamW), then records `copied`. The step thread only enqueues
//   (no host wait). The next step's device work waits for `copied` on the
//   device (OrderBefore; a ~3 TB/s device copy, done long before when the
//   step is waiting for pushes), and host writes into the state (a
//   mirror's upload, a restore's) wait for it on the host (WaitHost).
//   The snapshot keeper's thread then downloads the spare into host
//   vectors through two page-locked bounce buffers (each copied out by up
//   to 8 threads), while the daemon steps on; the next capture waits for
//   that download (the spare is reused).
//
//   direct (where the spare does not fit: free memory < spare + reserve,
//   or PARAMD_GPU_SNAPSHOT_SPARE=0): the capture reads the live buffers,
//   so the keeper holds the next step until the download is done
//   (StateCapture::reads_live_state).
//
// Threading: Capture, OrderBefore and WaitHost on the store's step thread;
// a capture's Copy on one other thread (the keeper's); one capture at a
// time (a second Capture while one is not yet copied fails).
#ifndef PARAMD_SERVER_GPU_BACKEND_STATE_CAPTURE_H_
#define PARAMD_SERVER_GPU_BACKEND_STATE_CAPTURE_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/backend/shard_backend.h"
#include "server/gpu_backend/shard_store.h"

namespace paramd {
namespace gpu_backend {

class DeviceSnapshotSpare : public std::enable_shared_from_this<DeviceSnapshotSpare> {
 public:
  // Nothing is allocated until the first Capture.
  static std::shared_ptr<DeviceSnapshotSpare> Create(std::shared_ptr<GpuShardStore> store);
  ~DeviceSnapshotSpare();
  DeviceSnapshotSpare(const DeviceSnapshotSpare&) = delete;
  DeviceSnapshotSpare& operator=(const DeviceSnapshotSpare&) = delete;

  // The store's masters and moments as the last finished step left them
  // (moments only once a step ran, as the host mirror has them).
  absl::StatusOr<std::unique_ptr<StateCapture>> Capture();
  // The device work enqueued on `stream` after this waits for a spare copy
  // that was enqueued and not yet waited for on the host. Never blocks.
  absl::Status OrderBefore(cudaStream_t stream);
  // Blocks until that copy is done (before host writes into the state).
  absl::Status WaitHost();

  // Device bytes of the spare (0 until allocated, or in direct mode).
  int64_t device_bytes() const { return spare_bytes_.load(std::memory_order_relaxed); }
  // Milliseconds of the last spare copy on the device (events), once its
  // download finished; 0 before.
  double last_device_copy_ms() const { return last_copy_ms_.load(std::memory_order_relaxed); }

 private:
  class Capture_;
  explicit DeviceSnapshotSpare(std::shared_ptr<GpuShardStore> store) : store_(std::move(store)) {}
  absl::Status Init();
  // Decides spare or direct at the first capture (allocates the spare),
  // again when the store's buffers changed since.
  absl::Status ChooseMode();
  // Offsets (floats) of every live buffer's copy in a spare, and its size.
  std::vector<std::array<int64_t, 3>> Layout(int64_t* floats) const;
  // Copies `count` floats from device `src` into host `dst` through the
  // bounce buffers, on side_ (after what is enqueued there). Keeper thread.
  struct Piece {
    const float* src;
    float* dst;
    int64_t count;
  };
  absl::Status Download(const std::vector<Piece>& pieces);

  const std::shared_ptr<GpuShardStore> store_;
  cudaStream_t side_ = nullptr;
  cudaEvent_t after_step_ = nullptr;
  cudaEvent_t copy_start_ = nullptr;
  cudaEvent_t copied_ = nullptr;
  cudaEvent_t bounce_done_[2] = {};
  void* bounce_[2] = {};
  bool mode_chosen_ = false;
  bool use_spare_ = false;
  float* spare_ = nullptr;
  // Offset (floats) of shard i's master, m, v in spare_.
  std::vector<std::array<int64_t, 3>> offsets_;
  bool copy_pending_ = false;        // step thread only
  std::atomic<bool> in_use_{false};  // a capture not yet copied
  std::atomic<int64_t> spare_bytes_{0};
  std::atomic<double> last_copy_ms_{0};
};

}  // namespace gpu_backend
}  // namespace paramd

#endif  // PARAMD_SERVER_GPU_BACKEND_STATE_CAPTURE_H_
