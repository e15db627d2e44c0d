#include "recipe/recipe.h"

#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace paramd {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::TextFormat;
using Tree = TextFormat::ParseInfoTree;
using Location = TextFormat::ParseLocation;

constexpr int kMaxAmaxHistory = 1 << 20;
constexpr int kMaxMargin = 64;

constexpr char kBuiltinText[] = R"txt(
  name: "builtin"
  rule {
    name: "norms, biases and embeddings stay BF16"
    pattern: ".*(norm|bias|embed).*"
    spec {
      rowwise { format: IDENTITY_BF16 }
      columnwise { format: IDENTITY_BF16 }
    }
  }
  rule {
    name: "weights: FP8 per-tensor current scaling"
    pattern: ".*weight"
    spec {
      rowwise { format: FP8_CURRENT }
      columnwise { format: FP8_CURRENT }
    }
  }
  default_spec {
    rowwise { format: IDENTITY_BF16 }
    columnwise { format: IDENTITY_BF16 }
  }
)txt";

std::string JoinPath(absl::string_view a, absl::string_view b) {
  if (a.empty()) return std::string(b);
  if (b.empty()) return std::string(a);
  return absl::StrCat(a, ".", b);
}

// A message of the recipe being validated: where it is in the text (if the
// recipe came from text) and how to name it in errors.
class Context {
 public:
  Context(absl::string_view source, const Tree* tree, const Descriptor* descriptor,
          std::string path, Location where)
      : source_(source),
        tree_(tree),
        descriptor_(descriptor),
        path_(std::move(path)),
        where_(where) {}

  // The context of message field `field` (element `index` if repeated).
  Context Nested(absl::string_view field, int index, absl::string_view label) const {
    const FieldDescriptor* fd = Field(field);
    const int i = fd->is_repeated() ? index : -1;
    const Tree* nested = tree_ == nullptr ? nullptr : tree_->GetTreeForNested(fd, i);
    return Context(source_, nested, fd->message_type(), JoinPath(path_, label), Locate(fd, i));
  }

  // "<source>:<line>:<col>: <path>.<field>: <message>", at the field's
  // value if it is in the text, else at this message.
  absl::Status Error(absl::string_view field, absl::string_view message) const {
    Location at = field.empty() ? where_ : Locate(Field(field), -1);
    std::string prefix = std::string(source_);
    if (at.line >= 0) absl::StrAppend(&prefix, ":", at.line + 1, ":", at.column + 1);
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, ": ", JoinPath(path_, field), ": ", message));
  }

  int line() const { return where_.line + 1; }

 private:
  const FieldDescriptor* Field(absl::string_view name) const {
    const FieldDescriptor* fd = descriptor_->FindFieldByName(std::string(name));
    if (fd == nullptr) {  // a typo in this file, not in the recipe
      std::fprintf(stderr, "recipe.cc: no field %s in %s\n", std::string(name).c_str(),
                   descriptor_->full_name().c_str());
      std::abort();
    }
    return fd;
  }
  Location Locate(const FieldDescriptor* fd, int index) const {
    if (tree_ != nullptr) {
      Location at = tree_->GetLocation(fd, index);
      if (at.line >= 0) return at;
    }
    return where_;
  }

  absl::string_view source_;
  const Tree* tree_;
  const Descriptor* descriptor_;
  std::string path_;
  Location where_;
};

absl::StatusOr<Format> MapFormat(recipe::Format f, const Context& ctx) {
  switch (f) {
    case recipe::IDENTITY_BF16:
      return Format::kIdentityBf16;
    case recipe::IDENTITY_FP32:
      return Format::kIdentityFp32;
    case recipe::FP8_DELAYED:
      return Format::kFp8Delayed;
    case recipe::FP8_CURRENT:
      return Format::kFp8Current;
    case recipe::MXFP8:
      return Format::kMxfp8;
    case recipe::NVFP4:
      return Format::kNvfp4;
    case recipe::FP8_BLOCK_128X128:
      return Format::kFp8Block128x128;
    case recipe::FP8_BLOCK_1X128:
      return Format::kFp8Block1x128;
    case recipe::FORMAT_UNSPECIFIED:
      return ctx.Error("format",
                       "is required (IDENTITY_BF16, IDENTITY_FP32, FP8_DELAYED, "
                       "FP8_CURRENT, MXFP8, NVFP4, FP8_BLOCK_128X128, FP8_BLOCK_1X128)");
    default:
      return ctx.Error("format", absl::StrCat("unknown format value ", static_cast<int>(f)));
  }
}

bool IsBlockwise(Format f) { return f == Format::kFp8Block128x128 || f == Format::kFp8Block1x128; }
bool IsPerTensorFp8(Format f) { return f == Format::kFp8Delayed || f == Format::kFp8Current; }

// Refuses a field set on a format it does not apply to.
absl::Status CheckApplies(bool applies, absl::string_view field, Format format,
                          absl::string_view applies_to, const Context& ctx) {
  if (applies) return absl::OkStatus();
  return ctx.Error(
      field, absl::StrCat("does not apply to ", FormatName(format), " (only to ", applies_to, ")"));
}

absl::StatusOr<QuantSpec> ResolveQuantSpec(const recipe::QuantSpec& p, const Context& ctx) {
  ASSIGN_OR_RETURN(Format format, MapFormat(p.format(), ctx));
  QuantSpec spec = DefaultQuantSpec(format);
  if (p.has_fp8_type()) {
    RETURN_IF_ERROR(
        CheckApplies(IsPerTensorFp8(format) || format == Format::kMxfp8 || IsBlockwise(format),
                     "fp8_type", format, "FP8 and MXFP8 formats", ctx));
    switch (p.fp8_type()) {
      case recipe::E4M3:
        spec.fp8_type = Fp8Type::kE4M3;
        break;
      case recipe::E5M2:
        if (IsBlockwise(format)) {
          return ctx.Error("fp8_type", absl::StrCat("E5M2 is not allowed for ", FormatName(format),
                                                    " (E4M3 only; E5M2 is for FP8_DELAYED, "
                                                    "FP8_CURRENT and MXFP8)"));
        }
        spec.fp8_type = Fp8Type::kE5M2;
        break;
      default:
        return ctx.Error("fp8_type", "must be E4M3 or E5M2");
    }
  }
  const bool scaled = format == Format::kFp8Current || IsBlockwise(format);
  if (p.has_pow2_scales()) {
    RETURN_IF_ERROR(
        CheckApplies(scaled, "pow2_scales", format, "FP8_CURRENT and FP8_BLOCK_*", ctx));
    spec.pow2_scales = p.pow2_scales();
  }
  if (p.has_eps()) {
    RETURN_IF_ERROR(CheckApplies(scaled, "eps", format, "FP8_CURRENT and FP8_BLOCK_*", ctx));
    if (!std::isfinite(p.eps()) || p.eps() < 0) {
      return ctx.Error("eps", absl::StrCat("must be finite and >= 0, got ", p.eps()));
    }
    spec.eps = p.eps();
  }
  const bool delayed = format == Format::kFp8Delayed;
  if (p.has_amax_history_len()) {
    RETURN_IF_ERROR(CheckApplies(delayed, "amax_history_len", format, "FP8_DELAYED", ctx));
    if (p.amax_history_len() < 1 || p.amax_history_len() > kMaxAmaxHistory) {
      return ctx.Error("amax_history_len", absl::StrCat("must be in [1, ", kMaxAmaxHistory,
                                                        "], got ", p.amax_history_len()));
    }
    spec.amax_history_len = p.amax_history_len();
  }
  if (p.has_amax_algo()) {
    RETURN_IF_ERROR(CheckApplies(delayed, "amax_algo", format, "FP8_DELAYED", ctx));
    switch (p.amax_algo()) {
      case recipe::MAX_OF_HISTORY:
        spec.amax_algo = AmaxAlgo::kMax;
        break;
      case recipe::MOST_RECENT:
        spec.amax_algo = AmaxAlgo::kMostRecent;
        break;
      default:
        return ctx.Error("amax_algo", "must be MAX_OF_HISTORY or MOST_RECENT");
    }
  }
  if (p.has_margin()) {
    RETURN_IF_ERROR(CheckApplies(delayed, "margin", format, "FP8_DELAYED", ctx));
    if (p.margin() < 0 || p.margin() > kMaxMargin) {
      return ctx.Error("margin",
                       absl::StrCat("must be in [0, ", kMaxMargin, "], got ", p.margin()));
    }
    spec.margin = p.margin();
  }
  if (p.has_two_d()) {
    RETURN_IF_ERROR(CheckApplies(format == Format::kMxfp8 || format == Format::kNvfp4, "two_d",
                                 format, "MXFP8 and NVFP4", ctx));
    spec.two_d = p.two_d();
  }
  return spec;
}

// `base` supplies everything `p` leaves unset.
absl::StatusOr<HybridSpec> ResolveHybridSpec(const recipe::HybridSpec& p, const Context& ctx,
                                             const HybridSpec& base) {
  HybridSpec spec = base;
  if (p.has_rowwise()) {
    ASSIGN_OR_RETURN(spec.rowwise,
                     ResolveQuantSpec(p.rowwise(), ctx.Nested("rowwise", -1, "rowwise")));
  }
  if (p.has_columnwise()) {
    ASSIGN_OR_RETURN(spec.columnwise,
                     ResolveQuantSpec(p.columnwise(), ctx.Nested("columnwise", -1, "columnwise")));
  }
  if (p.has_columnwise_source()) {
    switch (p.columnwise_source()) {
      case recipe::ORIGINAL:
        spec.columnwise_source = ColumnwiseSource::kOriginal;
        break;
      case recipe::ROWWISE_DEQUANTIZED:
        spec.columnwise_source = ColumnwiseSource::kRowwiseDequantized;
        break;
      default:
        return ctx.Error("columnwise_source", "must be ORIGINAL or ROWWISE_DEQUANTIZED");
    }
  }
  if (p.has_source_dtype()) {
    switch (p.source_dtype()) {
      case recipe::BF16:
        spec.source_dtype = SourceDtype::kBf16;
        break;
      case recipe::FP32:
        spec.source_dtype = SourceDtype::kFp32;
        break;
      default:
        return ctx.Error("source_dtype", "must be BF16 or FP32");
    }
  }
  if (p.has_rowwise_usage()) spec.rowwise_usage = p.rowwise_usage();
  if (p.has_columnwise_usage()) spec.columnwise_usage = p.columnwise_usage();
  if (!spec.rowwise_usage && !spec.columnwise_usage) {
    return ctx.Error(p.has_columnwise_usage() ? "columnwise_usage" : "rowwise_usage",
                     "rowwise_usage and columnwise_usage are both false: nothing would be "
                     "published");
  }
  if (p.has_columnwise_source() && !spec.columnwise_usage) {
    return ctx.Error("columnwise_source", "is set but columnwise_usage is false");
  }
  // kernels/format.h: each QuantSpec carries its hybrid's source dtype.
  spec.rowwise.source_dtype = spec.source_dtype;
  spec.columnwise.source_dtype = spec.source_dtype;
  return spec;
}

struct Parts {
  std::string name;
  std::vector<RecipeRule> rules;
  HybridSpec default_spec;
  std::optional<recipe::OptimizerConfig> optimizer;
};

// Rule.optimizer: multipliers and decays must be finite and >= 0.
absl::Status CheckRuleOptimizer(const recipe::RuleOptimizer& o, const Context& ctx) {
  if (o.has_lr_multiplier() && !(o.lr_multiplier() >= 0 && std::isfinite(o.lr_multiplier()))) {
    return ctx.Error("optimizer", absl::StrCat("lr_multiplier must be finite and >= 0, got ",
                                               o.lr_multiplier()));
  }
  if (o.has_weight_decay() && !(o.weight_decay() >= 0 && std::isfinite(o.weight_decay()))) {
    return ctx.Error("optimizer",
                     absl::StrCat("weight_decay must be finite and >= 0, got ", o.weight_decay()));
  }
  return absl::OkStatus();
}

absl::StatusOr<Parts> BuildParts(const recipe::Recipe& proto, absl::string_view source,
                                 const Tree* tree) {
  Context root(source, tree, recipe::Recipe::descriptor(), "", Location());
  Parts parts;
  parts.name = proto.name();
  if (proto.has_optimizer()) parts.optimizer = proto.optimizer();
  if (proto.has_default_spec()) {
    ASSIGN_OR_RETURN(
        parts.default_spec,
        ResolveHybridSpec(proto.default_spec(), root.Nested("default_spec", -1, "default_spec"),
                          HybridSpec()));
  }
  for (int i = 0; i < proto.rule_size(); ++i) {
    const recipe::Rule& r = proto.rule(i);
    std::string label = absl::StrCat("rule[", i, "]");
    if (!r.name().empty()) absl::StrAppend(&label, " \"", r.name(), "\"");
    Context ctx = root.Nested("rule", i, label);
    RecipeRule rule;
    rule.name = r.name();
    rule.pattern = r.pattern();
    rule.line = ctx.line();
    if (r.pattern().empty()) return ctx.Error("pattern", "is missing or empty");
    if (r.pattern().size() > Recipe::kMaxPatternBytes) {
      return ctx.Error("pattern",
                       absl::StrCat("is ", r.pattern().size(), " bytes long; the limit is ",
                                    Recipe::kMaxPatternBytes));
    }
    RE2::Options re2_options;
    re2_options.set_log_errors(false);
    // Bounds the compiled program (e.g. nested counted repetitions).
    re2_options.set_max_mem(int64_t{8} << 20);
    auto regex = std::make_shared<const RE2>(r.pattern(), re2_options);
    if (!regex->ok()) {
      return ctx.Error("pattern", absl::StrCat(QuoteForError(r.pattern(), 80),
                                               " is not a valid RE2 regex: ", regex->error()));
    }
    rule.regex = std::move(regex);
    rule.spec = parts.default_spec;
    if (r.has_spec()) {
      ASSIGN_OR_RETURN(rule.spec, ResolveHybridSpec(r.spec(), ctx.Nested("spec", -1, "spec"),
                                                    parts.default_spec));
    }
    if (r.has_optimizer()) {
      RETURN_IF_ERROR(CheckRuleOptimizer(r.optimizer(), ctx));
      rule.optimizer = r.optimizer();
    }
    parts.rules.push_back(std::move(rule));
  }
  return parts;
}

// Keeps the first parse error, already formatted with 1-based positions.
class FirstErrorCollector : public google::protobuf::io::ErrorCollector {
 public:
  explicit FirstErrorCollector(absl::string_view source) : source_(source) {}
  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    if (first_.empty())
      first_ = absl::StrFormat("%s:%d:%d: %s", source_, line + 1, column + 1, message);
  }
  void AddWarning(int, google::protobuf::io::ColumnNumber, const std::string&) override {}
  const std::string& first() const { return first_; }

 private:
  std::string source_;
  std::string first_;
};

std::string OnOff(bool value, absl::string_view on, absl::string_view off) {
  return std::string(value ? on : off);
}

}  // namespace

absl::StatusOr<Recipe> Recipe::Parse(absl::string_view text, absl::string_view source) {
  recipe::Recipe proto;
  TextFormat::Parser parser;
  FirstErrorCollector errors(source);
  parser.RecordErrorsTo(&errors);
  Tree tree;
  parser.WriteLocationsTo(&tree);
  if (!parser.ParseFromString(std::string(text), &proto)) {
    return absl::InvalidArgumentError(
        errors.first().empty() ? absl::StrCat(source, ": cannot parse recipe") : errors.first());
  }
  ASSIGN_OR_RETURN(Parts parts, BuildParts(proto, source, &tree));
  Recipe r(std::move(parts.name), std::move(parts.rules), parts.default_spec);
  r.optimizer_ = std::move(parts.optimizer);
  return r;
}

absl::StatusOr<Recipe> Recipe::FromProto(const recipe::Recipe& proto, absl::string_view source) {
  ASSIGN_OR_RETURN(Parts parts, BuildParts(proto, source, nullptr));
  Recipe r(std::move(parts.name), std::move(parts.rules), parts.default_spec);
  r.optimizer_ = std::move(parts.optimizer);
  return r;
}

absl::StatusOr<Recipe> Recipe::Load(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return WithContext(text.status(), "recipe");
  return Parse(*text, path);
}

absl::string_view Recipe::BuiltinRecipeText() { return kBuiltinText; }

const Recipe& Recipe::Builtin() {
  static const Recipe* builtin = [] {
    absl::StatusOr<Recipe> recipe = Parse(kBuiltinText, "builtin recipe");
    if (!recipe.ok()) {  // a bug in this file; recipe_test catches it
      std::fprintf(stderr, "%s\n", recipe.status().ToString().c_str());
      std::abort();
    }
    return new Recipe(*std::move(recipe));
  }();
  return *builtin;
}

Recipe::Match Recipe::Resolve(absl::string_view tensor_name) const {
  const re2::StringPiece name(tensor_name.data(), tensor_name.size());
  for (size_t i = 0; i < rules_.size(); ++i) {
    if (RE2::FullMatch(name, *rules_[i].regex)) return {&rules_[i].spec, static_cast<int>(i)};
  }
  return {&default_spec_, -1};
}

std::string Recipe::DescribeMatch(const Match& match) const {
  if (match.rule < 0) return "default";
  const RecipeRule& rule = rules_[match.rule];
  if (rule.name.empty()) return absl::StrCat("rule ", match.rule);
  return absl::StrCat("rule ", match.rule, " (\"", rule.name, "\")");
}

std::string DescribeQuantSpec(const QuantSpec& spec) {
  const QuantSpec d = DefaultQuantSpec(spec.format);
  std::vector<std::string> extras;
  const Format f = spec.format;
  if ((IsPerTensorFp8(f) || f == Format::kMxfp8 || IsBlockwise(f)) && spec.fp8_type != d.fp8_type) {
    extras.push_back(spec.fp8_type == Fp8Type::kE5M2 ? "e5m2" : "e4m3");
  }
  if (f == Format::kFp8Current || IsBlockwise(f)) {
    if (spec.pow2_scales != d.pow2_scales)
      extras.push_back(OnOff(spec.pow2_scales, "pow2", "fp32_scales"));
    if (spec.eps != d.eps) extras.push_back(absl::StrCat("eps=", spec.eps));
  }
  if (f == Format::kFp8Delayed) {
    if (spec.amax_history_len != d.amax_history_len) {
      extras.push_back(absl::StrCat("L=", spec.amax_history_len));
    }
    if (spec.amax_algo != d.amax_algo) {
      extras.push_back(spec.amax_algo == AmaxAlgo::kMostRecent ? "most_recent" : "max");
    }
    if (spec.margin != d.margin) extras.push_back(absl::StrCat("margin=", spec.margin));
  }
  if ((f == Format::kMxfp8 || f == Format::kNvfp4) && spec.two_d != d.two_d) {
    extras.push_back(OnOff(spec.two_d, "2d", "1d"));
  }
  std::string out(FormatName(f));
  if (!extras.empty()) absl::StrAppend(&out, "(", absl::StrJoin(extras, ","), ")");
  return out;
}

std::string DescribeHybridSpec(const HybridSpec& spec) {
  std::string out =
      absl::StrCat("row=", spec.rowwise_usage ? DescribeQuantSpec(spec.rowwise) : "-",
                   " col=", spec.columnwise_usage ? DescribeQuantSpec(spec.columnwise) : "-",
                   " src=", spec.source_dtype == SourceDtype::kFp32 ? "fp32" : "bf16");
  if (spec.columnwise_usage && spec.columnwise_source == ColumnwiseSource::kRowwiseDequantized) {
    absl::StrAppend(&out, " col_from=rowwise");
  }
  return out;
}

}  // namespace paramd
