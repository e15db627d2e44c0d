// File: hpctl/generate.h
//
// Synthetic models for `hpctl generate`, the demo and tests: a handful of
// tensors named like a transformer's, with odd shapes (1 x N, primes, a
// scalar), realistic per-tensor magnitudes (embeddings ~0.02, linear
// weights ~1/sqrt(fan_in), norms ~1, biases ~0.01) and a few outlier
// columns, so every command runs without downloading a model.
//
// Values are deterministic in (seed, tensor name) on a given standard
// library. Pure functions except GenerateModel (file I/O, blocking).
#ifndef PARAMD_HPCTL_GENERATE_H_
#define PARAMD_HPCTL_GENERATE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "safetensors/safetensors.h"

namespace paramd {
namespace hpctl {

enum class SyntheticKind { kLinear, kEmbedding, kNorm, kBias };

struct SyntheticTensor {
  std::string name;
  std::vector<int64_t> shape;
  SyntheticKind kind = SyntheticKind::kLinear;
  // Multiplies the base standard deviation (per-tensor magnitude spread).
  float scale = 1.0f;
  // Columns (last dimension) multiplied by `outlier_scale`.
  std::vector<int64_t> outlier_columns;
  float outlier_scale = 1.0f;
};

// "small" (~0.4 MB as F32, for tests) or "demo" (includes a 4096 x 4096
// weight; ~90 MB as F32). InvalidArgument names the presets otherwise.
absl::StatusOr<std::vector<SyntheticTensor>> PresetTensors(absl::string_view preset);

// The FP32 values of `tensor`, row-major.
std::vector<float> SyntheticValues(const SyntheticTensor& tensor, uint64_t seed);

struct GenerateOptions {
  std::string preset = "small";
  uint64_t seed = 1;
  // Element type on disk: F32 (masters) or BF16 (RNE from the FP32 values).
  safetensors::Dtype dtype = safetensors::Dtype::kF32;
};

// Writes the model to `path` (atomically, one tensor in memory at a time)
// with __metadata__ {"generator": "hpctl generate", "preset", "seed"}.
absl::Status GenerateModel(const std::string& path, const GenerateOptions& options);

}  // namespace hpctl
}  // namespace paramd

#endif  // PARAMD_HPCTL_GENERATE_H_
