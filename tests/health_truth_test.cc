// What operators see of a cluster that lost a daemon, against real
// processes (tests/client_cluster.h): a coordinator and two daemons.
//
//   Nothing to recover from (no snapshots, no checkpoint directory): after
//   a daemon is SIGKILLed and a replacement joins, gRPC health of the
//   coordinator is NOT_SERVING, /metrics shows paramd_daemon_up 0 for the
//   lost rank, the coordinator logs the failed recovery once at ERROR with
//   the way out (not at every 2 s retry), `hpctl status` says the cluster
//   cannot serve and why; `hpctl load --force` then works, health is
//   SERVING again and a step commits.
//
//   JSON logs: with --log_format=json every line every process writes
//   (joins, a lost daemon, refused requests, a refused join that ends a
//   daemon) is one JSON object, and the lost daemon is a warning.
#include <sys/wait.h>

#include <fstream>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "deploy/process.h"
#include "nlohmann/json.hpp"
#include "tests/client_cluster.h"
#include "tests/recovery_test_util.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace {

using client::Client;
using client::ClientOptions;
using testing::FreePort;
using testing::Health;
using testing::HealthStatus;
using testing::HttpGet;
using testing::TestCluster;
using testing::TestClusterOptions;
using testing::WaitForHealth;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A coordinator (metrics on `metrics_port`) and two daemons without
// snapshots or checkpoints, the test model loaded and stepped to version 1.
class LostStateCluster {
 public:
  static std::unique_ptr<LostStateCluster> Start(const std::vector<std::string>& flags = {}) {
    auto c = std::make_unique<LostStateCluster>();
    c->metrics_port = FreePort();
    TestClusterOptions options;
    options.daemons = 2;
    options.expected_pushers = 0;  // admin steps only
    options.coordinator_flags = {absl::StrCat("--metrics_listen=127.0.0.1:", c->metrics_port)};
    options.coordinator_flags.insert(options.coordinator_flags.end(), flags.begin(), flags.end());
    options.daemon_flags = {"--snapshot_every_steps=0"};
    options.daemon_flags.insert(options.daemon_flags.end(), flags.begin(), flags.end());
    auto cluster = TestCluster::Start(options);
    EXPECT_TRUE(cluster.ok()) << cluster.status();
    if (!cluster.ok()) return nullptr;
    c->cluster = *std::move(cluster);
    ClientOptions co;
    co.coordinator_address = c->cluster->coordinator_address();
    co.role = ClientOptions::Role::kObserver;
    auto client = Client::Connect(co);
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return nullptr;
    c->client = *std::move(client);
    c->model = c->cluster->dir() + "/model.safetensors";
    absl::StatusOr<int64_t> v = testing::WriteAndLoadModel(*c->client, c->model);
    EXPECT_TRUE(v.ok()) << v.status() << c->cluster->Logs();
    if (!v.ok()) return nullptr;
    absl::StatusOr<int64_t> stepped = c->client->Step(0, /*wait=*/true, absl::Seconds(30));
    EXPECT_TRUE(stepped.ok()) << stepped.status() << c->cluster->Logs();
    if (!stepped.ok()) return nullptr;
    return c;
  }

  rpc::GetStatusResponse Status() {
    auto s = client->Status(false, absl::Seconds(5));
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : rpc::GetStatusResponse();
  }

  // The daemon process (index for KillDaemon) holding `rank`; -1 if none.
  int ProcessOfRank(int rank) { return DaemonProcessOfRank(Status(), *cluster, rank); }

  // paramd_daemon_up of `rank` in a scrape of the coordinator's /metrics
  // ("" if the scrape has no such series).
  std::string DaemonUp(int rank) {
    return Metric(absl::StrCat(R"(paramd_daemon_up\{rank=\")", rank, R"(\"[^}]*\})"));
  }

  // The value of the first series matching `series` (a regex of name and
  // labels) in a scrape of the coordinator's /metrics ("" if none).
  std::string Metric(const std::string& series) {
    const std::string body = HttpGet(metrics_port, "/metrics");
    std::smatch m;
    return std::regex_search(body, m, std::regex(series + " ([0-9.]+)")) ? m[1].str() : "";
  }

  // hpctl with `args` against the coordinator: its exit code and output.
  std::pair<int, std::string> Hpctl(std::vector<std::string> args) {
    args.insert(args.begin(), "hpctl/hpctl");
    args.push_back("--address=" + cluster->coordinator_address());
    args.push_back("--timeout=20");
    const std::string log = absl::StrCat(cluster->dir(), "/hpctl", ++hpctl_runs, ".out");
    demo::ChildProcesses children;
    auto index = children.Start({"hpctl", args, log, log});
    EXPECT_TRUE(index.ok()) << index.status();
    if (!index.ok()) return {-1, ""};
    auto status = children.Wait(*index, absl::Seconds(40));
    EXPECT_TRUE(status.ok()) << status.status();
    const int code = status.ok() && WIFEXITED(*status) ? WEXITSTATUS(*status) : -1;
    return {code, ReadFile(log)};
  }

  // SIGKILLs the daemon of rank 1 and starts a replacement with its rank.
  void ReplaceRankOne() {
    const int victim = ProcessOfRank(1);
    ASSERT_GE(victim, 0) << cluster->Logs();
    cluster->KillDaemon(victim);
    auto replacement = cluster->StartDaemon({"--rank=1"});
    ASSERT_TRUE(replacement.ok()) << replacement.status();
  }

  std::unique_ptr<TestCluster> cluster;
  std::unique_ptr<Client> client;
  std::string model;
  int metrics_port = 0;
  int hpctl_runs = 0;
};

TEST(HealthTruthTest, NothingToRecoverFromIsNotServingUntilLoadedAgain) {
  auto c = LostStateCluster::Start();
  ASSERT_NE(c, nullptr);
  const std::string coordinator = c->cluster->coordinator_address();
  ASSERT_TRUE(WaitForHealth(coordinator, "", HealthStatus::SERVING, absl::Seconds(10)))
      << c->cluster->Logs();
  EXPECT_EQ(c->DaemonUp(1), "1");

  c->ReplaceRankOne();
  // The replacement joins once the dead daemon's lease (1.5 s) expires;
  // the recovery then finds nothing to recover from.
  rpc::RecoveryStatus recovery;
  const absl::Time give_up = absl::Now() + absl::Seconds(15);
  while (absl::Now() < give_up && !recovery.needs_load()) {
    absl::SleepFor(absl::Milliseconds(50));
    recovery = c->Status().recovery();
  }
  ASSERT_TRUE(recovery.needs_load()) << recovery.ShortDebugString() << c->cluster->Logs();
  const absl::Time failed_at = absl::Now();
  EXPECT_TRUE(absl::StrContains(recovery.error(), "nothing to recover from")) << recovery.error();

  // Health follows within the server's 50 ms monitor tick.
  EXPECT_TRUE(WaitForHealth(coordinator, "paramd.rpc.Coordinator", HealthStatus::NOT_SERVING,
                            absl::Seconds(2)));
  EXPECT_EQ(Health(coordinator, ""), HealthStatus::NOT_SERVING);
  EXPECT_EQ(c->DaemonUp(1), "0");
  EXPECT_EQ(c->DaemonUp(0), "1");
  // What deploy/prometheus/alerts.yml's ParamdRecoveryFailed reads.
  EXPECT_EQ(c->Metric(R"(paramd_recovery_failed\{[^}]*\})"), "1");
  EXPECT_EQ(c->Metric(R"(paramd_recovery_needs_load\{[^}]*\})"), "1");
  absl::StatusOr<int64_t> step = c->client->Step(1, /*wait=*/false, absl::Seconds(5));
  EXPECT_FALSE(step.ok());

  const auto [status_code, status_out] = c->Hpctl({"status", "--noshards"});
  EXPECT_EQ(status_code, 0) << status_out;
  EXPECT_TRUE(absl::StrContains(status_out, "CLUSTER CANNOT SERVE")) << status_out;
  EXPECT_TRUE(absl::StrContains(status_out, "nothing to recover from")) << status_out;
  EXPECT_TRUE(absl::StrContains(status_out, "hpctl load MODEL --force")) << status_out;

  // Several retry periods (every 2 s) after the first failure: still one
  // ERROR line about it, naming the way out.
  absl::SleepFor(absl::Seconds(4.5) - (absl::Now() - failed_at));
  int error_lines = 0;
  std::string error_line;
  for (absl::string_view line :
       absl::StrSplit(ReadFile(c->cluster->dir() + "/coordinator.log"), '\n')) {
    if (absl::StrContains(line, "recovery failed") && absl::StrContains(line, " ERROR ")) {
      ++error_lines;
      error_line = std::string(line);
    }
  }
  EXPECT_EQ(error_lines, 1) << c->cluster->Logs();
  EXPECT_TRUE(absl::StrContains(error_line, "hpctl load MODEL --force")) << error_line;
  // The retries went on meanwhile (quietly).
  EXPECT_TRUE(c->Status().recovery().needs_load());

  // The way out: load again, replacing what was lost.
  const auto [load_code, load_out] = c->Hpctl({"load", c->model, "--force"});
  ASSERT_EQ(load_code, 0) << load_out << c->cluster->Logs();
  EXPECT_TRUE(WaitForHealth(coordinator, "", HealthStatus::SERVING, absl::Seconds(5)))
      << c->cluster->Logs();
  EXPECT_TRUE(WaitForHealth(coordinator, "paramd.rpc.Coordinator", HealthStatus::SERVING,
                            absl::Seconds(1)));
  EXPECT_EQ(c->DaemonUp(1), "1");
  EXPECT_EQ(c->Metric(R"(paramd_recovery_failed\{[^}]*\})"), "0");
  EXPECT_EQ(c->Metric(R"(paramd_recovery_needs_load\{[^}]*\})"), "0");
  recovery = c->Status().recovery();
  EXPECT_FALSE(recovery.needs_load()) << recovery.ShortDebugString();
  EXPECT_EQ(recovery.error(), "");
  const auto [clean_code, clean_out] = c->Hpctl({"status", "--noshards"});
  EXPECT_FALSE(absl::StrContains(clean_out, "CANNOT SERVE")) << clean_out;
  ASSERT_TRUE(c->client->RefreshManifest().ok());
  step = c->client->Step(0, /*wait=*/true, absl::Seconds(30));
  ASSERT_TRUE(step.ok()) << step.status() << c->cluster->Logs();
  EXPECT_EQ(*step, 1);
}

TEST(HealthTruthTest, JsonLogModeWritesOnlyJsonLines) {
  auto c = LostStateCluster::Start({"--log_format=json"});
  ASSERT_NE(c, nullptr);
  // A refused request: a load of a file that is not there.
  EXPECT_FALSE(c->client
                   ->Load(c->cluster->dir() + "/missing.safetensors", "", absl::Seconds(10),
                          /*replace_model=*/true)
                   .ok());
  // A lost daemon and its replacement (a failed recovery: nothing to
  // recover from), then a daemon refused at join (its optimizer differs),
  // which exits with the reason.
  c->ReplaceRankOne();
  const absl::Time give_up = absl::Now() + absl::Seconds(15);
  while (absl::Now() < give_up && !c->Status().recovery().needs_load()) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  // It may exit before StartDaemon has seen its port file. Wait for its
  // own exit: the daemon killed above is among the exited processes too.
  const std::string refused_exit =
      absl::StrCat("daemon", c->cluster->num_daemon_processes(), ": exit");
  (void)c->cluster->StartDaemon({"--lr=0.125"});
  const absl::Time exit_by = absl::Now() + absl::Seconds(10);
  auto refused_exited = [&] {
    for (const std::string& e : c->cluster->Exited()) {
      if (absl::StartsWith(e, refused_exit)) return true;
    }
    return false;
  };
  while (absl::Now() < exit_by && !refused_exited()) absl::SleepFor(absl::Milliseconds(50));
  std::vector<std::string> logs = {"coordinator"};
  for (int d = 0; d < 4; ++d) logs.push_back(absl::StrCat("daemon", d));
  int lines = 0;
  bool lost_warned = false, recovery_error = false, join_refused = false;
  for (const std::string& name : logs) {
    const std::string text = ReadFile(c->cluster->dir() + "/" + name + ".log");
    EXPECT_FALSE(text.empty()) << name;
    for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
      ++lines;
      nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      ASSERT_TRUE(j.is_object()) << name << ": not a JSON line: " << line;
      for (const char* key : {"ts", "level", "role", "rank", "pid", "tag", "msg"}) {
        EXPECT_TRUE(j.contains(key)) << name << ": no " << key << ": " << line;
      }
      const std::string msg = j.value("msg", "");
      const std::string level = j.value("level", "");
      if (absl::StrContains(msg, "is DOWN") && level == "warn") lost_warned = true;
      if (absl::StrContains(msg, "recovery failed") && level == "error") recovery_error = true;
      if (absl::StrContains(msg, "join refused") && level == "error") join_refused = true;
    }
  }
  EXPECT_GT(lines, 10);
  EXPECT_TRUE(lost_warned) << c->cluster->Logs();
  EXPECT_TRUE(recovery_error) << c->cluster->Logs();
  EXPECT_TRUE(join_refused) << c->cluster->Logs();
}

}  // namespace
}  // namespace paramd
