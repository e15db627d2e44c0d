// File: tests/gpu_integration/device_test_util.h
//
// Small helpers the multi-process device tests share (testonly,
// header-only): the GPU count, the trainer's GPU and device -> host copies
// of fetched bytes, checked with gtest (a failed copy fails the calling
// test).
#ifndef PARAMD_TESTS_GPU_INTEGRATION_DEVICE_TEST_UTIL_H_
#define PARAMD_TESTS_GPU_INTEGRATION_DEVICE_TEST_UTIL_H_

#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "gtest/gtest.h"

namespace paramd {
namespace testing {

// The visible CUDA devices (0 when CUDA cannot count them).
inline int GpuCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// GPU 1 when there are two (the daemons run on GPU 0), else GPU 0.
inline int TrainerDevice() { return GpuCount() >= 2 ? 1 : 0; }

// `n` bytes of device memory at `p`, on the host.
inline std::vector<uint8_t> ToHost(const void* p, int64_t n) {
  std::vector<uint8_t> out(n);
  if (n > 0) {
    EXPECT_EQ(cudaMemcpy(out.data(), p, n, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return out;
}

// One device float, on the host.
inline float FloatToHost(const float* p) {
  float f = 0;
  EXPECT_EQ(cudaMemcpy(&f, p, sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  return f;
}

}  // namespace testing
}  // namespace paramd

#endif  // PARAMD_TESTS_GPU_INTEGRATION_DEVICE_TEST_UTIL_H_
