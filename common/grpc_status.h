// File: common/grpc_status.h
//
// The one place where absl::Status and grpc::Status are converted (STYLE.md
// practice 3). The two code enums share their numbers (OK = 0 ...
// UNAUTHENTICATED = 16), so a code survives a round trip unchanged and a
// retry decision made on one side of an RPC holds on the other. Error
// details (payloads) are not carried; messages are.
//
// Thread-safe, no state.
#ifndef PARAMD_COMMON_GRPC_STATUS_H_
#define PARAMD_COMMON_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"

namespace paramd {

// For handlers: the status to finish an RPC with.
grpc::Status ToGrpcStatus(const absl::Status& status);

// For callers: the RPC's outcome. A code outside 0..16 becomes UNKNOWN.
absl::Status FromGrpcStatus(const grpc::Status& status);

// The same, with `context` (e.g. "Deliver to rank 3 at 10.0.0.2:7000")
// prefixed to the message of a non-OK status: "<context>: <message>".
absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view context);

}  // namespace paramd

#endif  // PARAMD_COMMON_GRPC_STATUS_H_
