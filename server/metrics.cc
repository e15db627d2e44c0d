#include "server/metrics.h"

#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "CivetServer.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "prometheus/metric_family.h"
#include "common/status_macros.h"

namespace paramd {
namespace {

prometheus::MetricFamily Family(std::string name, std::string help, prometheus::MetricType type,
                                double value,
                                std::vector<prometheus::ClientMetric::Label> labels = {}) {
  prometheus::MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  if (type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(std::move(m));
  return f;
}

class Collector : public prometheus::Collectable {
 public:
  explicit Collector(ParamdServer* server) : server_(server) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    std::vector<prometheus::MetricFamily> out;
    if (Coordinator* c = server_->coordinator()) {
      out.push_back(Family("paramd_committed_version", "Committed model version (-1: none)",
                           MetricType::Gauge, static_cast<double>(c->committed_version())));
      // Membership: one series per joined rank (1 = heartbeats within the
      // lease), and how many leases expired since start.
      prometheus::MetricFamily up;
      up.name = "paramd_daemon_up";
      up.help = "1 if the daemon of this rank renews its lease, 0 if it is DOWN";
      up.type = MetricType::Gauge;
      for (const rpc::Member& m : c->daemon_members()) {
        prometheus::ClientMetric v;
        v.label = {{"rank", std::to_string(m.rank())}, {"address", m.address()}};
        v.gauge.value = m.state() == rpc::MEMBER_STATE_DOWN ? 0 : 1;
        up.metric.push_back(std::move(v));
      }
      out.push_back(std::move(up));
      out.push_back(Family("paramd_daemons_lost_total",
                           "Daemon leases that expired (dead or stopped daemons)",
                           MetricType::Counter, static_cast<double>(c->daemons_lost())));
    }
    if (Daemon* d = server_->daemon()) {
      const rpc::DaemonStats s = d->Stats(/*include_shards=*/false);
      out.push_back(Family("paramd_daemon_rank", "Daemon rank (-1: not joined)",
                           MetricType::Gauge, s.rank()));
      out.push_back(Family("paramd_published_version", "Latest version published here",
                           MetricType::Gauge, static_cast<double>(s.published_version())));
      out.push_back(Family("paramd_steps_total", "Optimizer steps applied", MetricType::Counter,
                           static_cast<double>(s.steps())));
      out.push_back(Family("paramd_last_step_seconds", "Wall time of the last step",
                           MetricType::Gauge, s.last_step_seconds()));
      out.push_back(Family("paramd_pushers_received", "Pushes received for the current version",
                           MetricType::Gauge, s.pushers_received()));
      out.push_back(Family("paramd_pushed_bytes_total", "Gradient bytes accepted",
                           MetricType::Counter, static_cast<double>(s.bytes_pushed())));
      prometheus::MetricFamily served =
          Family("paramd_served_bytes_total", "Quantized bytes served by fetches",
                 MetricType::Counter, static_cast<double>(s.bytes_served_rowwise()),
                 {{"direction", "rowwise"}});
      prometheus::ClientMetric col;
      col.label = {{"direction", "columnwise"}};
      col.counter.value = static_cast<double>(s.bytes_served_columnwise());
      served.metric.push_back(std::move(col));
      out.push_back(std::move(served));
    }
    return out;
  }

 private:
  ParamdServer* const server_;
};

}  // namespace

class MetricsExporter::Impl {
 public:
  std::shared_ptr<Collector> collector;
  std::unique_ptr<prometheus::Exposer> exposer;
  int port = 0;
};

namespace {

// civetweb reports why it could not start (e.g. "cannot bind to
// 0.0.0.0:9100: 98 (Address already in use)") only through its log
// callback, and prometheus-cpp's exception then says just "null context".
// mg_start runs on the calling thread, so a thread-local buffer captures
// the reason of this thread's start.
thread_local std::string* start_errors = nullptr;

int CaptureLog(const struct mg_connection*, const char* message) {
  if (start_errors == nullptr) return 0;  // civetweb prints it
  if (!start_errors->empty()) start_errors->append("; ");
  start_errors->append(message);
  return 1;
}

}  // namespace

absl::StatusOr<std::pair<std::string, int>> ParseMetricsListen(absl::string_view listen) {
  const size_t colon = listen.rfind(':');
  int port = -1;
  if (colon == absl::string_view::npos || !absl::SimpleAtoi(listen.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_listen must be HOST:PORT (e.g. 0.0.0.0:9100), got \"", listen, "\""));
  }
  std::string host(listen.substr(0, colon));
  if (host.empty()) host = "0.0.0.0";
  // civetweb takes IPv6 as "[::]:9100": keep the brackets, drop none.
  return std::make_pair(host, port);
}

absl::StatusOr<std::unique_ptr<MetricsExporter>> MetricsExporter::Start(
    const std::string& listen, ParamdServer* server) {
  ASSIGN_OR_RETURN(auto host_port, ParseMetricsListen(listen));
  auto impl = std::make_unique<Impl>();
  impl->collector = std::make_shared<Collector>(server);
  CivetCallbacks callbacks;
  callbacks.log_message = &CaptureLog;
  std::string errors;
  start_errors = &errors;
  // prometheus-cpp reports start failures by exception; this is the boundary.
  // Two worker threads: a scrape never waits behind another one.
  try {
    impl->exposer = std::make_unique<prometheus::Exposer>(
        std::vector<std::string>{"listening_ports",
                                 absl::StrCat(host_port.first, ":", host_port.second),
                                 "num_threads", "2"},
        &callbacks);
  } catch (const std::exception& e) {
    start_errors = nullptr;
    return absl::UnavailableError(absl::StrCat("metrics endpoint on ", listen, ": ",
                                               errors.empty() ? e.what() : errors));
  }
  start_errors = nullptr;
  const std::vector<int> ports = impl->exposer->GetListeningPorts();
  impl->port = ports.empty() ? host_port.second : ports[0];
  impl->exposer->RegisterCollectable(impl->collector);
  return std::unique_ptr<MetricsExporter>(new MetricsExporter(std::move(impl)));
}

int MetricsExporter::port() const { return impl_->port; }

MetricsExporter::MetricsExporter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetricsExporter::~MetricsExporter() = default;

}  // namespace paramd
