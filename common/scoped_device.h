// File: common/scoped_device.h
//
// ScopedDevice: makes a CUDA device current on the calling thread for the
// scope and restores the previous one after. Header-only; --config=cuda.
// Errors of cudaGetDevice / cudaSetDevice are not reported (a destructor
// cannot): a device that cannot be made current fails the first CUDA call
// made under the guard, which is checked.
#ifndef PARAMD_COMMON_SCOPED_DEVICE_H_
#define PARAMD_COMMON_SCOPED_DEVICE_H_

#include <cuda_runtime_api.h>

namespace paramd {

class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
  }
  ~ScopedDevice() { cudaSetDevice(previous_); }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace paramd

#endif  // PARAMD_COMMON_SCOPED_DEVICE_H_
