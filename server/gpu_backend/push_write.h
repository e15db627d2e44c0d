// File: server/gpu_backend/push_write.h
//
// The first push of a version into an accumulator that is still zero: one
// pass reads the gradient, flags a NaN/Inf and writes 0 + float(g) (what
// the add into zeros would give, bit for bit, -0 included) instead of the
// two passes of a check and an add (which also reads the accumulator).
// The caller undoes the write (zeroes the range) when the flag is set, so
// a refused push still adds nothing. Enqueue-only on `stream`; device
// pointers.
#ifndef PARAMD_SERVER_GPU_BACKEND_PUSH_WRITE_H_
#define PARAMD_SERVER_GPU_BACKEND_PUSH_WRITE_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace paramd {
namespace gpu_backend {

// acc[i] = 0.0f + float(grad[i]) for i < count (`bf16` selects the element
// type of `grad`, else FP32); *flag (device uint32) is set nonzero if any
// value is NaN or infinite, left as it is otherwise.
cudaError_t LaunchWriteChecked(float* acc, const void* grad, bool bf16, int64_t count,
                               uint32_t* flag, cudaStream_t stream);

}  // namespace gpu_backend
}  // namespace paramd

#endif  // PARAMD_SERVER_GPU_BACKEND_PUSH_WRITE_H_
