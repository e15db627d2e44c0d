#include "common/grpc_status.h"

#include "gtest/gtest.h"

namespace paramd {
namespace {

TEST(GrpcStatusTest, EveryCodeRoundTrips) {
  for (int c = 1; c <= 16; ++c) {
    const absl::Status in(static_cast<absl::StatusCode>(c), "why");
    const grpc::Status g = ToGrpcStatus(in);
    EXPECT_EQ(static_cast<int>(g.error_code()), c);
    EXPECT_EQ(g.error_message(), "why");
    EXPECT_EQ(FromGrpcStatus(g), in);
  }
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

TEST(GrpcStatusTest, NamedCodesMatch) {
  EXPECT_EQ(ToGrpcStatus(absl::UnavailableError("x")).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(ToGrpcStatus(absl::DeadlineExceededError("x")).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "x")).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(GrpcStatusTest, ContextAndUnknownCodes) {
  const absl::Status s =
      FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "connect failed"), "Deliver");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "Deliver: connect failed");
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK, "Deliver").ok());
  EXPECT_EQ(FromGrpcStatus(grpc::Status(static_cast<grpc::StatusCode>(99), "?")).code(),
            absl::StatusCode::kUnknown);
}

}  // namespace
}  // namespace paramd
