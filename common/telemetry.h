// File: common/telemetry.h
//
// The process's Prometheus instruments that code records into as events
// happen (prometheus-cpp); server/metrics.h serves them on /metrics with
// the values it reads at scrape time, every series labelled with the
// process's role and rank.
//
//   paramd_step_seconds         histogram  optimizer step (daemon)
//   paramd_push_seconds{path}   histogram  gradient push RPC, start to status (host|device)
//   paramd_fetch_seconds{path}  histogram  fetch RPC, start to status (host|device)
//   paramd_checkpoint_seconds   histogram  checkpoint (coordinator)
//   paramd_export_seconds       histogram  one ExportRows piece (daemon)
//   paramd_refused_requests_total{method,code}  counter  RPCs answered with an error
//   paramd_checkpoint_last_bytes / _last_seconds / _last_success_timestamp_seconds  gauges
//   paramd_checkpoint_failures_total  counter
//
// Threading: every function is thread-safe and cheap (atomic updates).
#ifndef PARAMD_COMMON_TELEMETRY_H_
#define PARAMD_COMMON_TELEMETRY_H_

#include <cstdint>
#include <memory>

#include "absl/strings/string_view.h"

namespace prometheus {
class Registry;
}

namespace paramd {
namespace telemetry {

// The registry holding every instrument above (created on first use).
std::shared_ptr<prometheus::Registry> Registry();

void ObserveStep(double seconds);
void ObservePush(double seconds, bool device);
void ObserveFetch(double seconds, bool device);
void ObserveExport(double seconds);
// A finished checkpoint: its duration, and on success its bytes.
void ObserveCheckpoint(bool ok, double seconds, int64_t bytes);
// The unix time of the last successful checkpoint; 0 if none.
double LastCheckpointUnixSeconds();
// An RPC answered with status `code` (a grpc::StatusCode, not OK):
// `method` as "Service/Method" (e.g. "Daemon/Fetch").
void CountRefused(absl::string_view method, absl::string_view code);

}  // namespace telemetry
}  // namespace paramd

#endif  // PARAMD_COMMON_TELEMETRY_H_
