#include "sharding/balance.h"

#include <cmath>
#include <utility>

#include "absl/status/status.h"
#include "common/status_macros.h"

namespace paramd {
namespace sharding {

absl::StatusOr<ManifestTensor> ManifestEntry(std::string name, int64_t rows, int64_t cols,
                                             const HybridSpec& spec,
                                             const DaemonMemoryModel& model) {
  if (!(model.state_bytes_per_element >= 0) || model.published_versions < 0) {
    return absl::InvalidArgumentError("negative daemon memory model");
  }
  double published = 0;
  if (spec.rowwise_usage) {
    ASSIGN_OR_RETURN(Layout l, ComputeLayout(spec.rowwise, Direction::kRowwise, rows, cols));
    published += l.data_bytes() + l.scale_bytes();
  }
  if (spec.columnwise_usage) {
    ASSIGN_OR_RETURN(Layout l, ComputeLayout(spec.columnwise, Direction::kColumnwise, rows, cols));
    published += l.data_bytes() + l.scale_bytes();
  }
  const double elements = static_cast<double>(rows) * static_cast<double>(cols);
  ManifestTensor t;
  t.name = std::move(name);
  t.rows = rows;
  t.cols = cols;
  t.bytes_per_element =
      model.state_bytes_per_element + model.published_versions * published / elements;
  if (!(t.bytes_per_element > 0) || !std::isfinite(t.bytes_per_element)) {
    // Possible only with a zero model and no published direction.
    return absl::InvalidArgumentError("tensor costs nothing under this memory model");
  }
  return t;
}

}  // namespace sharding
}  // namespace paramd
