#include "server/gpu_backend/grad_norm.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace paramd {
namespace gpu_backend {
namespace {

constexpr int kLanes = 256;         // = kGradNormLanes (server/step/grad_norm.h)
constexpr int kChunk = 4 * kLanes;  // elements per round of the vectorized row sums

// lane[0] = the fixed tree of server/step/grad_norm.h over lane[0 .. kLanes).
__device__ void LaneTree(double* lane) {
  __syncthreads();
  for (int half = kLanes / 2; half >= 1; half >>= 1) {
    if (threadIdx.x < half) {
      lane[threadIdx.x] = __dadd_rn(lane[threadIdx.x], lane[threadIdx.x + half]);
    }
    __syncthreads();
  }
}

// Explicit double intrinsics: no contraction choice can change the order.
// `add` (nullable) is FP32, or BF16 when kBf16 (widened exactly, as
// accumulate.cu). Scalar loads: any cols, any alignment.
template <bool kBf16>
__global__ void __launch_bounds__(kLanes)
    RowSumSqKernel(float* __restrict__ acc, const void* __restrict__ add, int64_t cols,
                   double* __restrict__ row_sums) {
  __shared__ double lane[kLanes];
  const int64_t row = blockIdx.x;
  float* a = acc + row * cols;
  const float* g = add == nullptr || kBf16 ? nullptr : static_cast<const float*>(add) + row * cols;
  const __nv_bfloat16* h =
      add == nullptr || !kBf16 ? nullptr : static_cast<const __nv_bfloat16*>(add) + row * cols;
  double s = 0.0;
  for (int64_t k = threadIdx.x; k < cols; k += kLanes) {
    float v = a[k];
    if (g != nullptr || h != nullptr) {
      v = __fadd_rn(v, kBf16 ? __bfloat162float(h[k]) : g[k]);
      a[k] = v;
    }
    const double d = v;
    s = __dadd_rn(s, __dmul_rn(d, d));
  }
  lane[threadIdx.x] = s;
  LaneTree(lane);
  if (threadIdx.x == 0) row_sums[row] = lane[0];
}

// The same sums with 16-byte accumulator loads (cols % 4 == 0, rows
// 16-byte aligned; `add` 16-byte aligned FP32 or 8-byte aligned BF16): each
// round, thread t adds elements [4 t, 4 t + 4) of a 1024-element chunk and
// stores them into shared memory, then lane l squares elements l, l + 256,
// l + 512, l + 768 of it, which is lane l's order in server/step/grad_norm.h
// (two shared buffers: one barrier per round). What the add costs beyond a
// plain vectorized add: the shared-memory pass and the float64 adds.
template <bool kBf16, bool kAdd>
__global__ void __launch_bounds__(kLanes)
    RowSumSqVecKernel(float* __restrict__ acc, const void* __restrict__ add, int64_t cols,
                      double* __restrict__ row_sums) {
  __shared__ __align__(16) float buf[2][kChunk];
  __shared__ double lane[kLanes];
  const int64_t row = blockIdx.x;
  float* a = acc + row * cols;
  double s = 0.0;
  int parity = 0;
  for (int64_t base = 0; base < cols; base += kChunk, parity ^= 1) {
    const int n = cols - base < kChunk ? static_cast<int>(cols - base) : kChunk;
    const int at = 4 * threadIdx.x;
    if (at < n) {
      float4 v = *reinterpret_cast<const float4*>(a + base + at);
      if constexpr (kAdd) {
        float4 g;
        if constexpr (kBf16) {
          const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(add) +
                                                            row * cols + base + at);
          const __nv_bfloat16* hb = reinterpret_cast<const __nv_bfloat16*>(&raw);
          g = make_float4(__bfloat162float(hb[0]), __bfloat162float(hb[1]), __bfloat162float(hb[2]),
                          __bfloat162float(hb[3]));
        } else {
          g = *reinterpret_cast<const float4*>(static_cast<const float*>(add) + row * cols + base +
                                               at);
        }
        v.x = __fadd_rn(v.x, g.x);
        v.y = __fadd_rn(v.y, g.y);
        v.z = __fadd_rn(v.z, g.z);
        v.w = __fadd_rn(v.w, g.w);
        *reinterpret_cast<float4*>(a + base + at) = v;
      }
      *reinterpret_cast<float4*>(&buf[parity][at]) = v;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int k = threadIdx.x + j * kLanes;
      if (k < n) {
        const double d = buf[parity][k];
        s = __dadd_rn(s, __dmul_rn(d, d));
      }
    }
  }
  lane[threadIdx.x] = s;
  LaneTree(lane);
  if (threadIdx.x == 0) row_sums[row] = lane[0];
}

__device__ void Encode(double v, float* out) {
  const unsigned long long bits = static_cast<unsigned long long>(__double_as_longlong(v));
  for (int k = 0; k < 4; ++k) out[k] = static_cast<float>((bits >> (16 * k)) & 0xFFFFull);
}

constexpr int kSlotThreads = 128;
constexpr int kSlotsPerBlock = 32;
constexpr int kSlotRows = 128;              // = kGradNormBlockRows
constexpr int kSlotStride = kSlotRows + 1;  // shared row pitch: 2-way bank conflicts at most
constexpr int kSumChunk = 2048;             // slots decoded per round of the final sum
constexpr int kSharedDoubles = kSlotsPerBlock * kSlotStride;
static_assert(kSumChunk <= kSharedDoubles, "the final sum reuses the slot staging");

// The clip factor of the gathered slots (ClipFactor of server/step/optimizer.h)
// from their float64 sum.
__device__ float ClipFactorOf(double sum, float max_grad_norm, bool skip_non_finite) {
  if (!isfinite(sum)) return skip_non_finite ? __int_as_float(0x7fc00000) : 1.0f;
  if (max_grad_norm <= 0.0f) return 1.0f;
  const double c = __ddiv_rn(static_cast<double>(max_grad_norm), __dadd_rn(__dsqrt_rn(sum), 1e-6));
  return c < 1.0 ? __double2float_rn(c) : 1.0f;
}

// The whole block decodes a chunk of slots into `chunk` (shared); thread 0
// adds them in slot order (the adds are the only serial part: a few us at
// 1 B parameters). L2 loads (__ldcg): in the fused kernel other blocks
// wrote the slots during this launch.
__device__ void SumSlotsAndFactor(const float* slots, int64_t num_slots, float max_grad_norm,
                                  bool skip_non_finite, volatile double* sum_sq, float* factor,
                                  double* chunk) {
  double sum = 0.0;
  for (int64_t base = 0; base < num_slots; base += kSumChunk) {
    const int n = num_slots - base < kSumChunk ? static_cast<int>(num_slots - base) : kSumChunk;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const float* in = slots + 4 * (base + i);
      unsigned long long bits = 0;
      for (int k = 0; k < 4; ++k) {
        bits |= static_cast<unsigned long long>(__ldcg(in + k)) << (16 * k);
      }
      chunk[i] = __longlong_as_double(static_cast<long long>(bits));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll 8
      for (int i = 0; i < n; ++i) sum = __dadd_rn(sum, chunk[i]);
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  *sum_sq = sum;
  *factor = ClipFactorOf(sum, max_grad_norm, skip_non_finite);
}

// 32 slots per block: the four warps stage the slots' row sums in shared
// memory (coalesced), then thread j adds slot j's in row order and encodes
// it (every slot not of this daemon: 0, so no memset first). kFused (one
// daemon, no all-reduce between): the last block to finish (a counter in
// device memory, reset by that block) also takes the sum and the factor.
template <bool kFused>
__global__ void __launch_bounds__(kSlotThreads)
    EncodeSlotsKernel(const NormSlotSource* __restrict__ table, int64_t num_slots,
                      float* __restrict__ slots, unsigned int* counter, float max_grad_norm,
                      bool skip_non_finite, volatile double* sum_sq, float* factor) {
  __shared__ double staged[kSharedDoubles];
  const int64_t first = blockIdx.x * int64_t{kSlotsPerBlock};
  const int count =
      num_slots - first < kSlotsPerBlock ? static_cast<int>(num_slots - first) : kSlotsPerBlock;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int j = warp; j < count; j += kSlotThreads / 32) {
    const NormSlotSource src = table[first + j];
    for (int r = lane; r < src.rows; r += 32) staged[j * kSlotStride + r] = src.row_sums[r];
  }
  __syncthreads();
  if (threadIdx.x < count) {
    const int rows = table[first + threadIdx.x].rows;
    const double* mine = staged + threadIdx.x * kSlotStride;
    double sum = 0.0;
    for (int r = 0; r < rows; ++r) sum = __dadd_rn(sum, mine[r]);
    Encode(sum, slots + 4 * (first + threadIdx.x));
  }
  if constexpr (kFused) {
    __shared__ bool last;
    __threadfence();  // this block's slots are visible before it is counted
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    SumSlotsAndFactor(slots, num_slots, max_grad_norm, skip_non_finite, sum_sq, factor, staged);
    if (threadIdx.x == 0) *counter = 0;
  }
}

__global__ void __launch_bounds__(kLanes)
    ClipFactorKernel(const float* __restrict__ slots, int64_t num_slots, float max_grad_norm,
                     bool skip_non_finite, volatile double* sum_sq, float* factor) {
  __shared__ double chunk[kSumChunk];
  SumSlotsAndFactor(slots, num_slots, max_grad_norm, skip_non_finite, sum_sq, factor, chunk);
}

bool Aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

unsigned SlotBlocks(int64_t num_slots) {
  return static_cast<unsigned>((num_slots + kSlotsPerBlock - 1) / kSlotsPerBlock);
}

}  // namespace

cudaError_t LaunchRowSumSq(float* acc, const void* add, bool add_bf16, int64_t rows, int64_t cols,
                           double* row_sums, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (rows > 0x7FFFFFFF) return cudaErrorInvalidValue;
  const unsigned grid = static_cast<unsigned>(rows);
  const bool vec =
      cols % 4 == 0 && Aligned(acc, 16) && (add == nullptr || Aligned(add, add_bf16 ? 8 : 16));
  if (vec && add == nullptr) {
    RowSumSqVecKernel<false, false><<<grid, kLanes, 0, stream>>>(acc, add, cols, row_sums);
  } else if (vec && add_bf16) {
    RowSumSqVecKernel<true, true><<<grid, kLanes, 0, stream>>>(acc, add, cols, row_sums);
  } else if (vec) {
    RowSumSqVecKernel<false, true><<<grid, kLanes, 0, stream>>>(acc, add, cols, row_sums);
  } else if (add_bf16) {
    RowSumSqKernel<true><<<grid, kLanes, 0, stream>>>(acc, add, cols, row_sums);
  } else {
    RowSumSqKernel<false><<<grid, kLanes, 0, stream>>>(acc, add, cols, row_sums);
  }
  return cudaGetLastError();
}

cudaError_t LaunchEncodeNormSlots(const NormSlotSource* table, int64_t num_slots, float* slots,
                                  cudaStream_t stream) {
  if (num_slots <= 0) return cudaSuccess;
  EncodeSlotsKernel<false><<<SlotBlocks(num_slots), kSlotThreads, 0, stream>>>(
      table, num_slots, slots, nullptr, 0.0f, false, nullptr, nullptr);
  return cudaGetLastError();
}

cudaError_t LaunchClipFactor(const float* slots, int64_t num_slots, float max_grad_norm,
                             bool skip_non_finite, double* sum_sq, float* factor,
                             cudaStream_t stream) {
  ClipFactorKernel<<<1, kLanes, 0, stream>>>(slots, num_slots, max_grad_norm, skip_non_finite,
                                             sum_sq, factor);
  return cudaGetLastError();
}

cudaError_t LaunchNormSlotsAndClipFactor(const NormSlotSource* table, int64_t num_slots,
                                         float* slots, unsigned int* counter, float max_grad_norm,
                                         bool skip_non_finite, double* sum_sq, float* factor,
                                         cudaStream_t stream) {
  if (num_slots <= 0) {
    return LaunchClipFactor(slots, 0, max_grad_norm, skip_non_finite, sum_sq, factor, stream);
  }
  EncodeSlotsKernel<true><<<SlotBlocks(num_slots), kSlotThreads, 0, stream>>>(
      table, num_slots, slots, counter, max_grad_norm, skip_non_finite, sum_sq, factor);
  return cudaGetLastError();
}

}  // namespace gpu_backend
}  // namespace paramd
