// File: common/gpu_status.h
//
// One adapter from every GPU library's status type (cudaError_t,
// cublasStatus_t, ncclResult_t) to absl::Status, behind one macro that
// records file, line and the failing expression:
//
//   GPU_RETURN_IF_ERROR(cudaMemcpyAsync(...));
//   absl::Status s = GPU_STATUS(ncclGroupEnd());
//
// Only compiled under --config=cuda (depends on //third_party:cuda).
// Thread-safe: stateless apart from the libraries' own thread-local errors.
#ifndef PARAMD_COMMON_GPU_STATUS_H_
#define PARAMD_COMMON_GPU_STATUS_H_

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace paramd {

template <typename T>
struct GpuErrorTraits;

template <>
struct GpuErrorTraits<cudaError_t> {
  static bool Ok(cudaError_t e) { return e == cudaSuccess; }
  static std::string Message(cudaError_t e) {
    return absl::StrCat(cudaGetErrorName(e), ": ", cudaGetErrorString(e));
  }
  // Out of memory can clear up after a retry; everything else is a bug or a
  // broken device.
  static absl::StatusCode Code(cudaError_t e) {
    return e == cudaErrorMemoryAllocation ? absl::StatusCode::kResourceExhausted
                                          : absl::StatusCode::kInternal;
  }
};

template <>
struct GpuErrorTraits<cublasStatus_t> {
  static bool Ok(cublasStatus_t e) { return e == CUBLAS_STATUS_SUCCESS; }
  static std::string Message(cublasStatus_t e) {
    return absl::StrCat("cuBLAS status ", static_cast<int>(e));
  }
  static absl::StatusCode Code(cublasStatus_t e) {
    switch (e) {
      case CUBLAS_STATUS_ALLOC_FAILED:
        return absl::StatusCode::kResourceExhausted;
      case CUBLAS_STATUS_NOT_SUPPORTED:
        return absl::StatusCode::kUnimplemented;
      case CUBLAS_STATUS_INVALID_VALUE:
        return absl::StatusCode::kInvalidArgument;
      default:
        return absl::StatusCode::kInternal;
    }
  }
};

template <>
struct GpuErrorTraits<ncclResult_t> {
  static bool Ok(ncclResult_t e) { return e == ncclSuccess || e == ncclInProgress; }
  static std::string Message(ncclResult_t e) {
    return absl::StrCat("NCCL ", ncclGetErrorString(e), " (", static_cast<int>(e), ")");
  }
  // A remote or system error means a peer died or the network broke: the
  // caller may rebuild the communicator and retry the whole operation.
  static absl::StatusCode Code(ncclResult_t e) {
    switch (e) {
      case ncclRemoteError:
      case ncclSystemError:
        return absl::StatusCode::kUnavailable;
      case ncclInvalidArgument:
      case ncclInvalidUsage:
        return absl::StatusCode::kInvalidArgument;
      default:
        return absl::StatusCode::kInternal;
    }
  }
};

template <typename T>
absl::Status AsStatus(T err, const char* file, int line, const char* expr) {
  if (GpuErrorTraits<T>::Ok(err)) return absl::OkStatus();
  return absl::Status(
      GpuErrorTraits<T>::Code(err),
      absl::StrCat(file, ":", line, ": ", expr, " failed: ", GpuErrorTraits<T>::Message(err)));
}

}  // namespace paramd

#define GPU_STATUS(expr) ::paramd::AsStatus((expr), __FILE__, __LINE__, #expr)

#define GPU_RETURN_IF_ERROR(expr)                            \
  do {                                                       \
    ::absl::Status paramd_gpu_status_ = GPU_STATUS(expr);    \
    if (!paramd_gpu_status_.ok()) return paramd_gpu_status_; \
  } while (0)

// After a kernel launch: picks up launch-configuration errors.
#define GPU_RETURN_IF_LAUNCH_ERROR() GPU_RETURN_IF_ERROR(cudaGetLastError())

#endif  // PARAMD_COMMON_GPU_STATUS_H_
