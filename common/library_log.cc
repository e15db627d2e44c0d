#include "common/library_log.h"

#include <string>

#include "absl/base/internal/raw_logging.h"
#include "absl/base/log_severity.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "google/protobuf/stubs/logging.h"
#include "grpc/support/log.h"

namespace paramd {
namespace {

void GrpcLog(gpr_log_func_args* args) {
  LogLevel level = LogLevel::kError;
  if (args->severity == GPR_LOG_SEVERITY_DEBUG) level = LogLevel::kDebug;
  if (args->severity == GPR_LOG_SEVERITY_INFO) level = LogLevel::kInfo;
  LogAt(level, "grpc",
        absl::StrCat(args->file == nullptr ? "" : args->file, ":", args->line, ": ",
                     args->message == nullptr ? "" : args->message));
}

void ProtobufLog(google::protobuf::LogLevel severity, const char* file, int line,
                 const std::string& message) {
  LogLevel level = LogLevel::kError;
  if (severity == google::protobuf::LOGLEVEL_INFO) level = LogLevel::kInfo;
  if (severity == google::protobuf::LOGLEVEL_WARNING) level = LogLevel::kWarning;
  LogAt(level, "protobuf", absl::StrCat(file == nullptr ? "" : file, ":", line, ": ", message));
}

// Abseil's ABSL_INTERNAL_LOG / ABSL_INTERNAL_CHECK (a FATAL one aborts
// once this returns).
void AbseilLog(absl::LogSeverity severity, const char* file, int line, const std::string& message) {
  LogLevel level = LogLevel::kError;
  if (severity == absl::LogSeverity::kInfo) level = LogLevel::kInfo;
  if (severity == absl::LogSeverity::kWarning) level = LogLevel::kWarning;
  LogAt(level, "absl", absl::StrCat(file == nullptr ? "" : file, ":", line, ": ", message));
}

}  // namespace

void RouteLibraryLogging() {
  gpr_set_log_function(&GrpcLog);
  google::protobuf::SetLogHandler(&ProtobufLog);
  absl::raw_logging_internal::RegisterInternalLogFunction(&AbseilLog);
}

}  // namespace paramd
