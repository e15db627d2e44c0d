// File: server/metrics.h
//
// A Prometheus text endpoint (http://<bind>:<port>/metrics, prometheus-cpp)
// for one hybrid-paramd process, every series labelled role and rank:
//   - the instruments of common/telemetry.h (step, push, fetch, checkpoint
//     and export latency histograms; refused requests by method and code;
//     last checkpoint bytes, duration and time);
//   - read at scrape time: build info, host memory (RSS), the standard
//     process_* series (server/process_metrics.h); coordinator: checkpoint
//     age (seconds since its last successful checkpoint, before the first
//     one since the process started, so "too old" fires when there never
//     was one), committed version, daemons joined and expected, daemon up
//     per rank, recovery failing / needing a load, recoveries; daemon:
//     rank, published version, steps, last step time, pushes, bytes pushed
//     and served, parameters, device memory, and per tensor and direction
//     the FP8 health signals (amax, scale, saturated and zero fractions of
//     the published codes: server/step/fp8_health.h, sampled; the gpu backend
//     publishes on the device, so only amax and scale there).
//
// Thread-safe. The server must outlive the exporter.
#ifndef PARAMD_SERVER_METRICS_H_
#define PARAMD_SERVER_METRICS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "server/server.h"

namespace paramd {

// "HOST:PORT" -> (host, port); an empty host is 0.0.0.0. InvalidArgument
// otherwise.
absl::StatusOr<std::pair<std::string, int>> ParseMetricsListen(absl::string_view listen);

// The metrics endpoint is plain HTTP without authentication (neither TLS
// nor --auth_token_file covers it), so it listens on loopback only unless
// `insecure_listen_anywhere`: OK for `metrics_listen` (else, when
// `metrics_port` != 0, for 0.0.0.0:<metrics_port>) on 127.0.0.0/8, ::1 or
// localhost, or when neither is set; InvalidArgument naming the flag
// otherwise. Checked before the server starts.
absl::Status CheckMetricsListen(const std::string& metrics_listen, int metrics_port,
                                bool insecure_listen_anywhere);

struct MetricsOptions {
  // "HOST:PORT" (port 0: any free port, see port()).
  std::string listen;
  // The `role` label of every series (coordinator, daemon, both).
  std::string role = "both";
  // FP8 health: elements read per published piece at each scrape.
  int64_t fp8_samples_per_piece = 65536;
};

class MetricsExporter {
 public:
  // Serves http://<listen>/metrics. InvalidArgument for a malformed
  // address; Unavailable with civetweb's reason if it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsExporter>> Start(const MetricsOptions& options,
                                                                ParamdServer* server);
  ~MetricsExporter();

  // The bound port.
  int port() const;

  class Impl;

 private:
  explicit MetricsExporter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace paramd

#endif  // PARAMD_SERVER_METRICS_H_
