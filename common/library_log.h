// File: common/library_log.h
//
// The libraries' own diagnostics (gRPC's gpr_log, protobuf's GOOGLE_LOG)
// written through common/log.h instead of straight to stderr, so that in
// --log_format=json every line the process writes is one JSON object.
// gRPC's lines get tag "grpc" (its ERROR as error, INFO as info, DEBUG as
// debug; GRPC_VERBOSITY still filters what gRPC emits), protobuf's
// "protobuf".
//
// Threading: call once from main() after InitLogging, before threads that
// use gRPC or protobuf start (protobuf's SetLogHandler is not thread-safe).
#ifndef PARAMD_COMMON_LIBRARY_LOG_H_
#define PARAMD_COMMON_LIBRARY_LOG_H_

namespace paramd {

void RouteLibraryLogging();

}  // namespace paramd

#endif  // PARAMD_COMMON_LIBRARY_LOG_H_
