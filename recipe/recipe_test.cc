#include "recipe/recipe.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace paramd {
namespace {

TEST(Recipe, FirstMatchingRuleWinsElseDefault) {
  absl::StatusOr<Recipe> r = Recipe::Parse(R"txt(
    name: "order"
    rule {
      name: "attn"
      pattern: ".*attn.*"
      spec { rowwise { format: MXFP8 } columnwise { format: MXFP8 } }
    }
    rule {
      pattern: ".*weight"
      spec { rowwise { format: FP8_CURRENT } columnwise { format: FP8_CURRENT } }
    }
    rule {
      name: "never reached for weights"
      pattern: "layer\\..*"
      spec { rowwise { format: NVFP4 } columnwise { format: NVFP4 } }
    }
  )txt");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->name(), "order");
  ASSERT_EQ(r->rules().size(), 3u);
  EXPECT_EQ(r->rules()[0].line, 3);
  EXPECT_EQ(r->rules()[1].line, 8);

  Recipe::Match m = r->Resolve("layer.0.attn.qkv.weight");  // rules 0, 1, 2 all match
  EXPECT_EQ(m.rule, 0);
  EXPECT_EQ(m.spec->rowwise.format, Format::kMxfp8);
  EXPECT_EQ(r->DescribeMatch(m), "rule 0 (\"attn\")");

  m = r->Resolve("layer.0.mlp.weight");  // rules 1 and 2 match
  EXPECT_EQ(m.rule, 1);
  EXPECT_EQ(m.spec->columnwise.format, Format::kFp8Current);
  EXPECT_EQ(r->DescribeMatch(m), "rule 1");

  m = r->Resolve("layer.0.norm.scale");
  EXPECT_EQ(m.rule, 2);
  EXPECT_EQ(m.spec->rowwise.format, Format::kNvfp4);

  m = r->Resolve("bias");  // nothing matches
  EXPECT_EQ(m.rule, -1);
  EXPECT_EQ(r->DescribeMatch(m), "default");
  EXPECT_EQ(m.spec->rowwise.format, Format::kIdentityBf16);  // built-in default
  EXPECT_EQ(m.spec->columnwise.format, Format::kIdentityBf16);
  EXPECT_TRUE(m.spec->rowwise_usage && m.spec->columnwise_usage);
  EXPECT_EQ(m.spec->source_dtype, SourceDtype::kBf16);
  EXPECT_EQ(m.spec->columnwise_source, ColumnwiseSource::kOriginal);
}

TEST(Recipe, PatternsMatchTheWholeName) {
  auto r = Recipe::Parse(R"txt(rule { pattern: "weight" spec { rowwise { format: MXFP8 } } })txt");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->Resolve("weight").rule, 0);
  EXPECT_EQ(r->Resolve("a.weight").rule, -1);
  EXPECT_EQ(r->Resolve("weight.b").rule, -1);
}

TEST(Recipe, RulesInheritFromDefaultSpecPerItem) {
  auto r = Recipe::Parse(R"txt(
    default_spec {
      rowwise { format: FP8_DELAYED margin: 2 }
      columnwise { format: NVFP4 }
      source_dtype: FP32
      columnwise_source: ROWWISE_DEQUANTIZED
    }
    rule { pattern: "a" spec { rowwise { format: MXFP8 } } }
    rule { pattern: "b" spec { columnwise_usage: false source_dtype: BF16 } }
    rule { pattern: "c" }
  )txt");
  ASSERT_TRUE(r.ok()) << r.status();
  const HybridSpec& a = r->SpecFor("a");
  EXPECT_EQ(a.rowwise.format, Format::kMxfp8);
  EXPECT_EQ(a.rowwise.margin, 0);  // a QuantSpec is inherited whole, never field by field
  EXPECT_EQ(a.columnwise.format, Format::kNvfp4);
  EXPECT_TRUE(a.columnwise.two_d);  // DefaultQuantSpec(NVFP4)
  EXPECT_EQ(a.source_dtype, SourceDtype::kFp32);
  EXPECT_EQ(a.rowwise.source_dtype, SourceDtype::kFp32);  // copied into both QuantSpecs
  EXPECT_EQ(a.columnwise.source_dtype, SourceDtype::kFp32);
  EXPECT_EQ(a.columnwise_source, ColumnwiseSource::kRowwiseDequantized);

  const HybridSpec& b = r->SpecFor("b");
  EXPECT_EQ(b.rowwise.format, Format::kFp8Delayed);
  EXPECT_EQ(b.rowwise.margin, 2);
  EXPECT_FALSE(b.columnwise_usage);
  EXPECT_EQ(b.source_dtype, SourceDtype::kBf16);
  EXPECT_EQ(b.rowwise.source_dtype, SourceDtype::kBf16);

  const HybridSpec& c = r->SpecFor("c");  // a rule without spec = the default
  EXPECT_EQ(c.rowwise.format, Format::kFp8Delayed);
  EXPECT_EQ(r->Resolve("c").rule, 2);
  EXPECT_EQ(r->Resolve("d").rule, -1);
}

TEST(Recipe, UnsetFieldsTakeDefaultQuantSpecAndSetOnesApply) {
  auto r = Recipe::Parse(R"txt(
    rule {
      pattern: "x"
      spec {
        rowwise { format: FP8_DELAYED fp8_type: E5M2 amax_history_len: 16 amax_algo: MOST_RECENT margin: 1 }
        columnwise { format: FP8_BLOCK_1X128 }
      }
    }
    rule {
      pattern: "y"
      spec {
        rowwise { format: FP8_CURRENT pow2_scales: true eps: 1e-6 }
        columnwise { format: MXFP8 two_d: true fp8_type: E5M2 }
      }
    }
    rule {
      pattern: "z"
      spec {
        rowwise { format: NVFP4 two_d: false }
        columnwise { format: FP8_BLOCK_128X128 pow2_scales: false }
      }
    }
  )txt");
  ASSERT_TRUE(r.ok()) << r.status();
  const HybridSpec& x = r->SpecFor("x");
  EXPECT_EQ(x.rowwise.fp8_type, Fp8Type::kE5M2);
  EXPECT_EQ(x.rowwise.amax_history_len, 16);
  EXPECT_EQ(x.rowwise.amax_algo, AmaxAlgo::kMostRecent);
  EXPECT_EQ(x.rowwise.margin, 1);
  EXPECT_TRUE(x.columnwise.pow2_scales);  // blockwise default
  EXPECT_EQ(x.columnwise.fp8_type, Fp8Type::kE4M3);
  const HybridSpec& y = r->SpecFor("y");
  EXPECT_TRUE(y.rowwise.pow2_scales);
  EXPECT_FLOAT_EQ(y.rowwise.eps, 1e-6f);
  EXPECT_TRUE(y.columnwise.two_d);
  EXPECT_EQ(y.columnwise.fp8_type, Fp8Type::kE5M2);
  const HybridSpec& z = r->SpecFor("z");
  EXPECT_FALSE(z.rowwise.two_d);
  EXPECT_FALSE(z.columnwise.pow2_scales);

  EXPECT_EQ(DescribeQuantSpec(x.rowwise), "fp8_delayed(e5m2,L=16,most_recent,margin=1)");
  EXPECT_EQ(DescribeQuantSpec(x.columnwise), "fp8_block1x128");
  EXPECT_EQ(DescribeQuantSpec(z.rowwise), "nvfp4(1d)");
  EXPECT_EQ(DescribeHybridSpec(y), "row=fp8_current(pow2,eps=1e-06) col=mxfp8(e5m2,2d) src=bf16");
}

struct Bad {
  std::string name;
  std::string text;
  // "recipe:L:C", 1-based: semantic errors point at the field name, syntax
  // errors at the token where the parser noticed.
  std::string position;
  std::string message;  // substring after the position
};

std::vector<Bad> BadRecipes() {
  return {
      {"syntax: missing closing brace",
       "rule {\n"
       "  pattern: \"a\"\n"
       "  spec { rowwise { format: MXFP8 }\n"
       "}\n",
       "recipe:5:1", "Expected identifier"},
      {"unknown field",
       "rule {\n"
       "  pattern: \"a\"\n"
       "  spec { rowwise { fromat: MXFP8 } }\n"
       "}\n",
       "recipe:3:26", "no field named \"fromat\""},
      {"unknown format name",
       "default_spec {\n"
       "  rowwise { format: MXFP9 }\n"
       "}\n",
       "recipe:2:27", "Unknown enumeration value of \"MXFP9\" for field \"format\""},
      {"unknown format number",
       "default_spec {\n"
       "  rowwise { format: 42 }\n"
       "}\n",
       "recipe:2:13", "default_spec.rowwise.format: unknown format value 42"},
      {"field given twice",
       "default_spec {\n"
       "  rowwise { format: FP8_DELAYED margin: 1 margin: 2 }\n"
       "}\n",
       "recipe:2:49", "Non-repeated field \"margin\" is specified multiple times"},
      {"missing format",
       "rule {\n"
       "  name: \"attn\"\n"
       "  pattern: \".*attn.*\"\n"
       "  spec {\n"
       "    columnwise { pow2_scales: true }\n"
       "  }\n"
       "}\n",
       "recipe:5:5", "rule[0] \"attn\".spec.columnwise.format: is required"},
      {"bad regex",
       "rule { pattern: \"ok\" }\n"
       "rule {\n"
       "  pattern: \"layer[0-\"\n"
       "}\n",
       "recipe:3:3", "rule[1].pattern: \"layer[0-\" is not a valid RE2 regex"},
      {"nested quantifier (the audit's ReDoS pattern)",
       "rule {\n"
       "  name: \"mlp\"\n"
       "  pattern: \".**mlp.*\\\\.weight\"\n"
       "}\n",
       "recipe:3:3",
       "rule[0] \"mlp\".pattern: \".**mlp.*\\\\.weight\" is not a valid RE2 regex: "
       "bad repetition operator: **"},
      {"backreference", "rule { pattern: \"(a)\\\\1\" }\n", "recipe:1:8",
       "is not a valid RE2 regex"},
      {"empty pattern",
       "rule {\n"
       "  name: \"no pattern\"\n"
       "  spec { rowwise { format: MXFP8 } }\n"
       "}\n",
       "recipe:1:1", "rule[0] \"no pattern\".pattern: is missing or empty"},
      {"amax_history_len < 1",
       "rule {\n"
       "  pattern: \"w\"\n"
       "  spec {\n"
       "    rowwise {\n"
       "      format: FP8_DELAYED\n"
       "      amax_history_len: 0\n"
       "    }\n"
       "  }\n"
       "}\n",
       "recipe:6:7", "rule[0].spec.rowwise.amax_history_len: must be in [1, 1048576], got 0"},
      {"margin < 0", "default_spec { rowwise { format: FP8_DELAYED margin: -2 } }\n", "recipe:1:46",
       "default_spec.rowwise.margin: must be in [0, 64], got -2"},
      {"eps < 0",
       "default_spec {\n"
       "  columnwise { format: FP8_BLOCK_128X128 eps: -0.5 }\n"
       "}\n",
       "recipe:2:42", "default_spec.columnwise.eps: must be finite and >= 0, got -0.5"},
      {"eps nan",
       "default_spec {\n"
       "  columnwise { format: FP8_CURRENT eps: nan }\n"
       "}\n",
       "recipe:2:36", "must be finite and >= 0, got nan"},
      {"E5M2 on blockwise",
       "default_spec {\n"
       "  rowwise { format: FP8_BLOCK_128X128 fp8_type: E5M2 }\n"
       "}\n",
       "recipe:2:39", "E5M2 is not allowed for fp8_block128x128"},
      {"field that does not apply",
       "default_spec {\n"
       "  rowwise { format: MXFP8 margin: 1 }\n"
       "}\n",
       "recipe:2:27", "default_spec.rowwise.margin: does not apply to mxfp8 (only to FP8_DELAYED)"},
      {"fp8_type on identity",
       "default_spec {\n"
       "  rowwise { format: IDENTITY_BF16 fp8_type: E4M3 }\n"
       "}\n",
       "recipe:2:35", "fp8_type: does not apply to identity_bf16"},
      {"both usages off",
       "rule {\n"
       "  pattern: \"x\"\n"
       "  spec {\n"
       "    rowwise_usage: false\n"
       "    columnwise_usage: false\n"
       "  }\n"
       "}\n",
       "recipe:5:5", "both false: nothing would be published"},
      {"explicit UNSPECIFIED",
       "default_spec {\n"
       "  rowwise { format: FP8_DELAYED amax_algo: AMAX_ALGO_UNSPECIFIED }\n"
       "}\n",
       "recipe:2:33", "amax_algo: must be MAX_OF_HISTORY or MOST_RECENT"},
  };
}

TEST(Recipe, MalformedRecipesAreRefusedWithLineAndColumn) {
  std::vector<Bad> cases = BadRecipes();
  EXPECT_GE(cases.size(), 8u);
  for (const Bad& c : cases) {
    absl::StatusOr<Recipe> r = Recipe::Parse(c.text);
    ASSERT_FALSE(r.ok()) << c.name << " was accepted";
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    const std::string message(r.status().message());
    EXPECT_EQ(message.rfind(c.position + ": ", 0), 0u) << c.name << ": " << message;
    EXPECT_NE(message.find(c.message), std::string::npos) << c.name << ": " << message;
  }
}

TEST(Recipe, SourceNameAndProtoWithoutLines) {
  auto r =
      Recipe::Parse("default_spec { rowwise { format: FP8_DELAYED margin: -1 } }", "my.textproto");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message().rfind("my.textproto:1:", 0), 0u) << r.status();

  recipe::Recipe proto;
  proto.add_rule()->set_pattern("(");
  auto from_proto = Recipe::FromProto(proto, "rpc");
  ASSERT_FALSE(from_proto.ok());
  EXPECT_EQ(from_proto.status().message().rfind("rpc: rule[0].pattern: \"(\" is not a valid", 0),
            0u)
      << from_proto.status();
  EXPECT_EQ(Recipe::Load("/no/such/recipe.textproto").status().code(), absl::StatusCode::kNotFound);
}

TEST(Recipe, BuiltinRecipe) {
  const Recipe& r = Recipe::Builtin();
  EXPECT_EQ(r.name(), "builtin");
  EXPECT_EQ(r.SpecFor("model.layers.0.input_layernorm.weight").rowwise.format,
            Format::kIdentityBf16);
  EXPECT_EQ(r.SpecFor("model.embed_tokens.weight").rowwise.format, Format::kIdentityBf16);
  EXPECT_EQ(r.SpecFor("model.layers.0.mlp.up_proj.weight").rowwise.format, Format::kFp8Current);
  EXPECT_EQ(r.SpecFor("model.layers.0.mlp.up_proj.weight").columnwise.format, Format::kFp8Current);
  EXPECT_EQ(r.SpecFor("something_else").rowwise.format, Format::kIdentityBf16);
}

TEST(Recipe, DemoRecipeUsesThreeFormatsAndBothColumnwiseSources) {
  absl::StatusOr<Recipe> r = Recipe::Load("deploy/recipes/demo.textproto");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->name(), "demo");
  const HybridSpec& attn = r->SpecFor("layers.0.attn.qkv.weight");
  EXPECT_EQ(attn.rowwise.format, Format::kFp8Delayed);
  EXPECT_EQ(attn.rowwise.amax_history_len, 16);
  EXPECT_EQ(attn.columnwise.format, Format::kMxfp8);
  EXPECT_EQ(attn.columnwise_source, ColumnwiseSource::kRowwiseDequantized);
  const HybridSpec& mlp = r->SpecFor("layers.0.mlp.fc1.weight");
  EXPECT_EQ(mlp.rowwise.format, Format::kNvfp4);
  EXPECT_EQ(mlp.columnwise.format, Format::kFp8Block128x128);
  EXPECT_EQ(mlp.columnwise_source, ColumnwiseSource::kOriginal);
  EXPECT_EQ(mlp.source_dtype, SourceDtype::kFp32);
  EXPECT_EQ(r->SpecFor("layers.0.norm.weight").rowwise.format, Format::kIdentityBf16);
  const HybridSpec& head = r->SpecFor("lm_head.weight");
  EXPECT_EQ(head.rowwise.format, Format::kFp8Current);
  EXPECT_FALSE(head.columnwise_usage);
  EXPECT_EQ(r->SpecFor("other.weight").columnwise.format, Format::kFp8Current);
}

// The audit's crash: std::regex_match recursed once per character of a
// ~100 KB name. RE2 matches in linear time without recursion.
TEST(Recipe, LongNamesResolveQuicklyWithoutRecursion) {
  const Recipe& r = Recipe::Builtin();
  const absl::Time start = absl::Now();
  for (const size_t n : {size_t{20} << 10, size_t{100} << 10, size_t{4} << 20}) {
    std::string name(n, 'a');
    EXPECT_EQ(r.SpecFor(name).rowwise.format, Format::kIdentityBf16);
    name += "weight";
    EXPECT_EQ(r.SpecFor(name).rowwise.format, Format::kFp8Current) << n;
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST(Recipe, PatternsThatBacktrackExponentiallyInOtherEnginesAreFast) {
  absl::StatusOr<Recipe> r = Recipe::Parse(R"txt(
    rule { pattern: "(a*)*b" spec { rowwise { format: MXFP8 } } }
    rule { pattern: "(a|aa)+c" spec { rowwise { format: NVFP4 } } }
  )txt");
  ASSERT_TRUE(r.ok()) << r.status();
  const absl::Time start = absl::Now();
  EXPECT_EQ(r->SpecFor(std::string(50000, 'a')).rowwise.format, Format::kIdentityBf16);
  EXPECT_EQ(r->SpecFor(std::string(50000, 'a') + "c").rowwise.format, Format::kNvfp4);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST(Recipe, MatchIsFullNotPartial) {
  absl::StatusOr<Recipe> r =
      Recipe::Parse(R"txt(rule { pattern: "mlp" spec { rowwise { format: MXFP8 } } })txt");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->SpecFor("mlp").rowwise.format, Format::kMxfp8);
  EXPECT_EQ(r->SpecFor("layers.0.mlp").rowwise.format, Format::kIdentityBf16);
  EXPECT_EQ(r->SpecFor("mlp.weight").rowwise.format, Format::kIdentityBf16);
}

TEST(Recipe, OverlongPatternIsRefused) {
  const std::string text = absl::StrCat("rule { pattern: \"", std::string(5000, 'a'), "\" }");
  absl::StatusOr<Recipe> r = Recipe::Parse(text);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(r.status().message(), "recipe:1:8")) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "limit is 4096")) << r.status();
}

}  // namespace
}  // namespace paramd
