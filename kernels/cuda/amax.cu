// Multi-tensor amax (§0: NaN ignored, Inf counts) of the source values (D1:
// optionally rounded to BF16 first), max-updated into per-tensor slots.
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/batch_search.cuh"
#include "kernels/cuda/codecs.cuh"
#include "kernels/cuda/misc_launch.h"

namespace paramd {
namespace gpu {
namespace detail {
namespace {

using namespace ::paramd::gpu::dev;  // NOLINT

constexpr int kThreads = 512;

__device__ __forceinline__ float Load(const AmaxItem& t, int64_t i) {
  return t.src_bf16
             ? __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(t.src)[i]) << 16)
             : static_cast<const float*>(t.src)[i];
}

__global__ void __launch_bounds__(kThreads) AmaxKernel(const __grid_constant__ AmaxBatch batch) {
  __shared__ float warp_max[kThreads / 32];
  const int64_t chunk = blockIdx.x;
  const AmaxItem& t = batch.t[FindBatchItem(batch.t, batch.num, chunk, &AmaxItem::chunk_begin)];
  const int64_t begin = (chunk - t.chunk_begin) * kAmaxChunk;
  const int64_t end = begin + kAmaxChunk < t.count ? begin + kAmaxChunk : t.count;
  const bool rb = t.round_bf16;
  float m = 0.0f;
  if (t.vec && !t.src_bf16) {
    // Float4 body (begin is a multiple of 4), scalar tail.
    const int64_t end4 = begin + ((end - begin) & ~int64_t{3});
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(t.src) + begin);
    const int64_t n4 = (end4 - begin) / 4;
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < n4; i += kThreads) {
      const float4 v = __ldg(p + i);
      m = AbsMax(m, ToSource(v.x, rb));
      m = AbsMax(m, ToSource(v.y, rb));
      m = AbsMax(m, ToSource(v.z, rb));
      m = AbsMax(m, ToSource(v.w, rb));
    }
    for (int64_t i = end4 + threadIdx.x; i < end; i += kThreads)
      m = AbsMax(m, ToSource(Load(t, i), rb));
  } else if (t.vec) {
    const int64_t end8 = begin + ((end - begin) & ~int64_t{7});
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(t.src) + begin);
    const int64_t n8 = (end8 - begin) / 8;
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < n8; i += kThreads) {
      const uint4 v = __ldg(p + i);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        m = AbsMax(m, __uint_as_float(w[k] << 16));
        m = AbsMax(m, __uint_as_float(w[k] & 0xFFFF0000u));
      }
    }
    for (int64_t i = end8 + threadIdx.x; i < end; i += kThreads) m = AbsMax(m, Load(t, i));
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads)
      m = AbsMax(m, ToSource(Load(t, i), rb));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0.0f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
    if (threadIdx.x == 0) AtomicMaxNonNeg(t.out, m);
  }
}

// ---- Per-block amax (ComputeBlockAmax) ----
//
// One CTA of 256 threads per 128x128 tile of one tensor. Warp w reads rows
// 16w .. 16w+15 of the tile, lane l columns 4l .. 4l+3 (a warp reads 512
// contiguous bytes of FP32 per row). 1 x bk blocks are reduced per row by
// shuffles over bk/4 lanes; taller blocks from each thread's 4 column maxima
// over its 16 rows: shuffles across the block's columns, then (32 and 128
// rows, per tensor) shared memory across the warps. Every block size divides
// 128, so every block lies in one tile and is written by exactly one thread;
// per-tensor slots are max-updated by one atomic per tile. The max is taken
// over the raw values and rounded to BF16 once per block (RNE is monotone and
// symmetric: round(max |x|) = max |round(x)|; NaN is ignored either way).
constexpr int kBlockAmaxThreads = 256;

__device__ __forceinline__ float RoundedMax(float m, bool round_bf16) {
  if (round_bf16) {
    float unused = 0.0f;
    RoundPairBf16(m, unused);
  }
  return m;
}

// max(0, |a|, |b|, |c|, |d|) ignoring NaN: 0 when all four are NaN.
__device__ __forceinline__ float Max4(float a, float b, float c, float d) {
  return fmaxf(fmaxf(AbsMax(0.0f, a), fabsf(b)), fmaxf(fabsf(c), fabsf(d)));
}

// Row r (global) of the tile, columns j .. j+3 (global), 0 outside [M, K].
__device__ __forceinline__ float4 LoadQuad(const BlockAmaxItem& t, int64_t r, int64_t j,
                                           bool row_ok) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  if (!row_ok || j >= t.cols) return v;
  const int64_t off = r * t.cols + j;
  if (t.src_bf16) {
    const uint16_t* p = static_cast<const uint16_t*>(t.src) + off;
    if (t.vec) {
      const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
      return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xFFFF0000u),
                         __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xFFFF0000u));
    }
    const int n = t.cols - j < 4 ? static_cast<int>(t.cols - j) : 4;
    v.x = __uint_as_float(static_cast<uint32_t>(__ldg(p)) << 16);
    if (n > 1) v.y = __uint_as_float(static_cast<uint32_t>(__ldg(p + 1)) << 16);
    if (n > 2) v.z = __uint_as_float(static_cast<uint32_t>(__ldg(p + 2)) << 16);
    if (n > 3) v.w = __uint_as_float(static_cast<uint32_t>(__ldg(p + 3)) << 16);
    return v;
  }
  const float* p = static_cast<const float*>(t.src) + off;
  if (t.vec) return __ldg(reinterpret_cast<const float4*>(p));
  const int n = t.cols - j < 4 ? static_cast<int>(t.cols - j) : 4;
  v.x = __ldg(p);
  if (n > 1) v.y = __ldg(p + 1);
  if (n > 2) v.z = __ldg(p + 2);
  if (n > 3) v.w = __ldg(p + 3);
  return v;
}

// 1 x 32 blocks of rows 8h .. 8h+7 of this warp (v[k] = row 8h + k): lane l
// stores the block max of row 8h + (l & 7) (GroupRowMax8).
__device__ __forceinline__ void RowBlocks32(const float4 (&v)[8], int64_t r0, int64_t M,
                                            int64_t j_block, int64_t K, int64_t gc, bool rb,
                                            float* out) {
  float x[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) x[k] = Max4(v[k].x, v[k].y, v[k].z, v[k].w);
  const float m = GroupRowMax8(x);
  const int64_t r = r0 + (threadIdx.x & 7);
  if (r < M && j_block < K) out[r * gc + (j_block >> 5)] = RoundedMax(m, rb);
}

// (256, 4): the rows are loaded in two halves of 8 (32 registers of values
// instead of 64), so 4 blocks fit an SM instead of 2 (ncu 2026-12-01: 128
// registers, 25 % occupancy, DRAM 58 % for 1 x 32 blocks).
__global__ void __launch_bounds__(kBlockAmaxThreads, 4)
    BlockAmaxKernel(const __grid_constant__ BlockAmaxBatch batch) {
  __shared__ float part[8][128];  // [16-row group][column]: partial block maxima
  const int64_t tile = blockIdx.x;
  const BlockAmaxItem& t =
      batch.t[FindBatchItem(batch.t, batch.num, tile, &BlockAmaxItem::tile_begin)];
  const int64_t M = t.rows, K = t.cols;
  const int64_t local = tile - t.tile_begin;
  const int64_t tm = local / t.tiles_k, tk = local - tm * t.tiles_k;
  const int64_t i0 = tm * 128, j0 = tk * 128;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t j = j0 + 4 * lane;
  const int bm_log2 = t.bm_log2, bk_log2 = t.bk_log2;
  const bool rb = t.round_bf16;
  const int64_t gc = t.grid_cols;
  float* const out = t.out;
  // Lanes per block along a row (1 for column blocks, up to 32).
  const int bk_lanes = bk_log2 >= 2 ? 1 << (bk_log2 - 2) : 1;

  float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;  // column maxima over the 16 rows
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t r = i0 + 16 * warp + 8 * h + k;
      v[k] = LoadQuad(t, r, j, r < M);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      c0 = AbsMax(c0, v[k].x), c1 = AbsMax(c1, v[k].y), c2 = AbsMax(c2, v[k].z),
      c3 = AbsMax(c3, v[k].w);
    }
    if (bm_log2 == 0) {  // 1 x bk blocks: one row each
      const int64_t r0 = i0 + 16 * warp + 8 * h;
      if (bk_lanes == 8) {
        RowBlocks32(v, r0, M, j0 + 32 * (lane >> 3), K, gc, rb, out);
        continue;
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        float m = Max4(v[k].x, v[k].y, v[k].z, v[k].w);
        for (int off = 1; off < bk_lanes; off <<= 1)
          m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
        const int64_t r = r0 + k;
        if ((lane & (bk_lanes - 1)) == 0 && r < M && j < K)
          out[r * gc + (j >> bk_log2)] = RoundedMax(m, rb);
      }
    }
  }
  if (bm_log2 == 0) return;
  // Blocks of 16, 32 or 128 rows (or the tensor): reduce along the row first.
  float m = Max4(c0, c1, c2, c3);
  for (int off = 1; off < bk_lanes; off <<= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  const bool leader = (lane & (bk_lanes - 1)) == 0;  // holds its block's value (bk >= 4)
  if (bm_log2 == 4) {  // 16 rows: this warp's rows are the whole block
    const int64_t bi = (i0 >> 4) + warp;
    if (i0 + 16 * warp >= M) return;
    if (bk_log2 == 0) {
      const float cs[4] = {c0, c1, c2, c3};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (j + e < K) out[bi * gc + j + e] = RoundedMax(cs[e], rb);
      }
    } else if (leader && j < K) {
      out[bi * gc + (j >> bk_log2)] = RoundedMax(m, rb);
    }
    return;
  }
  // 32 or 128 rows: combine 2 or 8 warps' partials through shared memory.
  if (bk_log2 == 0) {
    part[warp][4 * lane + 0] = c0;
    part[warp][4 * lane + 1] = c1;
    part[warp][4 * lane + 2] = c2;
    part[warp][4 * lane + 3] = c3;
  } else if (leader) {
    part[warp][4 * lane] = m;  // column of the block's first element
  }
  __syncthreads();
  const int g = 1 << (bm_log2 - 4);  // warps per block
  const int bk = 1 << bk_log2;
  const int outputs =
      (8 / g) * 128;  // (row block, column) slots; columns that start a block are used
  for (int o = threadIdx.x; o < outputs; o += kBlockAmaxThreads) {
    const int rbl = o >> 7, c = o & 127;
    if ((c & (bk - 1)) != 0) continue;
    const int64_t row0 = i0 + int64_t{rbl} * (int64_t{1} << bm_log2);
    if (row0 >= M || j0 + c >= K) continue;
    float x = 0.f;
    for (int w = rbl * g; w < rbl * g + g; ++w) x = fmaxf(x, part[w][c]);
    x = RoundedMax(x, rb);
    if (t.per_tensor) {
      AtomicMaxNonNeg(out, x);
    } else {
      out[((i0 >> bm_log2) + rbl) * gc + ((j0 + c) >> bk_log2)] = x;
    }
  }
}

__global__ void ZeroPerTensorSlots(const __grid_constant__ BlockAmaxBatch batch) {
  for (int i = threadIdx.x; i < batch.num; i += blockDim.x) {
    if (batch.t[i].per_tensor) *batch.t[i].out = 0.0f;
  }
}

}  // namespace

cudaError_t LaunchBlockAmax(const BlockAmaxBatch& batch, cudaStream_t stream) {
  if (batch.total_tiles <= 0) return cudaSuccess;
  bool any_per_tensor = false;
  for (int i = 0; i < batch.num; ++i) any_per_tensor |= batch.t[i].per_tensor != 0;
  if (any_per_tensor) {
    ZeroPerTensorSlots<<<1, 256, 0, stream>>>(batch);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  BlockAmaxKernel<<<static_cast<unsigned>(batch.total_tiles), kBlockAmaxThreads, 0, stream>>>(
      batch);
  return cudaGetLastError();
}

cudaError_t LaunchAmax(const AmaxBatch& batch, cudaStream_t stream) {
  if (batch.total_chunks <= 0) return cudaSuccess;
  AmaxKernel<<<static_cast<unsigned>(batch.total_chunks), kThreads, 0, stream>>>(batch);
  return cudaGetLastError();
}

}  // namespace detail
}  // namespace gpu
}  // namespace paramd
