#include "ipc/cuda_vmm.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace paramd {
namespace ipc {
namespace {

// The driver functions used here, from the runtime's entry-point lookup.
struct Driver {
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuMemExportToShareableHandle) export_handle = nullptr;
  decltype(&cuMemImportFromShareableHandle) import_handle = nullptr;
  decltype(&cuDeviceGetAttribute) attribute = nullptr;
  decltype(&cuGetErrorString) error_string = nullptr;
  absl::Status status;
};

template <typename F>
absl::Status Load(const char* name, F* fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q;
  cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || p == nullptr) {
    cudaGetLastError();
    return absl::UnimplementedError(absl::StrCat("CUDA driver entry point ", name, " not found"));
  }
  *fn = reinterpret_cast<F>(p);
  return absl::OkStatus();
}

const Driver& D() {
  static Driver* d = [] {
    auto* d = new Driver();
    absl::Status s;
    auto load = [&s](const char* name, auto* fn) {
      if (s.ok()) s = Load(name, fn);
    };
    load("cuMemCreate", &d->create);
    load("cuMemRelease", &d->release);
    load("cuMemAddressReserve", &d->reserve);
    load("cuMemAddressFree", &d->address_free);
    load("cuMemMap", &d->map);
    load("cuMemUnmap", &d->unmap);
    load("cuMemSetAccess", &d->set_access);
    load("cuMemGetAllocationGranularity", &d->granularity);
    load("cuMemExportToShareableHandle", &d->export_handle);
    load("cuMemImportFromShareableHandle", &d->import_handle);
    load("cuDeviceGetAttribute", &d->attribute);
    load("cuGetErrorString", &d->error_string);
    d->status = s;
    return d;
  }();
  return *d;
}

absl::Status Check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  const char* msg = nullptr;
  if (D().error_string != nullptr) D().error_string(r, &msg);
  const std::string m =
      absl::StrCat(what, ": ", msg != nullptr ? msg : "CUDA driver error ", static_cast<int>(r));
  if (r == CUDA_ERROR_OUT_OF_MEMORY) return absl::ResourceExhaustedError(m);
  if (r == CUDA_ERROR_NOT_SUPPORTED) return absl::UnimplementedError(m);
  return absl::InternalError(m);
}

#define VMM_RETURN_IF_ERROR(call, what)                             \
  do {                                                              \
    if (absl::Status _s = Check((call), what); !_s.ok()) return _s; \
  } while (0)

CUmemAllocationProp Prop(int device) {
  CUmemAllocationProp p = {};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = device;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return p;
}

// Reserves `size` bytes of address space, maps `handle` there read-write
// on `device`. On error nothing is left mapped (the handle stays).
absl::StatusOr<uint64_t> MapHandle(CUmemGenericAllocationHandle handle, size_t size, int device) {
  const Driver& d = D();
  CUdeviceptr ptr = 0;
  VMM_RETURN_IF_ERROR(d.reserve(&ptr, size, 0, 0, 0), "cuMemAddressReserve");
  CUresult r = d.map(ptr, size, 0, handle, 0);
  if (r != CUDA_SUCCESS) {
    d.address_free(ptr, size);
    return Check(r, "cuMemMap");
  }
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = d.set_access(ptr, size, &access, 1);
  if (r != CUDA_SUCCESS) {
    d.unmap(ptr, size);
    d.address_free(ptr, size);
    return Check(r, "cuMemSetAccess");
  }
  return static_cast<uint64_t>(ptr);
}

}  // namespace

bool VmmBuffer::Supported(int device) {
  const Driver& d = D();
  if (!d.status.ok()) return false;
  int value = 0;
  if (cudaFree(nullptr) != cudaSuccess) {  // a context for the driver calls
    cudaGetLastError();
    return false;
  }
  if (d.attribute(&value, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                  device) != CUDA_SUCCESS) {
    return false;
  }
  int vmm = 0;
  d.attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device);
  return value != 0 && vmm != 0;
}

absl::StatusOr<size_t> VmmBuffer::Granularity(int device) {
  const Driver& d = D();
  if (!d.status.ok()) return d.status;
  if (!Supported(device)) {
    return absl::UnimplementedError(absl::StrCat(
        "CUDA device ", device, " has no exportable (POSIX file descriptor) allocations"));
  }
  CUmemAllocationProp prop = Prop(device);
  size_t granularity = 0;
  VMM_RETURN_IF_ERROR(d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                      "cuMemGetAllocationGranularity");
  return granularity;
}

absl::StatusOr<VmmBuffer> VmmBuffer::Allocate(size_t bytes, int device) {
  const Driver& d = D();
  if (!d.status.ok()) return d.status;
  ASSIGN_OR_RETURN(const size_t granularity, Granularity(device));
  CUmemAllocationProp prop = Prop(device);
  const size_t size = (std::max<size_t>(bytes, 1) + granularity - 1) / granularity * granularity;
  CUmemGenericAllocationHandle handle = 0;
  VMM_RETURN_IF_ERROR(d.create(&handle, size, &prop, 0), "cuMemCreate");
  absl::StatusOr<uint64_t> ptr = MapHandle(handle, size, device);
  if (!ptr.ok()) {
    d.release(handle);
    return ptr.status();
  }
  VmmBuffer b;
  b.ptr_ = *ptr;
  b.size_ = size;
  b.handle_ = handle;
  b.device_ = device;
  return b;
}

absl::StatusOr<VmmBuffer> VmmBuffer::Import(int fd, size_t bytes, int device) {
  const Driver& d = D();
  if (!d.status.ok()) {
    close(fd);
    return d.status;
  }
  CUmemGenericAllocationHandle handle = 0;
  // The driver takes a POSIX fd handle as a pointer-sized value.
  CUresult r = d.import_handle(
      &handle,
      reinterpret_cast<void*>(static_cast<intptr_t>(fd)),  // NOLINT(performance-no-int-to-ptr)
      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  close(fd);  // the handle holds the allocation now
  VMM_RETURN_IF_ERROR(r, "cuMemImportFromShareableHandle");
  absl::StatusOr<uint64_t> ptr = MapHandle(handle, bytes, device);
  if (!ptr.ok()) {
    d.release(handle);
    return absl::Status(ptr.status().code(),
                        absl::StrCat(ptr.status().message(), " (mapping ", bytes,
                                     " bytes: not the exported allocation's size?)"));
  }
  VmmBuffer b;
  b.ptr_ = *ptr;
  b.size_ = bytes;
  b.handle_ = handle;
  b.device_ = device;
  return b;
}

absl::StatusOr<int> VmmBuffer::Export() const {
  if (!valid()) return absl::FailedPreconditionError("no allocation");
  int fd = -1;
  VMM_RETURN_IF_ERROR(D().export_handle(&fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                      "cuMemExportToShareableHandle");
  return fd;
}

void VmmBuffer::Reset() {
  if (ptr_ != 0) {
    const Driver& d = D();
    d.unmap(ptr_, size_);
    d.address_free(ptr_, size_);
    d.release(handle_);
  }
  ptr_ = 0;
  size_ = 0;
  handle_ = 0;
}

VmmBuffer::~VmmBuffer() { Reset(); }

VmmBuffer::VmmBuffer(VmmBuffer&& o) noexcept
    : ptr_(o.ptr_), size_(o.size_), handle_(o.handle_), device_(o.device_) {
  o.ptr_ = 0;
  o.size_ = 0;
  o.handle_ = 0;
}

VmmBuffer& VmmBuffer::operator=(VmmBuffer&& o) noexcept {
  if (this != &o) {
    Reset();
    ptr_ = o.ptr_;
    size_ = o.size_;
    handle_ = o.handle_;
    device_ = o.device_;
    o.ptr_ = 0;
    o.size_ = 0;
    o.handle_ = 0;
  }
  return *this;
}

}  // namespace ipc
}  // namespace paramd
