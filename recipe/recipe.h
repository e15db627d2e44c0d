// File: recipe/recipe.h
//
// Quantization recipes: proto/recipe.proto in protobuf text format, parsed,
// validated and resolved into kernels/format.h HybridSpecs. See
// proto/recipe.proto for the language (rules, first match wins, inheritance
// from default_spec) and deploy/recipes/demo.textproto for an example.
//
// Every error is an InvalidArgument whose message starts with
// "<source>:<line>:<column>: " (1-based; the line of the offending field or
// value) followed by the field path and the problem, e.g.
//   demo.textproto:14:7: rule[1] "attention".spec.rowwise.margin: must be >= 0, got -2
// Recipes built from a proto (no text) carry no line numbers.
//
// A Recipe is immutable after construction; all methods are thread-safe.
// Resolve() costs one regex match per rule until the first match. Patterns
// are RE2 (https://github.com/google/re2/wiki/Syntax): matching is linear in
// the name's length and never recurses, so no name or pattern can make it
// hang or overflow the stack. Patterns RE2 refuses (backreferences,
// lookaround, `**`) and patterns longer than kMaxPatternBytes are errors at
// parse.
#ifndef PARAMD_RECIPE_RECIPE_H_
#define PARAMD_RECIPE_RECIPE_H_

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/format.h"
#include "proto/recipe.pb.h"
#include "re2/re2.h"

namespace paramd {

// One rule, resolved: its spec has every field filled in.
struct RecipeRule {
  std::string name;     // as written; may be empty
  std::string pattern;  // RE2 regex, matched against the whole name
  HybridSpec spec;
  // Optimizer overrides of the tensors this rule matches (all unset: none).
  recipe::RuleOptimizer optimizer;
  int line = 0;  // 1-based line of the rule in the text; 0 if unknown
  std::shared_ptr<const RE2> regex;
};

class Recipe {
 public:
  // Longest pattern accepted (a tensor name is at most 1 KiB by default:
  // common/names.h).
  static constexpr size_t kMaxPatternBytes = 4096;

  // Parses protobuf text. `source` names the text in error messages
  // (usually the file path).
  static absl::StatusOr<Recipe> Parse(absl::string_view text, absl::string_view source = "recipe");
  // Reads and parses a file (NotFound etc. if it cannot be read).
  static absl::StatusOr<Recipe> Load(const std::string& path);
  // Validates an already parsed proto (errors without line numbers).
  static absl::StatusOr<Recipe> FromProto(const recipe::Recipe& proto,
                                          absl::string_view source = "recipe");

  // The recipe used when none is given: norms, biases and embeddings stay
  // BF16; other "*weight" tensors are FP8 per-tensor current scaling
  // (E4M3) in both directions; everything else BF16. Its text is
  // BuiltinRecipeText().
  static const Recipe& Builtin();
  static absl::string_view BuiltinRecipeText();

  struct Match {
    const HybridSpec* spec = nullptr;
    int rule = -1;  // index into rules(); -1 = default_spec
  };
  // The spec for tensor `tensor_name`: the first rule whose pattern matches
  // the whole name, else the default.
  Match Resolve(absl::string_view tensor_name) const;
  const HybridSpec& SpecFor(absl::string_view tensor_name) const {
    return *Resolve(tensor_name).spec;
  }
  // "rule 2 (\"name\")" / "rule 2" / "default", for output.
  std::string DescribeMatch(const Match& match) const;

  const std::string& name() const { return name_; }
  const std::vector<RecipeRule>& rules() const { return rules_; }
  const HybridSpec& default_spec() const { return default_spec_; }
  // The recipe's `optimizer` section (validated by its user:
  // server/step/optimizer_config.h), if it has one.
  const std::optional<recipe::OptimizerConfig>& optimizer() const { return optimizer_; }
  // The optimizer overrides of the rule `match` names (none for default).
  const recipe::RuleOptimizer& OptimizerFor(const Match& match) const {
    return match.rule < 0 ? recipe::RuleOptimizer::default_instance()
                          : rules_[match.rule].optimizer;
  }

 private:
  Recipe(std::string name, std::vector<RecipeRule> rules, HybridSpec default_spec)
      : name_(std::move(name)), rules_(std::move(rules)), default_spec_(default_spec) {}

  std::string name_;
  std::vector<RecipeRule> rules_;
  HybridSpec default_spec_;
  std::optional<recipe::OptimizerConfig> optimizer_;
};

// Short human-readable forms, e.g. "fp8_delayed(e5m2,L=16,most_recent,margin=1)"
// (only fields that differ from DefaultQuantSpec are shown) and
// "row=fp8_current col=mxfp8 src=bf16 col_from=rowwise" ("-" for an unused
// direction).
std::string DescribeQuantSpec(const QuantSpec& spec);
std::string DescribeHybridSpec(const HybridSpec& spec);

}  // namespace paramd

#endif  // PARAMD_RECIPE_RECIPE_H_
