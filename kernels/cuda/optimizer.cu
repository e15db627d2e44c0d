// Fused multi-tensor optimizer steps (AdamW, SGD with momentum) over FP32
// master, moments and an FP32 gradient accumulator, producing each tensor's
// amax of the updated weights (rounded to the source dtype, D1) in the same
// pass. One block per 16384-element chunk; float4 accesses when aligned.
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/codecs.cuh"
#include "kernels/cuda/optimizer_launch.h"
#include "kernels/cuda/optimizer_math.cuh"

namespace paramd {
namespace gpu {
namespace detail {
namespace {

using namespace ::paramd::gpu::dev;  // NOLINT

constexpr int kThreads = 256;

// Block-wide max of `v`, then one atomic max into `out`.
__device__ __forceinline__ void BlockMaxToGlobal(float v, float* warp_max, float* out) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
    AtomicMaxNonNeg(out, m);
  }
}

template <int kKind>  // 0: AdamW, 1: SGD
__device__ __forceinline__ void Update(float& p, float& m, float& v, float g, bool has_m,
                                       const OptBatch& b) {
  if (kKind == 0) {
    AdamWElement(p, m, v, g, b.adam);
  } else {
    SgdElement(p, m, g, has_m, b.sgd);
  }
}

template <int kKind, bool kAmax>
__global__ void __launch_bounds__(kThreads)
    OptimizerKernel(const __grid_constant__ OptBatch batch) {
  __shared__ float warp_max[kThreads / 32];
  const int64_t chunk = blockIdx.x;
  int lo = 0, hi = batch.num - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (batch.t[mid].chunk_begin <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const OptItem& t = batch.t[lo];
  const int64_t begin = (chunk - t.chunk_begin) * kOptChunk;
  const int64_t end = begin + kOptChunk < t.count ? begin + kOptChunk : t.count;
  const bool has_m = t.m != nullptr;
  const bool rb = t.round_bf16;
  float amax = 0.0f;
  int64_t tail = begin;
  // The clip factor (uniform per block); NaN: a skipped step, where only
  // the amax of the unchanged params is taken.
  const bool scaled = batch.grad_scale != nullptr;
  const float c = scaled ? *batch.grad_scale : 1.0f;
  if (c != c) {
    // Out of place: the unchanged values are the result.
    if (t.param_out != t.param || t.m_out != t.m || t.v_out != t.v) {
      for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
        t.param_out[i] = t.param[i];
        if (has_m) t.m_out[i] = t.m[i];
        if (kKind == 0) t.v_out[i] = t.v[i];
      }
    }
    if constexpr (kAmax) {
      for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
        amax = AbsMax(amax, ToSource(t.param[i], rb));
      }
      if (t.amax != nullptr) BlockMaxToGlobal(amax, warp_max, t.amax);
    }
    return;
  }
  auto G = [&](float g) { return scaled ? __fmul_rn(g, c) : g; };
  if (t.vec && (kKind == 0 || has_m)) {
    const int64_t n4 = (end - begin) / 4;
    tail = begin + 4 * n4;
    const float4* P = reinterpret_cast<const float4*>(t.param + begin);
    const float4* Mm = reinterpret_cast<const float4*>(t.m + begin);
    const float4* V = kKind == 0 ? reinterpret_cast<const float4*>(t.v + begin) : nullptr;
    float4* Po = reinterpret_cast<float4*>(t.param_out + begin);
    float4* Mo = reinterpret_cast<float4*>(t.m_out + begin);
    float4* Vo = kKind == 0 ? reinterpret_cast<float4*>(t.v_out + begin) : nullptr;
    const float4* Gv = reinterpret_cast<const float4*>(t.grad + begin);
    constexpr int kUnroll = 2;
    for (int64_t i0 = threadIdx.x; i0 < n4; i0 += kThreads * kUnroll) {
      float4 p[kUnroll], m[kUnroll], v[kUnroll], g[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + u * kThreads;
        if (i < n4) {
          p[u] = P[i];
          m[u] = Mm[i];
          v[u] = kKind == 0 ? V[i] : make_float4(0.f, 0.f, 0.f, 0.f);
          g[u] = __ldg(Gv + i);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + u * kThreads;
        if (i < n4) {
          Update<kKind>(p[u].x, m[u].x, v[u].x, G(g[u].x), true, batch);
          Update<kKind>(p[u].y, m[u].y, v[u].y, G(g[u].y), true, batch);
          Update<kKind>(p[u].z, m[u].z, v[u].z, G(g[u].z), true, batch);
          Update<kKind>(p[u].w, m[u].w, v[u].w, G(g[u].w), true, batch);
          Po[i] = p[u];
          Mo[i] = m[u];
          if (kKind == 0) Vo[i] = v[u];
          if (kAmax) {
            amax = AbsMax(amax, ToSource(p[u].x, rb));
            amax = AbsMax(amax, ToSource(p[u].y, rb));
            amax = AbsMax(amax, ToSource(p[u].z, rb));
            amax = AbsMax(amax, ToSource(p[u].w, rb));
          }
        }
      }
    }
  }
  for (int64_t i = tail + threadIdx.x; i < end; i += kThreads) {
    float p = t.param[i];
    float m = has_m ? t.m[i] : 0.0f;
    float v = kKind == 0 ? t.v[i] : 0.0f;
    Update<kKind>(p, m, v, G(t.grad[i]), has_m, batch);
    t.param_out[i] = p;
    if (has_m) t.m_out[i] = m;
    if (kKind == 0) t.v_out[i] = v;
    if (kAmax) amax = AbsMax(amax, ToSource(p, rb));
  }
  if constexpr (kAmax) {
    if (t.amax != nullptr) BlockMaxToGlobal(amax, warp_max, t.amax);  // uniform branch
  }
}

}  // namespace

cudaError_t LaunchOptimizer(const OptBatch& batch, int kind, int with_amax, cudaStream_t stream) {
  if (batch.total_chunks <= 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(batch.total_chunks);
  if (kind == 0) {
    if (with_amax) {
      OptimizerKernel<0, true><<<grid, kThreads, 0, stream>>>(batch);
    } else {
      OptimizerKernel<0, false><<<grid, kThreads, 0, stream>>>(batch);
    }
  } else {
    if (with_amax) {
      OptimizerKernel<1, true><<<grid, kThreads, 0, stream>>>(batch);
    } else {
      OptimizerKernel<1, false><<<grid, kThreads, 0, stream>>>(batch);
    }
  }
  return cudaGetLastError();
}

}  // namespace detail
}  // namespace gpu
}  // namespace paramd
