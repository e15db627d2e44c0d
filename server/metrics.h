// File: server/metrics.h
//
// A Prometheus text endpoint (http://<bind>:<port>/metrics, prometheus-cpp)
// for one hybrid-paramd process: committed version (coordinator), published
// version, steps, last step time, pushes and bytes served per direction
// (daemon). Values are read from the server at scrape time.
//
// Thread-safe. The server must outlive the exporter.
#ifndef PARAMD_SERVER_METRICS_H_
#define PARAMD_SERVER_METRICS_H_

#include <memory>

#include "absl/status/statusor.h"
#include "server/server.h"

namespace paramd {

class MetricsExporter {
 public:
  // Unavailable if the port cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsExporter>> Start(int port, ParamdServer* server);
  ~MetricsExporter();

  class Impl;

 private:
  explicit MetricsExporter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace paramd

#endif  // PARAMD_SERVER_METRICS_H_
