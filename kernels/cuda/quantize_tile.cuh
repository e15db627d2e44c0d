// File: kernels/cuda/quantize_tile.cuh
//
// INTERNAL: the tile layout and the stage helpers of the quantize tile kernel
// (quantize.cu): shared-memory tile, loads, block-amax pre-passes, byte
// stores, amax reductions. Device code only. Everything is in an anonymous
// namespace (one copy per translation unit).
#ifndef PARAMD_KERNELS_CUDA_QUANTIZE_TILE_CUH_
#define PARAMD_KERNELS_CUDA_QUANTIZE_TILE_CUH_

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/codecs.cuh"
#include "kernels/cuda/optimizer_math.cuh"
#include "kernels/cuda/quantize_launch.h"

namespace paramd {
namespace gpu {
namespace detail {
namespace {

using namespace ::paramd::gpu::dev;  // NOLINT

constexpr int kChunks = kTile / 4;  // float4 chunks per tile row

struct __align__(16) TileSmem {
  float4 tile[kTile * kChunks];  // 64 KiB, swizzled
  uint32_t colbuf[8 * kTile];    // [row block][column]: amax bits, then multiplier bits
  uint32_t amax2d_row[64];       // [row block][column block] of the rowwise 2D tiles
  uint32_t amax2d_col[64];
  uint32_t red[4];  // [0] rowwise amax, [1] columnwise amax
};

__device__ __forceinline__ int Phys(int r, int ch) { return r * kChunks + (ch ^ ((r >> 4) & 7)); }

__device__ __forceinline__ void CpAsyncWaitAll() { asm volatile("cp.async.wait_all;\n" ::); }

__device__ __forceinline__ float Bf16ToFloat(uint32_t bits16) {
  return __uint_as_float(bits16 << 16);
}

__device__ __forceinline__ float4 Bf16x4ToFloat4(uint32_t lo, uint32_t hi) {
  return make_float4(__uint_as_float(lo << 16), __uint_as_float(lo & 0xFFFF0000u),
                     __uint_as_float(hi << 16), __uint_as_float(hi & 0xFFFF0000u));
}

// Byte k (0..3) of q, k known at run time, without a local array.
__device__ __forceinline__ uint32_t ByteOf(uint32_t q, int k) { return (q >> (8 * k)) & 0xFFu; }

// ---------------------------------------------------------------------------
// Stage 1: load
// ---------------------------------------------------------------------------

// cp.async of 16 bytes to a shared-memory address (32-bit, from
// __cvta_generic_to_shared); src_bytes < 16 zero-fills the rest.
__device__ __forceinline__ void CpAsync16Shared(unsigned saddr, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(gmem),
               "r"(src_bytes));
}

// Thread (w, ch) copies the 16 bytes of chunk ch of rows w + 8k, k = 0..15.
// One global pointer advanced by 8 rows and compile-time shared offsets: for
// these rows (r >> 4) & 7 = (k >> 1) & 7, so the swizzle is ch ^ (k >> 1)
// (run 8e: the per-copy 64-bit address and swizzle arithmetic was 14 % of
// the MXFP8 kernel's instructions).
template <int NT>
__device__ __forceinline__ void LoadTileFp32Vec(const float* src, int64_t M, int64_t K, TileSmem& s,
                                                int64_t i0, int64_t j0) {
  static_assert(NT == 256, "the row mapping below assumes 8 warps");
  constexpr int kStep = NT / 32;
  const int rows_valid = M - i0 < kTile ? static_cast<int>(M - i0) : kTile;
  const int cols_valid = K - j0 < kTile ? static_cast<int>(K - j0) : kTile;
  const int ch = threadIdx.x & 31, r0 = threadIdx.x >> 5;
  // Copies k < kvalid are inside [M, K] (K % 4 == 0: a chunk is all in or all out).
  const int kvalid = 4 * ch < cols_valid ? (rows_valid - r0 + kStep - 1) / kStep : 0;
  const float* g = src + (i0 + r0) * K + j0 + 4 * ch;
  const int64_t gstep = int64_t{kStep} * K;
  const unsigned sbase = static_cast<unsigned>(__cvta_generic_to_shared(&s.tile[r0 * kChunks]));
#pragma unroll 8  // (fully unrolled, the NVFP4 instantiation spilled)
  for (int k = 0; k < kTile * kChunks / NT; ++k, g += gstep) {
    const bool ok = k < kvalid;
    const unsigned dst = sbase + 16u * (k * kStep * kChunks + (ch ^ ((k >> 1) & 7)));
    // Outside [M, K]: 0 source bytes (zero fill, nothing read; the CUTLASS
    // zfill idiom), so g may point past the tensor there.
    CpAsync16Shared(dst, g, ok ? 16 : 0);
  }
  CpAsyncWaitAll();
}

template <int NT>
__device__ __forceinline__ void LoadTileBf16Vec(const uint16_t* src, int64_t M, int64_t K,
                                                TileSmem& s, int64_t i0, int64_t j0) {
  constexpr int kPer = kTile * kTile / 8 / NT;  // 16-byte segments per thread
  uint4 buf[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int seg = threadIdx.x + k * NT;
    const int r = seg >> 4, sg = seg & 15;
    const int64_t gi = i0 + r, gj = j0 + 8 * sg;
    buf[k] = make_uint4(0, 0, 0, 0);
    if (gi < M && gj < K) buf[k] = __ldg(reinterpret_cast<const uint4*>(src + gi * K + gj));
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int seg = threadIdx.x + k * NT;
    const int r = seg >> 4, sg = seg & 15;
    s.tile[Phys(r, 2 * sg)] = Bf16x4ToFloat4(buf[k].x, buf[k].y);
    s.tile[Phys(r, 2 * sg + 1)] = Bf16x4ToFloat4(buf[k].z, buf[k].w);
  }
}

template <int NT>
__device__ __forceinline__ void LoadTileScalar(const void* src, bool bf16, int64_t M, int64_t K,
                                               TileSmem& s, int64_t i0, int64_t j0) {
  float* tf = reinterpret_cast<float*>(s.tile);
  for (int e = threadIdx.x; e < kTile * kTile; e += NT) {
    const int r = e >> 7, c = e & 127;
    const int64_t gi = i0 + r, gj = j0 + c;
    float v = 0.0f;
    if (gi < M && gj < K) {
      v = bf16 ? Bf16ToFloat(static_cast<const uint16_t*>(src)[gi * K + gj])
               : static_cast<const float*>(src)[gi * K + gj];
    }
    tf[Phys(r, c >> 2) * 4 + (c & 3)] = v;
  }
}

// One 512-byte row segment (a tile row of one FP32 array) into L2, no
// registers held (sm_90 bulk prefetch; a hint: it never faults or blocks).
__device__ __forceinline__ void PrefetchL2Row512(const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], 512;\n" ::"l"(gmem) : "memory");
#endif
}

// Fused AdamW: the tile's master values are updated in registers, p/m/v are
// written back, and the new p is what the quantizer sees. Gradients enter
// the update multiplied by `gscale` (the clip factor; exact at 1).
// kBatch: rows of p, m, v, g in flight per thread and step. Full tiles take
// one pointer per array advanced by kBatch * 8 rows (no per-access 64-bit
// offsets or bounds).
// kPrefetch > 0: each warp keeps the rows of the next kPrefetch steps on
// their way into L2 (lanes 0..4*kBatch-1: one bulk prefetch per row and
// array), so the loads that the AdamW arithmetic holds back find them there
// and more bytes are in flight than the registers could hold
// (docs/GPU_NOTES.md, the one-pass step). kStream: evict-first loads and
// stores (ld/st.global.cs; every byte is touched once).
template <int NT, int kBatch = 2, int kPrefetch = 0, bool kStream = false>
__device__ __forceinline__ void LoadTileAdam(const OptDesc& o, bool vec, int64_t M, int64_t K,
                                             const AdamHyper& h, float gscale, TileSmem& s,
                                             int64_t i0, int64_t j0) {
  if (vec && M - i0 >= kTile && K - j0 >= kTile) {
    static_assert(NT == 256, "rows w + 8k");
    constexpr int kStep = NT / 32;
    constexpr int kSteps = kTile / kStep / kBatch;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t base = (i0 + warp) * K + j0 + 4 * lane;
    float* P = o.param + base;
    float* Mm = o.m + base;
    float* V = o.v + base;
    const float* G = o.grad + base;
    const int64_t step = int64_t{kStep} * K;
    float4* trow = &s.tile[warp * kChunks];
    // Prefetch lane: array lane / kBatch, row k0 + lane % kBatch of a step.
    const float* pf = nullptr;
    if constexpr (kPrefetch > 0) {
      static_assert(4 * kBatch <= 32, "one prefetch lane per row and array");
      const int64_t row0 = (i0 + warp) * K + j0 + (lane % kBatch) * step;
      const int arr = lane / kBatch;
      pf = (arr == 0 ? o.param : arr == 1 ? o.m : arr == 2 ? o.v : o.grad) + row0;
      if (lane < 4 * kBatch) {
#pragma unroll
        for (int d = 1; d <= kPrefetch && d < kSteps; ++d) PrefetchL2Row512(pf + d * kBatch * step);
      }
    }
#pragma unroll 1
    for (int k0 = 0; k0 < kTile / kStep; k0 += kBatch) {
      if constexpr (kPrefetch > 0) {
        const int ahead = k0 + kPrefetch * kBatch;  // first row of the step kPrefetch ahead
        if (k0 > 0 && ahead < kTile / kStep && lane < 4 * kBatch) {
          PrefetchL2Row512(pf + ahead * step);
        }
      }
      float4 p[kBatch], m[kBatch], v[kBatch], g[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if constexpr (kStream) {
          p[b] = __ldcs(reinterpret_cast<const float4*>(P + b * step));
          m[b] = __ldcs(reinterpret_cast<const float4*>(Mm + b * step));
          v[b] = __ldcs(reinterpret_cast<const float4*>(V + b * step));
          g[b] = __ldcs(reinterpret_cast<const float4*>(G + b * step));
        } else {
          p[b] = *reinterpret_cast<const float4*>(P + b * step);
          m[b] = *reinterpret_cast<const float4*>(Mm + b * step);
          v[b] = *reinterpret_cast<const float4*>(V + b * step);
          g[b] = __ldg(reinterpret_cast<const float4*>(G + b * step));
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        AdamWElement(p[b].x, m[b].x, v[b].x, __fmul_rn(g[b].x, gscale), h);
        AdamWElement(p[b].y, m[b].y, v[b].y, __fmul_rn(g[b].y, gscale), h);
        AdamWElement(p[b].z, m[b].z, v[b].z, __fmul_rn(g[b].z, gscale), h);
        AdamWElement(p[b].w, m[b].w, v[b].w, __fmul_rn(g[b].w, gscale), h);
        if constexpr (kStream) {
          __stcs(reinterpret_cast<float4*>(P + b * step), p[b]);
          __stcs(reinterpret_cast<float4*>(Mm + b * step), m[b]);
          __stcs(reinterpret_cast<float4*>(V + b * step), v[b]);
        } else {
          *reinterpret_cast<float4*>(P + b * step) = p[b];
          *reinterpret_cast<float4*>(Mm + b * step) = m[b];
          *reinterpret_cast<float4*>(V + b * step) = v[b];
        }
        const int k = k0 + b;  // row w + 8k: swizzle ch ^ ((k >> 1) & 7)
        trow[k * kStep * kChunks + (lane ^ ((k >> 1) & 7))] = p[b];
      }
      P += kBatch * step, Mm += kBatch * step, V += kBatch * step, G += kBatch * step;
    }
    return;
  }
  if (vec) {
    constexpr int kPer = kTile * kChunks / NT;
    constexpr int kBatch = 2;
#pragma unroll 1
    for (int k0 = 0; k0 < kPer; k0 += kBatch) {
      float4 p[kBatch], m[kBatch], v[kBatch], g[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int c = threadIdx.x + (k0 + b) * NT;
        const int r = c >> 5, ch = c & 31;
        const int64_t gi = i0 + r, gj = j0 + 4 * ch;
        const int64_t off = gi * K + gj;
        if (gi < M && gj < K) {
          p[b] = *reinterpret_cast<const float4*>(o.param + off);
          m[b] = *reinterpret_cast<const float4*>(o.m + off);
          v[b] = *reinterpret_cast<const float4*>(o.v + off);
          g[b] = __ldg(reinterpret_cast<const float4*>(o.grad + off));
        } else {
          p[b] = m[b] = v[b] = g[b] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int c = threadIdx.x + (k0 + b) * NT;
        const int r = c >> 5, ch = c & 31;
        const int64_t gi = i0 + r, gj = j0 + 4 * ch;
        const int64_t off = gi * K + gj;
        if (gi < M && gj < K) {
          AdamWElement(p[b].x, m[b].x, v[b].x, __fmul_rn(g[b].x, gscale), h);
          AdamWElement(p[b].y, m[b].y, v[b].y, __fmul_rn(g[b].y, gscale), h);
          AdamWElement(p[b].z, m[b].z, v[b].z, __fmul_rn(g[b].z, gscale), h);
          AdamWElement(p[b].w, m[b].w, v[b].w, __fmul_rn(g[b].w, gscale), h);
          *reinterpret_cast<float4*>(o.param + off) = p[b];
          *reinterpret_cast<float4*>(o.m + off) = m[b];
          *reinterpret_cast<float4*>(o.v + off) = v[b];
        }
        s.tile[Phys(r, ch)] = p[b];
      }
    }
    return;
  }
  float* tf = reinterpret_cast<float*>(s.tile);
  for (int e = threadIdx.x; e < kTile * kTile; e += NT) {
    const int r = e >> 7, c = e & 127;
    const int64_t gi = i0 + r, gj = j0 + c;
    float p = 0.0f;
    if (gi < M && gj < K) {
      const int64_t off = gi * K + gj;
      p = o.param[off];
      float m = o.m[off], v = o.v[off];
      AdamWElement(p, m, v, __fmul_rn(o.grad[off], gscale), h);
      o.param[off] = p;
      o.m[off] = m;
      o.v[off] = v;
    }
    tf[Phys(r, c >> 2) * 4 + (c & 3)] = p;
  }
}

// ---------------------------------------------------------------------------
// Stage 2: block amaxes
// ---------------------------------------------------------------------------

__device__ __forceinline__ void ReadRow4(const TileSmem& s, int r, int ch, bool round_bf16,
                                         float& x0, float& x1, float& x2, float& x3) {
  const float4 v = s.tile[Phys(r, ch)];
  x0 = v.x, x1 = v.y, x2 = v.z, x3 = v.w;
  if (round_bf16) {
    RoundPairBf16(x0, x1);
    RoundPairBf16(x2, x3);
  }
}

__device__ __forceinline__ float Max4Abs(float x0, float x1, float x2, float x3) {
  return fmaxf(fmaxf(fabsf(x0), fabsf(x1)), fmaxf(fabsf(x2), fabsf(x3)));
}

// Max-updates dst with the amax of each kBm x kBk block of the tile: kBk == 1
// gives one entry per (row block, column) at dst[rb * 128 + col]; otherwise
// dst[rb * (128 / kBk) + cb]. dst must be zero beforehand.
template <int NT, int kBm, int kBk>
__device__ __forceinline__ void BlockAmaxPass(const TileSmem& s, bool round_bf16, uint32_t* dst) {
  constexpr int kWarps = NT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // RNE to BF16 is monotone and symmetric, so the amax of the rounded values
  // is the rounded amax of the raw ones (NaN ignored either way): round once
  // per block instead of once per element.
  float acc0 = 0.f, acc1 = 0.f, acc2 = 0.f, acc3 = 0.f;
#pragma unroll 4
  for (int r = warp; r < kTile; r += kWarps) {
    const float4 v = s.tile[Phys(r, lane)];
    acc0 = AbsMax(acc0, v.x);
    acc1 = AbsMax(acc1, v.y);
    acc2 = AbsMax(acc2, v.z);
    acc3 = AbsMax(acc3, v.w);
    const int next = r + kWarps;
    if (next >= kTile || next / kBm != r / kBm) {
      const int rb = r / kBm;
      if (round_bf16) {
        RoundPairBf16(acc0, acc1);
        RoundPairBf16(acc2, acc3);
      }
      if constexpr (kBk == 1) {
        uint32_t* d = dst + rb * kTile + 4 * lane;
        atomicMax(d + 0, __float_as_uint(acc0));
        atomicMax(d + 1, __float_as_uint(acc1));
        atomicMax(d + 2, __float_as_uint(acc2));
        atomicMax(d + 3, __float_as_uint(acc3));
      } else {
        float m = fmaxf(fmaxf(acc0, acc1), fmaxf(acc2, acc3));
#pragma unroll
        for (int off = 1; off < kBk / 4; off <<= 1) {
          m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
        }
        if ((lane & (kBk / 4 - 1)) == 0) {
          atomicMax(dst + rb * (kTile / kBk) + (4 * lane) / kBk, __float_as_uint(m));
        }
      }
      acc0 = acc1 = acc2 = acc3 = 0.f;
    }
  }
}

struct BlockCfg {
  int bm = 0;  // 0: none
  int bk = 0;
};

__device__ __forceinline__ BlockCfg RowBlockCfg(const DirDesc& d) {
  if (d.fmt == kKMxfp8 && d.two_d) return {32, 32};
  if (d.fmt == kKNvfp4 && d.two_d) return {16, 16};
  if (d.fmt == kKBlock2d) return {128, 128};
  return {};
}
__device__ __forceinline__ BlockCfg ColBlockCfg(const DirDesc& d) {
  switch (d.fmt) {
    case kKMxfp8:
      return d.two_d ? BlockCfg{32, 32} : BlockCfg{32, 1};
    case kKNvfp4:
      return d.two_d ? BlockCfg{16, 16} : BlockCfg{16, 1};
    case kKBlock1d:
      return {128, 1};
    case kKBlock2d:
      return {128, 128};
    default:
      return {};
  }
}

template <int NT>
__device__ __forceinline__ void RunBlockAmax(const TileSmem& s, bool round_bf16, BlockCfg c,
                                             uint32_t* dst) {
  if (c.bm == 32 && c.bk == 32) BlockAmaxPass<NT, 32, 32>(s, round_bf16, dst);
  if (c.bm == 32 && c.bk == 1) BlockAmaxPass<NT, 32, 1>(s, round_bf16, dst);
  if (c.bm == 16 && c.bk == 16) BlockAmaxPass<NT, 16, 16>(s, round_bf16, dst);
  if (c.bm == 16 && c.bk == 1) BlockAmaxPass<NT, 16, 1>(s, round_bf16, dst);
  if (c.bm == 128 && c.bk == 128) BlockAmaxPass<NT, 128, 128>(s, round_bf16, dst);
  if (c.bm == 128 && c.bk == 1) BlockAmaxPass<NT, 128, 1>(s, round_bf16, dst);
}

// Four bytes (b0 lowest) at out[0..3], `n` of them valid.
__device__ __forceinline__ void Store4Bytes(uint8_t* out, uint32_t q, int n, bool vec) {
  if (vec && n == 4) {
    *reinterpret_cast<uint32_t*>(out) = q;
    return;
  }
  for (int k = 0; k < n; ++k) out[k] = static_cast<uint8_t>(ByteOf(q, k));
}

// amax of the tile only (amax of the columnwise source, no outputs).
template <int NT>
__device__ __forceinline__ float TileAmax(const TileSmem& s, bool round_bf16) {
  float m = 0.f;
  for (int c = threadIdx.x; c < kTile * kChunks; c += NT) {
    float x0, x1, x2, x3;
    ReadRow4(s, c >> 5, c & 31, round_bf16, x0, x1, x2, x3);
    m = fmaxf(m, Max4Abs(x0, x1, x2, x3));
  }
  return m;
}

// Warp max then one shared atomic per warp.
__device__ __forceinline__ void BlockAmaxContribute(float v, uint32_t* slot) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  if ((threadIdx.x & 31) == 0) atomicMax(slot, __float_as_uint(v));
}

__device__ __forceinline__ bool IsTransposed(uint8_t fmt) {
  return fmt == kKFp8Tensor || fmt == kKBlock2d || fmt == kKBlock1d || fmt == kKNvfp4;
}

}  // namespace
}  // namespace detail
}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_QUANTIZE_TILE_CUH_
