#include "server/metrics.h"

#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "prometheus/metric_family.h"

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
};

absl::StatusOr<std::unique_ptr<MetricsExporter>> MetricsExporter::Start(int port,
                                                                       ParamdServer* server) {
  auto impl = std::make_unique<Impl>();
  impl->collector = std::make_shared<Collector>(server);
  // prometheus-cpp reports bind failures by exception; this is the boundary.
  try {
    impl->exposer = std::make_unique<prometheus::Exposer>(absl::StrCat("0.0.0.0:", port), 1);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("metrics on port ", port, ": ", e.what()));
  }
  impl->exposer->RegisterCollectable(impl->collector);
  return std::unique_ptr<MetricsExporter>(new MetricsExporter(std::move(impl)));
}

MetricsExporter::MetricsExporter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetricsExporter::~MetricsExporter() = default;

}  // namespace paramd
