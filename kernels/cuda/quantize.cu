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
//
// The tensor descriptor is copied out of the parameter space once per tile
// (fields held in registers), and every pass is specialised at compile time
// on its format (one switch per tile, none per element).
//
// This is the v3.3 kernel (helpers in quantize_tile.cuh). The default
// launcher sends batches of NVFP4 16x16 row + col, MXFP8 row + col and 1x128
// row + col tensors to the v4 kernel of quantize_v4.cu instead (see
// UseV4Pattern below); its sm_90a code is byte-identical to the build
// measured and tested in run 6 of docs/GPU_NOTES.md.
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/codecs.cuh"
#include "kernels/cuda/optimizer_math.cuh"
#include "kernels/cuda/quantize_launch.h"
#include "kernels/cuda/quantize_tile.cuh"

namespace paramd {
namespace gpu {
namespace detail {
namespace {

// ---------------------------------------------------------------------------
// Stage 3: row-mapped pass (rowwise of every format; columnwise MXFP8 and
// identity, which keep the [M][K] order)
// ---------------------------------------------------------------------------

struct RowPassArgs {
  bool round_bf16 = false;     // tile values still need rounding to the source dtype
  bool writeback = false;      // write values for the columnwise pass back to the tile
  bool deq_writeback = false;  // ... the dequantized values (rowwise_dequantized), else the source
  bool source_bf16 = false;    // D2: round the dequantized values to BF16
  // Fused columnwise block amax (per column, row blocks of col_bm rows), max-
  // updated into col_amax[rb * 128 + col]; null: none.
  uint32_t* col_amax = nullptr;
  int col_bm_log2 = 0;  // row block of 16, 32 or 128 rows
};

// kColMode: the columnwise copy of MXFP8 / identity (multipliers from colbuf,
// no scale writes, no writeback). Addresses advance by pointer increments; the
// per-row bounds are 32-bit compares against the tile's valid extent.
template <int NT, int F, bool kE5M2, bool kColMode>
__device__ __forceinline__ void RowMappedPass(int64_t M, int64_t K, const DirDesc& d,
                                              TileSmem& s, int tm, int tk, RowPassArgs a,
                                              float& amax_acc) {
  constexpr int kWarps = NT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t i0 = int64_t{tm} * kTile, j0 = int64_t{tk} * kTile;
  const int64_t gj = j0 + 4 * lane;
  const int nvalid_col = gj >= K ? 0 : (K - gj >= 4 ? 4 : static_cast<int>(K - gj));
  const int rows_valid = M - i0 < kTile ? static_cast<int>(M - i0) : kTile;
  const bool write = d.write;
  const bool vec = d.vec;
  const int64_t scale_rows = d.scale_rows, scale_cols = d.scale_cols;
  const bool round_bf16 = a.round_bf16, writeback = a.writeback, deq_wb = a.deq_writeback;
  const bool src_bf16 = a.source_bf16;
  uint32_t* const col_amax = a.col_amax;
  const int col_sh = a.col_bm_log2;

  // Output row pitch (bytes) and this thread's first output byte.
  int64_t pitch, col_off;
  if constexpr (F == kKBf16) {
    pitch = 2 * K, col_off = 2 * gj;
  } else if constexpr (F == kKFp32) {
    pitch = 4 * K, col_off = 4 * gj;
  } else if constexpr (F == kKNvfp4) {
    pitch = (K + 1) / 2, col_off = gj / 2;
  } else {
    pitch = K, col_off = gj;
  }
  uint8_t* out = static_cast<uint8_t*>(d.data) + (i0 + warp) * pitch + col_off;
  const int64_t out_step = kWarps * pitch;
  // Row-scale entries (MXFP8 [i][b], NVFP4 [i][b]; 1x128 [kb][i]).
  int scale_rows_valid = 0;
  uint8_t* srow = nullptr;
  int64_t srow_step = 0;
  int64_t sblock = 0;
  bool sblock_in = false, sblock_ok = false;  // inside the scale buffer / covers real columns
  if constexpr (F == kKMxfp8 || F == kKNvfp4) {
    constexpr int kBlk = F == kKMxfp8 ? 32 : 16;
    sblock = int64_t{tk} * (kTile / kBlk) + lane / (kBlk / 4);
    sblock_in = sblock < scale_cols;
    sblock_ok = sblock * kBlk < K;
    const int64_t left = scale_rows - i0;
    scale_rows_valid = left < kTile ? static_cast<int>(left) : kTile;
    srow = static_cast<uint8_t*>(d.scales) + (i0 + warp) * scale_cols + sblock;
    srow_step = kWarps * scale_cols;
  } else if constexpr (F == kKBlock1d) {
    const int64_t left = scale_cols - i0;  // scale "rows" of 1x128 are the entries [kb][i]
    scale_rows_valid = left < kTile ? static_cast<int>(left) : kTile;
    srow = static_cast<uint8_t*>(d.scales) + 4 * (int64_t{tk} * scale_cols + i0 + warp);
    srow_step = 4 * kWarps;
  }

  // Per-tile constants.
  float scale = 1.0f, scale_inv = 1.0f;  // FP8 per-tensor / 128x128 block
  float nv_factor = 0.f, nv_sdec = 0.f, nv_a = 0.f;
  const float rcp_max = Fbits(kE5M2 ? kRcp57344Bits : kRcp448Bits);
  if constexpr (F == kKFp8Tensor) {
    scale = *d.scale;
    scale_inv = __frcp_rn(scale);
  } else if constexpr (F == kKBlock2d) {
    scale = ComputeScale(Fbits(s.amax2d_row[0]), Fp8Max(kE5M2), d.pow2, d.eps, d.inf_value);
    scale_inv = __frcp_rn(scale);
  } else if constexpr (F == kKNvfp4) {
    nv_a = *d.global_amax;
    const float s_enc = Nvfp4GlobalEncodeScale(nv_a);
    nv_sdec = __frcp_rn(s_enc);
    nv_factor = __fmul_rn(s_enc, Fbits(kRcp6Bits));
  }
  const bool pow2 = d.pow2;
  const float eps = d.eps, inf_value = d.inf_value;
  const bool two_d = d.two_d;
  float ca0 = 0.f, ca1 = 0.f, ca2 = 0.f, ca3 = 0.f;  // fused column amax

#pragma unroll 2
  for (int r = warp; r < kTile; r += kWarps, out += out_step, srow += srow_step) {
    const bool row_ok = r < rows_valid;
    const int n = row_ok ? nvalid_col : 0;
    float x0, x1, x2, x3;
    ReadRow4(s, r, lane, round_bf16, x0, x1, x2, x3);
    const float lmax = Max4Abs(x0, x1, x2, x3);
    amax_acc = fmaxf(amax_acc, lmax);
    if (col_amax != nullptr) {
      ca0 = AbsMax(ca0, x0), ca1 = AbsMax(ca1, x1), ca2 = AbsMax(ca2, x2), ca3 = AbsMax(ca3, x3);
      const int next = r + kWarps;
      if (next >= kTile || (next >> col_sh) != (r >> col_sh)) {
        uint32_t* dst = col_amax + (r >> col_sh) * kTile + 4 * lane;
        atomicMax(dst + 0, __float_as_uint(ca0));
        atomicMax(dst + 1, __float_as_uint(ca1));
        atomicMax(dst + 2, __float_as_uint(ca2));
        atomicMax(dst + 3, __float_as_uint(ca3));
        ca0 = ca1 = ca2 = ca3 = 0.f;
      }
    }
    float d0 = x0, d1 = x1, d2 = x2, d3 = x3;  // dequantized values
    if constexpr (F == kKBf16) {
      const uint32_t b01 = Bf16x2Bits(x0, x1), b23 = Bf16x2Bits(x2, x3);
      if (write && n > 0) {
        uint16_t* o = reinterpret_cast<uint16_t*>(out);
        if (vec && n == 4) {
          *reinterpret_cast<uint2*>(o) = make_uint2(b01, b23);
        } else {
          o[0] = static_cast<uint16_t>(b01);
          if (n > 1) o[1] = static_cast<uint16_t>(b01 >> 16);
          if (n > 2) o[2] = static_cast<uint16_t>(b23);
          if (n > 3) o[3] = static_cast<uint16_t>(b23 >> 16);
        }
      }
      d0 = __uint_as_float(b01 << 16), d1 = __uint_as_float(b01 & 0xFFFF0000u);
      d2 = __uint_as_float(b23 << 16), d3 = __uint_as_float(b23 & 0xFFFF0000u);
    } else if constexpr (F == kKFp32) {
      if (write && n > 0) {
        float* o = reinterpret_cast<float*>(out);
        if (vec && n == 4) {
          *reinterpret_cast<float4*>(o) = make_float4(x0, x1, x2, x3);
        } else {
          o[0] = x0;
          if (n > 1) o[1] = x1;
          if (n > 2) o[2] = x2;
          if (n > 3) o[3] = x3;
        }
      }
    } else if constexpr (F == kKNvfp4) {
      float bam;
      if (two_d) {
        bam = Fbits(s.amax2d_row[(r >> 4) * 8 + (lane >> 2)]);
      } else {
        bam = lmax;
        bam = fmaxf(bam, __shfl_xor_sync(0xFFFFFFFFu, bam, 1));
        bam = fmaxf(bam, __shfl_xor_sync(0xFFFFFFFFu, bam, 2));
      }
      const uint32_t sd = CvtFp8(__fmul_rn(bam, nv_factor), false);
      const float sdv = DecodeFp8(sd, false);
      const float enc = fminf(__frcp_rn(__fmul_rn(sdv, nv_sdec)), Fbits(kFltMaxBits));
      const uint32_t byte0 = EncodeE2M1x2(__fmul_rn(x0, enc), __fmul_rn(x1, enc));
      const uint32_t byte1 = EncodeE2M1x2(__fmul_rn(x2, enc), __fmul_rn(x3, enc));
      if (write) {
        if (n > 0) {
          if (vec && n == 4) {
            *reinterpret_cast<uint16_t*>(out) = static_cast<uint16_t>(byte0 | (byte1 << 8));
          } else {
            out[0] = static_cast<uint8_t>(byte0);
            if (gj / 2 + 1 < pitch) out[1] = static_cast<uint8_t>(byte1);
          }
        }
        if ((lane & 3) == 0 && r < scale_rows_valid && sblock_in) {
          const bool valid = row_ok && sblock_ok;
          *srow = static_cast<uint8_t>(valid ? sd : 0u);
        }
      }
      if (deq_wb) {
        const float f = __fmul_rn(__fmul_rn(sdv, nv_a), Fbits(kRcp2688Bits));
        d0 = __fmul_rn(DecodeE2M1(byte0 & 0xFu), f);
        d1 = __fmul_rn(DecodeE2M1(byte0 >> 4), f);
        d2 = __fmul_rn(DecodeE2M1(byte1 & 0xFu), f);
        d3 = __fmul_rn(DecodeE2M1(byte1 >> 4), f);
      }
    } else {  // FP8 element formats: per-tensor, 128x128, 1x128, MXFP8
      float m0, m1, m2, m3;  // multipliers
      float q = 1.0f;        // dequantization factor (one per lane here)
      if constexpr (F == kKMxfp8 && kColMode) {
        const float4 mm = reinterpret_cast<const float4*>(s.colbuf)[(r >> 5) * kChunks + lane];
        m0 = mm.x, m1 = mm.y, m2 = mm.z, m3 = mm.w;
      } else if constexpr (F == kKMxfp8) {
        float bam;
        if (two_d) {
          bam = Fbits(s.amax2d_row[(r >> 5) * 4 + (lane >> 3)]);
        } else {
          bam = lmax;
          bam = fmaxf(bam, __shfl_xor_sync(0xFFFFFFFFu, bam, 1));
          bam = fmaxf(bam, __shfl_xor_sync(0xFFFFFFFFu, bam, 2));
          bam = fmaxf(bam, __shfl_xor_sync(0xFFFFFFFFu, bam, 4));
        }
        const uint32_t e = E8M0FromScaledAmax(__fmul_rn(bam, rcp_max));
        m0 = m1 = m2 = m3 = E8M0Reciprocal(e);
        if (deq_wb) q = DecodeE8M0(e);
        if (write && (lane & 7) == 0 && r < scale_rows_valid && sblock_in) {
          const bool valid = row_ok && sblock_ok;
          *srow = static_cast<uint8_t>(valid ? e : 0u);
        }
      } else if constexpr (F == kKBlock1d) {
        float bam = lmax;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) bam = fmaxf(bam, __shfl_xor_sync(0xFFFFFFFFu, bam, off));
        const float sc = ComputeScale(bam, Fp8Max(kE5M2), pow2, eps, inf_value);
        m0 = m1 = m2 = m3 = sc;
        q = __frcp_rn(sc);
        // Layout [ceil(K/128)][roundup(M,4)], entry [kb][i].
        if (write && lane == 0 && r < scale_rows_valid) {
          *reinterpret_cast<float*>(srow) = row_ok ? q : 0.0f;
        }
      } else {  // per-tensor or 128x128 block
        m0 = m1 = m2 = m3 = scale;
        q = scale_inv;
      }
      const uint32_t qb = CvtFp8x4(__fmul_rn(x0, m0), __fmul_rn(x1, m1), __fmul_rn(x2, m2),
                                   __fmul_rn(x3, m3), kE5M2);
      if (write && n > 0) Store4Bytes(out, qb, n, vec);
      if constexpr (!kColMode) {
        if (deq_wb) {
          d0 = __fmul_rn(DecodeFp8(qb, kE5M2), q);
          d1 = __fmul_rn(DecodeFp8(qb >> 8, kE5M2), q);
          d2 = __fmul_rn(DecodeFp8(qb >> 16, kE5M2), q);
          d3 = __fmul_rn(DecodeFp8(qb >> 24, kE5M2), q);
        }
      }
    }
    if constexpr (!kColMode) {
      if (writeback) {
        // Elements outside [M, K] stay 0 (they must not reach an amax).
        float4 w;
        if (deq_wb) {
          // D2: the dequantized rowwise values rounded to the source dtype.
          if (src_bf16) {
            RoundPairBf16(d0, d1);
            RoundPairBf16(d2, d3);
          }
          w.x = n > 0 ? d0 : 0.f;
          w.y = n > 1 ? d1 : 0.f;
          w.z = n > 2 ? d2 : 0.f;
          w.w = n > 3 ? d3 : 0.f;
        } else {
          w = make_float4(x0, x1, x2, x3);
        }
        s.tile[Phys(r, lane)] = w;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Stage 4: columnwise scales -> multipliers in colbuf
// ---------------------------------------------------------------------------

template <int NT>
__device__ __forceinline__ void ColScaleStep(int64_t M, int64_t K, const DirDesc& d, TileSmem& s,
                                             const uint32_t* amax2d, int tm, int tk) {
  const int64_t i0 = int64_t{tm} * kTile, j0 = int64_t{tk} * kTile;
  const bool e5m2 = d.e5m2, two_d = d.two_d, write = d.write;
  const int64_t scale_rows = d.scale_rows, scale_cols = d.scale_cols;
  switch (d.fmt) {
    case kKMxfp8: {
      // Compact C[roundup(ceil(M/32),4)][roundup(K,128)], entry [i/32][j].
      uint8_t* scales = static_cast<uint8_t*>(d.scales);
      const float rcp_max = Fbits(e5m2 ? kRcp57344Bits : kRcp448Bits);
      for (int it = threadIdx.x; it < 4 * kTile; it += NT) {
        const int rb = it >> 7, c = it & 127;
        const float bam = Fbits(two_d ? amax2d[rb * 4 + (c >> 5)] : s.colbuf[it]);
        const uint32_t e = E8M0FromScaledAmax(__fmul_rn(bam, rcp_max));
        s.colbuf[it] = __float_as_uint(E8M0Reciprocal(e));
        const int64_t srow = int64_t{tm} * 4 + rb, gj = j0 + c;
        if (write && srow < scale_rows && gj < scale_cols) {
          const bool valid = i0 + rb * 32 < M && gj < K;
          scales[srow * scale_cols + gj] = static_cast<uint8_t>(valid ? e : 0u);
        }
      }
      break;
    }
    case kKNvfp4: {
      // [roundup(K,128)][roundup(ceil(M/16),4)], entry [j][i/16]: one thread
      // per column writes the tile's 8 row blocks.
      uint8_t* scales = static_cast<uint8_t*>(d.scales);
      const float A = *d.global_amax;
      const float s_enc = Nvfp4GlobalEncodeScale(A);
      const float s_dec = __frcp_rn(s_enc);
      const float factor = __fmul_rn(s_enc, Fbits(kRcp6Bits));
      for (int c = threadIdx.x; c < kTile; c += NT) {
        const int64_t gj = j0 + c;
        uint32_t lo = 0, hi = 0;
#pragma unroll
        for (int rb = 0; rb < 8; ++rb) {
          const float bam = Fbits(two_d ? amax2d[rb * 8 + (c >> 4)] : s.colbuf[rb * kTile + c]);
          const uint32_t sd = CvtFp8(__fmul_rn(bam, factor), false);
          const float enc =
              fminf(__frcp_rn(__fmul_rn(DecodeFp8(sd, false), s_dec)), Fbits(kFltMaxBits));
          s.colbuf[rb * kTile + c] = __float_as_uint(enc);
          const bool valid = gj < K && i0 + rb * 16 < M;
          const uint32_t byte = valid ? sd : 0u;
          if (rb < 4) {
            lo |= byte << (8 * rb);
          } else {
            hi |= byte << (8 * (rb - 4));
          }
        }
        if (write && gj < scale_rows) {
          uint8_t* out = scales + gj * scale_cols + int64_t{tm} * 8;
          const int64_t room = scale_cols - int64_t{tm} * 8;
          if (room >= 8 && (scale_cols & 7) == 0 && (reinterpret_cast<uintptr_t>(scales) & 7) == 0) {
            *reinterpret_cast<uint2*>(out) = make_uint2(lo, hi);
          } else {
            for (int b = 0; b < 8 && b < room; ++b) {
              out[b] = static_cast<uint8_t>(b < 4 ? ByteOf(lo, b) : ByteOf(hi, b - 4));
            }
          }
        }
      }
      break;
    }
    case kKBlock1d: {
      // [ceil(M/128)][roundup(K,4)], entry [mb][j].
      float* scales = static_cast<float*>(d.scales);
      const bool pow2 = d.pow2;
      const float eps = d.eps, inf_value = d.inf_value;
      for (int c = threadIdx.x; c < kTile; c += NT) {
        const float sc = ComputeScale(Fbits(s.colbuf[c]), Fp8Max(e5m2), pow2, eps, inf_value);
        s.colbuf[c] = __float_as_uint(sc);
        const int64_t gj = j0 + c;
        if (write && gj < scale_cols) {
          scales[int64_t{tm} * scale_cols + gj] = gj < K ? __frcp_rn(sc) : 0.0f;
        }
      }
      break;
    }
    case kKBlock2d: {
      // [ceil(K/128)][roundup(ceil(M/128),4)], entry [kb][mb].
      if (threadIdx.x == 0) {
        const float sc = ComputeScale(Fbits(amax2d[0]), Fp8Max(e5m2), d.pow2, d.eps, d.inf_value);
        s.colbuf[0] = __float_as_uint(sc);
        if (write) {
          float* out = static_cast<float*>(d.scales) + int64_t{tk} * scale_cols;
          out[tm] = __frcp_rn(sc);
          if ((int64_t{tm} + 1) * kTile >= M) {  // last row tile: padding entries
            for (int64_t x = tm + 1; x < scale_cols; ++x) out[x] = 0.0f;
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

// kFp4: NVFP4 (nibbles, multiplier per 16-row block); otherwise FP8 bytes with
// a multiplier per tile (per-tensor, 128x128) or per column (1x128).
template <int NT, bool kFp4, bool kE5M2>
__device__ __forceinline__ void ColTransposedPass(int64_t M, int64_t K, const DirDesc& d,
                                                  const TileSmem& s, int tm, int tk,
                                                  bool round_bf16, float& amax_acc) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int a = lane & 7, b = lane >> 3;
  const int64_t i0 = int64_t{tm} * kTile, j0 = int64_t{tk} * kTile;
  const int64_t gi0 = i0 + 16 * a;
  const uint8_t fmt = d.fmt;
  const bool write = d.write && gi0 < M;
  const bool full = d.vec && gi0 + 16 <= M;
  const int cols_valid = K - j0 < kTile ? static_cast<int>(K - j0) : kTile;
  const float tensor_scale = fmt == kKFp8Tensor ? *d.scale : 1.0f;
  const int64_t pitch = kFp4 ? (M + 1) / 2 : M;  // bytes per output row
  uint8_t* const out_base = static_cast<uint8_t*>(d.data) + j0 * pitch + (kFp4 ? gi0 / 2 : gi0);
  for (int ch = warp * 4 + b; ch < kChunks; ch += NT / 8) {
    float m0, m1, m2, m3;
    const int c0 = 4 * ch;
    if (kFp4) {
      const float4 mm = reinterpret_cast<const float4*>(s.colbuf)[a * kChunks + ch];
      m0 = mm.x, m1 = mm.y, m2 = mm.z, m3 = mm.w;
    } else if (fmt == kKBlock1d) {
      const float4 mm = reinterpret_cast<const float4*>(s.colbuf)[ch];
      m0 = mm.x, m1 = mm.y, m2 = mm.z, m3 = mm.w;
    } else if (fmt == kKBlock2d) {
      m0 = m1 = m2 = m3 = Fbits(s.colbuf[0]);
    } else {
      m0 = m1 = m2 = m3 = tensor_scale;
    }
    // Rows 16a .. 16a+15 of chunk ch: (16a+sr) >> 4 == a, so the swizzled
    // position is the same for all 16 rows.
    const float4* rows = &s.tile[(16 * a) * kChunks + (ch ^ a)];
    // FP8: w[k][q] = bytes of rows 4q..4q+3 of column c0+k. NVFP4: w[k][0..1].
    uint32_t w0[4], w1[4], w2[4], w3[4];
#pragma unroll
    for (int sr = 0; sr < 16; sr += 2) {
      float4 va = rows[sr * kChunks], vb = rows[(sr + 1) * kChunks];
      if (round_bf16) {
        RoundPairBf16(va.x, va.y), RoundPairBf16(va.z, va.w);
        RoundPairBf16(vb.x, vb.y), RoundPairBf16(vb.z, vb.w);
      }
      amax_acc = fmaxf(amax_acc, fmaxf(Max4Abs(va.x, va.y, va.z, va.w), Max4Abs(vb.x, vb.y, vb.z, vb.w)));
      if constexpr (kFp4) {
        // Two rows of one column make one byte (even row in the low nibble).
        const uint32_t y0 = EncodeE2M1x2(__fmul_rn(va.x, m0), __fmul_rn(vb.x, m0));
        const uint32_t y1 = EncodeE2M1x2(__fmul_rn(va.y, m1), __fmul_rn(vb.y, m1));
        const uint32_t y2 = EncodeE2M1x2(__fmul_rn(va.z, m2), __fmul_rn(vb.z, m2));
        const uint32_t y3 = EncodeE2M1x2(__fmul_rn(va.w, m3), __fmul_rn(vb.w, m3));
        const int q = sr >> 3, sh = 8 * ((sr >> 1) & 3);
        if (sh == 0) {
          w0[q] = y0, w1[q] = y1, w2[q] = y2, w3[q] = y3;
        } else {
          w0[q] |= y0 << sh, w1[q] |= y1 << sh, w2[q] |= y2 << sh, w3[q] |= y3 << sh;
        }
      } else {
        // cvt packs the two rows of one column into 16 bits (row sr low).
        const uint32_t h0 = CvtFp8x2(__fmul_rn(va.x, m0), __fmul_rn(vb.x, m0), kE5M2);
        const uint32_t h1 = CvtFp8x2(__fmul_rn(va.y, m1), __fmul_rn(vb.y, m1), kE5M2);
        const uint32_t h2 = CvtFp8x2(__fmul_rn(va.z, m2), __fmul_rn(vb.z, m2), kE5M2);
        const uint32_t h3 = CvtFp8x2(__fmul_rn(va.w, m3), __fmul_rn(vb.w, m3), kE5M2);
        const int q = sr >> 2;
        if ((sr & 2) == 0) {
          w0[q] = h0, w1[q] = h1, w2[q] = h2, w3[q] = h3;
        } else {
          w0[q] = __byte_perm(w0[q], h0, 0x5410);
          w1[q] = __byte_perm(w1[q], h1, 0x5410);
          w2[q] = __byte_perm(w2[q], h2, 0x5410);
          w3[q] = __byte_perm(w3[q], h3, 0x5410);
        }
      }
    }
    if (!write) continue;
    uint8_t* out = out_base + c0 * pitch;
#pragma unroll
    for (int k = 0; k < 4; ++k, out += pitch) {
      if (c0 + k >= cols_valid) continue;
      const uint32_t* w = k == 0 ? w0 : k == 1 ? w1 : k == 2 ? w2 : w3;
      if constexpr (kFp4) {
        if (full) {
          *reinterpret_cast<uint2*>(out) = make_uint2(w[0], w[1]);
        } else {
          for (int qb = 0; qb < 8 && gi0 / 2 + qb < pitch; ++qb) {
            out[qb] = static_cast<uint8_t>(ByteOf(qb < 4 ? w[0] : w[1], qb & 3));
          }
        }
      } else {
        if (full) {
          *reinterpret_cast<uint4*>(out) = make_uint4(w[0], w[1], w[2], w[3]);
        } else {
          for (int qb = 0; qb < 16 && gi0 + qb < M; ++qb) {
            const uint32_t word = qb < 4 ? w[0] : qb < 8 ? w[1] : qb < 12 ? w[2] : w[3];
            out[qb] = static_cast<uint8_t>(ByteOf(word, qb & 3));
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Dispatch on the formats (once per tile)
// ---------------------------------------------------------------------------

template <int NT, bool kColMode>
__device__ __forceinline__ void RunRowMapped(int64_t M, int64_t K, const DirDesc& d, TileSmem& s,
                                             int tm, int tk, RowPassArgs a, float& amax) {
  const bool e5 = d.e5m2;
  switch (d.fmt) {
    case kKBf16:
      RowMappedPass<NT, kKBf16, false, kColMode>(M, K, d, s, tm, tk, a, amax);
      break;
    case kKFp32:
      RowMappedPass<NT, kKFp32, false, kColMode>(M, K, d, s, tm, tk, a, amax);
      break;
    case kKMxfp8:
      if (e5) {
        RowMappedPass<NT, kKMxfp8, true, kColMode>(M, K, d, s, tm, tk, a, amax);
      } else {
        RowMappedPass<NT, kKMxfp8, false, kColMode>(M, K, d, s, tm, tk, a, amax);
      }
      break;
    default:
      if constexpr (!kColMode) {
        switch (d.fmt) {
          case kKNvfp4:
            RowMappedPass<NT, kKNvfp4, false, false>(M, K, d, s, tm, tk, a, amax);
            break;
          case kKBlock1d:
            if (e5) {
              RowMappedPass<NT, kKBlock1d, true, false>(M, K, d, s, tm, tk, a, amax);
            } else {
              RowMappedPass<NT, kKBlock1d, false, false>(M, K, d, s, tm, tk, a, amax);
            }
            break;
          case kKBlock2d:
            if (e5) {
              RowMappedPass<NT, kKBlock2d, true, false>(M, K, d, s, tm, tk, a, amax);
            } else {
              RowMappedPass<NT, kKBlock2d, false, false>(M, K, d, s, tm, tk, a, amax);
            }
            break;
          case kKFp8Tensor:
            if (e5) {
              RowMappedPass<NT, kKFp8Tensor, true, false>(M, K, d, s, tm, tk, a, amax);
            } else {
              RowMappedPass<NT, kKFp8Tensor, false, false>(M, K, d, s, tm, tk, a, amax);
            }
            break;
          default:
            break;
        }
      }
      break;
  }
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
  // Each pass copies the descriptor fields it needs into registers before
  // its loops (a read through this reference could alias the global stores
  // and would be repeated after each of them).
  const TensorDesc& t = batch.t[lo];
  const int64_t M = t.rows, K = t.cols;
  const int64_t local = tile - t.tile_begin;
  const int tm = static_cast<int>(local / t.tiles_k);
  const int tk = static_cast<int>(local - int64_t{tm} * t.tiles_k);
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
    LoadTileAdam<NT>(t.opt, t.src_vec, M, K, batch.adam, s, i0, j0);
  } else if (t.src_vec && !t.src_bf16) {
    LoadTileFp32Vec<NT>(static_cast<const float*>(t.src), M, K, s, i0, j0);
  } else if (t.src_vec) {
    LoadTileBf16Vec<NT>(static_cast<const uint16_t*>(t.src), M, K, s, i0, j0);
  } else {
    LoadTileScalar<NT>(t.src, t.src_bf16, M, K, s, i0, j0);
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
  const bool deq = t.col_from_row;

  // Stage 2.
  const BlockCfg rcfg = row_needed ? RowBlockCfg(row) : BlockCfg{};
  const BlockCfg ccfg = col.fmt != kKNone ? ColBlockCfg(col) : BlockCfg{};
  const bool col_same_2d =
      ccfg.bm != 0 && ccfg.bk > 1 && ccfg.bm == rcfg.bm && ccfg.bk == rcfg.bk && !deq;
  const uint32_t* col2d = col_same_2d ? s.amax2d_row : s.amax2d_col;
  bool need_sync = false;
  if (rcfg.bm != 0) {
    RunBlockAmax<NT>(s, rbf, rcfg, s.amax2d_row);
    need_sync = true;
  }
  // Per-column block amaxes ride along the rowwise pass when it reads the
  // same values; otherwise a pre-pass computes them.
  const bool fuse_col_amax = ccfg.bm != 0 && ccfg.bk == 1 && !deq && row_needed;
  if (ccfg.bm != 0 && !deq && !col_same_2d && !fuse_col_amax) {
    RunBlockAmax<NT>(s, rbf, ccfg, ccfg.bk > 1 ? s.amax2d_col : s.colbuf);
    need_sync = true;
  }
  if (need_sync) __syncthreads();

  // Stage 3.
  float row_amax = 0.f, col_amax = 0.f;
  bool tile_is_source = false;  // the tile holds the columnwise input, already rounded
  if (row_needed) {
    RowPassArgs a;
    a.round_bf16 = rbf;
    a.deq_writeback = deq;
    a.writeback = col_needed && (deq || rbf);
    a.source_bf16 = t.source_bf16;
    if (fuse_col_amax) {
      a.col_amax = s.colbuf;
      a.col_bm_log2 = ccfg.bm == 16 ? 4 : ccfg.bm == 32 ? 5 : 7;
    }
    RunRowMapped<NT, false>(M, K, row, s, tm, tk, a, row_amax);
    if (a.writeback) tile_is_source = true;
    if (a.writeback || fuse_col_amax) __syncthreads();
  }

  // Stages 4-5.
  if (col_needed) {
    const bool crbf = rbf && !tile_is_source;
    if (col.fmt == kKNone) {
      col_amax = TileAmax<NT>(s, crbf);
    } else {
      if (ccfg.bm != 0 && deq) {
        RunBlockAmax<NT>(s, crbf, ccfg, ccfg.bk > 1 ? s.amax2d_col : s.colbuf);
        __syncthreads();
      }
      if (col.fmt != kKFp8Tensor && col.fmt != kKBf16 && col.fmt != kKFp32) {
        ColScaleStep<NT>(M, K, col, s, col2d, tm, tk);
        __syncthreads();
      }
      if (IsTransposed(col.fmt)) {
        if (col.fmt == kKNvfp4) {
          ColTransposedPass<NT, true, false>(M, K, col, s, tm, tk, crbf, col_amax);
        } else if (col.e5m2) {
          ColTransposedPass<NT, false, true>(M, K, col, s, tm, tk, crbf, col_amax);
        } else {
          ColTransposedPass<NT, false, false>(M, K, col, s, tm, tk, crbf, col_amax);
        }
      } else {
        RowPassArgs a;
        a.round_bf16 = crbf;
        RunRowMapped<NT, true>(M, K, col, s, tm, tk, a, col_amax);
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

// The tensors the v4 kernel (quantize_v4.cu) was measured faster on
// (docs/BENCHMARKS.md, GPU kernels): NVFP4 16x16 in both directions, MXFP8
// 1x32 + 32x1 with one element format, FP8 1x128 in both directions; never
// with columnwise_source = rowwise_dequantized. Both kernels are byte-exact
// for every format, so this choice only affects speed.
bool UseV4Pattern(const TensorDesc& t) {
  const DirDesc& r = t.row;
  const DirDesc& c = t.col;
  if (t.col_from_row) return false;
  if (r.fmt == kKNvfp4 && c.fmt == kKNvfp4) return r.two_d && c.two_d;
  if (r.fmt == kKMxfp8 && c.fmt == kKMxfp8) return !r.two_d && !c.two_d && r.e5m2 == c.e5m2;
  return r.fmt == kKBlock1d && c.fmt == kKBlock1d;
}

bool UseV4Kernel(const QuantizeBatch& batch) {
  for (int i = 0; i < batch.num; ++i) {
    if (!UseV4Pattern(batch.t[i])) return false;
  }
  return batch.num > 0;
}

}  // namespace

cudaError_t LaunchQuantizeTilesV4(const QuantizeBatch& batch, cudaStream_t stream);

cudaError_t LaunchQuantizeTiles(const QuantizeBatch& batch, int variant, cudaStream_t stream) {
  if (batch.total_tiles <= 0) return cudaSuccess;
  switch (variant) {
    case kVariant512:
      return LaunchVariant<512, 2>(batch, false, stream);
    case kVariantPersistent:
      return LaunchVariant<256, 3>(batch, true, stream);
    default:
      if (UseV4Kernel(batch)) return LaunchQuantizeTilesV4(batch, stream);
      return LaunchVariant<256, 3>(batch, false, stream);
  }
}

}  // namespace detail
}  // namespace gpu
}  // namespace paramd
