#include "deploy/demo_report.h"

#include <gtest/gtest.h>

namespace paramd {
namespace demo {
namespace {

TEST(DemoReport, StepRoundTrips) {
  StepReport r;
  r.rank = 1;
  r.step = 7;
  r.version = 9;
  r.loss_sum = 123.5;
  r.samples = 128;
  r.correct = 64;
  r.received = {1000, 500};
  r.fp32 = {8000, 6000};
  r.bf16 = {4000, 3000};
  r.fetch_ms = 1.5;
  r.step_ms = 20.25;
  r.scales.push_back({"head.weight", "rowwise", "fp8_current", 0.125f, 3.5f});
  auto parsed = ParseReport(ToJsonLine(r));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const StepReport& p = std::get<StepReport>(*parsed);
  EXPECT_EQ(p.rank, 1);
  EXPECT_EQ(p.step, 7);
  EXPECT_EQ(p.version, 9);
  EXPECT_EQ(p.loss_sum, 123.5);
  EXPECT_EQ(p.received.columnwise, 500);
  EXPECT_EQ(p.fp32.rowwise, 8000);
  EXPECT_EQ(p.bf16.total(), 7000);
  EXPECT_EQ(p.step_ms, 20.25);
  ASSERT_EQ(p.scales.size(), 1u);
  EXPECT_EQ(p.scales[0].format, "fp8_current");
  EXPECT_EQ(p.scales[0].scale_inv, 0.125f);
}

TEST(DemoReport, FinalRoundTrips) {
  auto parsed = ParseReport(ToJsonLine(FinalReport{0, 30, 1.25, 1024}));
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(std::get<FinalReport>(*parsed).eval_loss, 1.25);
  EXPECT_EQ(std::get<FinalReport>(*parsed).eval_samples, 1024);
}

TEST(DemoReport, RejectsGarbage) {
  EXPECT_FALSE(ParseReport("hello").ok());
  EXPECT_FALSE(ParseReport("{\"type\":\"step\"}").ok());
  EXPECT_FALSE(ParseReport("{\"type\":\"other\"}").ok());
  EXPECT_FALSE(ParseReport("[1,2]").ok());
}

}  // namespace
}  // namespace demo
}  // namespace paramd
