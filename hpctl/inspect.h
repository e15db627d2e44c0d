// File: hpctl/inspect.h
//
// The core of `hpctl inspect`: for every tensor of a model, the hybrid spec
// a recipe gives it, the bytes each published direction takes, and what
// quantize -> dequantize with the CPU reference (kernels/reference.h) does
// to its values. Errors are measured against the FP32 values read from the
// file, so the source rounding of D1 (BF16 by default) is part of them.
//
// Per-tensor scales: current scaling and NVFP4 use ref::Amax +
// ref::ScalingFromAmax of the direction's source; delayed scaling starts
// from a fresh state (scale 1, zero history) and runs one warm-up step
// (DelayedRecordAmax + DelayedUpdate) so that the scale is the one a daemon
// would use at step 2.
//
// Pure functions over in-memory values (InspectModel reads the file);
// thread-safe; CPU-bound (a 4096 x 4096 tensor takes about a second per
// format).
#ifndef PARAMD_HPCTL_INSPECT_H_
#define PARAMD_HPCTL_INSPECT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/format.h"
#include "recipe/recipe.h"
#include "safetensors/sharded.h"

namespace paramd {
namespace hpctl {

// How far `approx` is from `reference` (same length).
struct ErrorStats {
  double rel_l2 = 0;   // ||approx - ref|| / ||ref||  (0 if both are 0)
  double max_abs = 0;  // max |approx - ref|
  double sqnr_db = 0;  // 10 log10(sum ref^2 / sum (approx - ref)^2); +inf if exact
};
ErrorStats CompareValues(absl::Span<const float> reference, absl::Span<const float> approx);

struct DirectionResult {
  Direction direction = Direction::kRowwise;
  QuantSpec spec;
  int64_t data_bytes = 0;
  // Scale buffer plus the per-tensor fp32 scalar of per-tensor FP8
  // (scale_inv) and NVFP4 (global amax).
  int64_t scale_bytes = 0;
  ErrorStats error;
};

struct FormatErrors {
  Format format = Format::kIdentityBf16;
  ErrorStats rowwise;
  ErrorStats columnwise;
};

struct TensorResult {
  std::string name;
  std::vector<int64_t> shape;
  int64_t rows = 0;  // the 2-D view quantized: [prod(shape[:-1]), shape[-1]]
  int64_t cols = 0;
  std::string rule;  // Recipe::DescribeMatch
  HybridSpec spec;
  std::vector<DirectionResult> directions;  // the used ones, rowwise first
  std::vector<FormatErrors> all_formats;    // filled when asked for
};

// Quantizes `values` ([rows][cols], FP32) per `spec` and measures each used
// direction; with `all_formats`, also every format alone (DefaultQuantSpec,
// the spec's source_dtype, columnwise from the original).
absl::StatusOr<TensorResult> InspectTensor(absl::string_view name, absl::Span<const float> values,
                                           int64_t rows, int64_t cols, const HybridSpec& spec,
                                           bool all_formats);

struct InspectOptions {
  bool all_formats = false;
  // Only tensors whose name contains a match of this RE2 regex
  // (empty = all). InspectModel refuses an invalid one.
  std::string filter;
};

struct InspectReport {
  std::vector<TensorResult> tensors;
  // Tensors not inspected, with the reason (integer dtype, no elements).
  std::vector<std::string> skipped;
  std::string recipe_name;
};

// Every tensor of `model`, in file order.
absl::StatusOr<InspectReport> InspectModel(const safetensors::ShardedSafetensors& model,
                                           const Recipe& recipe, const InspectOptions& options);

// The aligned tables and totals that `hpctl inspect` prints.
std::string RenderReport(const InspectReport& report, const InspectOptions& options);

}  // namespace hpctl
}  // namespace paramd

#endif  // PARAMD_HPCTL_INSPECT_H_
