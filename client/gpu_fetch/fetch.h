// File: client/gpu_fetch/fetch.h
//
// The trainer's device-buffer fetch API: receives published
// directions of a version straight into device memory over the "nccl"
// transport, in the layouts of FORMATS.md (ComputeLayout), as one NCCL group
// per request. The piece order is the plan of
// server/gpu_backend/fetch_server.h: per item data, scales (if any),
// scale_inv, amax.
//
// Memory: caller-owned buffers (DeviceDirection with the caller's pointers)
// or a DevicePool that owns them. Streams: FetchDirections returns once the
// bytes are in device memory, so work on any stream enqueued after it sees
// them; to order the receive after the caller's own work on a stream, the
// caller synchronises that stream first (a fetch overwrites the buffers).
// Thread-compatible: one fetch per (transport, daemon) at a time.
#ifndef PARAMD_CLIENT_GPU_FETCH_FETCH_H_
#define PARAMD_CLIENT_GPU_FETCH_FETCH_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/format.h"
#include "transport/nccl_transport.h"

namespace paramd {
namespace gpu_fetch {

// One direction of one tensor in device memory.
struct DeviceDirection {
  Layout layout;
  void* data = nullptr;        // layout.data_bytes()
  void* scales = nullptr;      // layout.scale_bytes(), or null when 0
  float* scale_inv = nullptr;  // one device float
  float* amax = nullptr;       // one device float
};

// The receive pieces of `dst` in plan order.
std::vector<MutableDeviceBytes> PlanPieces(absl::Span<const DeviceDirection> dst);

// Receives one fetch message from `daemon` into `dst`. INVALID_ARGUMENT if
// the daemon's plan does not match the buffers (the message is consumed);
// the transport's codes otherwise (DEADLINE_EXCEEDED, UNAVAILABLE for a dead
// daemon: never a hang past `deadline`).
absl::Status FetchDirections(NcclTransport& transport, int daemon, uint64_t tag,
                             absl::Span<const DeviceDirection> dst, absl::Time deadline);

// Device buffers the library owns (one cudaMalloc per Allocate), on the
// transport's device; freed with the pool.
class DevicePool {
 public:
  explicit DevicePool(int device) : device_(device) {}
  ~DevicePool();
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  // Buffers for `layout` (RESOURCE_EXHAUSTED when the device is full).
  absl::StatusOr<DeviceDirection> Allocate(const Layout& layout);
  int64_t bytes() const { return bytes_; }

 private:
  int device_;
  std::vector<void*> blocks_;
  int64_t bytes_ = 0;
};

}  // namespace gpu_fetch
}  // namespace paramd

#endif  // PARAMD_CLIENT_GPU_FETCH_FETCH_H_
