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
// The kernel is instantiated per format pattern (KernelPattern,
// quantize_pattern.cuh): the launcher runs the narrowest instantiation that
// covers the whole batch, so each format's hot loops get the register
// allocation of a kernel that contains only them. Descriptor fields are
// copied into registers once per pass, and every pass is specialised at
// compile time on its format.
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "kernels/cuda/batch_search.cuh"
#include "kernels/cuda/codecs.cuh"
#include "kernels/cuda/optimizer_math.cuh"
#include "kernels/cuda/quantize_launch.h"
#include "kernels/cuda/quantize_tile.cuh"
// The passes of a tile (stages 3-5, the NVFP4 two-direction pass):
#include "kernels/cuda/quantize_col_pass.cuh"
#include "kernels/cuda/quantize_nvfp4_pass.cuh"
#include "kernels/cuda/quantize_pattern.cuh"
#include "kernels/cuda/quantize_row_pass.cuh"

namespace paramd {
namespace gpu {
namespace detail {
namespace {

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
      if constexpr (Has<kPat>(kKBf16))
        RunRowMappedF<NT, kKBf16, kColMode>(M, K, d, s, tm, tk, a, amax);
      break;
    case kKFp32:
      if constexpr (Has<kPat>(kKFp32))
        RunRowMappedF<NT, kKFp32, kColMode>(M, K, d, s, tm, tk, a, amax);
      break;
    case kKMxfp8:
      if constexpr (Has<kPat>(kKMxfp8))
        RunRowMappedF<NT, kKMxfp8, kColMode>(M, K, d, s, tm, tk, a, amax);
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
__device__ __forceinline__ void ProcessTile(const QuantizeBatch& batch, int64_t tile, TileSmem& s) {
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
    if (row.fmt == kKFp8Tensor && row.write && row.scale_inv)
      *row.scale_inv = __frcp_rn(*row.scale);
    if (col.fmt == kKFp8Tensor && col.write && col.scale_inv)
      *col.scale_inv = __frcp_rn(*col.scale);
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
      Nvfp4TwoDirPass<NT, false, (kVar & kVarScalarE2M1) != 0>(M, K, row, col, s, tm, tk, rbf,
                                                               row_amax);
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
        constexpr bool kFp8T =
            Has<kPat>(kKFp8Tensor) || Has<kPat>(kKBlock2d) || Has<kPat>(kKBlock1d);
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
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem));
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
    if ((t.opt.param != nullptr) != kAdam || !Has<kPat>(t.row.fmt) || !Has<kPat>(t.col.fmt))
      return false;
  }
  return true;
}

// A one-pass (AdamW) batch of pattern kPat with the load `variant` asks for.
template <int kPat>
cudaError_t LaunchOnePass(const QuantizeBatch& batch, int variant, cudaStream_t stream) {
  if (variant == kVariantOnePassPrefetch0) return LaunchPattern<kPat, true, 0>(batch, stream);
  if constexpr (kPat == kPatPlain || kPat == kPatMxfp8) {
    if (variant == kVariantOnePassStream) {
      return LaunchPattern<kPat, true, kVarStream | kAdamPrefetch>(batch, stream);
    }
    if (variant == kVariantOnePassStreamPrefetch2) {
      return LaunchPattern<kPat, true, kVarStream | 2>(batch, stream);
    }
  }
  return LaunchPattern<kPat, true, kAdamPrefetch>(batch, stream);
}

}  // namespace

// Runs the narrowest instantiation that covers every tensor of the batch.
// Every instantiation is byte-exact for the formats it contains (quantize_test
// on the device, docs/GPU_NOTES.md run 8), so the choice only affects speed.
cudaError_t LaunchQuantizeTiles(const QuantizeBatch& batch, int variant, cudaStream_t stream) {
  if (variant < kVariantDefault || variant > kVariantOnePassPrefetch1) return cudaErrorInvalidValue;
  if (batch.total_tiles <= 0) return cudaSuccess;
  if (Covers<kPatPlain, true>(batch)) return LaunchOnePass<kPatPlain>(batch, variant, stream);
  if (Covers<kPatMxfp8, true>(batch)) return LaunchOnePass<kPatMxfp8>(batch, variant, stream);
  if (Covers<kPatBlock1d, true>(batch)) return LaunchOnePass<kPatBlock1d>(batch, variant, stream);
  if (variant == kVariantNvfp4ScalarE2M1 && Covers<kPatNvfp4>(batch)) {
    return LaunchPattern<kPatNvfp4, false, kVarScalarE2M1>(batch, stream);
  }
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
