// File: kernels/cuda/quantize_launch.h
//
// INTERNAL (detail layer, STYLE.md 12): the plain-old-data descriptors the
// tile kernel of quantize.cu reads, and its raw launcher. Included by
// quantize.cu (nvcc) and quantize.cc (host, which validates and fills these
// from the public API in quantize.h). No Abseil here: nvcc's input stays
// simple. Everything is by value; pointers are device pointers.
#ifndef PARAMD_KERNELS_CUDA_QUANTIZE_LAUNCH_H_
#define PARAMD_KERNELS_CUDA_QUANTIZE_LAUNCH_H_

#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/cuda/optimizer_launch.h"

namespace paramd {
namespace gpu {
namespace detail {

// What the kernel writes for one direction.
enum KernelFormat : uint8_t {
  kKNone = 0,       // direction not computed
  kKBf16 = 1,       // identity BF16 [M][K]
  kKFp32 = 2,       // identity FP32 [M][K]
  kKFp8Tensor = 3,  // per-tensor FP8 (delayed or current): row [M][K], col [K][M]
  kKMxfp8 = 4,      // row [M][K] + R[Mp][Bp]; col [M][K] + C[..][..]
  kKNvfp4 = 5,      // row [M][ceil(K/2)]; col [K][ceil(M/2)]
  kKBlock2d = 6,    // FP8 128x128 blocks, col [K][M]
  kKBlock1d = 7,    // FP8 1x128 blocks (along the direction), col [K][M]
};

// One direction of one tensor.
struct DirDesc {
  uint8_t fmt = kKNone;
  uint8_t e5m2 = 0;
  uint8_t pow2 = 0;
  uint8_t two_d = 0;
  // 1 when every data store of this direction may use the vector path
  // (dimension multiple of 16 along the store, pointers 16-byte aligned).
  uint8_t vec = 0;
  uint8_t write = 0;  // 0: compute only (temporary rowwise copy, amax passes)
  float eps = 0.0f;
  float inf_value = 0.0f;              // blockwise compute_scale inf_value
  const float* scale = nullptr;        // per-tensor FP8 multiplier (device scalar)
  const float* global_amax = nullptr;  // NVFP4 A (device scalar)
  void* data = nullptr;
  void* scales = nullptr;
  float* scale_inv = nullptr;  // per-tensor FP8: rcp(scale) is written here
  float* amax = nullptr;       // max-updated with amax of this direction's input
  int64_t scale_rows = 0;      // Layout::scale_rows / scale_cols
  int64_t scale_cols = 0;
};

// Optional optimizer stage fused into the tile load (FP32 master only).
struct OptDesc {
  float* param = nullptr;  // null: plain quantize from `src`
  float* m = nullptr;
  float* v = nullptr;
  const float* grad = nullptr;
};

struct TensorDesc {
  const void* src = nullptr;  // [M][K], fp32 or bf16
  int64_t rows = 0;
  int64_t cols = 0;
  uint8_t src_bf16 = 0;      // input element type is bf16
  uint8_t round_bf16 = 0;    // D1: round to BF16 on read
  uint8_t src_vec = 0;       // 16-byte aligned rows (cols % 8 == 0 and aligned pointer)
  uint8_t col_from_row = 0;  // columnwise_source = rowwise_dequantized
  uint8_t source_bf16 = 0;   // D1 source dtype is BF16 (D2 rounds the dequantized values)
  DirDesc row;
  DirDesc col;
  OptDesc opt;
  int64_t tiles_k = 0;     // ceil(K / 128)
  int64_t tile_begin = 0;  // first global tile index of this tensor
};

constexpr int kTile = 128;
constexpr int kMaxTensorsPerLaunch = 40;

struct QuantizeBatch {
  int num = 0;
  int64_t total_tiles = 0;
  AdamHyper adam;
  // The fused AdamW load's gradient multiplier, a device scalar c (null:
  // 1), as OptBatch::grad_scale: g * c enters the update; c NaN skips the
  // update (the tile is the unchanged master, quantized and amax-recorded).
  const float* grad_scale = nullptr;
  TensorDesc t[kMaxTensorsPerLaunch];
};

// Kernel parameters are limited to 32764 bytes (CUDA >= 12.1).
static_assert(sizeof(QuantizeBatch) <= 32000, "QuantizeBatch exceeds the kernel parameter limit");

// Kernel variants. The default is what the library runs: for a one-pass
// (AdamW) batch the host wrapper resolves it per device to
// kVariantOnePassPrefetch0 or kVariantOnePassPrefetch1 (device_tuning.h);
// given to the launcher unresolved it means kVariantOnePassPrefetch1. The
// others are benchmark-only and change one thing each in the batches named;
// every other batch runs the default. The 512-thread and persistent
// variants of the v3.3 kernel were slower (docs/GPU_NOTES.md) and went with
// it.
enum QuantizeVariant : int {
  kVariantDefault = 0,                 // 256 threads, one 128x128 tile per block
  kVariantOnePassPrefetch0 = 1,        // one-pass step (every pattern): no L2 prefetch
  kVariantOnePassStream = 2,           // one-pass plain / MXFP8: evict-first loads and stores
  kVariantOnePassStreamPrefetch2 = 3,  // ... evict-first, prefetch 2 steps ahead
  kVariantNvfp4ScalarE2M1 = 4,         // NVFP4-only batches: the per-element E2M1 encoder in 16x16
  kVariantOnePassPrefetch1 = 5,        // one-pass step (every pattern): L2 prefetch 1 step ahead
};

// Launches the tile kernel over every tile of every tensor in `batch`;
// cudaErrorInvalidValue for an unknown variant.
cudaError_t LaunchQuantizeTiles(const QuantizeBatch& batch, int variant, cudaStream_t stream);

// Layout helpers shared by host validation and tests (bytes per data row, etc.).
inline int64_t CeilDivI(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace detail
}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_QUANTIZE_LAUNCH_H_
