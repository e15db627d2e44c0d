// File: kernels/cuda/batch_search.cuh
//
// INTERNAL device helper of the multi-tensor kernels: which tensor of a
// batch a block's global work index (tile or chunk) belongs to. Device code
// only; included by amax.cu and quantize.cu.
#ifndef PARAMD_KERNELS_CUDA_BATCH_SEARCH_CUH_
#define PARAMD_KERNELS_CUDA_BATCH_SEARCH_CUH_

#include <cstdint>

#include <cuda_runtime.h>

namespace paramd {
namespace gpu {
namespace dev {

// The last i in [0, n) with items[i].*begin <= idx: items are sorted by
// their `begin` field (the first global index of each), items[0] starts at 0.
template <typename Item>
__device__ __forceinline__ int FindBatchItem(const Item* items, int n, int64_t idx,
                                             int64_t Item::*begin) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (items[mid].*begin <= idx) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace dev
}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_BATCH_SEARCH_CUH_
