// File: kernels/cuda/quantize_nvfp4_pass.cuh
//
// NVFP4 16x16 in both directions from one encode (the columnwise codes are
// the rowwise codes transposed).
// INTERNAL to the quantize tile kernel (quantize.cu, which includes it once;
// see its head comment for the passes). Device code only, in an anonymous
// namespace (one copy per translation unit).
#ifndef PARAMD_KERNELS_CUDA_QUANTIZE_NVFP4_PASS_CUH_
#define PARAMD_KERNELS_CUDA_QUANTIZE_NVFP4_PASS_CUH_

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/quantize_pattern.cuh"
#include "kernels/cuda/quantize_tile.cuh"

namespace paramd {
namespace gpu {
namespace detail {
namespace {

// ---------------------------------------------------------------------------
// NVFP4 2D in both directions from one encode (v4)
// ---------------------------------------------------------------------------

// Nibbles of p = [n0 .. n7] (n0 lowest) -> [n0 n4 n1 n5 n2 n6 n3 n7]: byte k
// holds nibble k in its low half and nibble 4+k in its high half.
__device__ __forceinline__ uint32_t InterleaveNibbles(uint32_t p) {
  const uint32_t x = __byte_perm(p, 0u, 0x3120);    // [n0 n1 n4 n5 n2 n3 n6 n7]
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
        sbase[int64_t{r} * scale_cols] =
            static_cast<uint8_t>(r < rows_valid && sblock_ok ? sd : 0u);
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

}  // namespace
}  // namespace detail
}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_QUANTIZE_NVFP4_PASS_CUH_
