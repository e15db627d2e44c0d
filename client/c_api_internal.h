// File: client/c_api_internal.h
//
// What the C API's other files (client/c_api_ipc.cc) take from
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

namespace paramd {
namespace capi {

// The client of a live handle; INVALID_ARGUMENT for NULL, closed or foreign
// handles.
absl::StatusOr<client::Client*> ClientOf(hpd_client* handle);
// Runs `f`, fills `status` and returns its code (exceptions become
// INTERNAL / RESOURCE_EXHAUSTED).
int32_t Call(hpd_status* status, const std::function<absl::Status()>& f);

}  // namespace capi
}  // namespace paramd

#endif  // PARAMD_CLIENT_C_API_INTERNAL_H_
