// File: server/gpu_backend/grad_norm.h
//
// The global gradient norm on the daemon's GPU, in exactly the order of
// server/step/grad_norm.h (so the gpu and cpu backends, and any layout, get the
// same float64 bits): row sums (one 256-thread block per row, lane-strided
// float64 sums, a fixed tree), 128-row block slots encoded as 4 exact
// floats, and the clip factor of the gathered slots. Enqueue-only on
// `stream`; device pointers unless said otherwise.
#ifndef PARAMD_SERVER_GPU_BACKEND_GRAD_NORM_H_
#define PARAMD_SERVER_GPU_BACKEND_GRAD_NORM_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace paramd {
namespace gpu_backend {

// For each of `rows` rows of `cols` FP32 accumulators at `acc`: first
// acc += add (pushed values, FP32 or `add_bf16` BF16, the same add as
// accumulate.h; null: nothing added), then row_sums[r] = the row's sum of
// squares (RowSumSq). The add and the sum in one pass: what the last
// pusher's push costs beyond a plain add. 16-byte loads when cols % 4 == 0
// and the rows are 16-byte aligned (`add` 16 bytes FP32, 8 bytes BF16);
// scalar loads otherwise; the same bits either way.
cudaError_t LaunchRowSumSq(float* acc, const void* add, bool add_bf16, int64_t rows, int64_t cols,
                           double* row_sums, cudaStream_t stream);

// Where slot s of the manifest's slot vector comes from on this daemon: the
// row sums of its 128-row block (`rows` of them, in row order), or none
// (row_sums null, rows 0: another daemon's slot, encoded as 0).
struct NormSlotSource {
  const double* row_sums = nullptr;
  int32_t rows = 0;
};

// slots[4 s .. 4 s + 3] = the encoded float64 sum of table[s]'s row sums,
// for every s < num_slots (`table` in device memory): the whole vector in
// one launch, ready for the all-reduce MAX.
cudaError_t LaunchEncodeNormSlots(const NormSlotSource* table, int64_t num_slots, float* slots,
                                  cudaStream_t stream);

// From the gathered slots (4 * num_slots floats): *sum_sq = their float64
// sum in slot order (`sum_sq` may be mapped page-locked host memory: the
// host reads it once the stream passed this kernel); *factor = the clip
// factor (ClipFactor of
// server/step/optimizer.h: min(1, max_grad_norm / (sqrt(sum) + 1e-6)), 1 without
// clipping), NaN when the sum is not finite and `skip_non_finite` (the
// optimizer kernels then skip the update), 1 when not finite otherwise.
cudaError_t LaunchClipFactor(const float* slots, int64_t num_slots, float max_grad_norm,
                             bool skip_non_finite, double* sum_sq, float* factor,
                             cudaStream_t stream);

// A single daemon's norm phase in one launch: LaunchEncodeNormSlots, then
// (its last block to finish) LaunchClipFactor's sum and factor, with the
// same results. `counter` is a device uint32 that is 0 between launches
// (the kernel leaves it 0); one launch at a time per counter.
cudaError_t LaunchNormSlotsAndClipFactor(const NormSlotSource* table, int64_t num_slots,
                                         float* slots, unsigned int* counter, float max_grad_norm,
                                         bool skip_non_finite, double* sum_sq, float* factor,
                                         cudaStream_t stream);

}  // namespace gpu_backend
}  // namespace paramd

#endif  // PARAMD_SERVER_GPU_BACKEND_GRAD_NORM_H_
