#include "client/gpu_fetch/fetch.h"

#include <cuda_runtime_api.h>

#include "common/gpu_status.h"
#include "format/fetch_plan.h"

namespace paramd {
namespace gpu_fetch {

std::vector<MutableDeviceBytes> PlanPieces(absl::Span<const DeviceDirection> dst) {
  std::vector<MutableDeviceBytes> pieces;
  for (const DeviceDirection& d : dst) {
    AppendItemPieces(d.layout, d.data, d.scales, d.scale_inv, d.amax, &pieces);
  }
  return pieces;
}

absl::Status FetchDirections(NcclTransport& transport, int daemon, uint64_t tag,
                             absl::Span<const DeviceDirection> dst, absl::Time deadline) {
  return transport.RecvDevice(daemon, tag, PlanPieces(dst), deadline);
}

DevicePool::~DevicePool() {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  for (void* p : blocks_) cudaFree(p);
  cudaSetDevice(previous);
}

absl::StatusOr<DeviceDirection> DevicePool::Allocate(const Layout& layout) {
  auto up = [](int64_t n) { return (n + 255) / 256 * 256; };
  const int64_t bytes = up(layout.data_bytes()) + up(layout.scale_bytes()) + 512;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  void* block = nullptr;
  absl::Status s = GPU_STATUS(cudaMalloc(&block, bytes));
  if (s.ok()) s = GPU_STATUS(cudaMemset(block, 0, bytes));
  cudaSetDevice(previous);
  if (!s.ok()) return s;
  blocks_.push_back(block);
  bytes_ += bytes;
  uint8_t* p = static_cast<uint8_t*>(block);
  DeviceDirection d;
  d.layout = layout;
  d.data = p;
  p += up(layout.data_bytes());
  if (layout.scale_bytes() > 0) d.scales = p;
  p += up(layout.scale_bytes());
  d.scale_inv = reinterpret_cast<float*>(p);
  d.amax = reinterpret_cast<float*>(p + 256);
  return d;
}

}  // namespace gpu_fetch
}  // namespace paramd
