// The quantize tile kernel: every format and direction of FORMATS.md, both
// directions of a tensor from one read of the input.
//
// Each block owns one 128x128 tile of one tensor (tiles of all tensors of a
// batch are numbered consecutively; a binary search finds the tensor). The
// tile is staged in shared memory as float (cp.async for aligned FP32, or
// converted BF16, or guarded scalar loads at ragged edges; elements outside
// [M, K] are 0). 128 is a multiple of every block size (16, 32, 128), so
// every block and every padded scale entry belongs to exactly one tile.
//
// Shared memory layout: row r holds 32 float4 chunks, chunk ch stored at
// position ch ^ ((r >> 4) & 7). Row-major reads (a warp reads one row) and
// the transposed reads of the columnwise pass (8 lanes read rows 16a+s of
// one chunk) are then both free of bank conflicts.
//
// Passes per tile:
//   1. load (optionally the fused AdamW update: p, m, v written back);
//   2. block-amax pre-passes (2D tiles, columnwise blocks) into shared memory;
//   3. rowwise pass: warp per row, lane per 4 columns; 1D row block amaxes by
//      shuffles; writes data + scales; writes back the source-rounded or
//      (rowwise_dequantized) the dequantized values for the columnwise pass;
//   4. columnwise scale step: one multiplier per (row block, column);
//   5. columnwise pass: transposed layouts are written 16 rows x 4 columns
//      per thread (8 lanes cover 128 contiguous output bytes); MXFP8 and
//      identity columnwise keep [M][K] order and use the row mapping;
//   6. per-direction amax: block reduction, one atomic per tile.
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
  uint32_t red[4];               // [0] rowwise amax, [1] columnwise amax
};

__device__ __forceinline__ int Phys(int r, int ch) { return r * kChunks + (ch ^ ((r >> 4) & 7)); }

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncWaitAll() { asm volatile("cp.async.wait_all;\n" ::); }

__device__ __forceinline__ float Bf16ToFloat(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

__device__ __forceinline__ float4 Bf16x4ToFloat4(uint32_t lo, uint32_t hi) {
  return make_float4(__uint_as_float(lo << 16), __uint_as_float(lo & 0xFFFF0000u),
                     __uint_as_float(hi << 16), __uint_as_float(hi & 0xFFFF0000u));
}

// ---------------------------------------------------------------------------
// Stage 1: load
// ---------------------------------------------------------------------------

template <int NT>
__device__ __forceinline__ void LoadTileFp32Vec(const TensorDesc& t, TileSmem& s, int64_t i0,
                                                int64_t j0) {
  const float* src = static_cast<const float*>(t.src);
  const int64_t M = t.rows, K = t.cols;
#pragma unroll 8
  for (int k = 0; k < kTile * kChunks / NT; ++k) {
    const int c = threadIdx.x + k * NT;
    const int r = c >> 5, ch = c & 31;
    const int64_t gi = i0 + r, gj = j0 + 4 * ch;
    const bool ok = gi < M && gj < K;  // K % 4 == 0: a chunk is all in or all out
    CpAsync16(&s.tile[Phys(r, ch)], ok ? src + gi * K + gj : src, ok ? 16 : 0);
  }
  CpAsyncWaitAll();
}

template <int NT>
__device__ __forceinline__ void LoadTileBf16Vec(const TensorDesc& t, TileSmem& s, int64_t i0,
                                                int64_t j0) {
  const uint16_t* src = static_cast<const uint16_t*>(t.src);
  const int64_t M = t.rows, K = t.cols;
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
__device__ __forceinline__ void LoadTileScalar(const TensorDesc& t, TileSmem& s, int64_t i0,
                                               int64_t j0) {
  const int64_t M = t.rows, K = t.cols;
  float* tf = reinterpret_cast<float*>(s.tile);
  for (int e = threadIdx.x; e < kTile * kTile; e += NT) {
    const int r = e >> 7, c = e & 127;
    const int64_t gi = i0 + r, gj = j0 + c;
    float v = 0.0f;
    if (gi < M && gj < K) {
      v = t.src_bf16 ? Bf16ToFloat(static_cast<const uint16_t*>(t.src)[gi * K + gj])
                     : static_cast<const float*>(t.src)[gi * K + gj];
    }
    tf[Phys(r, c >> 2) * 4 + (c & 3)] = v;
  }
}

// Fused AdamW: the tile's master values are updated in registers, p/m/v are
// written back, and the new p is what the quantizer sees.
template <int NT>
__device__ __forceinline__ void LoadTileAdam(const TensorDesc& t, const AdamHyper& h,
                                             TileSmem& s, int64_t i0, int64_t j0) {
  const int64_t M = t.rows, K = t.cols;
  const OptDesc& o = t.opt;
  if (t.src_vec) {
    constexpr int kPer = kTile * kChunks / NT;
    constexpr int kBatch = 4;
#pragma unroll 1
    for (int k0 = 0; k0 < kPer; k0 += kBatch) {
      float4 p[kBatch], m[kBatch], v[kBatch], g[kBatch];
      bool ok[kBatch];
      int64_t off[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int c = threadIdx.x + (k0 + b) * NT;
        const int r = c >> 5, ch = c & 31;
        const int64_t gi = i0 + r, gj = j0 + 4 * ch;
        ok[b] = gi < M && gj < K;
        off[b] = gi * K + gj;
        if (ok[b]) {
          p[b] = *reinterpret_cast<const float4*>(o.param + off[b]);
          m[b] = *reinterpret_cast<const float4*>(o.m + off[b]);
          v[b] = *reinterpret_cast<const float4*>(o.v + off[b]);
          g[b] = __ldg(reinterpret_cast<const float4*>(o.grad + off[b]));
        } else {
          p[b] = m[b] = v[b] = g[b] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int c = threadIdx.x + (k0 + b) * NT;
        const int r = c >> 5, ch = c & 31;
        if (ok[b]) {
          AdamWElement(p[b].x, m[b].x, v[b].x, g[b].x, h);
          AdamWElement(p[b].y, m[b].y, v[b].y, g[b].y, h);
          AdamWElement(p[b].z, m[b].z, v[b].z, g[b].z, h);
          AdamWElement(p[b].w, m[b].w, v[b].w, g[b].w, h);
          *reinterpret_cast<float4*>(o.param + off[b]) = p[b];
          *reinterpret_cast<float4*>(o.m + off[b]) = m[b];
          *reinterpret_cast<float4*>(o.v + off[b]) = v[b];
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
      AdamWElement(p, m, v, o.grad[off], h);
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

// Max-updates dst with the amax of each bm x bk block of the tile: bk == 1
// gives one entry per (row block, column) at dst[rb * 128 + col]; otherwise
// dst[rb * (128 / bk) + cb]. dst must be zero beforehand.
template <int NT>
__device__ __forceinline__ void BlockAmaxPass(const TileSmem& s, bool round_bf16, int bm, int bk,
                                              uint32_t* dst) {
  constexpr int kWarps = NT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float acc0 = 0.f, acc1 = 0.f, acc2 = 0.f, acc3 = 0.f;
  for (int r = warp; r < kTile; r += kWarps) {
    const float4 v = s.tile[Phys(r, lane)];
    acc0 = AbsMax(acc0, ToSource(v.x, round_bf16));
    acc1 = AbsMax(acc1, ToSource(v.y, round_bf16));
    acc2 = AbsMax(acc2, ToSource(v.z, round_bf16));
    acc3 = AbsMax(acc3, ToSource(v.w, round_bf16));
    const int next = r + kWarps;
    if (next >= kTile || next / bm != r / bm) {
      const int rb = r / bm;
      if (bk == 1) {
        uint32_t* d = dst + rb * kTile + 4 * lane;
        atomicMax(d + 0, __float_as_uint(acc0));
        atomicMax(d + 1, __float_as_uint(acc1));
        atomicMax(d + 2, __float_as_uint(acc2));
        atomicMax(d + 3, __float_as_uint(acc3));
      } else {
        float m = fmaxf(fmaxf(acc0, acc1), fmaxf(acc2, acc3));
        for (int off = 1; off < bk / 4; off <<= 1) {
          m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
        }
        if ((lane & (bk / 4 - 1)) == 0) {
          atomicMax(dst + rb * (kTile / bk) + (4 * lane) / bk, __float_as_uint(m));
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

// ---------------------------------------------------------------------------
// Stores of 4 consecutive elements of one row (row-mapped passes)
// ---------------------------------------------------------------------------

// Four bytes (b0 lowest) at out[0..3], `n` of them valid.
__device__ __forceinline__ void Store4Bytes(uint8_t* out, uint32_t q, int n, bool vec) {
  if (vec && n == 4) {
    *reinterpret_cast<uint32_t*>(out) = q;
    return;
  }
  for (int k = 0; k < n; ++k) out[k] = static_cast<uint8_t>(q >> (8 * k));
}

// ---------------------------------------------------------------------------
// Stage 3: row-mapped pass (rowwise of every format; columnwise MXFP8 and
// identity, which keep the [M][K] order)
// ---------------------------------------------------------------------------

struct RowPassArgs {
  bool colmode;      // columnwise MXFP8 / identity: multipliers from colbuf, no scale writes
  bool round_bf16;   // tile values still need rounding to the source dtype
  bool writeback;    // write values for the columnwise pass back to the tile
  bool deq_writeback;  // ... the dequantized values (rowwise_dequantized), else the source
};

template <int NT>
__device__ __forceinline__ void RowMappedPass(const TensorDesc& t, const DirDesc& d,
                                              TileSmem& s, int tm, int tk, RowPassArgs a,
                                              float& amax_acc) {
  constexpr int kWarps = NT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t M = t.rows, K = t.cols;
  const int64_t i0 = int64_t{tm} * kTile, j0 = int64_t{tk} * kTile;
  const int64_t gj = j0 + 4 * lane;
  const int nvalid_col = gj >= K ? 0 : (K - gj >= 4 ? 4 : static_cast<int>(K - gj));
  const bool e5m2 = d.e5m2;
  const bool write = d.write;
  const bool round_bf16 = a.round_bf16;

  // Per-tile constants.
  float scale = 1.0f, scale_inv = 1.0f;  // FP8 per-tensor / 128x128 block
  float nv_factor = 0.f, nv_sdec = 0.f, nv_deq = 0.f;
  const float rcp_max = Fbits(e5m2 ? kRcp57344Bits : kRcp448Bits);
  if (d.fmt == kKFp8Tensor) {
    scale = *d.scale;
    scale_inv = __frcp_rn(scale);
  } else if (d.fmt == kKBlock2d && !a.colmode) {
    scale = ComputeScale(Fbits(s.amax2d_row[0]), Fp8Max(e5m2), d.pow2, d.eps, d.inf_value);
    scale_inv = __frcp_rn(scale);
  } else if (d.fmt == kKNvfp4) {
    const float A = *d.global_amax;
    const float s_enc = Nvfp4GlobalEncodeScale(A);
    nv_sdec = __frcp_rn(s_enc);
    nv_factor = __fmul_rn(s_enc, Fbits(kRcp6Bits));
    nv_deq = A;
  }

  for (int r = warp; r < kTile; r += kWarps) {
    const int64_t gi = i0 + r;
    const bool row_ok = gi < M;
    const int n = row_ok ? nvalid_col : 0;
    const float4 v4 = s.tile[Phys(r, lane)];
    float x0 = ToSource(v4.x, round_bf16), x1 = ToSource(v4.y, round_bf16);
    float x2 = ToSource(v4.z, round_bf16), x3 = ToSource(v4.w, round_bf16);
    const float lmax = fmaxf(fmaxf(fabsf(x0), fabsf(x1)), fmaxf(fabsf(x2), fabsf(x3)));
    amax_acc = fmaxf(amax_acc, lmax);
    float d0 = x0, d1 = x1, d2 = x2, d3 = x3;  // dequantized values
    switch (d.fmt) {
      case kKBf16: {
        const uint32_t b0 = Bf16Bits(x0), b1 = Bf16Bits(x1), b2 = Bf16Bits(x2), b3 = Bf16Bits(x3);
        if (write && n > 0) {
          uint16_t* out = static_cast<uint16_t*>(d.data) + gi * K + gj;
          if (d.vec && n == 4) {
            *reinterpret_cast<uint2*>(out) = make_uint2(b0 | (b1 << 16), b2 | (b3 << 16));
          } else {
            const uint32_t bb[4] = {b0, b1, b2, b3};
            for (int k = 0; k < n; ++k) out[k] = static_cast<uint16_t>(bb[k]);
          }
        }
        d0 = Bf16ToFloat(b0), d1 = Bf16ToFloat(b1), d2 = Bf16ToFloat(b2), d3 = Bf16ToFloat(b3);
        break;
      }
      case kKFp32: {
        if (write && n > 0) {
          float* out = static_cast<float*>(d.data) + gi * K + gj;
          if (d.vec && n == 4) {
            *reinterpret_cast<float4*>(out) = make_float4(x0, x1, x2, x3);
          } else {
            const float xx[4] = {x0, x1, x2, x3};
            for (int k = 0; k < n; ++k) out[k] = xx[k];
          }
        }
        break;
      }
      case kKFp8Tensor:
      case kKBlock2d:
      case kKBlock1d:
      case kKMxfp8: {
        float m0, m1, m2, m3;   // multipliers
        float q0, q1, q2, q3;   // dequantization factors
        if (d.fmt == kKMxfp8) {
          if (a.colmode) {
            const float4 mm = reinterpret_cast<const float4*>(s.colbuf)[(r >> 5) * kChunks + lane];
            m0 = mm.x, m1 = mm.y, m2 = mm.z, m3 = mm.w;
            q0 = q1 = q2 = q3 = 1.0f;  // no writeback in colmode
          } else {
            float bam;
            if (d.two_d) {
              bam = Fbits(s.amax2d_row[(r >> 5) * 4 + (lane >> 3)]);
            } else {
              bam = lmax;
              bam = fmaxf(bam, __shfl_xor_sync(0xFFFFFFFFu, bam, 1));
              bam = fmaxf(bam, __shfl_xor_sync(0xFFFFFFFFu, bam, 2));
              bam = fmaxf(bam, __shfl_xor_sync(0xFFFFFFFFu, bam, 4));
            }
            const uint32_t e = E8M0FromScaledAmax(__fmul_rn(bam, rcp_max));
            m0 = m1 = m2 = m3 = E8M0Reciprocal(e);
            q0 = q1 = q2 = q3 = DecodeE8M0(e);
            if (write && (lane & 7) == 0 && gi < d.scale_rows) {
              const int64_t b = int64_t{tk} * 4 + (lane >> 3);
              if (b < d.scale_cols) {
                const bool valid = row_ok && b * 32 < K;
                static_cast<uint8_t*>(d.scales)[gi * d.scale_cols + b] =
                    static_cast<uint8_t>(valid ? e : 0u);
              }
            }
          }
        } else if (d.fmt == kKBlock1d) {
          float bam = lmax;
#pragma unroll
          for (int off = 1; off < 32; off <<= 1) {
            bam = fmaxf(bam, __shfl_xor_sync(0xFFFFFFFFu, bam, off));
          }
          const float sc = ComputeScale(bam, Fp8Max(e5m2), d.pow2, d.eps, d.inf_value);
          const float si = __frcp_rn(sc);
          m0 = m1 = m2 = m3 = sc;
          q0 = q1 = q2 = q3 = si;
          // Layout [ceil(K/128)][roundup(M,4)], entry [kb][i].
          if (write && lane == 0 && gi < d.scale_cols) {
            static_cast<float*>(d.scales)[int64_t{tk} * d.scale_cols + gi] = row_ok ? si : 0.0f;
          }
        } else {  // per-tensor or 128x128 block
          m0 = m1 = m2 = m3 = scale;
          q0 = q1 = q2 = q3 = scale_inv;
        }
        const uint32_t q = CvtFp8x4(__fmul_rn(x0, m0), __fmul_rn(x1, m1), __fmul_rn(x2, m2),
                                    __fmul_rn(x3, m3), e5m2);
        if (write && n > 0) {
          Store4Bytes(static_cast<uint8_t*>(d.data) + gi * K + gj, q, n, d.vec);
        }
        if (a.deq_writeback) {
          d0 = __fmul_rn(DecodeFp8(q, e5m2), q0);
          d1 = __fmul_rn(DecodeFp8(q >> 8, e5m2), q1);
          d2 = __fmul_rn(DecodeFp8(q >> 16, e5m2), q2);
          d3 = __fmul_rn(DecodeFp8(q >> 24, e5m2), q3);
        }
        break;
      }
      case kKNvfp4: {
        float bam;
        if (d.two_d) {
          bam = Fbits(s.amax2d_row[(r >> 4) * 8 + (lane >> 2)]);
        } else {
          bam = lmax;
          bam = fmaxf(bam, __shfl_xor_sync(0xFFFFFFFFu, bam, 1));
          bam = fmaxf(bam, __shfl_xor_sync(0xFFFFFFFFu, bam, 2));
        }
        const uint32_t sd = CvtFp8(__fmul_rn(bam, nv_factor), false);
        const float sdv = DecodeFp8(sd, false);
        const float enc = fminf(__fdiv_rn(1.0f, __fmul_rn(sdv, nv_sdec)), Fbits(kFltMaxBits));
        const uint32_t c0 = EncodeE2M1(__fmul_rn(x0, enc)), c1 = EncodeE2M1(__fmul_rn(x1, enc));
        const uint32_t c2 = EncodeE2M1(__fmul_rn(x2, enc)), c3 = EncodeE2M1(__fmul_rn(x3, enc));
        if (write) {
          if (n > 0) {
            const int64_t rb = (K + 1) / 2;  // bytes per data row
            uint8_t* out = static_cast<uint8_t*>(d.data) + gi * rb + gj / 2;
            const uint32_t byte0 = c0 | (c1 << 4), byte1 = c2 | (c3 << 4);
            if (d.vec && n == 4) {
              *reinterpret_cast<uint16_t*>(out) = static_cast<uint16_t>(byte0 | (byte1 << 8));
            } else {
              out[0] = static_cast<uint8_t>(byte0);
              if (gj / 2 + 1 < rb) out[1] = static_cast<uint8_t>(byte1);
            }
          }
          if ((lane & 3) == 0 && gi < d.scale_rows) {
            const int64_t b = int64_t{tk} * 8 + (lane >> 2);
            if (b < d.scale_cols) {
              const bool valid = row_ok && b * 16 < K;
              static_cast<uint8_t*>(d.scales)[gi * d.scale_cols + b] =
                  static_cast<uint8_t>(valid ? sd : 0u);
            }
          }
        }
        if (a.deq_writeback) {
          const float f = __fmul_rn(__fmul_rn(sdv, nv_deq), Fbits(kRcp2688Bits));
          d0 = __fmul_rn(DecodeE2M1(c0), f);
          d1 = __fmul_rn(DecodeE2M1(c1), f);
          d2 = __fmul_rn(DecodeE2M1(c2), f);
          d3 = __fmul_rn(DecodeE2M1(c3), f);
        }
        break;
      }
      default:
        break;
    }
    if (a.writeback) {
      // Elements outside [M, K] stay 0 (they must not reach an amax).
      float4 w;
      if (a.deq_writeback) {
        // D2: the dequantized rowwise values rounded to the source dtype.
        const bool rs = t.round_bf16;
        w.x = n > 0 ? ToSource(d0, rs) : 0.f;
        w.y = n > 1 ? ToSource(d1, rs) : 0.f;
        w.z = n > 2 ? ToSource(d2, rs) : 0.f;
        w.w = n > 3 ? ToSource(d3, rs) : 0.f;
      } else {
        w = make_float4(x0, x1, x2, x3);
      }
      s.tile[Phys(r, lane)] = w;
    }
  }
}

// ---------------------------------------------------------------------------
// Stage 4: columnwise scales -> multipliers in colbuf
// ---------------------------------------------------------------------------

template <int NT>
__device__ __forceinline__ void ColScaleStep(const TensorDesc& t, const DirDesc& d, TileSmem& s,
                                             const uint32_t* amax2d, int tm, int tk) {
  const int64_t M = t.rows, K = t.cols;
  const int64_t i0 = int64_t{tm} * kTile, j0 = int64_t{tk} * kTile;
  const bool e5m2 = d.e5m2;
  switch (d.fmt) {
    case kKMxfp8: {
      // Compact C[roundup(ceil(M/32),4)][roundup(K,128)], entry [i/32][j].
      const float rcp_max = Fbits(e5m2 ? kRcp57344Bits : kRcp448Bits);
      for (int it = threadIdx.x; it < 4 * kTile; it += NT) {
        const int rb = it >> 7, c = it & 127;
        const float bam = Fbits(d.two_d ? amax2d[rb * 4 + (c >> 5)] : s.colbuf[it]);
        const uint32_t e = E8M0FromScaledAmax(__fmul_rn(bam, rcp_max));
        s.colbuf[it] = __float_as_uint(E8M0Reciprocal(e));
        const int64_t srow = int64_t{tm} * 4 + rb, gj = j0 + c;
        if (d.write && srow < d.scale_rows && gj < d.scale_cols) {
          const bool valid = i0 + rb * 32 < M && gj < K;
          static_cast<uint8_t*>(d.scales)[srow * d.scale_cols + gj] =
              static_cast<uint8_t>(valid ? e : 0u);
        }
      }
      break;
    }
    case kKNvfp4: {
      // [roundup(K,128)][roundup(ceil(M/16),4)], entry [j][i/16]: one thread
      // per column writes the tile's 8 row blocks.
      const float A = *d.global_amax;
      const float s_enc = Nvfp4GlobalEncodeScale(A);
      const float s_dec = __frcp_rn(s_enc);
      const float factor = __fmul_rn(s_enc, Fbits(kRcp6Bits));
      for (int c = threadIdx.x; c < kTile; c += NT) {
        const int64_t gj = j0 + c;
        uint32_t lo = 0, hi = 0;
#pragma unroll
        for (int rb = 0; rb < 8; ++rb) {
          const float bam = Fbits(d.two_d ? amax2d[rb * 8 + (c >> 4)] : s.colbuf[rb * kTile + c]);
          const uint32_t sd = CvtFp8(__fmul_rn(bam, factor), false);
          const float enc =
              fminf(__fdiv_rn(1.0f, __fmul_rn(DecodeFp8(sd, false), s_dec)), Fbits(kFltMaxBits));
          s.colbuf[rb * kTile + c] = __float_as_uint(enc);
          const bool valid = gj < K && i0 + rb * 16 < M;
          const uint32_t byte = valid ? sd : 0u;
          if (rb < 4) {
            lo |= byte << (8 * rb);
          } else {
            hi |= byte << (8 * (rb - 4));
          }
        }
        if (d.write && gj < d.scale_rows) {
          uint8_t* out = static_cast<uint8_t*>(d.scales) + gj * d.scale_cols + int64_t{tm} * 8;
          const int64_t room = d.scale_cols - int64_t{tm} * 8;
          if (room >= 8 && (d.scale_cols & 7) == 0 &&
              (reinterpret_cast<uintptr_t>(d.scales) & 7) == 0) {
            *reinterpret_cast<uint2*>(out) = make_uint2(lo, hi);
          } else {
            for (int b = 0; b < 8 && b < room; ++b) {
              out[b] = static_cast<uint8_t>(b < 4 ? lo >> (8 * b) : hi >> (8 * (b - 4)));
            }
          }
        }
      }
      break;
    }
    case kKBlock1d: {
      // [ceil(M/128)][roundup(K,4)], entry [mb][j].
      for (int c = threadIdx.x; c < kTile; c += NT) {
        const float sc =
            ComputeScale(Fbits(s.colbuf[c]), Fp8Max(e5m2), d.pow2, d.eps, d.inf_value);
        s.colbuf[c] = __float_as_uint(sc);
        const int64_t gj = j0 + c;
        if (d.write && gj < d.scale_cols) {
          static_cast<float*>(d.scales)[int64_t{tm} * d.scale_cols + gj] =
              gj < K ? __frcp_rn(sc) : 0.0f;
        }
      }
      break;
    }
    case kKBlock2d: {
      // [ceil(K/128)][roundup(ceil(M/128),4)], entry [kb][mb].
      if (threadIdx.x == 0) {
        const float sc = ComputeScale(Fbits(amax2d[0]), Fp8Max(e5m2), d.pow2, d.eps, d.inf_value);
        s.colbuf[0] = __float_as_uint(sc);
        if (d.write) {
          float* out = static_cast<float*>(d.scales) + int64_t{tk} * d.scale_cols;
          out[tm] = __frcp_rn(sc);
          if ((int64_t{tm} + 1) * kTile >= M) {  // last row tile: padding entries
            for (int64_t x = tm + 1; x < d.scale_cols; ++x) out[x] = 0.0f;
          }
        }
      }
      break;
    }
    default:
      break;
  }
}

// ---------------------------------------------------------------------------
// Stage 5: transposed columnwise pass (per-tensor FP8, blockwise FP8, NVFP4)
// ---------------------------------------------------------------------------

template <int NT>
__device__ __forceinline__ void ColTransposedPass(const TensorDesc& t, const DirDesc& d,
                                                  const TileSmem& s, int tm, int tk,
                                                  bool round_bf16, float& amax_acc) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int a = lane & 7, b = lane >> 3;
  const int64_t M = t.rows, K = t.cols;
  const int64_t i0 = int64_t{tm} * kTile, j0 = int64_t{tk} * kTile;
  const int64_t gi0 = i0 + 16 * a;
  const bool e5m2 = d.e5m2;
  const bool nvfp4 = d.fmt == kKNvfp4;
  const float tensor_scale = d.fmt == kKFp8Tensor ? *d.scale : 1.0f;
  for (int ch = warp * 4 + b; ch < kChunks; ch += NT / 8) {
    float mult[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int c = 4 * ch + k;
      switch (d.fmt) {
        case kKFp8Tensor:
          mult[k] = tensor_scale;
          break;
        case kKBlock2d:
          mult[k] = Fbits(s.colbuf[0]);
          break;
        case kKBlock1d:
          mult[k] = Fbits(s.colbuf[c]);
          break;
        default:  // NVFP4: the lane's 16 rows are row block a
          mult[k] = Fbits(s.colbuf[a * kTile + c]);
          break;
      }
    }
    uint32_t w[4][4];  // FP8: [column][4 rows per word]; NVFP4 uses w[k][0..1]
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k][0] = w[k][1] = w[k][2] = w[k][3] = 0u;
#pragma unroll
    for (int sr = 0; sr < 16; ++sr) {
      const float4 v4 = s.tile[Phys(16 * a + sr, ch)];
      const float x0 = ToSource(v4.x, round_bf16), x1 = ToSource(v4.y, round_bf16);
      const float x2 = ToSource(v4.z, round_bf16), x3 = ToSource(v4.w, round_bf16);
      amax_acc = fmaxf(amax_acc, fmaxf(fmaxf(fabsf(x0), fabsf(x1)), fmaxf(fabsf(x2), fabsf(x3))));
      if (nvfp4) {
        const int sh = 4 * (sr & 7);
        w[0][sr >> 3] |= EncodeE2M1(__fmul_rn(x0, mult[0])) << sh;
        w[1][sr >> 3] |= EncodeE2M1(__fmul_rn(x1, mult[1])) << sh;
        w[2][sr >> 3] |= EncodeE2M1(__fmul_rn(x2, mult[2])) << sh;
        w[3][sr >> 3] |= EncodeE2M1(__fmul_rn(x3, mult[3])) << sh;
      } else {
        const uint32_t p01 = CvtFp8x2(__fmul_rn(x0, mult[0]), __fmul_rn(x1, mult[1]), e5m2);
        const uint32_t p23 = CvtFp8x2(__fmul_rn(x2, mult[2]), __fmul_rn(x3, mult[3]), e5m2);
        const int sh = 8 * (sr & 3);
        w[0][sr >> 2] |= (p01 & 0xFFu) << sh;
        w[1][sr >> 2] |= (p01 >> 8) << sh;
        w[2][sr >> 2] |= (p23 & 0xFFu) << sh;
        w[3][sr >> 2] |= (p23 >> 8) << sh;
      }
    }
    if (!d.write || gi0 >= M) continue;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t gj = j0 + 4 * ch + k;
      if (gj >= K) continue;
      if (nvfp4) {
        const int64_t rbytes = (M + 1) / 2;
        uint8_t* out = static_cast<uint8_t*>(d.data) + gj * rbytes + gi0 / 2;
        if (d.vec && gi0 + 16 <= M) {
          *reinterpret_cast<uint2*>(out) = make_uint2(w[k][0], w[k][1]);
        } else {
          for (int q = 0; q < 8 && gi0 / 2 + q < rbytes; ++q) {
            out[q] = static_cast<uint8_t>(w[k][q >> 2] >> (8 * (q & 3)));
          }
        }
      } else {
        uint8_t* out = static_cast<uint8_t*>(d.data) + gj * M + gi0;
        if (d.vec && gi0 + 16 <= M) {
          *reinterpret_cast<uint4*>(out) = make_uint4(w[k][0], w[k][1], w[k][2], w[k][3]);
        } else {
          for (int q = 0; q < 16 && gi0 + q < M; ++q) {
            out[q] = static_cast<uint8_t>(w[k][q >> 2] >> (8 * (q & 3)));
          }
        }
      }
    }
  }
}

// amax of the tile only (amax of the columnwise source, no outputs).
template <int NT>
__device__ __forceinline__ float TileAmax(const TileSmem& s, bool round_bf16) {
  float m = 0.f;
  for (int c = threadIdx.x; c < kTile * kChunks; c += NT) {
    const float4 v = s.tile[c];
    m = AbsMax(m, ToSource(v.x, round_bf16));
    m = AbsMax(m, ToSource(v.y, round_bf16));
    m = AbsMax(m, ToSource(v.z, round_bf16));
    m = AbsMax(m, ToSource(v.w, round_bf16));
  }
  return m;
}

__device__ __forceinline__ bool IsTransposed(uint8_t fmt) {
  return fmt == kKFp8Tensor || fmt == kKBlock2d || fmt == kKBlock1d || fmt == kKNvfp4;
}

// Warp max then one shared atomic per warp.
__device__ __forceinline__ void BlockAmaxContribute(float v, uint32_t* slot) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  if ((threadIdx.x & 31) == 0) atomicMax(slot, __float_as_uint(v));
}

// ---------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------

template <int NT>
__device__ __forceinline__ void ProcessTile(const QuantizeBatch& batch, int64_t tile,
                                            TileSmem& s) {
  int lo = 0, hi = batch.num - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (batch.t[mid].tile_begin <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const TensorDesc& t = batch.t[lo];
  const int64_t local = tile - t.tile_begin;
  const int tm = static_cast<int>(local / t.tiles_k);
  const int tk = static_cast<int>(local % t.tiles_k);
  const int64_t i0 = int64_t{tm} * kTile, j0 = int64_t{tk} * kTile;
  const DirDesc& row = t.row;
  const DirDesc& col = t.col;

  for (int i = threadIdx.x; i < 8 * kTile; i += NT) s.colbuf[i] = 0u;
  if (threadIdx.x < 64) {
    s.amax2d_row[threadIdx.x] = 0u;
    s.amax2d_col[threadIdx.x] = 0u;
  }
  if (threadIdx.x < 4) s.red[threadIdx.x] = 0u;

  if (t.opt.param != nullptr) {
    LoadTileAdam<NT>(t, batch.adam, s, i0, j0);
  } else if (t.src_vec && !t.src_bf16) {
    LoadTileFp32Vec<NT>(t, s, i0, j0);
  } else if (t.src_vec) {
    LoadTileBf16Vec<NT>(t, s, i0, j0);
  } else {
    LoadTileScalar<NT>(t, s, i0, j0);
  }
  __syncthreads();

  // Per-tensor scalars, once per tensor.
  if (tm == 0 && tk == 0 && threadIdx.x == 0) {
    if (row.fmt == kKFp8Tensor && row.write && row.scale_inv) *row.scale_inv = __frcp_rn(*row.scale);
    if (col.fmt == kKFp8Tensor && col.write && col.scale_inv) *col.scale_inv = __frcp_rn(*col.scale);
  }

  const bool row_needed = row.fmt != kKNone;
  const bool col_needed = col.fmt != kKNone || col.amax != nullptr;
  const bool rbf = t.round_bf16;

  // Stage 2.
  const BlockCfg rcfg = row_needed ? RowBlockCfg(row) : BlockCfg{};
  const BlockCfg ccfg = col.fmt != kKNone ? ColBlockCfg(col) : BlockCfg{};
  const bool col_same_2d = ccfg.bm != 0 && ccfg.bk > 1 && ccfg.bm == rcfg.bm && ccfg.bk == rcfg.bk &&
                           !t.col_from_row;
  const uint32_t* col2d = col_same_2d ? s.amax2d_row : s.amax2d_col;
  bool synced = true;
  if (rcfg.bm != 0) {
    BlockAmaxPass<NT>(s, rbf, rcfg.bm, rcfg.bk, s.amax2d_row);
    synced = false;
  }
  if (ccfg.bm != 0 && !t.col_from_row && !col_same_2d) {
    BlockAmaxPass<NT>(s, rbf, ccfg.bm, ccfg.bk, ccfg.bk > 1 ? s.amax2d_col : s.colbuf);
    synced = false;
  }
  if (!synced) __syncthreads();

  // Stage 3.
  float row_amax = 0.f, col_amax = 0.f;
  bool tile_is_source = false;  // the tile holds the columnwise input, already rounded
  if (row_needed) {
    RowPassArgs a;
    a.colmode = false;
    a.round_bf16 = rbf;
    a.deq_writeback = t.col_from_row;
    a.writeback = col_needed && (t.col_from_row || rbf);
    RowMappedPass<NT>(t, row, s, tm, tk, a, row_amax);
    if (a.writeback) {
      tile_is_source = true;
      __syncthreads();
    }
  }

  // Stages 4-5.
  if (col_needed) {
    const bool crbf = rbf && !tile_is_source;
    if (col.fmt == kKNone) {
      col_amax = TileAmax<NT>(s, crbf);
    } else {
      if (ccfg.bm != 0 && t.col_from_row) {
        BlockAmaxPass<NT>(s, crbf, ccfg.bm, ccfg.bk, ccfg.bk > 1 ? s.amax2d_col : s.colbuf);
        __syncthreads();
      }
      if (col.fmt != kKFp8Tensor && col.fmt != kKBf16 && col.fmt != kKFp32) {
        ColScaleStep<NT>(t, col, s, col2d, tm, tk);
        __syncthreads();
      }
      if (IsTransposed(col.fmt)) {
        ColTransposedPass<NT>(t, col, s, tm, tk, crbf, col_amax);
      } else {
        RowPassArgs a;
        a.colmode = true;
        a.round_bf16 = crbf;
        a.writeback = false;
        a.deq_writeback = false;
        RowMappedPass<NT>(t, col, s, tm, tk, a, col_amax);
      }
    }
  }

  // Rowwise 128x128 block scale: one entry per tile ([ceil(M/128)][roundup(ceil(K/128),4)]).
  if (row.fmt == kKBlock2d && row.write && threadIdx.x == 0) {
    const float sc =
        ComputeScale(Fbits(s.amax2d_row[0]), Fp8Max(row.e5m2), row.pow2, row.eps, row.inf_value);
    float* out = static_cast<float*>(row.scales) + int64_t{tm} * row.scale_cols;
    out[tk] = __frcp_rn(sc);
    if (tk == t.tiles_k - 1) {
      for (int64_t x = tk + 1; x < row.scale_cols; ++x) out[x] = 0.0f;
    }
  }

  // Stage 6.
  if (row.amax != nullptr || col.amax != nullptr) {
    if (row.amax != nullptr) BlockAmaxContribute(row_amax, &s.red[0]);
    if (col.amax != nullptr) BlockAmaxContribute(col_amax, &s.red[1]);
    __syncthreads();
    if (threadIdx.x == 0) {
      if (row.amax != nullptr) AtomicMaxNonNeg(row.amax, Fbits(s.red[0]));
      if (col.amax != nullptr) AtomicMaxNonNeg(col.amax, Fbits(s.red[1]));
    }
  }
}

template <int NT, int kMinBlocks>
__global__ void __launch_bounds__(NT, kMinBlocks)
    QuantizeTilesKernel(const __grid_constant__ QuantizeBatch batch) {
  extern __shared__ float4 smem_raw[];
  TileSmem& s = *reinterpret_cast<TileSmem*>(smem_raw);
  for (int64_t tile = blockIdx.x; tile < batch.total_tiles; tile += gridDim.x) {
    ProcessTile<NT>(batch, tile, s);
    __syncthreads();  // shared memory is reused by the next tile
  }
}

template <int NT, int kMinBlocks>
cudaError_t LaunchVariant(const QuantizeBatch& batch, bool persistent, cudaStream_t stream) {
  static_assert(NT % 256 == 0 || NT == 128, "thread count");
  const size_t smem = sizeof(TileSmem);
  auto kernel = QuantizeTilesKernel<NT, kMinBlocks>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  int64_t grid = batch.total_tiles;
  if (persistent) {
    int device = 0, sms = 0, per_sm = 0;
    if ((err = cudaGetDevice(&device)) != cudaSuccess) return err;
    if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) {
      return err;
    }
    if ((err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, NT, smem)) !=
        cudaSuccess) {
      return err;
    }
    const int64_t cap = int64_t{sms} * (per_sm > 0 ? per_sm : 1);
    if (grid > cap) grid = cap;
  }
  if (grid > 0x7FFFFFFF) grid = 0x7FFFFFFF;
  kernel<<<static_cast<unsigned>(grid), NT, smem, stream>>>(batch);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchQuantizeTiles(const QuantizeBatch& batch, int variant, cudaStream_t stream) {
  if (batch.total_tiles <= 0) return cudaSuccess;
  switch (variant) {
    case kVariant512:
      return LaunchVariant<512, 2>(batch, false, stream);
    case kVariantPersistent:
      return LaunchVariant<256, 3>(batch, true, stream);
    default:
      return LaunchVariant<256, 3>(batch, false, stream);
  }
}

}  // namespace detail
}  // namespace gpu
}  // namespace paramd
