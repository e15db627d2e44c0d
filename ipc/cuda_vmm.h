// File: ipc/cuda_vmm.h
//
// Device memory that another process can map (same-GPU sessions): CUDA
// virtual memory management with POSIX file-descriptor shareable handles.
// The physical allocation is reference counted by the driver: it stays
// alive while any process holds a handle or a mapping of it, so a trainer
// that mapped a daemon's buffers never reads freed memory, whatever
// happens to the daemon (and the daemon, likewise, the trainer's gradient
// buffer). The driver entry points are looked up through the runtime
// (cudaGetDriverEntryPointByVersion): no link against libcuda.
//
// Threading: thread-safe (the driver's own rules); no blocking beyond the
// driver calls.
#ifndef PARAMD_IPC_CUDA_VMM_H_
#define PARAMD_IPC_CUDA_VMM_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace paramd {
namespace ipc {

// One mapped allocation. Move-only; the destructor unmaps and releases it.
class VmmBuffer {
 public:
  VmmBuffer() = default;
  ~VmmBuffer();
  VmmBuffer(VmmBuffer&& other) noexcept;
  VmmBuffer& operator=(VmmBuffer&& other) noexcept;
  VmmBuffer(const VmmBuffer&) = delete;
  VmmBuffer& operator=(const VmmBuffer&) = delete;

  // A new exportable allocation of at least `bytes` on `device` (rounded up
  // to the allocation granularity), mapped read-write on it. UNIMPLEMENTED
  // when the device or driver has no POSIX-fd shareable handles.
  static absl::StatusOr<VmmBuffer> Allocate(size_t bytes, int device);
  // Maps the allocation behind `fd` (from Export in another process; `fd`
  // is closed) of `bytes` (its rounded size) on `device`.
  static absl::StatusOr<VmmBuffer> Import(int fd, size_t bytes, int device);
  // The size every allocation on `device` is rounded up to (2 MiB on an
  // H200). UNIMPLEMENTED as Allocate.
  static absl::StatusOr<size_t> Granularity(int device);
  // Whether `device` supports exportable allocations.
  static bool Supported(int device);

  // A new descriptor for the allocation (the caller owns it).
  absl::StatusOr<int> Export() const;

  // CUdeviceptr is an integer by the driver API's definition.
  void* data() const { return reinterpret_cast<void*>(ptr_); }  // NOLINT(performance-no-int-to-ptr)
  size_t size() const { return size_; }
  bool valid() const { return ptr_ != 0; }

 private:
  void Reset();
  uint64_t ptr_ = 0;  // CUdeviceptr
  size_t size_ = 0;
  uint64_t handle_ = 0;  // CUmemGenericAllocationHandle
  int device_ = 0;
};

}  // namespace ipc
}  // namespace paramd

#endif  // PARAMD_IPC_CUDA_VMM_H_
