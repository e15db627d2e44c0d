#include "server/step/optimizer_config.h"

#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>

#include <charconv>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/file_util.h"
#include "common/status_macros.h"

namespace paramd {
namespace {

// Keeps the first parse error, with 1-based positions.
class FirstError : public google::protobuf::io::ErrorCollector {
 public:
  explicit FirstError(absl::string_view source) : source_(source) {}
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

// The shortest decimal that reads back as the same float (0.001, not
// 0.00100000005): what a user typed, and still exact, so two descriptions
// are equal exactly when the values are.
std::string G(float v) {
  char buffer[32];
  const std::to_chars_result r = std::to_chars(buffer, buffer + sizeof(buffer), v);
  return std::string(buffer, r.ptr);
}

}  // namespace

absl::StatusOr<OptimizerOptions> OptimizerFromProto(const recipe::OptimizerConfig& p) {
  OptimizerOptions o;
  switch (p.kind()) {
    case recipe::OPTIMIZER_KIND_UNSPECIFIED:
    case recipe::ADAMW:
      o.kind = OptimizerKind::kAdamW;
      break;
    case recipe::SGD:
      o.kind = OptimizerKind::kSgd;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer: unknown kind ", static_cast<int>(p.kind())));
  }
  if (p.has_lr()) o.lr = p.lr();
  if (p.has_beta1()) o.beta1 = p.beta1();
  if (p.has_beta2()) o.beta2 = p.beta2();
  if (p.has_eps()) o.eps = p.eps();
  if (p.has_weight_decay()) o.weight_decay = p.weight_decay();
  if (p.has_momentum()) o.momentum = p.momentum();
  const recipe::LrSchedule& s = p.schedule();
  o.schedule.warmup_steps = s.warmup_steps();
  o.schedule.decay_steps = s.decay_steps();
  o.schedule.min_lr = s.min_lr();
  switch (s.decay()) {
    case recipe::LR_DECAY_UNSPECIFIED:
    case recipe::CONSTANT:
      o.schedule.decay = LrDecay::kConstant;
      break;
    case recipe::LINEAR:
      o.schedule.decay = LrDecay::kLinear;
      break;
    case recipe::COSINE:
      o.schedule.decay = LrDecay::kCosine;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer: unknown schedule.decay ", static_cast<int>(s.decay())));
  }
  o.max_grad_norm = p.max_grad_norm();
  switch (p.non_finite()) {
    case recipe::NON_FINITE_POLICY_UNSPECIFIED:
    case recipe::REFUSE:
      o.non_finite = NonFinitePolicy::kRefuse;
      break;
    case recipe::SKIP_STEP:
      o.non_finite = NonFinitePolicy::kSkipStep;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer: unknown non_finite ", static_cast<int>(p.non_finite())));
  }
  RETURN_IF_ERROR(ValidateOptimizerOptions(o));
  return o;
}

recipe::OptimizerConfig OptimizerToProto(const OptimizerOptions& o) {
  recipe::OptimizerConfig p;
  p.set_kind(o.kind == OptimizerKind::kSgd ? recipe::SGD : recipe::ADAMW);
  p.set_lr(o.lr);
  p.set_beta1(o.beta1);
  p.set_beta2(o.beta2);
  p.set_eps(o.eps);
  p.set_weight_decay(o.weight_decay);
  p.set_momentum(o.momentum);
  recipe::LrSchedule* s = p.mutable_schedule();
  s->set_warmup_steps(o.schedule.warmup_steps);
  s->set_decay(o.schedule.decay == LrDecay::kCosine   ? recipe::COSINE
               : o.schedule.decay == LrDecay::kLinear ? recipe::LINEAR
                                                      : recipe::CONSTANT);
  s->set_decay_steps(o.schedule.decay_steps);
  s->set_min_lr(o.schedule.min_lr);
  p.set_max_grad_norm(o.max_grad_norm);
  p.set_non_finite(o.non_finite == NonFinitePolicy::kSkipStep ? recipe::SKIP_STEP : recipe::REFUSE);
  return p;
}

absl::StatusOr<OptimizerOptions> ParseOptimizerConfig(absl::string_view text,
                                                      absl::string_view source) {
  recipe::OptimizerConfig proto;
  google::protobuf::TextFormat::Parser parser;
  FirstError errors(source);
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(std::string(text), &proto)) {
    return absl::InvalidArgumentError(errors.first().empty()
                                          ? absl::StrCat(source, ": cannot parse optimizer config")
                                          : errors.first());
  }
  absl::StatusOr<OptimizerOptions> o = OptimizerFromProto(proto);
  if (!o.ok()) return absl::InvalidArgumentError(absl::StrCat(source, ": ", o.status().message()));
  return o;
}

absl::StatusOr<OptimizerOptions> LoadOptimizerConfig(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return WithContext(text.status(), "optimizer config");
  return ParseOptimizerConfig(*text, path);
}

absl::Status CheckOptimizerFlags(const recipe::OptimizerConfig& f, const OptimizerOptions& c) {
  auto refuse = [](absl::string_view flag, const std::string& mine, absl::string_view field,
                   const std::string& theirs) {
    return absl::FailedPreconditionError(absl::StrCat(
        "flag --", flag, "=", mine, " disagrees with the coordinator's optimizer config (", field,
        ": ", theirs, "); drop the flag or change the coordinator's config"));
  };
  if (f.kind() != recipe::OPTIMIZER_KIND_UNSPECIFIED) {
    const OptimizerKind k = f.kind() == recipe::SGD ? OptimizerKind::kSgd : OptimizerKind::kAdamW;
    if (k != c.kind) {
      return refuse("optimizer", std::string(OptimizerName(k)), "kind",
                    std::string(OptimizerName(c.kind)));
    }
  }
  struct Field {
    bool set;
    float mine;
    float theirs;
    const char* flag;
    const char* field;
  };
  const Field fields[] = {
      {f.has_lr(), f.lr(), c.lr, "lr", "lr"},
      {f.has_beta1(), f.beta1(), c.beta1, "beta1", "beta1"},
      {f.has_beta2(), f.beta2(), c.beta2, "beta2", "beta2"},
      {f.has_eps(), f.eps(), c.eps, "adam_eps", "eps"},
      {f.has_weight_decay(), f.weight_decay(), c.weight_decay, "weight_decay", "weight_decay"},
      {f.has_momentum(), f.momentum(), c.momentum, "momentum", "momentum"},
  };
  for (const Field& x : fields) {
    if (x.set && x.mine != x.theirs) return refuse(x.flag, G(x.mine), x.field, G(x.theirs));
  }
  return absl::OkStatus();
}

TensorOptimizer TensorOptimizerFromRule(const recipe::RuleOptimizer& r) {
  TensorOptimizer t;
  if (r.has_lr_multiplier()) t.lr_multiplier = r.lr_multiplier();
  if (r.has_weight_decay()) t.weight_decay = r.weight_decay();
  t.frozen = r.frozen();
  return t;
}

rpc::TensorOptimizer TensorOptimizerToProto(const TensorOptimizer& t,
                                            const OptimizerOptions& config) {
  rpc::TensorOptimizer p;
  p.set_lr_multiplier(t.lr_multiplier);
  p.set_weight_decay(t.weight_decay.value_or(config.weight_decay));
  p.set_frozen(t.frozen);
  return p;
}

TensorOptimizer TensorOptimizerFromProto(const rpc::TensorOptimizer& p) {
  TensorOptimizer t;
  t.lr_multiplier = p.lr_multiplier();
  t.weight_decay = p.weight_decay();
  t.frozen = p.frozen();
  return t;
}

std::string DescribeSchedule(const LrSchedule& s) {
  std::string out;
  if (s.warmup_steps > 0) out = absl::StrCat("warmup ", s.warmup_steps, " then ");
  if (s.decay == LrDecay::kConstant) {
    absl::StrAppend(&out, "constant");
  } else {
    absl::StrAppend(&out, s.decay == LrDecay::kCosine ? "cosine" : "linear", " over ",
                    s.decay_steps, " to ", G(s.min_lr));
  }
  return out;
}

std::string DescribeOptimizer(const OptimizerOptions& o) {
  std::string out = absl::StrCat(OptimizerName(o.kind), " lr=", G(o.lr));
  if (o.kind == OptimizerKind::kAdamW) {
    absl::StrAppend(&out, " betas=(", G(o.beta1), ",", G(o.beta2), ") eps=", G(o.eps));
  } else {
    absl::StrAppend(&out, " momentum=", G(o.momentum));
  }
  absl::StrAppend(&out, " wd=", G(o.weight_decay), " schedule=", DescribeSchedule(o.schedule),
                  " clip=", o.max_grad_norm > 0 ? G(o.max_grad_norm) : "off", " non_finite=",
                  o.non_finite == NonFinitePolicy::kSkipStep ? "skip_step" : "refuse");
  return out;
}

}  // namespace paramd
