#include "hpctl/generate.h"

#include <cmath>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "safetensors/convert.h"

namespace paramd {
namespace hpctl {
namespace {

using K = SyntheticKind;

// FNV-1a: a stable per-name seed (std::hash is not specified).
uint64_t HashName(absl::string_view name) {
  uint64_t h = 1469598103934665603ull;
  for (char c : name) {
    h ^= static_cast<uint8_t>(c);
    h *= 1099511628211ull;
  }
  return h;
}

std::vector<SyntheticTensor> Small() {
  return {
      {"embed.weight", {256, 64}, K::kEmbedding},
      {"layers.0.norm.weight", {64}, K::kNorm},
      {"layers.0.attn.qkv.weight", {192, 64}, K::kLinear, 1.0f, {3, 17}, 25.0f},
      {"layers.0.attn.qkv.bias", {192}, K::kBias},
      {"layers.0.attn.out.weight", {64, 64}, K::kLinear, 0.5f},
      {"layers.0.gate.weight", {1, 64}, K::kLinear, 2.0f},
      {"layers.0.mlp.fc1.weight", {257, 64}, K::kLinear},
      {"layers.0.mlp.fc2.weight", {64, 257}, K::kLinear, 0.7f, {100}, 40.0f},
      {"head.weight", {37, 64}, K::kLinear, 1.5f},
      {"logit_scale", {}, K::kNorm},
  };
}

std::vector<SyntheticTensor> Demo() {
  return {
      {"embed.weight", {1000, 512}, K::kEmbedding},
      {"layers.0.norm.weight", {512}, K::kNorm},
      {"layers.0.attn.qkv.weight", {1536, 512}, K::kLinear, 1.0f, {7, 300}, 25.0f},
      {"layers.0.attn.qkv.bias", {1536}, K::kBias},
      {"layers.0.attn.out.weight", {512, 512}, K::kLinear, 0.5f},
      {"layers.0.gate.weight", {1, 512}, K::kLinear, 2.0f},
      {"layers.0.router.weight", {7, 513}, K::kLinear},
      {"layers.0.mlp.fc1.weight", {4096, 4096}, K::kLinear, 1.0f, {11, 2048}, 30.0f},
      {"layers.0.mlp.fc2.weight", {333, 1000}, K::kLinear, 0.7f, {100}, 40.0f},
      {"head.weight", {999, 512}, K::kLinear, 1.5f},
      {"logit_scale", {}, K::kNorm},
  };
}

}  // namespace

absl::StatusOr<std::vector<SyntheticTensor>> PresetTensors(absl::string_view preset) {
  if (preset == "small") return Small();
  if (preset == "demo") return Demo();
  return absl::InvalidArgumentError(
      absl::StrCat("unknown preset '", preset, "' (choose small or demo)"));
}

std::vector<float> SyntheticValues(const SyntheticTensor& tensor, uint64_t seed) {
  int64_t n = 1;
  for (int64_t d : tensor.shape) n *= d;
  const int64_t cols = tensor.shape.empty() ? 1 : tensor.shape.back();
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull ^ HashName(tensor.name));
  float mean = 0.0f;
  float stddev = 0.0f;
  switch (tensor.kind) {
    case K::kEmbedding:
      stddev = 0.02f;
      break;
    case K::kLinear:
      stddev = 1.0f / std::sqrt(static_cast<float>(cols));
      break;
    case K::kNorm:
      mean = 1.0f;
      stddev = 0.05f;
      break;
    case K::kBias:
      stddev = 0.01f;
      break;
  }
  std::normal_distribution<float> normal(mean, stddev * tensor.scale);
  std::vector<float> values(static_cast<size_t>(n));
  for (float& v : values) v = normal(rng);
  for (int64_t c : tensor.outlier_columns) {
    if (c < 0 || c >= cols) continue;
    for (int64_t i = c; i < n; i += cols) values[i] *= tensor.outlier_scale;
  }
  return values;
}

absl::Status GenerateModel(const std::string& path, const GenerateOptions& options) {
  if (options.dtype != safetensors::Dtype::kF32 && options.dtype != safetensors::Dtype::kBF16) {
    return absl::InvalidArgumentError("synthetic models are F32 or BF16");
  }
  ASSIGN_OR_RETURN(std::vector<SyntheticTensor> tensors, PresetTensors(options.preset));
  std::vector<safetensors::TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const SyntheticTensor& t : tensors) specs.push_back({t.name, options.dtype, t.shape});
  ASSIGN_OR_RETURN(std::unique_ptr<safetensors::SafetensorsWriter> writer,
                   safetensors::SafetensorsWriter::Create(path, std::move(specs),
                                                          {{"generator", "hpctl generate"},
                                                           {"preset", options.preset},
                                                           {"seed", absl::StrCat(options.seed)}}));
  for (const SyntheticTensor& t : tensors) {
    std::vector<float> values = SyntheticValues(t, options.seed);
    std::vector<uint8_t> bytes;
    if (options.dtype == safetensors::Dtype::kBF16) {
      safetensors::AppendBf16(values, bytes);
    } else {
      safetensors::AppendF32(values, bytes);
    }
    RETURN_IF_ERROR(writer->WriteTensor(t.name, bytes));
  }
  return writer->Finish();
}

}  // namespace hpctl
}  // namespace paramd
