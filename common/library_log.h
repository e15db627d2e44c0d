// File: common/library_log.h
//
// The libraries' own diagnostics (gRPC's gpr_log, protobuf's GOOGLE_LOG,
// Abseil's ABSL_INTERNAL_LOG and ABSL_INTERNAL_CHECK) written through
// common/log.h instead of straight to stderr, so that in --log_format=json
// they are JSON objects like every line of the process. gRPC's lines get
// tag "grpc" (its ERROR as error, INFO as info, DEBUG as debug;
// GRPC_VERBOSITY still filters what gRPC emits), protobuf's "protobuf",
// Abseil's "absl".
//
// Command-line flag errors are JSON lines too (common/cli.h routes them).
// Not covered: Abseil's ABSL_RAW_LOG, which writes its text to stderr
// itself (its hooks never see the message; in this Abseil it reports
// Mutex misuse and fatal errors just before an abort).
//
// Threading: call once from main() after InitLogging, before threads that
// use gRPC or protobuf start (protobuf's SetLogHandler is not thread-safe).
#ifndef PARAMD_COMMON_LIBRARY_LOG_H_
#define PARAMD_COMMON_LIBRARY_LOG_H_

namespace paramd {

void RouteLibraryLogging();

}  // namespace paramd

#endif  // PARAMD_COMMON_LIBRARY_LOG_H_
