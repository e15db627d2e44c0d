#include "server/step/optimizer_config.h"

#include <cmath>

#include "gtest/gtest.h"

namespace paramd {
namespace {

TEST(OptimizerConfigTest, ParsesTextAndFillsDefaults) {
  absl::StatusOr<OptimizerOptions> o = ParseOptimizerConfig(R"txt(
    kind: SGD
    lr: 0.5
    momentum: 0.9
    schedule { warmup_steps: 10 decay: COSINE decay_steps: 90 min_lr: 0.05 }
    max_grad_norm: 1.0
    non_finite: SKIP_STEP
  )txt",
                                                            "opt.textproto");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->kind, OptimizerKind::kSgd);
  EXPECT_EQ(o->lr, 0.5f);
  EXPECT_EQ(o->momentum, 0.9f);
  EXPECT_EQ(o->beta2, 0.999f);  // default
  EXPECT_EQ(o->schedule.decay, LrDecay::kCosine);
  EXPECT_EQ(o->max_grad_norm, 1.0f);
  EXPECT_EQ(o->non_finite, NonFinitePolicy::kSkipStep);
  // Round trip through the resolved proto.
  absl::StatusOr<OptimizerOptions> back = OptimizerFromProto(OptimizerToProto(*o));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(DescribeOptimizer(*back), DescribeOptimizer(*o));
  EXPECT_EQ(DescribeOptimizer(*o),
            "sgd lr=0.5 momentum=0.9 wd=0 schedule=warmup 10 then cosine over 90 to "
            "0.05 clip=1 non_finite=skip_step");
}

TEST(OptimizerConfigTest, RefusesBadConfigsNamingTheField) {
  struct Bad {
    const char* text;
    const char* want;
  };
  for (const Bad& b :
       {Bad{"lr: -1", "lr"}, Bad{"beta1: 1.5", "beta1"},
        Bad{"schedule { decay: LINEAR }", "decay_steps"},
        Bad{"lr: 0.1 schedule { decay: COSINE decay_steps: 5 min_lr: 1 }", "min_lr"},
        Bad{"max_grad_norm: -2", "max_grad_norm"},
        Bad{"schedule { warmup_steps: -3 }", "warmup_steps"}, Bad{"lr: 0.1 bogus: 3", "bogus"}}) {
    absl::StatusOr<OptimizerOptions> o = ParseOptimizerConfig(b.text, "f.textproto");
    ASSERT_FALSE(o.ok()) << b.text;
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(o.status().message().find(b.want), std::string::npos) << o.status();
    EXPECT_NE(o.status().message().find("f.textproto"), std::string::npos) << o.status();
  }
}

TEST(OptimizerConfigTest, FlagCheckNamesBothValues) {
  OptimizerOptions config;
  config.lr = 1e-3f;
  recipe::OptimizerConfig flags;
  EXPECT_TRUE(CheckOptimizerFlags(flags, config).ok());  // no flags: takes the config
  flags.set_lr(1e-3f);
  EXPECT_TRUE(CheckOptimizerFlags(flags, config).ok());  // agrees
  flags.set_lr(1e-2f);
  absl::Status s = CheckOptimizerFlags(flags, config);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("--lr=0.01"), std::string::npos) << s;
  EXPECT_NE(s.message().find("lr: 0.001"), std::string::npos) << s;
  flags.clear_lr();
  flags.set_kind(recipe::SGD);
  s = CheckOptimizerFlags(flags, config);
  EXPECT_NE(s.message().find("--optimizer=sgd"), std::string::npos) << s;
  EXPECT_NE(s.message().find("kind: adamw"), std::string::npos) << s;
}

TEST(OptimizerConfigTest, ScheduleByStep) {
  OptimizerOptions o;
  o.lr = 1.0f;
  o.schedule = {4, LrDecay::kCosine, 10, 0.25f};
  EXPECT_DOUBLE_EQ(ScheduledLr(o, 1), 0.25);
  EXPECT_DOUBLE_EQ(ScheduledLr(o, 4), 1.0);
  EXPECT_DOUBLE_EQ(ScheduledLr(o, 9), 0.25 + 0.75 * 0.5);  // halfway: (1 + cos(pi/2)) / 2
  EXPECT_DOUBLE_EQ(ScheduledLr(o, 14), 0.25);
  EXPECT_DOUBLE_EQ(ScheduledLr(o, 1000), 0.25);  // the floor after decay_steps
  o.schedule.decay = LrDecay::kLinear;
  EXPECT_DOUBLE_EQ(ScheduledLr(o, 9), 1.0 - 0.75 * 0.5);
  o.schedule = {};
  EXPECT_DOUBLE_EQ(ScheduledLr(o, 7), 1.0);
}

TEST(OptimizerConfigTest, ClipFactor) {
  OptimizerOptions o;
  EXPECT_EQ(ClipFactor(o, 1e6), 1.0f);  // no clipping configured
  o.max_grad_norm = 1.0f;
  EXPECT_EQ(ClipFactor(o, 0.25), 1.0f);  // norm 0.5 < 1
  EXPECT_EQ(ClipFactor(o, 16.0), static_cast<float>(1.0 / (4.0 + 1e-6)));
  EXPECT_EQ(ClipFactor(o, INFINITY), 1.0f);
  EXPECT_EQ(ClipFactor(o, NAN), 1.0f);
}

TEST(OptimizerConfigTest, TensorOverrides) {
  OptimizerOptions config;
  config.weight_decay = 0.1f;
  recipe::RuleOptimizer rule;
  rule.set_weight_decay(0.0f);
  rule.set_lr_multiplier(0.5f);
  const TensorOptimizer t = TensorOptimizerFromRule(rule);
  EXPECT_EQ(t.weight_decay, 0.0f);
  const StepHyper h = TensorStepHyper(config, t, 1, 0.75f);
  EXPECT_DOUBLE_EQ(h.lr, 0.5 * static_cast<double>(config.lr));
  EXPECT_EQ(h.weight_decay, 0.0f);
  EXPECT_EQ(h.grad_scale, 0.75f);
  const TensorOptimizer none = TensorOptimizerFromRule(recipe::RuleOptimizer());
  EXPECT_EQ(TensorStepHyper(config, none, 1, 1.0f).weight_decay, 0.1f);
  const rpc::TensorOptimizer p = TensorOptimizerToProto(none, config);
  EXPECT_EQ(p.weight_decay(), 0.1f);
  EXPECT_EQ(p.lr_multiplier(), 1.0f);
}

}  // namespace
}  // namespace paramd
