#include "hpctl/inspect.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kernels/reference.h"
#include "re2/re2.h"
#include "safetensors/convert.h"

namespace paramd {
namespace hpctl {
namespace {

constexpr Format kAllFormats[] = {
    Format::kIdentityBf16, Format::kIdentityFp32, Format::kFp8Delayed,      Format::kFp8Current,
    Format::kMxfp8,        Format::kNvfp4,        Format::kFp8Block128x128, Format::kFp8Block1x128,
};

bool HasPerTensorScalar(Format f) {
  return f == Format::kFp8Delayed || f == Format::kFp8Current || f == Format::kNvfp4;
}

// The per-tensor scaling a daemon would use for `source` (see inspect.h).
TensorScaling ScalingFor(const QuantSpec& spec, absl::Span<const float> source) {
  const float amax = ref::Amax(source);
  if (spec.format == Format::kFp8Delayed) {
    DelayedScalingState state = ref::InitialDelayedState(spec);
    ref::DelayedRecordAmax(state, amax);
    ref::DelayedUpdate(state, state.amax_history[0], spec);
    TensorScaling scaling;
    scaling.scale = state.scale;
    scaling.global_amax = amax;
    return scaling;
  }
  return ref::ScalingFromAmax(spec, amax);
}

absl::StatusOr<ref::HybridResult> QuantizeBoth(absl::Span<const float> master, int64_t rows,
                                               int64_t cols, const HybridSpec& spec) {
  ref::HybridScaling scaling;
  const std::vector<float> source = ref::RoundToSource(master, spec.source_dtype);
  scaling.rowwise = ScalingFor(spec.rowwise, source);
  if (spec.columnwise_usage) {
    ASSIGN_OR_RETURN(std::vector<float> col_source,
                     ref::ColumnwiseSourceValues(master, rows, cols, spec, scaling.rowwise));
    scaling.columnwise = ScalingFor(spec.columnwise, col_source);
  }
  return ref::QuantizeHybrid(master, rows, cols, spec, scaling);
}

absl::StatusOr<ErrorStats> ErrorOf(const QuantizedTensor& q, const QuantSpec& spec,
                                   absl::Span<const float> master) {
  ASSIGN_OR_RETURN(std::vector<float> back, ref::Dequantize(q, spec));
  return CompareValues(master, back);
}

std::string HumanBytes(double bytes) {
  if (bytes < 1024) return absl::StrFormat("%.0f B", bytes);
  if (bytes < 1024.0 * 1024) return absl::StrFormat("%.1f KiB", bytes / 1024);
  if (bytes < 1024.0 * 1024 * 1024) return absl::StrFormat("%.2f MiB", bytes / (1024.0 * 1024));
  return absl::StrFormat("%.2f GiB", bytes / (1024.0 * 1024 * 1024));
}

std::string Sqnr(double db) { return std::isinf(db) ? "inf" : absl::StrFormat("%.1f", db); }

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

// Columns padded to their widest cell; numeric columns right-aligned.
class Table {
 public:
  explicit Table(std::vector<std::string> header, std::vector<bool> right_aligned)
      : right_(std::move(right_aligned)) {
    rows_.push_back(std::move(header));
  }
  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  std::string Render() const {
    std::vector<size_t> width(rows_[0].size(), 0);
    for (const auto& row : rows_) {
      for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
    }
    std::string out;
    for (size_t r = 0; r < rows_.size(); ++r) {
      std::string line;
      for (size_t c = 0; c < rows_[r].size(); ++c) {
        const std::string& cell = rows_[r][c];
        std::string pad(width[c] - cell.size(), ' ');
        if (c > 0) line += "  ";
        line += right_[c] ? pad + cell : cell + pad;
      }
      while (!line.empty() && line.back() == ' ') line.pop_back();
      absl::StrAppend(&out, line, "\n");
      if (r == 0) {
        size_t total = 0;
        for (size_t w : width) total += w;
        absl::StrAppend(&out, std::string(total + 2 * (width.size() - 1), '-'), "\n");
      }
    }
    return out;
  }

 private:
  std::vector<bool> right_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace

ErrorStats CompareValues(absl::Span<const float> reference, absl::Span<const float> approx) {
  double signal = 0, noise = 0, max_abs = 0;
  for (size_t i = 0; i < reference.size() && i < approx.size(); ++i) {
    const double r = reference[i];
    const double d = static_cast<double>(approx[i]) - r;
    signal += r * r;
    noise += d * d;
    max_abs = std::max(max_abs, std::abs(d));
  }
  ErrorStats stats;
  stats.max_abs = max_abs;
  stats.rel_l2 = signal > 0 ? std::sqrt(noise / signal) : (noise > 0 ? INFINITY : 0.0);
  stats.sqnr_db = noise > 0 ? 10 * std::log10(signal / noise) : INFINITY;
  return stats;
}

absl::StatusOr<TensorResult> InspectTensor(absl::string_view name, absl::Span<const float> values,
                                           int64_t rows, int64_t cols, const HybridSpec& spec,
                                           bool all_formats) {
  TensorResult result;
  result.name = std::string(name);
  result.rows = rows;
  result.cols = cols;
  result.spec = spec;
  ASSIGN_OR_RETURN(ref::HybridResult q, QuantizeBoth(values, rows, cols, spec));
  for (const auto& [copy, qspec] : {std::make_pair(&q.rowwise, &spec.rowwise),
                                    std::make_pair(&q.columnwise, &spec.columnwise)}) {
    if (!copy->has_value()) continue;
    const QuantizedTensor& t = **copy;
    DirectionResult d;
    d.direction = t.direction;
    d.spec = *qspec;
    d.data_bytes = static_cast<int64_t>(t.data.size());
    d.scale_bytes =
        static_cast<int64_t>(t.scales.size()) + (HasPerTensorScalar(qspec->format) ? 4 : 0);
    ASSIGN_OR_RETURN(d.error, ErrorOf(t, *qspec, values));
    result.directions.push_back(d);
  }
  if (all_formats) {
    for (Format f : kAllFormats) {
      HybridSpec one;
      one.rowwise = one.columnwise = DefaultQuantSpec(f);
      one.source_dtype = spec.source_dtype;
      one.rowwise.source_dtype = one.columnwise.source_dtype = spec.source_dtype;
      ASSIGN_OR_RETURN(ref::HybridResult qf, QuantizeBoth(values, rows, cols, one));
      FormatErrors e;
      e.format = f;
      ASSIGN_OR_RETURN(e.rowwise, ErrorOf(*qf.rowwise, one.rowwise, values));
      ASSIGN_OR_RETURN(e.columnwise, ErrorOf(*qf.columnwise, one.columnwise, values));
      result.all_formats.push_back(e);
    }
  }
  return result;
}

absl::StatusOr<InspectReport> InspectModel(const safetensors::ShardedSafetensors& model,
                                           const Recipe& recipe, const InspectOptions& options) {
  InspectReport report;
  report.recipe_name = recipe.name();
  std::optional<RE2> filter;
  if (!options.filter.empty()) {
    RE2::Options re2_options;
    re2_options.set_log_errors(false);
    filter.emplace(options.filter, re2_options);
    if (!filter->ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "filter \"", options.filter, "\" is not a valid RE2 regex: ", filter->error()));
    }
  }
  for (const safetensors::ShardedSafetensors::Entry& entry : model.tensors()) {
    const safetensors::TensorInfo& info = *entry.info;
    if (filter && !RE2::PartialMatch(info.name, *filter)) continue;
    if (!safetensors::ConvertsToFloat(info.dtype)) {
      report.skipped.push_back(
          absl::StrCat(info.name, " (dtype ", safetensors::DtypeName(info.dtype), ")"));
      continue;
    }
    if (info.num_elements == 0) {
      report.skipped.push_back(absl::StrCat(info.name, " (no elements)"));
      continue;
    }
    const int64_t cols = info.shape.empty() ? 1 : info.shape.back();
    const int64_t rows = info.num_elements / cols;
    ASSIGN_OR_RETURN(std::vector<float> values, safetensors::ReadTensorAsFloat(*entry.file, info));
    const Recipe::Match match = recipe.Resolve(info.name);
    absl::StatusOr<TensorResult> result =
        InspectTensor(info.name, values, rows, cols, *match.spec, options.all_formats);
    if (!result.ok()) {
      return absl::Status(result.status().code(),
                          absl::StrCat("tensor '", info.name, "': ", result.status().message()));
    }
    result->shape = info.shape;
    result->rule = recipe.DescribeMatch(match);
    report.tensors.push_back(*std::move(result));
  }
  return report;
}

std::string RenderReport(const InspectReport& report, const InspectOptions& options) {
  std::string out = absl::StrCat(
      "Recipe: ", report.recipe_name.empty() ? "(unnamed)" : report.recipe_name, "\n",
      "Errors: quantize -> dequantize with the CPU reference, against the FP32 values in the "
      "file.\nScales: current scaling and NVFP4 from the tensor's amax; delayed scaling from a "
      "fresh state after one warm-up step (amax recorded, scale updated).\n\n");
  Table table({"tensor", "shape", "rule", "src", "dir", "format", "data", "scales", "rel_l2",
               "max_abs", "SQNR_dB"},
              {false, false, false, false, false, false, true, true, true, true, true});
  int64_t elements = 0;
  int64_t bytes[2] = {0, 0};  // by direction
  for (const TensorResult& t : report.tensors) {
    elements += t.rows * t.cols;
    for (const DirectionResult& d : t.directions) {
      std::string from;
      if (d.direction == Direction::kColumnwise &&
          t.spec.columnwise_source == ColumnwiseSource::kRowwiseDequantized) {
        from = " <-row";
      }
      table.Add({t.name, ShapeText(t.shape), t.rule,
                 t.spec.source_dtype == SourceDtype::kFp32 ? "fp32" : "bf16",
                 d.direction == Direction::kRowwise ? "row" : "col" + from,
                 DescribeQuantSpec(d.spec), HumanBytes(d.data_bytes), HumanBytes(d.scale_bytes),
                 absl::StrFormat("%.3e", d.error.rel_l2), absl::StrFormat("%.3e", d.error.max_abs),
                 Sqnr(d.error.sqnr_db)});
      bytes[static_cast<int>(d.direction)] += d.data_bytes + d.scale_bytes;
    }
  }
  absl::StrAppend(&out, table.Render());

  const double fp32 = 4.0 * elements, bf16 = 2.0 * elements;
  auto share = [&](double b) {
    return absl::StrFormat("%10s  = %5.1f%% of FP32, %5.1f%% of BF16", HumanBytes(b),
                           100 * b / fp32, 100 * b / bf16);
  };
  absl::StrAppend(&out, "\nTotals over ", report.tensors.size(), " tensors (", elements,
                  " elements):\n");
  absl::StrAppend(&out, "  FP32 master            ", absl::StrFormat("%10s", HumanBytes(fp32)),
                  "\n");
  absl::StrAppend(&out, "  BF16 copy              ", absl::StrFormat("%10s", HumanBytes(bf16)),
                  "\n");
  absl::StrAppend(&out, "  rowwise published      ", share(bytes[0]), "\n");
  absl::StrAppend(&out, "  columnwise published   ", share(bytes[1]), "\n");
  absl::StrAppend(&out, "  both directions        ", share(bytes[0] + bytes[1]), "\n");
  if (!report.skipped.empty()) {
    absl::StrAppend(&out, "Skipped: ", absl::StrJoin(report.skipped, ", "), "\n");
  }

  if (options.all_formats) {
    std::vector<std::string> header = {"tensor", "dir"};
    std::vector<bool> right = {false, false};
    for (Format f : kAllFormats) {
      header.push_back(std::string(FormatName(f)));
      right.push_back(true);
    }
    Table all(header, right);
    for (const TensorResult& t : report.tensors) {
      for (Direction dir : {Direction::kRowwise, Direction::kColumnwise}) {
        std::vector<std::string> row = {t.name, dir == Direction::kRowwise ? "row" : "col"};
        for (const FormatErrors& e : t.all_formats) {
          row.push_back(
              Sqnr(dir == Direction::kRowwise ? e.rowwise.sqnr_db : e.columnwise.sqnr_db));
        }
        all.Add(row);
      }
    }
    absl::StrAppend(&out,
                    "\nSQNR in dB of every format (defaults of FORMATS.md, the tensor's source "
                    "dtype, columnwise from the original); higher is better, inf = exact:\n",
                    all.Render());
  }
  return out;
}

}  // namespace hpctl
}  // namespace paramd
