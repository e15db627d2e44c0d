#include "common/telemetry.h"

#include <atomic>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace paramd {
namespace telemetry {
namespace {

// Seconds: 1 ms .. 60 s for the hot path, 10 ms .. 1 h for file work.
const prometheus::Histogram::BucketBoundaries& FastBuckets() {
  static const auto* const b = new prometheus::Histogram::BucketBoundaries{
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
  return *b;
}
const prometheus::Histogram::BucketBoundaries& SlowBuckets() {
  static const auto* const b = new prometheus::Histogram::BucketBoundaries{
      0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600};
  return *b;
}

struct Instruments {
  Instruments() : registry(std::make_shared<prometheus::Registry>()) {
    using prometheus::BuildCounter;
    using prometheus::BuildGauge;
    using prometheus::BuildHistogram;
    auto& step_f = BuildHistogram()
                       .Name("paramd_step_seconds")
                       .Help("Optimizer step wall time (daemon)")
                       .Register(*registry);
    step = &step_f.Add({}, FastBuckets());
    auto& push_f = BuildHistogram()
                       .Name("paramd_push_seconds")
                       .Help("Gradient push RPC, from its start to its status")
                       .Register(*registry);
    push_host = &push_f.Add({{"path", "host"}}, FastBuckets());
    push_device = &push_f.Add({{"path", "device"}}, FastBuckets());
    auto& fetch_f = BuildHistogram()
                        .Name("paramd_fetch_seconds")
                        .Help("Fetch RPC, from its start to its status")
                        .Register(*registry);
    fetch_host = &fetch_f.Add({{"path", "host"}}, FastBuckets());
    fetch_device = &fetch_f.Add({{"path", "device"}}, FastBuckets());
    auto& checkpoint_f = BuildHistogram()
                             .Name("paramd_checkpoint_seconds")
                             .Help("Checkpoint wall time (coordinator)")
                             .Register(*registry);
    checkpoint = &checkpoint_f.Add({}, SlowBuckets());
    auto& export_f = BuildHistogram()
                         .Name("paramd_export_seconds")
                         .Help("One exported piece (ExportRows) wall time (daemon)")
                         .Register(*registry);
    export_piece = &export_f.Add({}, SlowBuckets());
    refused = &BuildCounter()
                   .Name("paramd_refused_requests_total")
                   .Help("RPCs answered with an error, by method and gRPC code")
                   .Register(*registry);
    checkpoint_failures = &BuildCounter()
                               .Name("paramd_checkpoint_failures_total")
                               .Help("Checkpoints that failed")
                               .Register(*registry)
                               .Add({});
    checkpoint_bytes = &BuildGauge()
                            .Name("paramd_checkpoint_last_bytes")
                            .Help("Bytes written by the last successful checkpoint")
                            .Register(*registry)
                            .Add({});
    checkpoint_seconds = &BuildGauge()
                              .Name("paramd_checkpoint_last_seconds")
                              .Help("Duration of the last successful checkpoint")
                              .Register(*registry)
                              .Add({});
    checkpoint_time = &BuildGauge()
                           .Name("paramd_checkpoint_last_success_timestamp_seconds")
                           .Help("Unix time of the last successful checkpoint (0: none)")
                           .Register(*registry)
                           .Add({});
  }

  std::shared_ptr<prometheus::Registry> registry;
  prometheus::Histogram* step;
  prometheus::Histogram* push_host;
  prometheus::Histogram* push_device;
  prometheus::Histogram* fetch_host;
  prometheus::Histogram* fetch_device;
  prometheus::Histogram* checkpoint;
  prometheus::Histogram* export_piece;
  prometheus::Family<prometheus::Counter>* refused;  // Add() is thread-safe
  prometheus::Counter* checkpoint_failures;
  prometheus::Gauge* checkpoint_bytes;
  prometheus::Gauge* checkpoint_seconds;
  prometheus::Gauge* checkpoint_time;
};

Instruments& I() {
  static Instruments* const instruments = new Instruments();
  return *instruments;
}

}  // namespace

std::shared_ptr<prometheus::Registry> Registry() { return I().registry; }

void ObserveStep(double seconds) { I().step->Observe(seconds); }
void ObservePush(double seconds, bool device) {
  (device ? I().push_device : I().push_host)->Observe(seconds);
}
void ObserveFetch(double seconds, bool device) {
  (device ? I().fetch_device : I().fetch_host)->Observe(seconds);
}
void ObserveExport(double seconds) { I().export_piece->Observe(seconds); }

void ObserveCheckpoint(bool ok, double seconds, int64_t bytes) {
  I().checkpoint->Observe(seconds);
  if (!ok) {
    I().checkpoint_failures->Increment();
    return;
  }
  I().checkpoint_bytes->Set(static_cast<double>(bytes));
  I().checkpoint_seconds->Set(seconds);
  I().checkpoint_time->Set(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
}

double LastCheckpointUnixSeconds() { return I().checkpoint_time->Value(); }

void CountRefused(absl::string_view method, absl::string_view code) {
  I().refused->Add({{"method", std::string(method)}, {"code", std::string(code)}}).Increment();
}

}  // namespace telemetry
}  // namespace paramd
