// File: kernels/cuda/quantize_pattern.cuh
//
// The kernel patterns (which formats one instantiation contains) and the
// one-pass load's compile-time switches.
// INTERNAL to the quantize tile kernel (quantize.cu, which includes it once;
// see its head comment for the passes). Device code only, in an anonymous
// namespace (one copy per translation unit).
#ifndef PARAMD_KERNELS_CUDA_QUANTIZE_PATTERN_CUH_
#define PARAMD_KERNELS_CUDA_QUANTIZE_PATTERN_CUH_

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/quantize_launch.h"

namespace paramd {
namespace gpu {
namespace detail {
namespace {

// Which formats one instantiation of the kernel contains. The host picks the
// narrowest pattern that covers every tensor of a batch (LaunchQuantizeTiles
// in quantize.cu): each instantiation is compiled with only its own passes,
// so the hot loops of one format do not share a register allocation with the
// others' (at the 80-register cap, the all-format kernel ran FP8 per-tensor
// row + col 5 % slower than a kernel without the MXFP8 / NVFP4 code;
// GPU_NOTES run 8).
enum KernelPattern : int {
  kPatAll = 0,      // every format, the fused AdamW load
  kPatPlain = 1,    // identity BF16 / FP32, per-tensor FP8, FP8 128x128
  kPatNvfp4 = 2,    // NVFP4 only
  kPatMxfp8 = 3,    // MXFP8 only
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

}  // namespace
}  // namespace detail
}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_QUANTIZE_PATTERN_CUH_
