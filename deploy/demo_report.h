// File: deploy/demo_report.h
//
// What a demo trainer reports to the orchestrator, one JSON object per line
// on its stdout:
//   {"type":"step", "rank", "step", "version", "loss_sum", "samples",
//    "correct", "received":{"rowwise","columnwise"},
//    "fp32":{"rowwise","columnwise"}, "bf16":{...}, "fetch_ms",
//    "compute_ms", "push_ms", "wait_ms", "step_ms",
//    "scales":[{"tensor","direction","format","scale_inv","amax"}, ...]}
//   {"type":"final", "rank", "version", "eval_loss", "eval_samples"}
// Bytes are those of this trainer's fetches (client::FetchStats).
//
// Pure functions; thread-safe.
#ifndef PARAMD_DEPLOY_DEMO_REPORT_H_
#define PARAMD_DEPLOY_DEMO_REPORT_H_

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"

namespace paramd {
namespace demo {

struct Bytes2 {
  int64_t rowwise = 0;
  int64_t columnwise = 0;
  int64_t total() const { return rowwise + columnwise; }
};

struct ScaleReport {
  std::string tensor;
  std::string direction;  // "rowwise" / "columnwise"
  std::string format;     // FormatName()
  float scale_inv = 1.0f;
  float amax = 0.0f;
};

struct StepReport {
  int64_t rank = 0;
  int64_t step = 0;
  int64_t version = 0;
  double loss_sum = 0;
  int64_t samples = 0;
  int64_t correct = 0;
  Bytes2 received, fp32, bf16;
  double fetch_ms = 0, compute_ms = 0, push_ms = 0, wait_ms = 0, step_ms = 0;
  std::vector<ScaleReport> scales;
};

struct FinalReport {
  int64_t rank = 0;
  int64_t version = 0;
  double eval_loss = 0;  // rank 0 only; 0 elsewhere
  int64_t eval_samples = 0;
};

using Report = std::variant<StepReport, FinalReport>;

// The "scales" array of a step report:
// [{"tensor","direction","format","scale_inv","amax"}, ...].
nlohmann::json ScalesJson(const std::vector<ScaleReport>& scales);

// One line (no trailing newline).
std::string ToJsonLine(const StepReport& report);
std::string ToJsonLine(const FinalReport& report);
// InvalidArgument for a line that is not a report.
absl::StatusOr<Report> ParseReport(const std::string& line);

}  // namespace demo
}  // namespace paramd

#endif  // PARAMD_DEPLOY_DEMO_REPORT_H_
