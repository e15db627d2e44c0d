// File: kernels/cuda/quantize_col_pass.cuh
//
// Stages 4 and 5: the columnwise scale step and the transposed columnwise
// pass (per-tensor FP8, blockwise FP8, NVFP4).
// INTERNAL to the quantize tile kernel (quantize.cu, which includes it once;
// see its head comment for the passes). Device code only, in an anonymous
// namespace (one copy per translation unit).
#ifndef PARAMD_KERNELS_CUDA_QUANTIZE_COL_PASS_CUH_
#define PARAMD_KERNELS_CUDA_QUANTIZE_COL_PASS_CUH_

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/quantize_pattern.cuh"
#include "kernels/cuda/quantize_tile.cuh"

namespace paramd {
namespace gpu {
namespace detail {
namespace {

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
            if (room >= 8 && (scale_cols & 7) == 0 &&
                (reinterpret_cast<uintptr_t>(scales) & 7) == 0) {
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
      amax_acc =
          fmaxf(amax_acc, fmaxf(Max4Abs(va.x, va.y, va.z, va.w), Max4Abs(vb.x, vb.y, vb.z, vb.w)));
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
          const uint32_t A = __byte_perm(pq[0], pq[1], 0x5140),
                         B = __byte_perm(pq[2], pq[3], 0x5140);
          const uint32_t C = __byte_perm(pq[0], pq[1], 0x7362),
                         D = __byte_perm(pq[2], pq[3], 0x7362);
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

}  // namespace
}  // namespace detail
}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_QUANTIZE_COL_PASS_CUH_
