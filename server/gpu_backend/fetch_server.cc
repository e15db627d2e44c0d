#include "server/gpu_backend/fetch_server.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace paramd {
namespace gpu_backend {
namespace {

absl::StatusOr<std::vector<DeviceBytes>> PiecesOf(const GpuPublishedDirection& d) {
  std::vector<DeviceBytes> pieces;
  pieces.push_back({d.data, static_cast<size_t>(d.layout.data_bytes())});
  if (d.layout.scale_bytes() > 0) {
    pieces.push_back({d.scales, static_cast<size_t>(d.layout.scale_bytes())});
  }
  pieces.push_back({d.scale_inv, sizeof(float)});
  pieces.push_back({d.amax, sizeof(float)});
  return pieces;
}

}  // namespace

absl::StatusOr<std::vector<DeviceBytes>> FetchPieces(const GpuShardStore& store, int64_t version,
                                                     absl::Span<const FetchItem> items) {
  std::vector<DeviceBytes> pieces;
  for (const FetchItem& item : items) {
    ASSIGN_OR_RETURN(GpuPublishedDirection d, store.Published(version, item.shard, item.direction));
    ASSIGN_OR_RETURN(std::vector<DeviceBytes> p, PiecesOf(d));
    pieces.insert(pieces.end(), p.begin(), p.end());
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

}  // namespace gpu_backend
}  // namespace paramd
