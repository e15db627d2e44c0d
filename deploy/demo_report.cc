#include "deploy/demo_report.h"

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace paramd {
namespace demo {
namespace {

using nlohmann::json;

json BytesJson(const Bytes2& b) { return {{"rowwise", b.rowwise}, {"columnwise", b.columnwise}}; }

Bytes2 BytesFrom(const json& j) {
  return {j.at("rowwise").get<int64_t>(), j.at("columnwise").get<int64_t>()};
}

}  // namespace

json ScalesJson(const std::vector<ScaleReport>& scales) {
  json out = json::array();
  for (const ScaleReport& s : scales) {
    out.push_back({{"tensor", s.tensor},
                   {"direction", s.direction},
                   {"format", s.format},
                   {"scale_inv", s.scale_inv},
                   {"amax", s.amax}});
  }
  return out;
}

std::string ToJsonLine(const StepReport& r) {
  json j = {{"type", "step"},
            {"rank", r.rank},
            {"step", r.step},
            {"version", r.version},
            {"loss_sum", r.loss_sum},
            {"samples", r.samples},
            {"correct", r.correct},
            {"received", BytesJson(r.received)},
            {"fp32", BytesJson(r.fp32)},
            {"bf16", BytesJson(r.bf16)},
            {"fetch_ms", r.fetch_ms},
            {"compute_ms", r.compute_ms},
            {"push_ms", r.push_ms},
            {"wait_ms", r.wait_ms},
            {"step_ms", r.step_ms},
            {"scales", ScalesJson(r.scales)}};
  return j.dump();
}

std::string ToJsonLine(const FinalReport& r) {
  json j = {{"type", "final"},
            {"rank", r.rank},
            {"version", r.version},
            {"eval_loss", r.eval_loss},
            {"eval_samples", r.eval_samples}};
  return j.dump();
}

absl::StatusOr<Report> ParseReport(const std::string& line) {
  json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("type")) {
    return absl::InvalidArgumentError(absl::StrCat("not a report: ", line));
  }
  // nlohmann reports missing or mistyped fields by exception only.
  try {
    if (j["type"] == "step") {
      StepReport r;
      r.rank = j.at("rank").get<int64_t>();
      r.step = j.at("step").get<int64_t>();
      r.version = j.at("version").get<int64_t>();
      r.loss_sum = j.at("loss_sum").get<double>();
      r.samples = j.at("samples").get<int64_t>();
      r.correct = j.at("correct").get<int64_t>();
      r.received = BytesFrom(j.at("received"));
      r.fp32 = BytesFrom(j.at("fp32"));
      r.bf16 = BytesFrom(j.at("bf16"));
      r.fetch_ms = j.at("fetch_ms").get<double>();
      r.compute_ms = j.at("compute_ms").get<double>();
      r.push_ms = j.at("push_ms").get<double>();
      r.wait_ms = j.at("wait_ms").get<double>();
      r.step_ms = j.at("step_ms").get<double>();
      for (const json& s : j.at("scales")) {
        r.scales.push_back({s.at("tensor").get<std::string>(), s.at("direction").get<std::string>(),
                            s.at("format").get<std::string>(), s.at("scale_inv").get<float>(),
                            s.at("amax").get<float>()});
      }
      return r;
    }
    if (j["type"] == "final") {
      FinalReport r;
      r.rank = j.at("rank").get<int64_t>();
      r.version = j.at("version").get<int64_t>();
      r.eval_loss = j.at("eval_loss").get<double>();
      r.eval_samples = j.at("eval_samples").get<int64_t>();
      return r;
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("bad report (", e.what(), "): ", line));
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown report type: ", line));
}

}  // namespace demo
}  // namespace paramd
