// File: kernels/cuda/quantize_row_pass.cuh
//
// Stage 3, the row-mapped pass: rowwise of every format, and the columnwise
// copies that keep the [M][K] order (MXFP8, identity).
// INTERNAL to the quantize tile kernel (quantize.cu, which includes it once;
// see its head comment for the passes). Device code only, in an anonymous
// namespace (one copy per translation unit).
#ifndef PARAMD_KERNELS_CUDA_QUANTIZE_ROW_PASS_CUH_
#define PARAMD_KERNELS_CUDA_QUANTIZE_ROW_PASS_CUH_

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/quantize_pattern.cuh"
#include "kernels/cuda/quantize_tile.cuh"

namespace paramd {
namespace gpu {
namespace detail {
namespace {

// ---------------------------------------------------------------------------
// Stage 3: row-mapped pass (rowwise of every format; columnwise MXFP8 and
// identity, which keep the [M][K] order)
// ---------------------------------------------------------------------------

template <int NT, int kPat>
__device__ __forceinline__ void ColScaleStep(int64_t M, int64_t K, const DirDesc& d, TileSmem& s,
                                             const uint32_t* amax2d, int tm, int tk,
                                             bool need_mult = true);

struct RowPassArgs {
  bool round_bf16 = false;     // tile values still need rounding to the source dtype
  bool writeback = false;      // write values for the columnwise pass back to the tile
  bool deq_writeback = false;  // ... the dequantized values (rowwise_dequantized), else the source
  bool source_bf16 = false;    // D2: round the dequantized values to BF16
  // Fused columnwise block amax (per column, row blocks of col_bm rows), max-
  // updated into col_amax[rb * 128 + col]; null: none.
  uint32_t* col_amax = nullptr;
  int col_bm_log2 = 0;  // row block of 16, 32 or 128 rows
  // MXFP8 rowwise only: the 32x1 columnwise copy (same element format, [M][K])
  // encoded in the same loop (v4); null: none.
  const DirDesc* mx_col = nullptr;
};

// MXFP8 1x32 rowwise + 32x1 columnwise (same element format) of a full tile
// with both directions written: every flag of the general loop is a
// compile-time constant here and the 16 rows of each warp are unrolled, so
// shared addresses, shuffle sources and block indices are constants (the
// general loop spent ~68 instructions per row on them and on run-time flag
// branches; ncu source counters, 2026-12-01).
// Pre-step: lane l of the 8 lanes of block b holds, for its warp's rows
// w + 8i, the max over its 4 columns; GroupRowMax8 leaves in lane l the
// block amax of row slot l (and 8 + l), the slots the row loop fetches by
// shuffle.
template <int NT, bool kE5M2, bool kRound>
__device__ __forceinline__ void Mxfp8FullTile(int64_t M, int64_t K, const DirDesc& d,
                                              const DirDesc& cd, TileSmem& s, int tm, int tk,
                                              float& amax_acc) {
  constexpr int kWarps = NT / 32;
  static_assert(kWarps == 8, "rows w + 8i, i < 16");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t i0 = int64_t{tm} * kTile, j0 = int64_t{tk} * kTile;
  const float rcp_max = Fbits(kE5M2 ? kRcp57344Bits : kRcp448Bits);
  const float4* trow = &s.tile[warp * kChunks];  // row w; row w + 8i is trow + 8i * kChunks
  // Pre-step: row-block maxima (by slot) and column-block maxima.
  float mine[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float x[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int i = 8 * h + k;
      const float4 v = trow[i * kWarps * kChunks + (lane ^ ((i >> 1) & 7))];
      x[k] = Max4Abs(v.x, v.y, v.z, v.w);
    }
    mine[h] = GroupRowMax8(x);
  }
  // Column-block maxima: slots 4c .. 4c+3 are this warp's rows of 32-row block c.
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    float cm0 = 0.0f, cm1 = 0.0f, cm2 = 0.0f, cm3 = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = 4 * c + k;
      const float4 v = trow[i * kWarps * kChunks + (lane ^ ((i >> 1) & 7))];
      cm0 = AbsMax(cm0, v.x), cm1 = AbsMax(cm1, v.y), cm2 = AbsMax(cm2, v.z),
      cm3 = AbsMax(cm3, v.w);
    }
    if (kRound) {  // monotone: round the block max once
      RoundPairBf16(cm0, cm1);
      RoundPairBf16(cm2, cm3);
    }
    uint32_t* dst = s.colbuf + c * kTile + 4 * lane;
    atomicMax(dst + 0, __float_as_uint(cm0));
    atomicMax(dst + 1, __float_as_uint(cm1));
    atomicMax(dst + 2, __float_as_uint(cm2));
    atomicMax(dst + 3, __float_as_uint(cm3));
  }
  // A block of NaNs only has amax 0 (§0); fmaxf of NaNs alone stays NaN.
  float mine0 = fmaxf(mine[0], 0.0f), mine1 = fmaxf(mine[1], 0.0f);
  if (kRound) RoundPairBf16(mine0, mine1);
  amax_acc = fmaxf(amax_acc, fmaxf(mine0, mine1));
  const uint32_t e0 = E8M0FromScaledAmax(__fmul_rn(mine0, rcp_max));
  const uint32_t e1 = E8M0FromScaledAmax(__fmul_rn(mine1, rcp_max));
  const float m0 = E8M0Reciprocal(e0), m1 = E8M0Reciprocal(e1);
  {
    // Scale bytes [i][b] of rows w + 8(8j + (lane & 7)), block tk*4 + lane/8.
    // Full tile: every row and block is inside [M, K] and the scale buffer.
    const int64_t scale_cols = d.scale_cols;
    uint8_t* srow = static_cast<uint8_t*>(d.scales) +
                    (i0 + warp + kWarps * (lane & 7)) * scale_cols + int64_t{tk} * (kTile / 32) +
                    (lane >> 3);
    srow[0] = static_cast<uint8_t>(e0);
    srow[64 * scale_cols] = static_cast<uint8_t>(e1);
  }
  __syncthreads();
  ColScaleStep<NT, kPatMxfp8>(M, K, cd, s, s.amax2d_col, tm, tk, true);
  __syncthreads();

  const int64_t pitch = K;
  uint8_t* out = static_cast<uint8_t*>(d.data) + (i0 + warp) * pitch + j0 + 4 * lane;
  uint8_t* cout = static_cast<uint8_t*>(cd.data) + (i0 + warp) * pitch + j0 + 4 * lane;
  const int64_t out_step = kWarps * pitch;
  const float4* cmul = reinterpret_cast<const float4*>(s.colbuf) + lane;
#pragma unroll
  for (int i = 0; i < 16; ++i, out += out_step, cout += out_step) {
    float4 v = trow[i * kWarps * kChunks + (lane ^ ((i >> 1) & 7))];
    if (kRound) {
      RoundPairBf16(v.x, v.y);
      RoundPairBf16(v.z, v.w);
    }
    const float m = __shfl_sync(0xFFFFFFFFu, i < 8 ? m0 : m1, (lane & ~7) | (i & 7));
    const uint32_t qb =
        CvtFp8x4(__fmul_rn(v.x, m), __fmul_rn(v.y, m), __fmul_rn(v.z, m), __fmul_rn(v.w, m), kE5M2);
    *reinterpret_cast<uint32_t*>(out) = qb;
    const float4 mm = cmul[(i >> 2) * kChunks];
    const uint32_t qc = CvtFp8x4(__fmul_rn(v.x, mm.x), __fmul_rn(v.y, mm.y), __fmul_rn(v.z, mm.z),
                                 __fmul_rn(v.w, mm.w), kE5M2);
    *reinterpret_cast<uint32_t*>(cout) = qc;
  }
}

// kColMode: the columnwise copy of MXFP8 / identity (multipliers from colbuf,
// no scale writes, no writeback). Addresses advance by pointer increments; the
// per-row bounds are 32-bit compares against the tile's valid extent.
template <int NT, int F, bool kE5M2, bool kColMode>
__device__ __forceinline__ void RowMappedPass(int64_t M, int64_t K, const DirDesc& d, TileSmem& s,
                                              int tm, int tk, RowPassArgs a, float& amax_acc) {
  constexpr int kWarps = NT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t i0 = int64_t{tm} * kTile, j0 = int64_t{tk} * kTile;
  const int64_t gj = j0 + 4 * lane;
  const int nvalid_col = gj >= K ? 0 : (K - gj >= 4 ? 4 : static_cast<int>(K - gj));
  const int rows_valid = M - i0 < kTile ? static_cast<int>(M - i0) : kTile;
  const bool write = d.write;
  const bool vec_d = d.vec;
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
  // 1x128: the row scales once per row, not in all 32 lanes. Lanes 2i and
  // 2i + 1 of warp w hold the multiplier and scale_inv of row w + kWarps*i
  // (WarpRowMax16) and lane 2i writes that row's scale entry; the row loop
  // fetches them by a shuffle.
  // MXFP8 rowwise (v4), likewise: the warp's 16 rows x 4 blocks = 64 E8M0
  // scales, 2 per lane: row w + kWarps*(8j + (lane&7)), block lane>>3 in slot
  // j; that lane also writes the scale byte. The tile amax comes from here too.
  uint32_t mx_e0 = 0u, mx_e1 = 0u;
  float mx_m0 = 1.0f, mx_m1 = 1.0f;
  if constexpr (F == kKMxfp8 && !kColMode && !kE5M2) {
    // Full tiles of MXFP8 E4M3 (the weight format) rowwise + 32x1 columnwise,
    // both written: the unrolled path. (Unrolled row-only variants for the
    // hybrid pairs made the MXFP8 kernels spill: ~1 KB of spill loads.)
    const DirDesc* cd = a.mx_col;
    if (cd != nullptr && write && vec_d && cd->write && cd->vec && rows_valid == kTile &&
        K - j0 >= kTile && !deq_wb && !writeback && col_amax == nullptr) {
      if (round_bf16) {
        Mxfp8FullTile<NT, false, true>(M, K, d, *cd, s, tm, tk, amax_acc);
      } else {
        Mxfp8FullTile<NT, false, false>(M, K, d, *cd, s, tm, tk, amax_acc);
      }
      return;
    }
  }
  if constexpr (F == kKMxfp8 && !kColMode) {
    constexpr int kRowsPerWarp = kTile / kWarps;
    constexpr int kRowsPerColBlock = 32 / kWarps;  // this warp's rows in each 32-row block
    const bool fuse_col = a.mx_col != nullptr;     // (then two_d is false)
    float mine0 = 0.0f, mine1 = 0.0f;
    float cm0 = 0.0f, cm1 = 0.0f, cm2 = 0.0f, cm3 = 0.0f;  // column amax of the 32-row block
#pragma unroll 2
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp + kWarps * i;
      float bam;
      if (two_d) {
        bam = Fbits(s.amax2d_row[(r >> 5) * 4 + (lane >> 3)]);  // already rounded
      } else {
        const float4 v = s.tile[Phys(r, lane)];
        bam = Max4Abs(v.x, v.y, v.z, v.w);  // raw values: rounded once below
        bam = fmaxf(bam, __shfl_xor_sync(0xFFFFFFFFu, bam, 1));
        bam = fmaxf(bam, __shfl_xor_sync(0xFFFFFFFFu, bam, 2));
        bam = fmaxf(bam, __shfl_xor_sync(0xFFFFFFFFu, bam, 4));
        if (fuse_col) {
          cm0 = AbsMax(cm0, v.x), cm1 = AbsMax(cm1, v.y), cm2 = AbsMax(cm2, v.z),
          cm3 = AbsMax(cm3, v.w);
          if (i % kRowsPerColBlock == kRowsPerColBlock - 1) {
            if (round_bf16) {  // monotone: round the block max once
              RoundPairBf16(cm0, cm1);
              RoundPairBf16(cm2, cm3);
            }
            uint32_t* dst = s.colbuf + (r >> 5) * kTile + 4 * lane;
            atomicMax(dst + 0, __float_as_uint(cm0));
            atomicMax(dst + 1, __float_as_uint(cm1));
            atomicMax(dst + 2, __float_as_uint(cm2));
            atomicMax(dst + 3, __float_as_uint(cm3));
            cm0 = cm1 = cm2 = cm3 = 0.0f;
          }
        }
      }
      if ((lane & 7) == (i & 7)) {
        if (i < 8) {
          mine0 = bam;
        } else {
          mine1 = bam;
        }
      }
    }
    // A block of NaNs only has amax 0 (§0); fmaxf of NaNs alone stays NaN.
    mine0 = fmaxf(mine0, 0.0f), mine1 = fmaxf(mine1, 0.0f);
    if (round_bf16) RoundPairBf16(mine0, mine1);  // monotone; idempotent on the 2D values
    amax_acc = fmaxf(amax_acc, fmaxf(mine0, mine1));
    mx_e0 = E8M0FromScaledAmax(__fmul_rn(mine0, rcp_max));
    mx_e1 = E8M0FromScaledAmax(__fmul_rn(mine1, rcp_max));
    mx_m0 = E8M0Reciprocal(mx_e0);
    mx_m1 = E8M0Reciprocal(mx_e1);
    if (write && sblock_in) {
#pragma unroll
      for (int j = 0; j < kRowsPerWarp / 8; ++j) {
        const int r = warp + kWarps * (8 * j + (lane & 7));
        if (r < scale_rows_valid) {
          const bool valid = r < rows_valid && sblock_ok;
          static_cast<uint8_t*>(d.scales)[(i0 + r) * scale_cols + sblock] =
              static_cast<uint8_t>(valid ? (j == 0 ? mx_e0 : mx_e1) : 0u);
        }
      }
    }
    if (fuse_col) {  // uniform over the block
      __syncthreads();
      ColScaleStep<NT, kPatMxfp8>(M, K, *a.mx_col, s, s.amax2d_col, tm, tk, true);
      __syncthreads();
    }
  }
  uint8_t* cout = nullptr;  // fused MXFP8 columnwise data, same [M][K] addressing as `out`
  bool cwrite = false, cvec_d = false;
  if constexpr (F == kKMxfp8 && !kColMode) {
    if (a.mx_col != nullptr) {
      cout = static_cast<uint8_t*>(a.mx_col->data) + (i0 + warp) * pitch + col_off;
      cwrite = a.mx_col->write;
      cvec_d = a.mx_col->vec;
    }
  }
  float b1_m = 1.0f, b1_q = 1.0f;
  if constexpr (F == kKBlock1d && !kColMode) {
    constexpr int kRowsPerWarp = kTile / kWarps;
    static_assert(kRowsPerWarp == 16, "WarpRowMax16: 16 rows per warp");
    float x[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      // Row w + kWarps*i: (r >> 4) & 7 = (i >> 1) & 7, a constant swizzle.
      const float4 v = s.tile[(warp + kWarps * i) * kChunks + (lane ^ ((i >> 1) & 7))];
      x[i] = Max4Abs(v.x, v.y, v.z, v.w);  // raw values: rounded once below
    }
    // Lanes 2i and 2i + 1 now hold row slot i (16 shuffles per warp, not 80).
    float mine = WarpRowMax16(x);
    mine = fmaxf(mine, 0.0f);  // a row of NaNs only has amax 0 (§0)
    if (round_bf16) {          // RNE to BF16 is monotone: round(max|x|) = max|round(x)|
      float unused = 0.0f;
      RoundPairBf16(mine, unused);
    }
    b1_m = ComputeScale(mine, Fp8Max(kE5M2), pow2, eps, inf_value);
    b1_q = __frcp_rn(b1_m);
    // Layout [ceil(K/128)][roundup(M,4)], entry [kb][i].
    if (write && (lane & 1) == 0) {
      const int slot = lane >> 1;
      const int r = warp + kWarps * slot;
      if (r < scale_rows_valid) {
        *reinterpret_cast<float*>(srow + int64_t{slot} * srow_step) = r < rows_valid ? b1_q : 0.0f;
      }
    }
  }

  // The row loop, once for full tiles (every row and column inside [M, K],
  // aligned vector stores: no bounds in the loop) and once for the rest. Run
  // 8's SASS of the general loop recomputed the 64-bit row / column bounds in
  // every row (rematerialised at the 80-register cap).
  const bool full_tile =
      rows_valid == kTile && K - j0 >= kTile && (!write || vec_d) && (!cwrite || cvec_d);
  auto row_loop = [&](auto full_tag) {
    constexpr bool kFull = decltype(full_tag)::value;
    const bool vec = kFull || vec_d;
    [[maybe_unused]] const bool cvec = kFull || cvec_d;
#pragma unroll 2
    for (int r = warp; r < kTile; r += kWarps, out += out_step, srow += srow_step) {
      const bool row_ok = kFull || r < rows_valid;
      const int n = kFull ? 4 : (row_ok ? nvalid_col : 0);
      float x0, x1, x2, x3;
      ReadRow4(s, r, lane, round_bf16, x0, x1, x2, x3);
      const float lmax = Max4Abs(x0, x1, x2, x3);
      if constexpr (!(F == kKMxfp8 && !kColMode)) {
        amax_acc = fmaxf(amax_acc, lmax);
      }
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
      [[maybe_unused]] float d0 = x0, d1 = x1, d2 = x2, d3 = x3;  // dequantized values
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
          bam = fmaxf(bam, 0.0f);  // a block of NaNs only has amax 0 (§0)
        }
        const uint32_t sd = CvtFp8(__fmul_rn(bam, nv_factor), false);
        const float sdv = DecodeFp8(sd, false);
        const float enc = fminf(__frcp_rn(__fmul_rn(sdv, nv_sdec)), Fbits(kFltMaxBits));
        const uint32_t pairs = E2M1PairBytes(EncodeE2M1x4Bytes(
            __fmul_rn(x0, enc), __fmul_rn(x1, enc), __fmul_rn(x2, enc), __fmul_rn(x3, enc)));
        const uint32_t byte0 = pairs & 0xFFu, byte1 = (pairs >> 16) & 0xFFu;
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
      } else {                            // FP8 element formats: per-tensor, 128x128, 1x128, MXFP8
        float m0, m1, m2, m3;             // multipliers
        [[maybe_unused]] float q = 1.0f;  // dequantization factor (one per lane here)
        if constexpr (F == kKMxfp8 && kColMode) {
          const float4 mm = reinterpret_cast<const float4*>(s.colbuf)[(r >> 5) * kChunks + lane];
          m0 = mm.x, m1 = mm.y, m2 = mm.z, m3 = mm.w;
        } else if constexpr (F == kKMxfp8) {
          const int i = r / kWarps;  // this row's slot (see above)
          const int src = (lane & ~7) | (i & 7);
          m0 = m1 = m2 = m3 = __shfl_sync(0xFFFFFFFFu, i < 8 ? mx_m0 : mx_m1, src);
          // 2^(e-127) = rcp(2^(127-e)) exactly for every e (NaN for e = 255 either way).
          if (deq_wb) q = __frcp_rn(m0);
          if (cout != nullptr) {  // the columnwise copy from the same registers
            const float4 mm = reinterpret_cast<const float4*>(s.colbuf)[(r >> 5) * kChunks + lane];
            const uint32_t qc = CvtFp8x4(__fmul_rn(x0, mm.x), __fmul_rn(x1, mm.y),
                                         __fmul_rn(x2, mm.z), __fmul_rn(x3, mm.w), kE5M2);
            if (cwrite && n > 0) Store4Bytes(cout, qc, n, cvec);
            cout += out_step;
          }
        } else if constexpr (F == kKBlock1d) {
          const int i = r / kWarps;  // this row's slot (see above)
          m0 = m1 = m2 = m3 = __shfl_sync(0xFFFFFFFFu, b1_m, 2 * i);
          if (deq_wb) q = __shfl_sync(0xFFFFFFFFu, b1_q, 2 * i);
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
  };
  // (NVFP4 1x16 keeps one loop: the copy cost its kernel a spill.)
  if (F != kKNvfp4 && full_tile) {
    if constexpr (F != kKNvfp4) row_loop(std::true_type{});
  } else {
    row_loop(std::false_type{});
  }
}

}  // namespace
}  // namespace detail
}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_QUANTIZE_ROW_PASS_CUH_
