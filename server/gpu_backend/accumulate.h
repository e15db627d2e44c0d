// File: server/gpu_backend/accumulate.h
//
// Gradient accumulation on the daemon's GPU: acc[i] += float(grad[i]) for a
// pushed BF16 or FP32 gradient (the first part of a step: summing the
// pushes). Enqueue-only on `stream`; device pointers. Not part of
// kernels/cuda, which has no accumulate kernel.
#ifndef PARAMD_SERVER_GPU_BACKEND_ACCUMULATE_H_
#define PARAMD_SERVER_GPU_BACKEND_ACCUMULATE_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace paramd {
namespace gpu_backend {

// `bf16` selects the element type of `grad` (else FP32).
cudaError_t LaunchAccumulate(float* acc, const void* grad, bool bf16, int64_t count,
                             cudaStream_t stream);

}  // namespace gpu_backend
}  // namespace paramd

#endif  // PARAMD_SERVER_GPU_BACKEND_ACCUMULATE_H_
