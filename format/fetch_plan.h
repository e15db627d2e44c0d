// File: format/fetch_plan.h
//
// The piece order of one device fetch message, the ONE
// definition both sides use: the daemon's sender
// (server/gpu_backend/fetch_server.h) and the trainer's receiver
// (client/gpu_fetch/fetch.h). Per (shard, direction) item, in item order:
//   1. the data buffer       (layout.data_bytes())
//   2. the scale buffer      (layout.scale_bytes(); only when > 0)
//   3. scale_inv             (one float)
//   4. amax                  (one float)
// Header-only and free of CUDA/NCCL types so that both libraries (and host
// tests) can use it; `Piece` is the transport's DeviceBytes or
// MutableDeviceBytes (any aggregate {pointer, size_t}).
#ifndef PARAMD_FORMAT_FETCH_PLAN_H_
#define PARAMD_FORMAT_FETCH_PLAN_H_

#include <cstddef>
#include <vector>

#include "kernels/format.h"

namespace paramd {
namespace gpu_fetch {

// Pieces of one item per item of a message: 3 or 4.
inline int PiecesPerItem(const Layout& layout) { return layout.scale_bytes() > 0 ? 4 : 3; }

// Appends the pieces of one item (the buffers of one published direction)
// to `out` in plan order.
template <typename Piece, typename Ptr, typename FloatPtr>
void AppendItemPieces(const Layout& layout, Ptr data, Ptr scales, FloatPtr scale_inv, FloatPtr amax,
                      std::vector<Piece>* out) {
  out->push_back({data, static_cast<size_t>(layout.data_bytes())});
  if (layout.scale_bytes() > 0) {
    out->push_back({scales, static_cast<size_t>(layout.scale_bytes())});
  }
  out->push_back({scale_inv, sizeof(float)});
  out->push_back({amax, sizeof(float)});
}

}  // namespace gpu_fetch
}  // namespace paramd

#endif  // PARAMD_FORMAT_FETCH_PLAN_H_
