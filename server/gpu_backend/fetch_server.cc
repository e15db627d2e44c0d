#include "server/gpu_backend/fetch_server.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "format/fetch_plan.h"

namespace paramd {
namespace gpu_backend {

absl::StatusOr<std::vector<DeviceBytes>> FetchPieces(const GpuShardStore& store, int64_t version,
                                                     absl::Span<const FetchItem> items) {
  std::vector<DeviceBytes> pieces;
  for (const FetchItem& item : items) {
    ASSIGN_OR_RETURN(GpuPublishedDirection d, store.Published(version, item.shard, item.direction));
    gpu_fetch::AppendItemPieces(
        d.layout, static_cast<const void*>(d.data), static_cast<const void*>(d.scales),
        static_cast<const void*>(d.scale_inv), static_cast<const void*>(d.amax), &pieces);
  }
  return pieces;
}

absl::Status ServeFetch(NcclTransport& transport, int trainer, uint64_t tag,
                        const GpuShardStore& store, int64_t version,
                        absl::Span<const FetchItem> items, bool per_item, absl::Time deadline,
                        cudaEvent_t ready) {
  if (!per_item) {
    ASSIGN_OR_RETURN(std::vector<DeviceBytes> pieces, FetchPieces(store, version, items));
    return transport.SendDevice(trainer, tag, pieces, ready, deadline);
  }
  // One message per run of consecutive items of the same shard.
  uint64_t message = 0;
  for (size_t begin = 0; begin < items.size(); ++message) {
    size_t end = begin + 1;
    while (end < items.size() && items[end].shard == items[begin].shard) ++end;
    ASSIGN_OR_RETURN(std::vector<DeviceBytes> pieces,
                     FetchPieces(store, version, items.subspan(begin, end - begin)));
    RETURN_IF_ERROR(transport.SendDevice(trainer, tag + message, pieces,
                                         store.TensorReady(items[begin].shard), deadline));
    begin = end;
  }
  return absl::OkStatus();
}

absl::Status ServeFetchPipelined(NcclTransport& transport, int trainer, uint64_t tag,
                                 const GpuShardStore& store, int64_t version,
                                 absl::Span<const FetchItem> items, absl::Time deadline) {
  std::vector<DeviceBytes> pieces;
  std::vector<cudaEvent_t> ready;
  for (size_t k = 0; k < items.size(); ++k) {
    ASSIGN_OR_RETURN(std::vector<DeviceBytes> item,
                     FetchPieces(store, version, items.subspan(k, 1)));
    pieces.insert(pieces.end(), item.begin(), item.end());
    ready.insert(ready.end(), item.size(), store.TensorReady(items[k].shard));
  }
  return transport.SendDevicePipelined(trainer, tag, pieces, ready, deadline);
}

}  // namespace gpu_backend
}  // namespace paramd
