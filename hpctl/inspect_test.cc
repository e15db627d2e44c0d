#include "hpctl/inspect.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "hpctl/generate.h"
#include "safetensors/test_util.h"

namespace paramd::hpctl {
namespace {

HybridSpec Both(Format format, SourceDtype source = SourceDtype::kBf16) {
  HybridSpec spec;
  spec.rowwise = spec.columnwise = DefaultQuantSpec(format);
  spec.source_dtype = spec.rowwise.source_dtype = spec.columnwise.source_dtype = source;
  return spec;
}

// A [96, 64] weight with realistic values and outlier columns.
std::vector<float> Weight() {
  SyntheticTensor t{"w", {96, 64}, SyntheticKind::kLinear, 1.0f, {5}, 20.0f};
  return SyntheticValues(t, 11);
}

ErrorStats RowError(Format format, SourceDtype source = SourceDtype::kBf16) {
  auto r = InspectTensor("w", Weight(), 96, 64, Both(format, source), false);
  EXPECT_TRUE(r.ok()) << r.status();
  return r->directions.at(0).error;
}

TEST(CompareValues, Definitions) {
  ErrorStats exact = CompareValues({1, -2, 3}, {1, -2, 3});
  EXPECT_EQ(exact.rel_l2, 0);
  EXPECT_EQ(exact.max_abs, 0);
  EXPECT_TRUE(std::isinf(exact.sqnr_db));
  ErrorStats e = CompareValues({3, 4}, {3, 4.5});  // |x| = 5, |d| = 0.5
  EXPECT_DOUBLE_EQ(e.rel_l2, 0.1);
  EXPECT_DOUBLE_EQ(e.max_abs, 0.5);
  EXPECT_NEAR(e.sqnr_db, 20.0, 1e-9);
}

TEST(InspectTensor, ErrorsAreOrderedByPrecision) {
  const ErrorStats fp32 = RowError(Format::kIdentityFp32, SourceDtype::kFp32);
  EXPECT_EQ(fp32.rel_l2, 0);
  EXPECT_EQ(fp32.max_abs, 0);
  EXPECT_TRUE(std::isinf(fp32.sqnr_db));

  const ErrorStats bf16 = RowError(Format::kIdentityBf16);
  EXPECT_GT(bf16.rel_l2, 0);
  EXPECT_LT(bf16.rel_l2, 1.0 / 256);  // 8 significant bits
  EXPECT_GT(bf16.sqnr_db, 48);

  // E4M3 keeps 4 significant bits: a few percent; below BF16 by ~4 bits.
  for (Format f : {Format::kFp8Current, Format::kFp8Delayed, Format::kMxfp8,
                   Format::kFp8Block128x128, Format::kFp8Block1x128}) {
    const ErrorStats e = RowError(f);
    EXPECT_GT(e.rel_l2, 4 * bf16.rel_l2) << FormatName(f);
    EXPECT_LT(e.rel_l2, 0.06) << FormatName(f);
    EXPECT_GT(e.sqnr_db, 25) << FormatName(f);
    EXPECT_LT(e.sqnr_db, bf16.sqnr_db - 15) << FormatName(f);
  }
  const ErrorStats nvfp4 = RowError(Format::kNvfp4);
  EXPECT_GT(nvfp4.rel_l2, RowError(Format::kMxfp8).rel_l2);
  EXPECT_LT(nvfp4.rel_l2, 0.3);
  EXPECT_GT(nvfp4.sqnr_db, 10);

  // One warm-up step makes delayed scaling's scale 448 / amax: the same as
  // current scaling without power-of-2 rounding, so the same error.
  EXPECT_DOUBLE_EQ(RowError(Format::kFp8Delayed).rel_l2, RowError(Format::kFp8Current).rel_l2);
}

TEST(InspectTensor, BytesFollowTheLayouts) {
  HybridSpec spec = Both(Format::kFp8Current);
  spec.columnwise = DefaultQuantSpec(Format::kMxfp8);
  auto r = InspectTensor("w", Weight(), 96, 64, spec, false);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->directions.size(), 2u);
  EXPECT_EQ(r->directions[0].direction, Direction::kRowwise);
  EXPECT_EQ(r->directions[0].data_bytes, 96 * 64);
  EXPECT_EQ(r->directions[0].scale_bytes, 4);  // scale_inv
  EXPECT_EQ(r->directions[1].direction, Direction::kColumnwise);
  EXPECT_EQ(r->directions[1].data_bytes, 96 * 64);
  // §3 columnwise scales: [roundup(96/32, 4)][roundup(64, 128)] bytes.
  EXPECT_EQ(r->directions[1].scale_bytes, 4 * 128);

  spec.columnwise_usage = false;
  r = InspectTensor("w", Weight(), 96, 64, spec, false);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->directions.size(), 1u);
}

TEST(InspectTensor, RowwiseDequantizedColumnwiseIsNoBetterThanRowwise) {
  HybridSpec spec = Both(Format::kFp8Current);
  spec.columnwise = DefaultQuantSpec(Format::kMxfp8);
  auto original = InspectTensor("w", Weight(), 96, 64, spec, false);
  spec.columnwise_source = ColumnwiseSource::kRowwiseDequantized;
  auto derived = InspectTensor("w", Weight(), 96, 64, spec, false);
  ASSERT_TRUE(original.ok() && derived.ok());
  // Quantizing already-quantized values compounds the rowwise error.
  EXPECT_GE(derived->directions[1].error.rel_l2, derived->directions[0].error.rel_l2 * 0.99);
  EXPECT_NE(derived->directions[1].error.rel_l2, original->directions[1].error.rel_l2);
}

TEST(InspectModel, GeneratedModelWithRecipeAllFormatsAndRendering) {
  const std::string path = safetensors::testing::MakeTempDir() + "/m.safetensors";
  GenerateOptions gen;
  ASSERT_TRUE(GenerateModel(path, gen).ok());
  auto model = safetensors::ShardedSafetensors::Open(path);
  ASSERT_TRUE(model.ok());
  auto recipe = Recipe::Parse(R"txt(
    name: "test"
    rule {
      name: "exact"
      pattern: "head.*"
      spec {
        rowwise { format: IDENTITY_FP32 }
        columnwise_usage: false
        source_dtype: FP32
      }
    }
    rule {
      pattern: ".*attn.*weight"
      spec {
        rowwise { format: FP8_DELAYED }
        columnwise { format: MXFP8 }
        columnwise_source: ROWWISE_DEQUANTIZED
      }
    }
    default_spec {
      rowwise { format: NVFP4 }
      columnwise { format: FP8_BLOCK_128X128 }
    }
  )txt");
  ASSERT_TRUE(recipe.ok()) << recipe.status();
  InspectOptions options;
  options.all_formats = true;
  auto report = InspectModel(*model, *recipe, options);
  ASSERT_TRUE(report.ok()) << report.status();
  ASSERT_EQ(report->tensors.size(), 10u);
  EXPECT_TRUE(report->skipped.empty());
  for (const TensorResult& t : report->tensors) {
    ASSERT_EQ(t.all_formats.size(), 8u) << t.name;
    for (const DirectionResult& d : t.directions) {
      EXPECT_GT(d.data_bytes, 0);
      EXPECT_TRUE(std::isfinite(d.error.rel_l2)) << t.name;
    }
    if (t.name == "head.weight") {
      EXPECT_EQ(t.rule, "rule 0 (\"exact\")");
      ASSERT_EQ(t.directions.size(), 1u);
      EXPECT_EQ(t.directions[0].error.max_abs, 0);
      EXPECT_EQ(t.directions[0].data_bytes, 37 * 64 * 4);
      // With an FP32 source, identity_fp32 is exact in --all_formats too.
      EXPECT_EQ(t.all_formats[1].format, Format::kIdentityFp32);
      EXPECT_EQ(t.all_formats[1].rowwise.rel_l2, 0);
    }
    if (t.name == "layers.0.attn.qkv.weight") {
      EXPECT_EQ(t.rule, "rule 1");
      EXPECT_EQ(t.spec.columnwise_source, ColumnwiseSource::kRowwiseDequantized);
    }
    if (t.name == "logit_scale") {  // a scalar is inspected as [1, 1]
      EXPECT_EQ(t.rows, 1);
      EXPECT_EQ(t.cols, 1);
    }
    // bf16 (index 0) beats fp8_current (3), which beats nvfp4 (5); a scalar
    // is exact in FP8 (scaled to 448), so only >= there.
    if (t.rows * t.cols > 1) {
      EXPECT_GT(t.all_formats[0].rowwise.sqnr_db, t.all_formats[3].rowwise.sqnr_db) << t.name;
    }
    EXPECT_GE(t.all_formats[0].rowwise.sqnr_db, t.all_formats[3].rowwise.sqnr_db) << t.name;
    EXPECT_GE(t.all_formats[3].rowwise.sqnr_db, t.all_formats[5].rowwise.sqnr_db) << t.name;
  }

  const std::string text = RenderReport(*report, options);
  EXPECT_NE(text.find("Recipe: test"), std::string::npos);
  EXPECT_NE(text.find("fresh state after one warm-up step"), std::string::npos);
  EXPECT_NE(text.find("Totals over 10 tensors"), std::string::npos);
  EXPECT_NE(text.find("both directions"), std::string::npos);
  EXPECT_NE(text.find("SQNR in dB of every format"), std::string::npos);
  EXPECT_NE(text.find("col <-row"), std::string::npos);
  // The main table is aligned: every data line has the "dir" column at the
  // same offset as the header's.
  const size_t header_begin = text.find("\ntensor ") + 1;
  ASSERT_NE(header_begin, 0u);
  const std::string header =
      text.substr(header_begin, text.find('\n', header_begin) - header_begin);
  const size_t dir_col = header.find("dir");
  ASSERT_NE(dir_col, std::string::npos);
  size_t pos = text.find("layers.0.gate.weight");
  ASSERT_NE(pos, std::string::npos);
  EXPECT_EQ(text.substr(pos + dir_col, 3), "row") << text;

  options.filter = "mlp";
  auto filtered = InspectModel(*model, *recipe, options);
  ASSERT_TRUE(filtered.ok());
  EXPECT_EQ(filtered->tensors.size(), 2u);
  options.filter = "(";
  EXPECT_EQ(InspectModel(*model, *recipe, options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace paramd::hpctl
