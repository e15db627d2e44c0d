// Runs the demo (//deploy:demo: coordinator, two daemons, two trainers as
// separate processes) with a small step count and checks its summary JSON;
// then checks that no process outlives the demo, whether it exits normally,
// is sent SIGTERM, or is SIGKILLed mid-run.
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "deploy/process.h"
#include "nlohmann/json.hpp"

namespace paramd {
namespace {

using demo::ChildProcesses;

std::string TestTmp() {
  const char* dir = getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

// Pids of live (non-zombie) processes whose command line mentions `needle`.
std::vector<pid_t> ProcessesMentioning(const std::string& needle) {
  std::vector<pid_t> pids;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return pids;
  while (dirent* e = readdir(proc)) {
    const pid_t pid = atoi(e->d_name);
    if (pid <= 0 || pid == getpid()) continue;
    std::ifstream cmdline(absl::StrCat("/proc/", pid, "/cmdline"));
    std::stringstream text;
    text << cmdline.rdbuf();
    if (!absl::StrContains(text.str(), needle)) continue;
    std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
    std::string id, comm, state;
    stat >> id >> comm >> state;
    if (state != "Z" && state != "X") pids.push_back(pid);
  }
  closedir(proc);
  return pids;
}

// Waits up to 5 s for every process mentioning `needle` to be gone.
std::vector<pid_t> Survivors(const std::string& needle) {
  std::vector<pid_t> left;
  for (int i = 0; i < 500; ++i) {
    left = ProcessesMentioning(needle);
    if (left.empty()) break;
    usleep(10000);
  }
  return left;
}

std::vector<std::string> DemoArgs(const std::string& workdir, int steps,
                                  const std::string& summary) {
  std::vector<std::string> args = {"deploy/demo", absl::StrCat("--steps=", steps),
                                   "--workdir=" + workdir, "--timeout_s=55"};
  if (!summary.empty()) args.push_back("--summary_json=" + summary);
  return args;
}

// --kill_daemon_at_step: one daemon process is SIGKILLed mid-run and a
// replacement with its rank started; the cluster rewinds to its newest
// checkpoint, the trainers resume from it, and the demo still ends OK.
TEST(Demo, KilledDaemonIsReplacedAndTheRunStillEndsOk) {
  const std::string workdir = TestTmp() + "/demo_kill";
  const std::string summary = TestTmp() + "/summary_kill.json";
  std::vector<std::string> args = DemoArgs(workdir, 12, summary);
  args.push_back("--kill_daemon_at_step=6");
  args.push_back("--checkpoint_every=4");
  ChildProcesses children;
  auto demo =
      children.Start({"demo", args, TestTmp() + "/demo_kill.out", TestTmp() + "/demo_kill.out"});
  ASSERT_TRUE(demo.ok()) << demo.status();
  auto status = children.Wait(*demo, absl::Seconds(58));
  std::ifstream out_file(TestTmp() + "/demo_kill.out");
  std::stringstream out;
  out << out_file.rdbuf();
  ASSERT_TRUE(status.ok()) << status.status() << "\n" << out.str();
  ASSERT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << out.str();
  EXPECT_TRUE(Survivors(workdir).empty()) << "processes outlived the demo";
  EXPECT_TRUE(absl::StrContains(out.str(), "OK: the loss fell")) << out.str();
  std::ifstream in(summary);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded()) << "bad summary JSON";
  const auto& r = j["recovery"];
  ASSERT_TRUE(r.is_object()) << j.dump(2);
  EXPECT_EQ(r["recovered"], true);
  EXPECT_EQ(r["killed_after_step"], 6);
  // Checkpoints every 4 versions: version 4 is the newest complete one
  // when the daemon dies after step 6 (version 7 committed; the periodic
  // checkpoint of 8 may not have run).
  const int64_t rewound = r["rewound_to_version"].get<int64_t>();
  EXPECT_TRUE(rewound == 4 || rewound == 8) << r.dump();
  EXPECT_EQ(r["steps_lost"].get<int64_t>(), r["committed_before"].get<int64_t>() - rewound);
  EXPECT_EQ(j["losses"].size(), 12u);
}

// The demo's command line follows hybrid-paramd's: --help lists its own
// flags and exits 0, --version exits 0, a bad flag exits non-zero.
TEST(Demo, HelpVersionAndBadFlags) {
  struct Case {
    std::vector<std::string> args;
    bool ok;
    std::string says;
  };
  for (const Case& c :
       std::vector<Case>{{{"deploy/demo", "--help"}, true, "--summary_json"},
                         {{"deploy/demo", "--version"}, true, "hybrid-paramd-demo"},
                         {{"deploy/demo", "--no_such_flag"}, false, "no_such_flag"}}) {
    ChildProcesses children;
    const std::string log = TestTmp() + "/demo_cli.out";
    auto demo = children.Start({"demo", c.args, log, log});
    ASSERT_TRUE(demo.ok()) << demo.status();
    auto status = children.Wait(*demo, absl::Seconds(30));
    ASSERT_TRUE(status.ok()) << status.status();
    std::ifstream out_file(log);
    std::stringstream out;
    out << out_file.rdbuf();
    ASSERT_TRUE(WIFEXITED(*status)) << c.args[1];
    EXPECT_EQ(WEXITSTATUS(*status) == 0, c.ok) << c.args[1] << ": " << out.str();
    EXPECT_TRUE(absl::StrContains(out.str(), c.says)) << c.args[1] << ": " << out.str();
  }
}

TEST(Demo, TrainsWithinToleranceOfFp32AndReportsItsFigures) {
  const std::string workdir = TestTmp() + "/demo_ok";
  const std::string summary = TestTmp() + "/summary.json";
  ChildProcesses children;
  auto demo = children.Start(
      {"demo", DemoArgs(workdir, 12, summary), TestTmp() + "/demo.out", TestTmp() + "/demo.out"});
  ASSERT_TRUE(demo.ok()) << demo.status();
  auto status = children.Wait(*demo, absl::Seconds(58));
  std::ifstream out_file(TestTmp() + "/demo.out");
  std::stringstream out;
  out << out_file.rdbuf();
  ASSERT_TRUE(status.ok()) << status.status() << "\n" << out.str();
  ASSERT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << out.str();
  EXPECT_TRUE(Survivors(workdir).empty()) << "processes outlived the demo";

  // The printed report: one line per step, and the verdict.
  EXPECT_TRUE(absl::StrContains(out.str(), "step  11 ")) << out.str();
  EXPECT_TRUE(absl::StrContains(out.str(), "OK: the loss fell")) << out.str();

  std::ifstream in(summary);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded()) << "bad summary JSON";
  EXPECT_EQ(j["steps"], 12);
  EXPECT_EQ(j["ok"], true);
  EXPECT_EQ(j["loss_fell"], true);
  EXPECT_EQ(j["within_tolerance"], true);
  const std::vector<double> losses = j["losses"].get<std::vector<double>>();
  const std::vector<double> baseline = j["baseline_losses"].get<std::vector<double>>();
  ASSERT_EQ(losses.size(), 12u);
  ASSERT_EQ(baseline.size(), 12u);
  EXPECT_LT(j["final_loss"].get<double>(), losses.front());
  // Version 0 is the loaded FP32 model seen through quantized weights: the
  // first loss is close to the baseline's.
  EXPECT_NEAR(losses.front(), baseline.front(), 0.05 * baseline.front());
  const double eval = j["eval_loss"], base_eval = j["baseline_eval_loss"];
  EXPECT_LE(std::fabs(eval - base_eval), j["tolerance"].get<double>() * base_eval);

  // Bytes: both directions moved, fewer than BF16 and FP32 would have.
  const auto& bytes = j["bytes_per_trainer"];
  EXPECT_GT(bytes["rowwise"].get<int64_t>(), 0);
  EXPECT_GT(bytes["columnwise"].get<int64_t>(), 0);
  EXPECT_EQ(bytes["total"].get<int64_t>(),
            bytes["rowwise"].get<int64_t>() + bytes["columnwise"].get<int64_t>());
  EXPECT_LT(bytes["total"].get<int64_t>(), bytes["bf16"].get<int64_t>());
  EXPECT_EQ(bytes["bf16"].get<int64_t>() * 2, bytes["fp32"].get<int64_t>());

  // The recipe: >= 3 formats, both columnwise sources, a tensor split
  // across both daemons.
  std::set<std::string> formats, sources;
  bool split = false;
  for (const auto& t : j["tensors"]) {
    formats.insert(t["rowwise"].get<std::string>());
    formats.insert(t["columnwise"].get<std::string>());
    sources.insert(t["columnwise_source"].get<std::string>());
    std::set<int> daemons;
    for (const auto& p : t["pieces"]) daemons.insert(p[2].get<int>());
    split |= daemons.size() == 2;
  }
  formats.erase("-");
  EXPECT_GE(formats.size(), 3u);
  EXPECT_EQ(sources.size(), 2u);
  EXPECT_TRUE(split);
  EXPECT_EQ(j["step_ms"].size(), 12u);
  EXPECT_GT(j["step_ms_mean"].get<double>(), 0);
  EXPECT_LT(j["wall_seconds"].get<double>(), 55);
  ASSERT_EQ(j["per_step"].size(), 12u);
  EXPECT_FALSE(j["per_step"][0]["scales"].empty());
}

// Starts the demo, waits until the trainers run, then delivers `signal`.
void KillMidRunAndCheckCleanup(int signal, const std::string& name) {
  const std::string workdir = TestTmp() + "/demo_" + name;
  ChildProcesses children;
  auto demo = children.Start({"demo", DemoArgs(workdir, 200, ""), "/dev/null", "/dev/null"});
  ASSERT_TRUE(demo.ok()) << demo.status();
  // Trainers are started after the model is loaded; their logs appear then.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!std::filesystem::exists(workdir + "/trainer1.log") && absl::Now() < deadline) {
    ASSERT_FALSE(children.Poll(*demo).has_value()) << "the demo exited early";
    usleep(20000);
  }
  ASSERT_TRUE(std::filesystem::exists(workdir + "/trainer1.log"));
  usleep(300000);
  // coordinator + 2 daemons + 2 trainers (+ the demo itself) mention workdir.
  EXPECT_GE(ProcessesMentioning(workdir).size(), 5u);
  children.Signal(*demo, signal);
  auto status = children.Wait(*demo, absl::Seconds(10));
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(WIFSIGNALED(*status));
  EXPECT_TRUE(Survivors(workdir).empty()) << "processes outlived the demo after " << name;
}

TEST(Demo, SigtermLeavesNoProcessBehind) { KillMidRunAndCheckCleanup(SIGTERM, "sigterm"); }

TEST(Demo, SigkillLeavesNoProcessBehind) { KillMidRunAndCheckCleanup(SIGKILL, "sigkill"); }

}  // namespace
}  // namespace paramd
