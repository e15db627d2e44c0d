#include "server/metrics.h"

#include <algorithm>
#include <exception>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "CivetServer.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "auth/security.h"
#include "common/build_info.h"
#include "common/status_macros.h"
#include "common/telemetry.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "server/process_metrics.h"

namespace paramd {
namespace {

using prometheus::MetricType;
using Labels = std::vector<prometheus::ClientMetric::Label>;

prometheus::ClientMetric Metric(MetricType type, double value, Labels labels = {}) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  if (type == MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  return m;
}

prometheus::MetricFamily Family(std::string name, std::string help, MetricType type,
                                std::vector<prometheus::ClientMetric> metrics) {
  prometheus::MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  f.metric = std::move(metrics);
  return f;
}

prometheus::MetricFamily Gauge(std::string name, std::string help, double value) {
  return Family(std::move(name), std::move(help), MetricType::Gauge,
                {Metric(MetricType::Gauge, value)});
}

prometheus::MetricFamily Counter(std::string name, std::string help, double value) {
  return Family(std::move(name), std::move(help), MetricType::Counter,
                {Metric(MetricType::Counter, value)});
}

// The standard process_* series (server/process_metrics.h).
void AppendProcessMetrics(const ProcessStats& p, std::vector<prometheus::MetricFamily>* out) {
  out->push_back(Counter("process_cpu_seconds_total",
                         "Total user and system CPU time spent in "
                         "seconds",
                         p.cpu_seconds));
  out->push_back(
      Gauge("process_resident_memory_bytes", "Resident memory size in bytes", p.resident_bytes));
  out->push_back(
      Gauge("process_virtual_memory_bytes", "Virtual memory size in bytes", p.virtual_bytes));
  out->push_back(Gauge("process_open_fds", "Number of open file descriptors", p.open_fds));
  out->push_back(Gauge("process_max_fds", "Maximum number of open file descriptors", p.max_fds));
  out->push_back(Gauge("process_start_time_seconds",
                       "Start time of the process since unix epoch in seconds",
                       p.start_time_seconds));
}

// A coordinator's recovery state: failing (the last attempt failed; it is
// retried, or waits for a load) and needing a load (nothing to recover
// from), and how many recoveries completed.
void AppendRecoveryMetrics(const rpc::RecoveryStatus& r,
                           std::vector<prometheus::MetricFamily>* out) {
  out->push_back(Gauge("paramd_recovery_failed",
                       "1 while the last recovery attempt after a lost daemon failed (retried "
                       "every 2 s, or waiting for a load: paramd_recovery_needs_load)",
                       r.error().empty() ? 0 : 1));
  out->push_back(Gauge("paramd_recovery_needs_load",
                       "1 while the cluster cannot serve until a load replaces lost state (a "
                       "recovery found nothing to recover from: hpctl load MODEL --force)",
                       r.needs_load() ? 1 : 0));
  out->push_back(Counter("paramd_recoveries_total", "Recoveries completed since start",
                         static_cast<double>(r.epoch())));
}

// Per (tensor, direction): the amax and scale of the cast, and the fraction
// of sampled codes saturated / zero, summed over this daemon's pieces.
void AppendFp8Health(const std::vector<PieceHealth>& pieces,
                     std::vector<prometheus::MetricFamily>* out) {
  struct Entry {
    float amax = 0.0f;
    float scale = 1.0f;
    bool has_codes = false;
    CodeCounts codes;
  };
  std::map<std::pair<std::string, std::string>, Entry> by_tensor;
  for (const PieceHealth& p : pieces) {
    if (p.format == Format::kIdentityBf16 || p.format == Format::kIdentityFp32) continue;
    Entry& e = by_tensor[{p.tensor, p.direction == Direction::kRowwise ? "rowwise" : "columnwise"}];
    e.amax = std::max(e.amax, p.amax);
    e.scale = p.scale;  // per-tensor: the same on every piece
    if (p.codes) {
      e.has_codes = true;
      e.codes.sampled += p.codes->sampled;
      e.codes.saturated += p.codes->saturated;
      e.codes.zero += p.codes->zero;
    }
  }
  if (by_tensor.empty()) return;
  std::vector<prometheus::ClientMetric> amax, scale, saturated, zero;
  for (const auto& [key, e] : by_tensor) {
    const Labels labels = {{"tensor", key.first}, {"direction", key.second}};
    amax.push_back(Metric(MetricType::Gauge, e.amax, labels));
    scale.push_back(Metric(MetricType::Gauge, e.scale, labels));
    if (e.has_codes && e.codes.sampled > 0) {
      const double n = static_cast<double>(e.codes.sampled);
      saturated.push_back(Metric(MetricType::Gauge, e.codes.saturated / n, labels));
      zero.push_back(Metric(MetricType::Gauge, e.codes.zero / n, labels));
    }
  }
  out->push_back(Family("paramd_tensor_amax",
                        "amax the latest cast of this tensor and direction used (this daemon's "
                        "pieces; per-tensor FP8: the global amax, NVFP4: the global A)",
                        MetricType::Gauge, std::move(amax)));
  out->push_back(Family("paramd_tensor_scale",
                        "per-tensor FP8 scale (multiplier) of the latest cast; 1 for block formats",
                        MetricType::Gauge, std::move(scale)));
  if (!saturated.empty()) {
    out->push_back(Family("paramd_tensor_saturated_fraction",
                          "fraction of sampled published codes at the format's largest "
                          "magnitude (clamped by the cast, or at amax)",
                          MetricType::Gauge, std::move(saturated)));
    out->push_back(Family("paramd_tensor_zero_fraction",
                          "fraction of sampled published codes that are zero (flushed to zero "
                          "by the cast, or zero in the source)",
                          MetricType::Gauge, std::move(zero)));
  }
}

class Collector : public prometheus::Collectable {
 public:
  Collector(ParamdServer* server, MetricsOptions options)
      : server_(server),
        options_(std::move(options)),
        started_(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch())) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out = telemetry::Registry()->Collect();
    const BuildInfo& build = GetBuildInfo();
    out.push_back(Family(
        "paramd_build_info", "Version, git commit and compilation mode (1)", MetricType::Gauge,
        {Metric(MetricType::Gauge, 1,
                {{"version", build.version}, {"commit", build.commit}, {"mode", build.mode}})}));
    const absl::StatusOr<ProcessStats> process = ReadProcessStats();
    const ProcessStats p = process.ok() ? *process : ProcessStats{};
    if (process.ok()) AppendProcessMetrics(p, &out);
    out.push_back(Gauge("paramd_host_memory_bytes", "Resident host memory of this process",
                        p.resident_bytes));
    int rank = -1;
    if (Coordinator* c = server_->coordinator()) {
      // Present from the start, so that an alert on it fires when no
      // checkpoint was ever taken: before the first, the process's age.
      const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
      const double last = telemetry::LastCheckpointUnixSeconds();
      const double since = last > 0                   ? last
                           : p.start_time_seconds > 0 ? p.start_time_seconds
                                                      : started_;
      out.push_back(Gauge("paramd_checkpoint_age_seconds",
                          "Seconds since this coordinator's last successful checkpoint; before "
                          "its first one, seconds since the process started",
                          std::max(0.0, now - since)));
      AppendRecoveryMetrics(c->recovery(), &out);
      out.push_back(Gauge("paramd_committed_version", "Committed model version (-1: none)",
                          static_cast<double>(c->committed_version())));
      out.push_back(
          Gauge("paramd_daemons_joined", "Daemons that have joined", c->joined_daemons()));
      out.push_back(Gauge("paramd_daemons_expected", "Daemons the world is waiting for",
                          c->expected_daemons()));
      // Membership: one series per joined rank (1 = heartbeats within the
      // lease and the rank's state held), and how many leases expired
      // since start.
      std::vector<prometheus::ClientMetric> up;
      for (const rpc::Member& m : c->daemon_members()) {
        up.push_back(Metric(MetricType::Gauge, m.state() == rpc::MEMBER_STATE_ALIVE ? 1 : 0,
                            {{"rank", std::to_string(m.rank())}, {"address", m.address()}}));
      }
      out.push_back(Family("paramd_daemon_up",
                           "1 if the daemon of this rank renews its lease and holds the rank's "
                           "state; 0 if it is DOWN or a replacement still without the state "
                           "(recovering, or a failed recovery waiting for a load)",
                           MetricType::Gauge, std::move(up)));
      out.push_back(Counter("paramd_daemons_lost_total",
                            "Daemon leases that expired (dead or stopped daemons)",
                            static_cast<double>(c->daemons_lost())));
    }
    if (Daemon* d = server_->daemon()) {
      const rpc::DaemonStats s = d->Stats(/*include_shards=*/false);
      rank = s.rank();
      out.push_back(Gauge("paramd_daemon_rank", "Daemon rank (-1: not joined)", s.rank()));
      out.push_back(Gauge("paramd_published_version", "Latest version published here",
                          static_cast<double>(s.published_version())));
      out.push_back(
          Counter("paramd_steps_total", "Optimizer steps applied", static_cast<double>(s.steps())));
      out.push_back(
          Gauge("paramd_last_step_seconds", "Wall time of the last step", s.last_step_seconds()));
      out.push_back(
          Gauge("paramd_optimizer_lr", "Base lr (schedule) of the last optimizer step", s.lr()));
      out.push_back(Gauge("paramd_grad_norm",
                          "Global gradient norm of the last step (-1: not computed)",
                          s.grad_norm()));
      out.push_back(Gauge("paramd_grad_clip_factor", "Clip factor applied to the last step",
                          s.clip_factor()));
      out.push_back(Gauge("paramd_optimizer_steps",
                          "Optimizer step counter (bias correction, schedule)",
                          static_cast<double>(s.optimizer_steps())));
      out.push_back(Counter("paramd_skipped_steps_total",
                            "Steps skipped for a non-finite gradient norm (non_finite: SKIP_STEP)",
                            static_cast<double>(s.skipped_steps())));
      out.push_back(Gauge("paramd_pushers_received", "Pushes received for the current version",
                          s.pushers_received()));
      out.push_back(Counter("paramd_pushed_bytes_total", "Gradient bytes accepted",
                            static_cast<double>(s.bytes_pushed())));
      out.push_back(Family(
          "paramd_served_bytes_total", "Quantized bytes served by fetches", MetricType::Counter,
          {Metric(MetricType::Counter, static_cast<double>(s.bytes_served_rowwise()),
                  {{"direction", "rowwise"}}),
           Metric(MetricType::Counter, static_cast<double>(s.bytes_served_columnwise()),
                  {{"direction", "columnwise"}})}));
      out.push_back(Gauge("paramd_parameters", "Parameters held by this daemon",
                          static_cast<double>(s.parameters())));
      out.push_back(Gauge("paramd_device_memory_bytes",
                          "Device memory of this daemon's shard state (0: cpu backend)",
                          static_cast<double>(s.device_bytes())));
      AppendFp8Health(d->PublishedHealth(options_.fp8_samples_per_piece), &out);
    }
    // Every series names the process that serves it, unless it names a
    // rank of its own (paramd_daemon_up: the daemon it describes).
    const std::string rank_label = rank >= 0 ? absl::StrCat(rank) : "-";
    for (prometheus::MetricFamily& f : out) {
      for (prometheus::ClientMetric& m : f.metric) {
        const bool has_rank =
            std::any_of(m.label.begin(), m.label.end(),
                        [](const prometheus::ClientMetric::Label& l) { return l.name == "rank"; });
        m.label.push_back({"role", options_.role});
        if (!has_rank) m.label.push_back({"rank", rank_label});
      }
    }
    return out;
  }

 private:
  ParamdServer* const server_;
  const MetricsOptions options_;
  const double started_;  // unix seconds: the process's start where /proc is not read
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

absl::Status CheckMetricsListen(const std::string& metrics_listen, int metrics_port,
                                bool insecure_listen_anywhere) {
  std::string flag = "--metrics_listen";
  std::string listen = metrics_listen;
  if (listen.empty()) {
    if (metrics_port == 0) return absl::OkStatus();
    flag = absl::StrCat("--metrics_port=", metrics_port, " (0.0.0.0:", metrics_port, ")");
    listen = absl::StrCat("0.0.0.0:", metrics_port);
  }
  RETURN_IF_ERROR(ParseMetricsListen(listen).status());  // a malformed address first
  // Loopback or opted in: the same rule as the gRPC ports, without the TLS
  // way out (the endpoint has none).
  if (auth::CheckListenAddress(listen, /*tls=*/false, insecure_listen_anywhere).ok()) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      metrics_listen.empty() ? flag : absl::StrCat(flag, "=", listen),
      " is not a loopback address: the metrics endpoint is plain HTTP without "
      "authentication (TLS and --auth_token_file do not cover it), so it listens on "
      "loopback only (127.0.0.1, ::1, localhost). Give --insecure_listen_anywhere to serve it "
      "to the network anyway (firewall it to the scraper), or scrape it on this host "
      "(docs/SECURITY.md)"));
}

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
    const MetricsOptions& options, ParamdServer* server) {
  const std::string& listen = options.listen;
  ASSIGN_OR_RETURN(auto host_port, ParseMetricsListen(listen));
  auto impl = std::make_unique<Impl>();
  impl->collector = std::make_shared<Collector>(server, options);
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
    return absl::UnavailableError(
        absl::StrCat("metrics endpoint on ", listen, ": ", errors.empty() ? e.what() : errors));
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
