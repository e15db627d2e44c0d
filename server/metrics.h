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
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "server/server.h"

namespace paramd {

// "HOST:PORT" -> (host, port); an empty host is 0.0.0.0. InvalidArgument
// otherwise.
absl::StatusOr<std::pair<std::string, int>> ParseMetricsListen(absl::string_view listen);

class MetricsExporter {
 public:
  // Serves http://<listen>/metrics; `listen` is "HOST:PORT" (port 0: any
  // free port, see port()). InvalidArgument for a malformed address;
  // Unavailable with civetweb's reason if it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsExporter>> Start(const std::string& listen,
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
