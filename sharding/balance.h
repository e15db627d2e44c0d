// File: sharding/balance.h
//
// What one element of a weight costs a daemon, for balancing the shard plan
// (sharding/plan.h) by bytes rather than by element count: the FP32 master
// and its optimizer state and gradient accumulator, plus the published
// quantized copies (both double-buffered versions: the latest and the
// previous stay fetchable) in the formats the tensor's HybridSpec asks for,
// with their scale buffers.
//
// Pure host code; thread-safe.
#ifndef PARAMD_SHARDING_BALANCE_H_
#define PARAMD_SHARDING_BALANCE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/format.h"
#include "sharding/plan.h"

namespace paramd {
namespace sharding {

struct DaemonMemoryModel {
  // FP32 master (4) + AdamW moments (8) + FP32 gradient accumulator (4).
  double state_bytes_per_element = 16.0;
  // Published versions kept per direction (double buffering).
  int published_versions = 2;
};

// The manifest entry of a [rows, cols] weight published per `spec`:
// bytes_per_element = (state bytes + published_versions x the data and
// scale bytes of every enabled direction, per ComputeLayout) / elements.
// InvalidArgument for a bad shape or format, or a negative model.
absl::StatusOr<ManifestTensor> ManifestEntry(std::string name, int64_t rows, int64_t cols,
                                             const HybridSpec& spec,
                                             const DaemonMemoryModel& model = {});

}  // namespace sharding
}  // namespace paramd

#endif  // PARAMD_SHARDING_BALANCE_H_
