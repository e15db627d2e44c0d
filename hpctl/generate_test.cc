#include "hpctl/generate.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "safetensors/convert.h"
#include "safetensors/safetensors.h"
#include "safetensors/test_util.h"

namespace paramd::hpctl {
namespace {

double Rms(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += static_cast<double>(x) * x;
  return std::sqrt(s / v.size());
}

TEST(Presets, ShapesIncludeOddOnesAndTheDemoHasA4096Square) {
  auto small = PresetTensors("small");
  ASSERT_TRUE(small.ok());
  bool has_scalar = false, has_row_vector = false, has_prime_rows = false;
  for (const SyntheticTensor& t : *small) {
    has_scalar |= t.shape.empty();
    has_row_vector |= t.shape.size() == 2 && t.shape[0] == 1;
    has_prime_rows |= t.shape.size() == 2 && t.shape[0] == 257;
  }
  EXPECT_TRUE(has_scalar && has_row_vector && has_prime_rows);
  auto demo = PresetTensors("demo");
  ASSERT_TRUE(demo.ok());
  bool has_big = false;
  for (const SyntheticTensor& t : *demo) {
    has_big |= t.shape == std::vector<int64_t>{4096, 4096};
  }
  EXPECT_TRUE(has_big);
  EXPECT_EQ(PresetTensors("huge").status().message(),
            "unknown preset 'huge' (choose small or demo)");
}

TEST(SyntheticValues, MagnitudesOutliersAndDeterminism) {
  auto tensors = *PresetTensors("small");
  for (const SyntheticTensor& t : tensors) {
    std::vector<float> v = SyntheticValues(t, 7);
    EXPECT_EQ(v, SyntheticValues(t, 7)) << t.name;
    EXPECT_NE(v, SyntheticValues(t, 8)) << t.name;
    for (float x : v) ASSERT_TRUE(std::isfinite(x));
    if (t.name == "embed.weight") {
      EXPECT_NEAR(Rms(v), 0.02, 0.002);
    }
    if (t.name == "layers.0.norm.weight") {
      EXPECT_NEAR(Rms(v), 1.0, 0.05);
    }
    if (t.name == "layers.0.attn.qkv.bias") {
      EXPECT_NEAR(Rms(v), 0.01, 0.003);
    }
    if (t.name == "layers.0.mlp.fc1.weight") {
      EXPECT_NEAR(Rms(v), 1 / 8.0, 0.01);
    }  // 1/sqrt(64)
    if (t.name == "layers.0.attn.qkv.weight") {
      // Columns 3 and 17 are 25x the others.
      const int64_t cols = t.shape[1];
      double outlier = 0, normal = 0;
      for (size_t i = 0; i < v.size(); ++i) {
        const int64_t c = static_cast<int64_t>(i) % cols;
        (c == 3 || c == 17 ? outlier : normal) += std::abs(v[i]);
      }
      outlier /= 2 * t.shape[0];
      normal /= (cols - 2) * t.shape[0];
      EXPECT_GT(outlier / normal, 15);
      EXPECT_LT(outlier / normal, 40);
    }
  }
}

TEST(GenerateModel, WritesEveryTensorInF32AndBf16) {
  const std::string dir = safetensors::testing::MakeTempDir();
  for (auto dtype : {safetensors::Dtype::kF32, safetensors::Dtype::kBF16}) {
    GenerateOptions options;
    options.seed = 3;
    options.dtype = dtype;
    const std::string path = dir + "/m.safetensors";
    ASSERT_TRUE(GenerateModel(path, options).ok());
    auto file = safetensors::SafetensorsFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ(file->metadata().at("preset"), "small");
    EXPECT_EQ(file->metadata().at("seed"), "3");
    auto tensors = *PresetTensors("small");
    ASSERT_EQ(file->tensors().size(), tensors.size());
    for (const SyntheticTensor& t : tensors) {
      const safetensors::TensorInfo* info = file->Find(t.name);
      ASSERT_NE(info, nullptr) << t.name;
      EXPECT_EQ(info->dtype, dtype);
      EXPECT_EQ(info->shape, t.shape);
      std::vector<float> expected = SyntheticValues(t, 3);
      std::vector<float> got = *safetensors::ReadTensorAsFloat(*file, *info);
      ASSERT_EQ(got.size(), expected.size());
      for (size_t i = 0; i < got.size(); ++i) {
        // BF16 keeps 8 significant bits: RNE is within 2^-8 relative.
        const float tol = dtype == safetensors::Dtype::kF32 ? 0 : std::abs(expected[i]) / 256;
        ASSERT_LE(std::abs(got[i] - expected[i]), tol) << t.name << "[" << i << "]";
      }
    }
  }
  GenerateOptions bad;
  bad.preset = "nope";
  EXPECT_EQ(GenerateModel(dir + "/x.safetensors", bad).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace paramd::hpctl
