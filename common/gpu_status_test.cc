#include "common/gpu_status.h"

#include <gtest/gtest.h>

namespace {

TEST(GpuStatus, CarriesFileLineAndExpression) {
  absl::Status s = GPU_STATUS(cudaErrorMemoryAllocation);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("gpu_status_test.cc"), absl::string_view::npos);
  EXPECT_NE(s.message().find("cudaErrorMemoryAllocation"), absl::string_view::npos);
  EXPECT_TRUE(GPU_STATUS(cudaSuccess).ok());
  EXPECT_EQ(GPU_STATUS(ncclRemoteError).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(GPU_STATUS(CUBLAS_STATUS_NOT_SUPPORTED).code(), absl::StatusCode::kUnimplemented);
}

}  // namespace
