// File: client/c_api_internal.h
//
// What the C API's files share (client/c_api.cc: handles, connect,
// manifests, versions, loads; c_api_data.cc: fetch and push; c_api_admin.cc:
// models in memory, exports, checkpoints; c_api_ipc.cc: same-GPU
// sessions): the hpd_client handle, the client behind a live one, and the
// call wrapper that reports a status and keeps C++ exceptions from
// crossing the C boundary. Library-internal (not installed).
#ifndef PARAMD_CLIENT_C_API_INTERNAL_H_
#define PARAMD_CLIENT_C_API_INTERNAL_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/c_api.h"
#include "client/client.h"
#include "client/weight_stream.h"
#include "google/protobuf/message.h"
#include "kernels/format.h"

#ifdef HPD_WITH_CUDA
#include "client/gpu_fetch/device_fetcher.h"
#endif

// One connection of the C API (hpd_connect .. hpd_close).
struct hpd_client {
  std::unique_ptr<paramd::client::Client> client;
#ifdef HPD_WITH_CUDA
  std::mutex device_mu;  // serialises device fetches and pushes; guards fetchers
  std::map<int, std::unique_ptr<paramd::gpu_fetch::DeviceFetcher>> fetchers;
#endif
};

namespace paramd {
namespace capi {

// A live handle itself, and the client of one; INVALID_ARGUMENT for NULL,
// closed or foreign handles.
absl::StatusOr<hpd_client*> LiveClient(hpd_client* handle);
absl::StatusOr<client::Client*> ClientOf(hpd_client* handle);
// Runs `f`, fills `status` and returns its code (exceptions become
// INTERNAL / RESOURCE_EXHAUSTED).
int32_t Call(hpd_status* status, const std::function<absl::Status()>& f);

// A timeout in milliseconds (<= 0: none).
absl::Duration Timeout(int64_t ms);
// INVALID_ARGUMENT "<what> is NULL".
absl::Status NullArgument(const char* what);
// HPD_ROWWISE / HPD_COLUMNWISE, else INVALID_ARGUMENT.
absl::StatusOr<Direction> ParseDirection(int32_t d);

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
