// The quantize tile kernel: every format and direction of FORMATS.md, both
// directions of a tensor from one read of the input (docs/GPU_NOTES.md: v4,
// runs 7-8; the v3.3 kernel it replaced is in git history).
//
// Each block owns one 128x128 tile of one tensor (tiles of all tensors of a
// batch are numbered consecutively; a binary search finds the tensor). The
// tile is staged in shared memory as float (cp.async for aligned FP32, or
// converted BF16, or guarded scalar loads at ragged edges; elements outside
// [M, K] are 0). 128 is a multiple of every block size (16, 32, 128), so
// every block and every padded scale entry belongs to exactly one tile.
// Shared memory: row r holds 32 float4 chunks, chunk ch stored at position
// ch ^ ((r >> 4) & 7), so row reads and the transposed reads are both free of
// bank conflicts (quantize_tile.cuh).
//
// Passes per tile:
//   1. load (optionally the fused AdamW update: p, m, v written back);
//   2. block-amax pre-passes (2D tiles, columnwise blocks) into shared memory;
//   3. rowwise pass: warp per row, lane per 4 columns; writes data + scales;
//      writes back the source-rounded or (rowwise_dequantized) dequantized
//      values for the columnwise pass. Per format:
//        * NVFP4 16x16 both ways with one global amax: encoded once, the
//          columnwise copy by nibble transpose (Nvfp4TwoDirPass; each warp
//          takes the block amaxes of its own 16 rows, no pre-pass); E2M1 by
//          one FFMA rounding, four codes packed at a time (EncodeE2M1x4Bytes);
//        * MXFP8: row scales once per (row, block) in a pre-step; the 32x1
//          columnwise copy encoded in the same loop;
//        * 1x128: row scales once per row;
//   4. columnwise scale step: one multiplier per (row block, column);
//   5. columnwise pass: transposed layouts are written 16 rows x 4 columns
//      per thread; MXFP8 and identity columnwise keep [M][K] order;
//   6. per-direction amax: block reduction, one atomic per tile.
//
// The kernel is instantiated per format pattern (KernelPattern below): the
// launcher runs the narrowest instantiation that covers the whole batch, so
// each format's hot loops get the register allocation of a kernel that
// contains only them. Descriptor fields are copied into registers once per
// pass, and every pass is specialised at compile time on its format.
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "kernels/cuda/batch_search.cuh"
#include "kernels/cuda/codecs.cuh"
#include "kernels/cuda/optimizer_math.cuh"
#include "kernels/cuda/quantize_launch.h"
#include "kernels/cuda/quantize_tile.cuh"

namespace paramd {
namespace gpu {
namespace detail {
namespace {

// Which formats one instantiation of the kernel contains. The host picks the
// narrowest pattern that covers every tensor of a batch (PatternOf below):
// each instantiation is then compiled with only its own passes, so the hot
// loops of one format do not share a register allocation with the others'
// (at the 80-register cap, the all-format kernel ran FP8 per-tensor row + col
// 5 % slower than a kernel without the MXFP8 / NVFP4 code; GPU_NOTES run 8).
enum KernelPattern : int {
  kPatAll = 0,    // every format, the fused AdamW load
  kPatPlain = 1,  // identity BF16 / FP32, per-tensor FP8, FP8 128x128
  kPatNvfp4 = 2,  // NVFP4 only
  kPatMxfp8 = 3,  // MXFP8 only
  kPatBlock1d = 4,  // FP8 1x128 only
  kPatPlainMx = 5,  // kPatPlain + MXFP8 (hybrid FP8 / MXFP8 tensors)
  kPatPlainNv = 6,  // kPatPlain + NVFP4 (hybrid FP8 / NVFP4 tensors)
};

// Rows of p, m, v, g in flight per thread in the one-pass step's load.
constexpr int kAdamBatch = 2;
// Steps of kAdamBatch rows per warp that the one-pass load keeps prefetching
// into L2 ahead of its loads (LoadTileAdam); the benchmark variants of
// LaunchQuantizeTiles measure the others.
constexpr int kAdamPrefetch = 1;
// The kernel's kVar template argument: the one-pass load's prefetch
// distance in the low bits, and benchmark-only switches.
constexpr int kVarPrefetchMask = 15;
constexpr int kVarStream = 16;      // LoadTileAdam with evict-first loads and stores
constexpr int kVarScalarE2M1 = 32;  // Nvfp4TwoDirPass with the per-element E2M1 encoder

template <int kPat>
__host__ __device__ constexpr bool Has(int fmt) {
  if (kPat == kPatAll || fmt == kKNone) return true;
  const bool plain = fmt == kKBf16 || fmt == kKFp32 || fmt == kKFp8Tensor || fmt == kKBlock2d;
  if (kPat == kPatPlain) return plain;
  if (kPat == kPatPlainMx) return plain || fmt == kKMxfp8;
  if (kPat == kPatPlainNv) return plain || fmt == kKNvfp4;
  if (kPat == kPatNvfp4) return fmt == kKNvfp4;
  if (kPat == kPatMxfp8) return fmt == kKMxfp8;
  return fmt == kKBlock1d;
}

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
      cm0 = AbsMax(cm0, v.x), cm1 = AbsMax(cm1, v.y), cm2 = AbsMax(cm2, v.z), cm3 = AbsMax(cm3, v.w);
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
    uint8_t* srow = static_cast<uint8_t*>(d.scales) + (i0 + warp + kWarps * (lane & 7)) * scale_cols +
                    int64_t{tk} * (kTile / 32) + (lane >> 3);
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
    const uint32_t qb = CvtFp8x4(__fmul_rn(v.x, m), __fmul_rn(v.y, m), __fmul_rn(v.z, m),
                                 __fmul_rn(v.w, m), kE5M2);
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
          cm0 = AbsMax(cm0, v.x), cm1 = AbsMax(cm1, v.y), cm2 = AbsMax(cm2, v.z), cm3 = AbsMax(cm3, v.w);
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
    if (round_bf16) {  // RNE to BF16 is monotone: round(max|x|) = max|round(x)|
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
  const bool full_tile = rows_valid == kTile && K - j0 >= kTile && (!write || vec_d) &&
                         (!cwrite || cvec_d);
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
      } else {  // FP8 element formats: per-tensor, 128x128, 1x128, MXFP8
        float m0, m1, m2, m3;  // multipliers
        [[maybe_unused]] float q = 1.0f;        // dequantization factor (one per lane here)
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
            const uint32_t qc = CvtFp8x4(__fmul_rn(x0, mm.x), __fmul_rn(x1, mm.y), __fmul_rn(x2, mm.z),
                                         __fmul_rn(x3, mm.w), kE5M2);
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

// ---------------------------------------------------------------------------
// Stage 4: columnwise scales -> multipliers in colbuf
// ---------------------------------------------------------------------------

template <int NT, int kPat>
__device__ __forceinline__ void ColScaleStep(int64_t M, int64_t K, const DirDesc& d, TileSmem& s,
                                             const uint32_t* amax2d, int tm, int tk,
                                             bool need_mult) {
  const int64_t i0 = int64_t{tm} * kTile, j0 = int64_t{tk} * kTile;
  const bool e5m2 = d.e5m2, two_d = d.two_d, write = d.write;
  const int64_t scale_rows = d.scale_rows, scale_cols = d.scale_cols;
  switch (d.fmt) {
    case kKMxfp8: {
      if constexpr (Has<kPat>(kKMxfp8)) {
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
      }
      break;
    }
    case kKNvfp4: {
      if constexpr (Has<kPat>(kKNvfp4)) {
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
            if (need_mult) {  // uniform: false on the NVFP4 two-direction path (no colbuf use)
              const float enc =
                  fminf(__frcp_rn(__fmul_rn(DecodeFp8(sd, false), s_dec)), Fbits(kFltMaxBits));
              s.colbuf[rb * kTile + c] = __float_as_uint(enc);
            }
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
      }
      break;
    }
    case kKBlock1d: {
      if constexpr (Has<kPat>(kKBlock1d)) {
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
      }
      break;
    }
    case kKBlock2d: {
      if constexpr (Has<kPat>(kKBlock2d)) {
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
    [[maybe_unused]] uint32_t pq[4];  // NVFP4: one group of 4 row pairs
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
        // pq[j]: byte k = the byte of column c0+k for row pair 8q + 2j.
        const uint32_t lo = EncodeE2M1x4Bytes(__fmul_rn(va.x, m0), __fmul_rn(vb.x, m0),
                                              __fmul_rn(va.y, m1), __fmul_rn(vb.y, m1));
        const uint32_t hi = EncodeE2M1x4Bytes(__fmul_rn(va.z, m2), __fmul_rn(vb.z, m2),
                                              __fmul_rn(va.w, m3), __fmul_rn(vb.w, m3));
        const int j = (sr >> 1) & 3;
        pq[j] = E2M1Nibbles8(lo, hi);
        if (j == 3) {  // a 4x4 byte transpose: wk[q] = byte k of pq[0..3]
          const int q = sr >> 3;
          const uint32_t A = __byte_perm(pq[0], pq[1], 0x5140), B = __byte_perm(pq[2], pq[3], 0x5140);
          const uint32_t C = __byte_perm(pq[0], pq[1], 0x7362), D = __byte_perm(pq[2], pq[3], 0x7362);
          w0[q] = __byte_perm(A, B, 0x5410);
          w1[q] = __byte_perm(A, B, 0x7632);
          w2[q] = __byte_perm(C, D, 0x5410);
          w3[q] = __byte_perm(C, D, 0x7632);
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
// NVFP4 2D in both directions from one encode (v4)
// ---------------------------------------------------------------------------

// Nibbles of p = [n0 .. n7] (n0 lowest) -> [n0 n4 n1 n5 n2 n6 n3 n7]: byte k
// holds nibble k in its low half and nibble 4+k in its high half.
__device__ __forceinline__ uint32_t InterleaveNibbles(uint32_t p) {
  const uint32_t x = __byte_perm(p, 0u, 0x3120);  // [n0 n1 n4 n5 n2 n3 n6 n7]
  const uint32_t t = (x ^ (x >> 4)) & 0x00F000F0u;  // swap nibbles 1<->2 and 5<->6
  return x ^ t ^ (t << 4);
}

// With 16x16 tiles in both directions and the same global amax, the
// columnwise codes are the rowwise codes transposed (FORMATS.md §4). Row part:
// warp w encodes the row pairs t = w + kWarps*i (rows 2t, 2t+1), with the
// tile's 64 (sd, enc) pairs computed once per warp (lane L holds blocks L and
// L+32) and fetched by shuffles; it writes the rowwise data and scales and
// stashes the pair's 4x2 codes as one word into the tile rows 2t..2t+1 it has
// just consumed (word 256t + ((ch + t) & 31): conflict-free for both sides).
// Column part (after a barrier): the thread of chunk ch and rows 16a..16a+15
// gathers the 8 words, interleaves the nibbles and transposes the bytes.
// Returns through amax_acc the amax of the tile (both directions' input).
// kRowOnly: the rowwise part alone (no stash, no columnwise part; the tile
// keeps the source values): NVFP4 16x16 rowwise beside a columnwise copy of
// another format, or none.
template <int NT, bool kRowOnly = false, bool kScalarE2M1 = false>
__device__ __forceinline__ void Nvfp4TwoDirPass(int64_t M, int64_t K, const DirDesc& row,
                                                const DirDesc& col, TileSmem& s, int tm, int tk,
                                                bool round_bf16, float& amax_acc) {
  constexpr int kWarps = NT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t i0 = int64_t{tm} * kTile, j0 = int64_t{tk} * kTile;
  const int rows_valid = M - i0 < kTile ? static_cast<int>(M - i0) : kTile;

  // Warp w owns tile rows 16w .. 16w+15: one row of 16x16 blocks, lanes
  // 4b .. 4b+3 hold block b. Its block amaxes come from a first pass over
  // those rows (no pre-pass over the whole tile, no barrier); they go to
  // amax2d_row for the column scale step after this pass.
  const float nv_a = *row.global_amax;
  const float s_enc = Nvfp4GlobalEncodeScale(nv_a);
  const float s_dec = __frcp_rn(s_enc);
  const float factor = __fmul_rn(s_enc, Fbits(kRcp6Bits));
  static_assert(kWarps * 16 == kTile, "one 16-row block row per warp");
  float bam = 0.0f;  // starts at 0: NaN never wins (§0)
  float chk = 0.0f;  // stays 0 unless this lane's values hold a NaN or an Inf (x * 0, FMA pipe)
#pragma unroll 8
  for (int k = 0; k < 16; ++k) {
    const float4 v = s.tile[Phys(16 * warp + k, lane)];
    bam = fmaxf(bam, Max4Abs(v.x, v.y, v.z, v.w));
    chk = __fmaf_rn(__fadd_rn(__fadd_rn(v.x, v.y), __fadd_rn(v.z, v.w)), 0.0f, chk);
  }
  bam = fmaxf(bam, __shfl_xor_sync(0xFFFFFFFFu, bam, 1));
  bam = fmaxf(bam, __shfl_xor_sync(0xFFFFFFFFu, bam, 2));
  if (round_bf16) {  // RNE to BF16 is monotone: round(max|x|) = max|round(x)|
    float unused = 0.0f;
    RoundPairBf16(bam, unused);
  }
  if ((lane & 3) == 0) s.amax2d_row[8 * warp + (lane >> 2)] = __float_as_uint(bam);
  amax_acc = fmaxf(amax_acc, bam);  // the tile amax is the max of its block amaxes
  const uint32_t sd = CvtFp8(__fmul_rn(bam, factor), false);
  const float enc = fminf(__frcp_rn(__fmul_rn(DecodeFp8(sd, false), s_dec)), Fbits(kFltMaxBits));
  // Every y = x * enc of the warp's rows is finite with |y| <= bam * enc < 7
  // (the usual case: the E4M3 scale's rounding keeps it <= 6.4; a stale
  // global amax, tiny blocks, NaN or Inf break it): the encoder may skip its
  // clamp (E2M1MagnitudeWord), warp-uniformly.
  const bool no_clamp = __all_sync(0xFFFFFFFFu, chk == 0.0f && __fmul_rn(bam, enc) < 7.0f);

  // Rowwise outputs.
  const int64_t gj = j0 + 4 * lane;
  const int nvalid_col = gj >= K ? 0 : (K - gj >= 4 ? 4 : static_cast<int>(K - gj));
  const bool write = row.write;
  const bool vec = row.vec;
  const int64_t pitch = (K + 1) / 2;
  uint8_t* const out_base = static_cast<uint8_t*>(row.data) + i0 * pitch + gj / 2;
  const int64_t scale_cols = row.scale_cols;
  const int64_t sblock = int64_t{tk} * (kTile / 16) + (lane >> 2);
  const bool sblock_in = sblock < scale_cols;
  const bool sblock_ok = sblock * 16 < K;
  const int64_t sleft = row.scale_rows - i0;
  const int scale_rows_valid = sleft < kTile ? static_cast<int>(sleft) : kTile;
  uint8_t* const sbase = static_cast<uint8_t*>(row.scales) + i0 * scale_cols + sblock;
  uint32_t* const words = reinterpret_cast<uint32_t*>(s.tile);

  // Rowwise scale bytes: the lane's block value in the warp's 16 rows, 4 rows
  // per lane of the block's 4 lanes (out of the row loop: run 8's SASS spent
  // ~15 % of the loop on per-row scale-store addressing and bounds checks).
  if (write && sblock_in) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = 16 * warp + 4 * (lane & 3) + k;
      if (r < scale_rows_valid) {
        sbase[int64_t{r} * scale_cols] = static_cast<uint8_t>(r < rows_valid && sblock_ok ? sd : 0u);
      }
    }
  }
  // Data rows by pointer increment; full row pairs with 4 valid columns and
  // aligned stores take the short path.
  const bool lane_fast = write && vec && nvalid_col == 4;
  uint8_t* out = out_base + int64_t{16 * warp} * pitch;
  const int64_t pitch2 = 2 * pitch;

  auto row_pairs = [&](auto clamp_tag) {
    constexpr bool kClamp = decltype(clamp_tag)::value;
#pragma unroll 2
    for (int t = 8 * warp; t < 8 * warp + 8; ++t, out += pitch2) {
      const int r0 = 2 * t;
      float x0, x1, x2, x3, z0, z1, z2, z3;
      ReadRow4(s, r0, lane, round_bf16, x0, x1, x2, x3);
      ReadRow4(s, r0 + 1, lane, round_bf16, z0, z1, z2, z3);
      // c01: the 4 codes of row r0 in the low 16 bits, of r0 + 1 in the high.
      uint32_t c01;
      if constexpr (kScalarE2M1) {  // benchmark comparison: one element at a time
        c01 = EncodeE2M1x2Fast(__fmul_rn(x0, enc), __fmul_rn(x1, enc)) |
              (EncodeE2M1x2Fast(__fmul_rn(x2, enc), __fmul_rn(x3, enc)) << 8) |
              (EncodeE2M1x2Fast(__fmul_rn(z0, enc), __fmul_rn(z1, enc)) << 16) |
              (EncodeE2M1x2Fast(__fmul_rn(z2, enc), __fmul_rn(z3, enc)) << 24);
      } else {
        c01 = E2M1Nibbles8(EncodeE2M1x4Bytes<kClamp>(__fmul_rn(x0, enc), __fmul_rn(x1, enc),
                                                     __fmul_rn(x2, enc), __fmul_rn(x3, enc)),
                           EncodeE2M1x4Bytes<kClamp>(__fmul_rn(z0, enc), __fmul_rn(z1, enc),
                                                     __fmul_rn(z2, enc), __fmul_rn(z3, enc)));
      }
      const uint32_t c0 = c01 & 0xFFFFu, c1 = c01 >> 16;
      if (lane_fast && r0 + 1 < rows_valid) {
        *reinterpret_cast<uint16_t*>(out) = static_cast<uint16_t>(c0);
        *reinterpret_cast<uint16_t*>(out + pitch) = static_cast<uint16_t>(c1);
      } else if (write) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t c = h == 0 ? c0 : c1;
          const int n = r0 + h < rows_valid ? nvalid_col : 0;
          uint8_t* o = out + h * pitch;
          if (n > 0) {
            if (vec && n == 4) {
              *reinterpret_cast<uint16_t*>(o) = static_cast<uint16_t>(c);
            } else {
              o[0] = static_cast<uint8_t>(c);
              if (gj / 2 + 1 < pitch) o[1] = static_cast<uint8_t>(c >> 8);
            }
          }
        }
      }
      if constexpr (!kRowOnly) {
        __syncwarp();  // every lane has read rows r0, r0+1 before any lane overwrites them
        words[256 * t + ((lane + t) & 31)] = c01;
      }
    }
  };
  if (kScalarE2M1 || !no_clamp) {
    row_pairs(std::true_type{});
  } else {
    row_pairs(std::false_type{});
  }
  if constexpr (kRowOnly) return;
  __syncthreads();

  // Columnwise data [K][ceil(M/2)]: byte (j, p) = code(2p, j) | code(2p+1, j) << 4.
  const int a = lane & 7, b = lane >> 3;
  const int64_t gi0 = i0 + 16 * a;
  if (!col.write || gi0 >= M) return;
  const bool full = col.vec && gi0 + 16 <= M;
  const int cols_valid = K - j0 < kTile ? static_cast<int>(K - j0) : kTile;
  const int64_t cpitch = (M + 1) / 2;
  uint8_t* const cout_base = static_cast<uint8_t*>(col.data) + j0 * cpitch + gi0 / 2;
  for (int ch = warp * 4 + b; ch < kChunks; ch += NT / 8) {
    uint32_t q[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int t = 8 * a + k;
      q[k] = InterleaveNibbles(words[256 * t + ((ch + t) & 31)]);
    }
    // Byte k of q[p] is output byte p of column 4ch+k: a 4x4 byte transpose per half.
    uint32_t w[4][2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const uint32_t* qq = q + 4 * hf;
      const uint32_t A = __byte_perm(qq[0], qq[1], 0x5140), B = __byte_perm(qq[2], qq[3], 0x5140);
      const uint32_t C = __byte_perm(qq[0], qq[1], 0x7362), D = __byte_perm(qq[2], qq[3], 0x7362);
      w[0][hf] = __byte_perm(A, B, 0x5410);
      w[1][hf] = __byte_perm(A, B, 0x7632);
      w[2][hf] = __byte_perm(C, D, 0x5410);
      w[3][hf] = __byte_perm(C, D, 0x7632);
    }
    const int c0 = 4 * ch;
    uint8_t* out = cout_base + c0 * cpitch;
#pragma unroll
    for (int k = 0; k < 4; ++k, out += cpitch) {
      if (c0 + k >= cols_valid) continue;
      if (full) {
        *reinterpret_cast<uint2*>(out) = make_uint2(w[k][0], w[k][1]);
      } else {
        for (int qb = 0; qb < 8 && gi0 / 2 + qb < cpitch; ++qb) {
          out[qb] = static_cast<uint8_t>(ByteOf(qb < 4 ? w[k][0] : w[k][1], qb & 3));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Dispatch on the formats (once per tile)
// ---------------------------------------------------------------------------

// One row-mapped pass, specialised on the format (and on the element type for
// FP8 formats); formats outside the pattern are not compiled in.
template <int NT, int F, bool kColMode>
__device__ __forceinline__ void RunRowMappedF(int64_t M, int64_t K, const DirDesc& d, TileSmem& s,
                                              int tm, int tk, const RowPassArgs& a, float& amax) {
  if constexpr (F == kKMxfp8 || F == kKBlock1d || F == kKBlock2d || F == kKFp8Tensor) {
    if (d.e5m2) {
      RowMappedPass<NT, F, true, kColMode>(M, K, d, s, tm, tk, a, amax);
      return;
    }
  }
  RowMappedPass<NT, F, false, kColMode>(M, K, d, s, tm, tk, a, amax);
}

template <int NT, int kPat, bool kColMode>
__device__ __forceinline__ void RunRowMapped(int64_t M, int64_t K, const DirDesc& d, TileSmem& s,
                                             int tm, int tk, RowPassArgs a, float& amax) {
  // kColMode (the columnwise copy in [M][K] order) exists for identity and MXFP8 only.
  switch (d.fmt) {
    case kKBf16:
      if constexpr (Has<kPat>(kKBf16)) RunRowMappedF<NT, kKBf16, kColMode>(M, K, d, s, tm, tk, a, amax);
      break;
    case kKFp32:
      if constexpr (Has<kPat>(kKFp32)) RunRowMappedF<NT, kKFp32, kColMode>(M, K, d, s, tm, tk, a, amax);
      break;
    case kKMxfp8:
      if constexpr (Has<kPat>(kKMxfp8)) RunRowMappedF<NT, kKMxfp8, kColMode>(M, K, d, s, tm, tk, a, amax);
      break;
    case kKNvfp4:
      if constexpr (Has<kPat>(kKNvfp4) && !kColMode) {
        RunRowMappedF<NT, kKNvfp4, false>(M, K, d, s, tm, tk, a, amax);
      }
      break;
    case kKBlock1d:
      if constexpr (Has<kPat>(kKBlock1d) && !kColMode) {
        RunRowMappedF<NT, kKBlock1d, false>(M, K, d, s, tm, tk, a, amax);
      }
      break;
    case kKBlock2d:
      if constexpr (Has<kPat>(kKBlock2d) && !kColMode) {
        RunRowMappedF<NT, kKBlock2d, false>(M, K, d, s, tm, tk, a, amax);
      }
      break;
    case kKFp8Tensor:
      if constexpr (Has<kPat>(kKFp8Tensor) && !kColMode) {
        RunRowMappedF<NT, kKFp8Tensor, false>(M, K, d, s, tm, tk, a, amax);
      }
      break;
    default:
      break;
  }
}

// ---------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------

// kAdam: every tensor of the batch takes the fused AdamW load (the one-pass
// step), configured by kVar (above); the all-format kernel decides per
// tensor at run time.
template <int NT, int kPat, bool kAdam, int kVar>
__device__ __forceinline__ void ProcessTile(const QuantizeBatch& batch, int64_t tile,
                                            TileSmem& s) {
  // Each pass copies the descriptor fields it needs into registers before
  // its loops (a read through this reference could alias the global stores
  // and would be repeated after each of them).
  const TensorDesc& t = batch.t[FindBatchItem(batch.t, batch.num, tile, &TensorDesc::tile_begin)];
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

  bool fused_adam = kAdam;
  if constexpr (kPat == kPatAll) fused_adam = t.opt.param != nullptr;
  // The clip factor; NaN: a skipped step, the tile is the master as it is
  // (t.src is the master in the one-pass step).
  const float gscale = fused_adam && batch.grad_scale != nullptr ? *batch.grad_scale : 1.0f;
  if (gscale != gscale) fused_adam = false;
  if (kAdam && fused_adam) {
    LoadTileAdam<NT, kAdamBatch, kVar & kVarPrefetchMask, (kVar & kVarStream) != 0>(
        t.opt, t.src_vec, M, K, batch.adam, gscale, s, i0, j0);
  } else if (fused_adam) {
    LoadTileAdam<NT>(t.opt, t.src_vec, M, K, batch.adam, gscale, s, i0, j0);
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
  // NVFP4 16x16 both ways with one global amax: encode once (v4); that pass
  // takes its block amaxes itself.
  const bool nvfp4_both = Has<kPat>(kKNvfp4) && row.fmt == kKNvfp4 && col.fmt == kKNvfp4 &&
                          row.two_d && col.two_d && !deq && col_same_2d &&
                          (row.global_amax == col.global_amax ||
                           __float_as_uint(*row.global_amax) == __float_as_uint(*col.global_amax));
  // MXFP8 1x32 rowwise + 32x1 columnwise, same element format: one loop
  // encodes both; the rowwise pass's pre-step computes the column block amaxes.
  const bool mx_fused = Has<kPat>(kKMxfp8) && row.fmt == kKMxfp8 && col.fmt == kKMxfp8 &&
                        !row.two_d && !col.two_d && row.e5m2 == col.e5m2 && !deq;
  // Per-column block amaxes ride along the rowwise pass when it reads the
  // same values; otherwise a pre-pass computes them.
  const bool fuse_col_amax = ccfg.bm != 0 && ccfg.bk == 1 && !deq && row_needed && !mx_fused;
  // NVFP4 16x16 rowwise beside another columnwise format: the row part of
  // the two-direction pass (its own block amaxes; the tile stays the source).
  const bool nvfp4_row_fast = Has<kPat>(kKNvfp4) && row.fmt == kKNvfp4 && row.two_d && !deq &&
                              !nvfp4_both && !fuse_col_amax;
  bool need_sync = false;
  if (rcfg.bm != 0 && !nvfp4_both && !nvfp4_row_fast) {
    RunBlockAmax<NT>(s, rbf, rcfg, s.amax2d_row);
    need_sync = true;
  }
  if (ccfg.bm != 0 && !deq && !col_same_2d && !fuse_col_amax && !mx_fused) {
    RunBlockAmax<NT>(s, rbf, ccfg, ccfg.bk > 1 ? s.amax2d_col : s.colbuf);
    need_sync = true;
  }
  if (need_sync) __syncthreads();

  // Stage 3.
  float row_amax = 0.f, col_amax = 0.f;
  bool tile_is_source = false;  // the tile holds the columnwise input, already rounded
  if (nvfp4_both) {
    if constexpr (Has<kPat>(kKNvfp4)) {
      Nvfp4TwoDirPass<NT, false, (kVar & kVarScalarE2M1) != 0>(M, K, row, col, s, tm, tk, rbf, row_amax);
      ColScaleStep<NT, kPat>(M, K, col, s, col2d, tm, tk, /*need_mult=*/false);
    }
  } else if (nvfp4_row_fast) {
    if constexpr (Has<kPat>(kKNvfp4)) {
      Nvfp4TwoDirPass<NT, true>(M, K, row, row, s, tm, tk, rbf, row_amax);
      if (col_needed) __syncthreads();  // amax2d_row for the column scale step
    }
  } else if (row_needed) {
    RowPassArgs a;
    a.round_bf16 = rbf;
    a.deq_writeback = deq;
    a.writeback = col_needed && (deq || rbf);
    a.source_bf16 = t.source_bf16;
    if (mx_fused) {
      a.mx_col = &col;
      a.writeback = false;  // no columnwise pass reads the tile
    }
    if (fuse_col_amax) {
      a.col_amax = s.colbuf;
      a.col_bm_log2 = ccfg.bm == 16 ? 4 : ccfg.bm == 32 ? 5 : 7;
    }
    RunRowMapped<NT, kPat, false>(M, K, row, s, tm, tk, a, row_amax);
    if (a.writeback) tile_is_source = true;
    if (a.writeback || fuse_col_amax) __syncthreads();
  }
  // Stage 6, first half: amaxes that are final now go to shared memory here,
  // so that no register carries them through the columnwise pass (at 80
  // registers that cost a spill). NVFP4 both ways and fused MXFP8 read one
  // set of values for both directions.
  const bool col_amax_done = nvfp4_both || mx_fused;
  if (row.amax != nullptr) BlockAmaxContribute(row_amax, &s.red[0]);
  if (col.amax != nullptr && col_amax_done) BlockAmaxContribute(row_amax, &s.red[1]);

  // Stages 4-5.
  if (col_needed && !nvfp4_both && !mx_fused) {
    const bool crbf = rbf && !tile_is_source;
    if (col.fmt == kKNone) {
      col_amax = TileAmax<NT>(s, crbf);
    } else {
      if (ccfg.bm != 0 && deq) {
        RunBlockAmax<NT>(s, crbf, ccfg, ccfg.bk > 1 ? s.amax2d_col : s.colbuf);
        __syncthreads();
      }
      if (col.fmt != kKFp8Tensor && col.fmt != kKBf16 && col.fmt != kKFp32) {
        ColScaleStep<NT, kPat>(M, K, col, s, col2d, tm, tk);
        __syncthreads();
      }
      if (IsTransposed(col.fmt)) {
        constexpr bool kFp8T = Has<kPat>(kKFp8Tensor) || Has<kPat>(kKBlock2d) || Has<kPat>(kKBlock1d);
        if (col.fmt == kKNvfp4) {
          if constexpr (Has<kPat>(kKNvfp4)) {
            ColTransposedPass<NT, true, false>(M, K, col, s, tm, tk, crbf, col_amax);
          }
        } else if constexpr (kFp8T) {
          if (col.e5m2) {
            ColTransposedPass<NT, false, true>(M, K, col, s, tm, tk, crbf, col_amax);
          } else {
            ColTransposedPass<NT, false, false>(M, K, col, s, tm, tk, crbf, col_amax);
          }
        }
      } else {
        RowPassArgs a;
        a.round_bf16 = crbf;
        RunRowMapped<NT, kPat, true>(M, K, col, s, tm, tk, a, col_amax);
      }
    }
  }

  // Rowwise 128x128 block scale: one entry per tile ([ceil(M/128)][roundup(ceil(K/128),4)]).
  if (Has<kPat>(kKBlock2d) && row.fmt == kKBlock2d && row.write && threadIdx.x == 0) {
    const float sc =
        ComputeScale(Fbits(s.amax2d_row[0]), Fp8Max(row.e5m2), row.pow2, row.eps, row.inf_value);
    float* out = static_cast<float*>(row.scales) + int64_t{tm} * row.scale_cols;
    out[tk] = __frcp_rn(sc);
    if (tk == t.tiles_k - 1) {
      for (int64_t x = tk + 1; x < row.scale_cols; ++x) out[x] = 0.0f;
    }
  }

  // Stage 6.
  if (col.amax != nullptr && !col_amax_done) BlockAmaxContribute(col_amax, &s.red[1]);
  if (row.amax != nullptr || col.amax != nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) {
      if (row.amax != nullptr) AtomicMaxNonNeg(row.amax, Fbits(s.red[0]));
      if (col.amax != nullptr) AtomicMaxNonNeg(col.amax, Fbits(s.red[1]));
    }
  }
}

template <int NT, int kMinBlocks, int kPat, bool kAdam, int kVar>
__global__ void __launch_bounds__(NT, kMinBlocks)
    QuantizeTilesKernel(const __grid_constant__ QuantizeBatch batch) {
  extern __shared__ float4 smem_raw[];
  TileSmem& s = *reinterpret_cast<TileSmem*>(smem_raw);
  for (int64_t tile = blockIdx.x; tile < batch.total_tiles; tile += gridDim.x) {
    ProcessTile<NT, kPat, kAdam, kVar>(batch, tile, s);
    __syncthreads();  // shared memory is reused by the next tile
  }
}

template <int kPat, bool kAdam = false, int kVar = kAdam ? kAdamPrefetch : 0>
cudaError_t LaunchPattern(const QuantizeBatch& batch, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const size_t smem = sizeof(TileSmem);
  auto kernel = QuantizeTilesKernel<kThreads, 3, kPat, kAdam, kVar>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  int64_t grid = batch.total_tiles;  // one tile per block
  if (grid > 0x7FFFFFFF) grid = 0x7FFFFFFF;
  kernel<<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(batch);
  return cudaGetLastError();
}

template <int kPat, bool kAdam = false>
bool Covers(const QuantizeBatch& batch) {
  for (int i = 0; i < batch.num; ++i) {
    const TensorDesc& t = batch.t[i];
    if ((t.opt.param != nullptr) != kAdam || !Has<kPat>(t.row.fmt) || !Has<kPat>(t.col.fmt)) return false;
  }
  return true;
}

}  // namespace

// Runs the narrowest instantiation that covers every tensor of the batch.
// Every instantiation is byte-exact for the formats it contains (quantize_test
// on the device, docs/GPU_NOTES.md run 8), so the choice only affects speed.
cudaError_t LaunchQuantizeTiles(const QuantizeBatch& batch, int variant, cudaStream_t stream) {
  if (variant < kVariantDefault || variant > kVariantNvfp4ScalarE2M1) return cudaErrorInvalidValue;
  if (batch.total_tiles <= 0) return cudaSuccess;
  if (variant != kVariantDefault) {  // benchmarks only
    const bool plain = Covers<kPatPlain, true>(batch), mx = Covers<kPatMxfp8, true>(batch);
    if (variant == kVariantOnePassPrefetch0) {
      if (plain) return LaunchPattern<kPatPlain, true, 0>(batch, stream);
      if (mx) return LaunchPattern<kPatMxfp8, true, 0>(batch, stream);
    } else if (variant == kVariantOnePassStream) {
      if (plain) return LaunchPattern<kPatPlain, true, kVarStream | kAdamPrefetch>(batch, stream);
      if (mx) return LaunchPattern<kPatMxfp8, true, kVarStream | kAdamPrefetch>(batch, stream);
    } else if (variant == kVariantOnePassStreamPrefetch2) {
      if (plain) return LaunchPattern<kPatPlain, true, kVarStream | 2>(batch, stream);
      if (mx) return LaunchPattern<kPatMxfp8, true, kVarStream | 2>(batch, stream);
    } else if (Covers<kPatNvfp4>(batch)) {
      return LaunchPattern<kPatNvfp4, false, kVarScalarE2M1>(batch, stream);
    }
  }
  if (Covers<kPatPlain, true>(batch)) return LaunchPattern<kPatPlain, true>(batch, stream);
  if (Covers<kPatMxfp8, true>(batch)) return LaunchPattern<kPatMxfp8, true>(batch, stream);
  if (Covers<kPatBlock1d, true>(batch)) return LaunchPattern<kPatBlock1d, true>(batch, stream);
  if (Covers<kPatPlain>(batch)) return LaunchPattern<kPatPlain>(batch, stream);
  if (Covers<kPatNvfp4>(batch)) return LaunchPattern<kPatNvfp4>(batch, stream);
  if (Covers<kPatMxfp8>(batch)) return LaunchPattern<kPatMxfp8>(batch, stream);
  if (Covers<kPatBlock1d>(batch)) return LaunchPattern<kPatBlock1d>(batch, stream);
  if (Covers<kPatPlainMx>(batch)) return LaunchPattern<kPatPlainMx>(batch, stream);
  if (Covers<kPatPlainNv>(batch)) return LaunchPattern<kPatPlainNv>(batch, stream);
  return LaunchPattern<kPatAll>(batch, stream);
}

}  // namespace detail
}  // namespace gpu
}  // namespace paramd
