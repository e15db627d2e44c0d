// File: deploy/gpu_trainer/kernels.h
//
// The few element-wise kernels of the GPU trainer example (enqueue-only on
// `stream`, device pointers).
#ifndef PARAMD_DEPLOY_GPU_TRAINER_KERNELS_H_
#define PARAMD_DEPLOY_GPU_TRAINER_KERNELS_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace paramd {
namespace gpu_trainer {

// dy = 2 (y - t) / n, and *loss += sum (y - t)^2 / n (loss zeroed by caller).
cudaError_t LaunchMseGrad(const float* y, const float* t, float* dy, float* loss, int64_t n,
                          cudaStream_t stream);
// out[i] = bf16(in[i]) (round to nearest even).
cudaError_t LaunchToBf16(const float* in, void* out, int64_t n, cudaStream_t stream);
// *out = *a * *b (one thread): the GEMM alpha of two per-tensor FP8 scales.
cudaError_t LaunchScaleProduct(const float* a, const float* b, float* out, cudaStream_t stream);
// out[i] = float(in[i]) for BF16 `in`.
cudaError_t LaunchFromBf16(const void* in, float* out, int64_t n, cudaStream_t stream);

}  // namespace gpu_trainer
}  // namespace paramd

#endif  // PARAMD_DEPLOY_GPU_TRAINER_KERNELS_H_
