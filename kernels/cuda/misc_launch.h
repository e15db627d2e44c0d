// File: kernels/cuda/misc_launch.h
//
// INTERNAL (detail layer): plain-old-data batches and raw launchers of the
// small kernels: multi-tensor amax (amax.cu), device scaling updates
// (scaling.cu) and dequantization (dequantize.cu). Included by the .cu files
// (nvcc) and their host wrappers. No Abseil.
#ifndef PARAMD_KERNELS_CUDA_MISC_LAUNCH_H_
#define PARAMD_KERNELS_CUDA_MISC_LAUNCH_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace paramd {
namespace gpu {
namespace detail {

// ---- amax.cu ----
struct AmaxItem {
  const void* src = nullptr;
  int64_t count = 0;
  float* out = nullptr;  // max-updated
  uint8_t src_bf16 = 0;
  uint8_t round_bf16 = 0;
  uint8_t vec = 0;  // 16-byte aligned source
  int64_t chunk_begin = 0;
};
constexpr int kMaxAmaxItems = 256;
constexpr int64_t kAmaxChunk = 65536;  // elements per block
struct AmaxBatch {
  int num = 0;
  int64_t total_chunks = 0;
  AmaxItem t[kMaxAmaxItems];
};
static_assert(sizeof(AmaxBatch) <= 32000, "kernel parameter limit");
cudaError_t LaunchAmax(const AmaxBatch& batch, cudaStream_t stream);

// Per-block amax (amax.cu, BlockAmaxKernel): one CTA per 128x128 tile of
// one tensor. Blocks are block_rows x block_cols with both in {1, 16, 32,
// 128} (not both 1), or the whole tensor (per_tensor). `out` points at the
// tensor's first block amax; block (bi, bj) is out[bi * grid_cols + bj].
struct BlockAmaxItem {
  const void* src = nullptr;  // [rows][cols]
  int64_t rows = 0;
  int64_t cols = 0;
  float* out = nullptr;
  int64_t grid_cols = 0;  // ceil(cols / block_cols)
  int64_t tiles_k = 0;    // ceil(cols / 128)
  int64_t tile_begin = 0;
  uint8_t src_bf16 = 0;
  uint8_t round_bf16 = 0;
  uint8_t vec = 0;         // 16-byte (fp32) / 8-byte (bf16) aligned rows of 4 elements
  uint8_t per_tensor = 0;  // out[0] max-updated (zeroed by LaunchBlockAmax first)
  uint8_t bm_log2 = 0;     // block_rows = 1 << bm_log2 (0, 4, 5, 7)
  uint8_t bk_log2 = 0;     // block_cols = 1 << bk_log2
};
constexpr int kMaxBlockAmaxItems = 256;
struct BlockAmaxBatch {
  int num = 0;
  int64_t total_tiles = 0;
  BlockAmaxItem t[kMaxBlockAmaxItems];
};
static_assert(sizeof(BlockAmaxBatch) <= 32000, "kernel parameter limit");
// Zeroes the per-tensor slots, then one launch over all tiles.
cudaError_t LaunchBlockAmax(const BlockAmaxBatch& batch, cudaStream_t stream);

// ---- scaling.cu ----
// §2 current scaling: scale = compute_scale(*amax, fp8_max, pow2, eps, FLT_MAX),
// scale_inv = rcp(scale).
struct CurrentItem {
  const float* amax = nullptr;
  float* scale = nullptr;
  float* scale_inv = nullptr;  // nullable
  float fp8_max = 448.0f;
  float eps = 0.0f;
  uint8_t pow2 = 0;
};
constexpr int kMaxScalingItems = 256;
struct CurrentBatch {
  int num = 0;
  CurrentItem t[kMaxScalingItems];
};
static_assert(sizeof(CurrentBatch) <= 32000, "kernel parameter limit");
cudaError_t LaunchCurrentScaling(const CurrentBatch& batch, cudaStream_t stream);

// §1 delayed scaling update (fused rule, D9), one block per tensor.
struct DelayedItem {
  float* history = nullptr;  // [len], history[0] = amax recorded this step
  int len = 1;
  float* scale = nullptr;
  float* scale_inv = nullptr;           // nullable: rcp(scale) after the update
  const float* reduced_amax = nullptr;  // nullable: use history[0]
  float scaled_max = 448.0f;            // fp8_max * 2^-margin
  uint8_t algo_max = 1;                 // 1: "max" over the history, 0: "most_recent"
};
struct DelayedBatch {
  int num = 0;
  int max_len = 1;
  DelayedItem t[kMaxScalingItems];
};
static_assert(sizeof(DelayedBatch) <= 32000, "kernel parameter limit");
cudaError_t LaunchDelayedScaling(const DelayedBatch& batch, cudaStream_t stream);

// ---- dequantize.cu ----
struct DequantItem {
  uint8_t fmt = 0;  // detail::KernelFormat
  uint8_t columnwise = 0;
  uint8_t e5m2 = 0;
  uint8_t out_bf16 = 0;  // 0: fp32 output
  int64_t rows = 0;
  int64_t cols = 0;
  const void* data = nullptr;
  const void* scales = nullptr;
  int64_t scale_cols = 0;
  const float* scale_inv = nullptr;    // per-tensor FP8
  const float* global_amax = nullptr;  // NVFP4 A
  void* out = nullptr;                 // [rows][cols]
};
cudaError_t LaunchDequantize(const DequantItem& item, cudaStream_t stream);

// ---- codec_check.cu ----
// Exhaustive self-check of the device codecs (see codec_check.cu); counts[kCodecChecks]
// and first[kCodecChecks] are device arrays, zero / 0xFFFFFFFF initialised by the caller.
constexpr int kCodecChecks = 8;
cudaError_t LaunchCodecCheck(unsigned long long* counts, unsigned* first, cudaStream_t stream);

}  // namespace detail
}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_MISC_LAUNCH_H_
