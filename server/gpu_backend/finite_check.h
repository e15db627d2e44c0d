// File: server/gpu_backend/finite_check.h
//
// Whether a pushed gradient on the device holds a NaN or an infinity (the
// host stream refuses those, server/step/chunks.h; the device push must too).
// Enqueue-only on `stream`; device pointers.
#ifndef PARAMD_SERVER_GPU_BACKEND_FINITE_CHECK_H_
#define PARAMD_SERVER_GPU_BACKEND_FINITE_CHECK_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace paramd {
namespace gpu_backend {

// Sets *flag (device uint32) to a nonzero value if any of the `count`
// values at `data` (BF16 when `bf16`, else FP32) is not finite; leaves it
// unchanged otherwise (the caller zeroes it first).
cudaError_t LaunchNonFiniteCheck(const void* data, bool bf16, int64_t count, uint32_t* flag,
                                 cudaStream_t stream);

}  // namespace gpu_backend
}  // namespace paramd

#endif  // PARAMD_SERVER_GPU_BACKEND_FINITE_CHECK_H_
