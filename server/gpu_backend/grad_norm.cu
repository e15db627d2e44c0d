#include "server/gpu_backend/grad_norm.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace paramd {
namespace gpu_backend {
namespace {

constexpr int kLanes = 256;  // = kGradNormLanes (server/grad_norm.h)

// Explicit double intrinsics: no contraction choice can change the order.
// `add` (nullable) is FP32, or BF16 when kBf16 (widened exactly, as
// accumulate.cu).
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
  __syncthreads();
  for (int half = kLanes / 2; half >= 1; half >>= 1) {
    if (threadIdx.x < half) {
      lane[threadIdx.x] = __dadd_rn(lane[threadIdx.x], lane[threadIdx.x + half]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) row_sums[row] = lane[0];
}

__device__ void Encode(double v, float* out) {
  const unsigned long long bits = static_cast<unsigned long long>(__double_as_longlong(v));
  for (int k = 0; k < 4; ++k) out[k] = static_cast<float>((bits >> (16 * k)) & 0xFFFFull);
}

// One thread per slot of the whole vector: a slot of this daemon gets its
// block's row sums in row order, every other slot 0 (so no memset first).
__global__ void EncodeSlotsKernel(const NormSlotSource* __restrict__ table, int64_t num_slots,
                                  float* __restrict__ slots) {
  const int64_t s = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (s >= num_slots) return;
  const NormSlotSource src = table[s];
  double sum = 0.0;
  for (int r = 0; r < src.rows; ++r) sum = __dadd_rn(sum, src.row_sums[r]);
  Encode(sum, slots + 4 * s);
}

constexpr int kSumChunk = 2048;  // slots decoded per round (16 KiB of shared doubles)

// 256 threads decode a chunk of slots into shared memory; thread 0 adds
// them in slot order (the adds are the only serial part: a few us at 1 B
// parameters).
__global__ void __launch_bounds__(kLanes)
    ClipFactorKernel(const float* __restrict__ slots, int64_t num_slots, float max_grad_norm,
                     bool skip_non_finite, volatile double* sum_sq, float* factor) {
  __shared__ double chunk[kSumChunk];
  double sum = 0.0;
  for (int64_t base = 0; base < num_slots; base += kSumChunk) {
    const int n = num_slots - base < kSumChunk ? static_cast<int>(num_slots - base) : kSumChunk;
    for (int i = threadIdx.x; i < n; i += kLanes) {
      const float* in = slots + 4 * (base + i);
      unsigned long long bits = 0;
      for (int k = 0; k < 4; ++k) bits |= static_cast<unsigned long long>(in[k]) << (16 * k);
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
  float f = 1.0f;
  if (!isfinite(sum)) {
    f = skip_non_finite ? __int_as_float(0x7fc00000) : 1.0f;
  } else if (max_grad_norm > 0.0f) {
    const double c =
        __ddiv_rn(static_cast<double>(max_grad_norm), __dadd_rn(__dsqrt_rn(sum), 1e-6));
    f = c < 1.0 ? __double2float_rn(c) : 1.0f;
  }
  *factor = f;
}

}  // namespace

cudaError_t LaunchRowSumSq(float* acc, const void* add, bool add_bf16, int64_t rows,
                           int64_t cols, double* row_sums, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (rows > 0x7FFFFFFF) return cudaErrorInvalidValue;
  if (add_bf16) {
    RowSumSqKernel<true>
        <<<static_cast<unsigned>(rows), kLanes, 0, stream>>>(acc, add, cols, row_sums);
  } else {
    RowSumSqKernel<false>
        <<<static_cast<unsigned>(rows), kLanes, 0, stream>>>(acc, add, cols, row_sums);
  }
  return cudaGetLastError();
}

cudaError_t LaunchEncodeNormSlots(const NormSlotSource* table, int64_t num_slots, float* slots,
                                  cudaStream_t stream) {
  if (num_slots <= 0) return cudaSuccess;
  EncodeSlotsKernel<<<static_cast<unsigned>((num_slots + 127) / 128), 128, 0, stream>>>(
      table, num_slots, slots);
  return cudaGetLastError();
}

cudaError_t LaunchClipFactor(const float* slots, int64_t num_slots, float max_grad_norm,
                             bool skip_non_finite, double* sum_sq, float* factor,
                             cudaStream_t stream) {
  ClipFactorKernel<<<1, kLanes, 0, stream>>>(slots, num_slots, max_grad_norm, skip_non_finite,
                                              sum_sq, factor);
  return cudaGetLastError();
}

}  // namespace gpu_backend
}  // namespace paramd
