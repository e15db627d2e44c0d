// File: client/c_api_internal.h
//
// What the C API's other files (client/c_api_ipc.cc, c_api_admin.cc) take from
// client/c_api.cc: the client behind a live hpd_client handle, and the
// call wrapper that reports a status and keeps C++ exceptions from
// crossing the C boundary. Library-internal (not installed).
#ifndef PARAMD_CLIENT_C_API_INTERNAL_H_
#define PARAMD_CLIENT_C_API_INTERNAL_H_

#include <functional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/c_api.h"
#include "client/client.h"
#include "client/weight_stream.h"
#include "google/protobuf/message.h"

namespace paramd {
namespace capi {

// The client of a live handle; INVALID_ARGUMENT for NULL, closed or foreign
// handles.
absl::StatusOr<client::Client*> ClientOf(hpd_client* handle);
// Runs `f`, fills `status` and returns its code (exceptions become
// INTERNAL / RESOURCE_EXHAUSTED).
int32_t Call(hpd_status* status, const std::function<absl::Status()>& f);

// A message as JSON with the .proto field names.
absl::StatusOr<std::string> ToJson(const google::protobuf::Message& m);
// Hands `s` to the caller as a malloc'ed string (hpd_free_string).
absl::Status ReturnString(const std::string& s, char** out);

// What hpd_load_model and hpd_load_tensors share of hpd_load_options: the
// size check, the timeout, and the progress callback as a StreamLoad one.
struct StreamLoadSettings {
  absl::Duration timeout;
  std::string recipe;
  bool replace_model = false;
  std::function<void(const client::StreamProgress&)> progress;
};
absl::StatusOr<StreamLoadSettings> StreamLoadSettingsOf(const hpd_load_options& options);

}  // namespace capi
}  // namespace paramd

#endif  // PARAMD_CLIENT_C_API_INTERNAL_H_
