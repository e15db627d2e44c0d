// What an operator (systemd, Kubernetes, Prometheus, a person) sees of
// hybrid-paramd processes: /metrics answers a scrape with what
// server/metrics.h lists (and everything deploy/grafana's dashboard
// queries), a second server on a bound port exits non-zero, fatal startup
// errors exit non-zero with the reason on stderr, gRPC health is
// NOT_SERVING until joined and loaded, logs are levelled (text or JSON),
// --version names the commit, --config files apply under the command line.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "deploy/process.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "proto/checkpoint_service.grpc.pb.h"
#include "proto/health.grpc.pb.h"
#include "proto/paramd.grpc.pb.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

constexpr char kServer[] = "server/hybrid-paramd";  // runfiles-relative

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// CheckpointCoordinator.Checkpoint of the committed version.
grpc::Status CheckpointNow(const std::string& address) {
  auto stub = checkpoint::CheckpointCoordinator::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(20));
  checkpoint::CheckpointRequest request;
  request.set_version(-1);
  checkpoint::CheckpointResponse response;
  return stub->Checkpoint(&context, request, &response);
}

// Coordinator.Load of a safetensors file; the committed version.
absl::StatusOr<int64_t> LoadModel(const std::string& address, const std::string& model) {
  auto coordinator =
      rpc::Coordinator::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(20));
  rpc::LoadRequest request;
  request.set_safetensors_path(model);
  rpc::LoadResponse response;
  const grpc::Status s = coordinator->Load(&context, request, &response);
  if (!s.ok()) return absl::UnavailableError(s.error_message());
  return response.committed_version();
}

class ServerOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<demo::TempDir> dir = demo::TempDir::Create("paramd_ops");
    ASSERT_TRUE(dir.ok());
    dir_.emplace(*std::move(dir));
    model_ = dir_->path() + "/model.safetensors";
    ASSERT_TRUE(
        WriteModel(model_, {{"layers.0.mlp.weight", {64, 32}, RandomValues(64 * 32, 3)}}).ok());
  }

  // Starts hybrid-paramd with `flags` (plus --listen=127.0.0.1:0 and a
  // port file unless `listen` is given); returns the child's index and sets
  // *address once it serves.
  int Start(const std::string& name, std::vector<std::string> flags, std::string* address,
            const std::string& listen = "") {
    const std::string port_file = absl::StrCat(dir_->path(), "/", name, ".port");
    std::vector<std::string> argv = {kServer, "--port_file=" + port_file};
    argv.push_back(listen.empty() ? "--listen=127.0.0.1:0" : "--listen=" + listen);
    argv.insert(argv.end(), flags.begin(), flags.end());
    const std::string log = Log(name);
    absl::StatusOr<int> child = children_.Start({name, argv, log, log});
    EXPECT_TRUE(child.ok()) << child.status();
    if (!child.ok()) return -1;
    if (address != nullptr) {
      absl::StatusOr<int> port =
          demo::WaitForPortFile(port_file, absl::Seconds(20), &children_, *child);
      EXPECT_TRUE(port.ok()) << port.status() << "\n" << ReadFile(log);
      *address = port.ok() ? absl::StrCat("127.0.0.1:", *port) : "";
    }
    return *child;
  }

  // Waits for the child to exit; its exit code (-1 if it did not exit).
  int ExitCode(int child, absl::Duration timeout = absl::Seconds(20)) {
    absl::StatusOr<int> status = children_.Wait(child, timeout);
    if (!status.ok() || !WIFEXITED(*status)) return -1;
    return WEXITSTATUS(*status);
  }

  std::string Log(const std::string& name) const {
    return absl::StrCat(dir_->path(), "/", name, ".log");
  }

  std::optional<demo::TempDir> dir_;
  std::string model_;
  demo::ChildProcesses children_;
};

TEST_F(ServerOpsTest, MetricsListenServesAScrape) {
  const int metrics_port = FreePort();
  std::string address;
  const int child = Start(
      "both", {"--model=" + model_, absl::StrCat("--metrics_listen=127.0.0.1:", metrics_port)},
      &address);
  ASSERT_FALSE(address.empty());
  ASSERT_TRUE(WaitForHealth(address, "", HealthStatus::SERVING, absl::Seconds(20)))
      << ReadFile(Log("both"));
  const std::string body = HttpGet(metrics_port, "/metrics");
  EXPECT_TRUE(absl::StartsWith(body, "HTTP/1.1 200")) << body;
  const std::string who = "{role=\"both\",rank=\"0\"}";
  EXPECT_TRUE(absl::StrContains(body, "\nparamd_committed_version" + who + " 0\n")) << body;
  EXPECT_TRUE(absl::StrContains(body, "\nparamd_daemon_rank" + who + " 0\n")) << body;
  EXPECT_TRUE(absl::StrContains(body, "\nparamd_published_version" + who + " 0\n")) << body;
  EXPECT_EQ(children_.Stop(child, absl::Seconds(5)), 0);
}

TEST_F(ServerOpsTest, MetricsPortIsAnAliasAndABoundPortIsAClearError) {
  const int metrics_port = FreePort();
  std::string address;
  // 0.0.0.0: plain HTTP beyond loopback must be asked for.
  Start("first", {absl::StrCat("--metrics_port=", metrics_port), "--insecure_listen_anywhere"},
        &address);
  ASSERT_FALSE(address.empty());
  // (rank "-" or "0": the daemon may not have joined yet)
  EXPECT_TRUE(absl::StrContains(HttpGet(metrics_port, "/metrics"),
                                "paramd_committed_version{role=\"both\",rank="));
  // The same metrics port again: exit 1 with civetweb's reason.
  const int second =
      Start("second", {absl::StrCat("--metrics_port=", metrics_port), "--insecure_listen_anywhere"},
            nullptr);
  EXPECT_EQ(ExitCode(second), 1);
  const std::string log = ReadFile(Log("second"));
  EXPECT_TRUE(absl::StrContains(log, "metrics endpoint on 0.0.0.0:")) << log;
  EXPECT_TRUE(absl::StrContains(log, "Address already in use")) << log;
  const int bad = Start("bad", {"--metrics_listen=nonsense"}, nullptr);
  EXPECT_EQ(ExitCode(bad), 1);
  EXPECT_TRUE(absl::StrContains(ReadFile(Log("bad")), "--metrics_listen must be HOST:PORT"));
}

// The metrics endpoint is plain HTTP without authentication: a
// non-loopback address without --insecure_listen_anywhere is refused at
// start (exit 1, naming the flag), TLS or not.
TEST_F(ServerOpsTest, MetricsBeyondLoopbackNeedInsecureListenAnywhere) {
  const std::vector<std::vector<std::string>> refused = {
      {"--metrics_listen=0.0.0.0:0"},
      {"--metrics_listen=:0"},
      {absl::StrCat("--metrics_port=", FreePort())},
  };
  for (size_t i = 0; i < refused.size(); ++i) {
    const std::string name = absl::StrCat("metrics_refused", i);
    const int child = Start(name, refused[i], nullptr);
    EXPECT_EQ(ExitCode(child), 1) << refused[i][0];
    const std::string log = ReadFile(Log(name));
    EXPECT_TRUE(absl::StrContains(log, "is not a loopback address")) << log;
    EXPECT_TRUE(absl::StrContains(log, "--insecure_listen_anywhere")) << log;
    EXPECT_TRUE(absl::StrContains(log, refused[i][0].substr(0, refused[i][0].find('=')))) << log;
  }
}

TEST_F(ServerOpsTest, SecondServerOnTheSamePortExitsNonZero) {
  const std::string listen = absl::StrCat("127.0.0.1:", FreePort());
  std::string address;
  const int first = Start("first", {"--role=coordinator"}, &address, listen);
  ASSERT_EQ(address, listen);
  const int second = Start("second", {"--role=coordinator"}, nullptr, listen);
  EXPECT_EQ(ExitCode(second), 1);
  const std::string log = ReadFile(Log("second"));
  EXPECT_TRUE(absl::StrContains(log, "cannot listen on " + listen)) << log;
  // The first one still answers, alone.
  EXPECT_FALSE(children_.Poll(first).has_value());
  EXPECT_EQ(Health(address, "paramd.rpc.Coordinator"), HealthStatus::NOT_SERVING);
}

TEST_F(ServerOpsTest, HealthIsNotServingUntilJoinedAndLoaded) {
  std::string coordinator;
  Start("coordinator", {"--role=coordinator", "--daemons=1", "--model=" + model_}, &coordinator);
  ASSERT_FALSE(coordinator.empty());
  // No daemon yet: nothing is ready.
  EXPECT_EQ(Health(coordinator, ""), HealthStatus::NOT_SERVING);
  EXPECT_EQ(Health(coordinator, "paramd.rpc.Coordinator"), HealthStatus::NOT_SERVING);
  std::string daemon;
  Start("daemon", {"--role=daemon", "--coordinator=" + coordinator}, &daemon);
  ASSERT_FALSE(daemon.empty());
  EXPECT_TRUE(WaitForHealth(coordinator, "", HealthStatus::SERVING, absl::Seconds(20)))
      << ReadFile(Log("coordinator")) << ReadFile(Log("daemon"));
  EXPECT_EQ(Health(coordinator, "paramd.rpc.Coordinator"), HealthStatus::SERVING);
  EXPECT_TRUE(WaitForHealth(daemon, "", HealthStatus::SERVING, absl::Seconds(10)));
  EXPECT_EQ(Health(daemon, "paramd.rpc.Daemon"), HealthStatus::SERVING);
}

TEST_F(ServerOpsTest, ACoordinatorWithADownDaemonIsNotServing) {
  std::string coordinator;
  Start("coordinator", {"--role=coordinator", "--daemons=1", "--model=" + model_}, &coordinator);
  ASSERT_FALSE(coordinator.empty());
  std::string daemon;
  const int d = Start("daemon", {"--role=daemon", "--coordinator=" + coordinator}, &daemon);
  ASSERT_TRUE(WaitForHealth(coordinator, "", HealthStatus::SERVING, absl::Seconds(20)))
      << ReadFile(Log("coordinator"));
  children_.Signal(d, SIGKILL);
  // Its lease ends (DOWN) and the coordinator stops being ready.
  EXPECT_TRUE(WaitForHealth(coordinator, "", HealthStatus::NOT_SERVING, absl::Seconds(10)))
      << ReadFile(Log("coordinator"));
  EXPECT_EQ(Health(coordinator, "paramd.rpc.Coordinator"), HealthStatus::SERVING)
      << "the world has joined; hpctl and a replacement daemon can still reach it";
}

TEST_F(ServerOpsTest, JoinedButNotLoadedIsNotServing) {
  std::string address;
  Start("both", {}, &address);  // no --model: waits for a Load
  ASSERT_FALSE(address.empty());
  EXPECT_TRUE(
      WaitForHealth(address, "paramd.rpc.Coordinator", HealthStatus::SERVING, absl::Seconds(10)));
  EXPECT_EQ(Health(address, "paramd.rpc.Daemon"), HealthStatus::NOT_SERVING);
  EXPECT_EQ(Health(address, ""), HealthStatus::NOT_SERVING);
  absl::StatusOr<int64_t> committed = LoadModel(address, model_);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_TRUE(WaitForHealth(address, "", HealthStatus::SERVING, absl::Seconds(5)));
  EXPECT_EQ(Health(address, "paramd.rpc.Daemon"), HealthStatus::SERVING);
}

TEST_F(ServerOpsTest, FailedRestoreExitsNonZeroWithTheReason) {
  const int child =
      Start("restore", {"--restore_from=" + dir_->path() + "/no_such_store"}, nullptr);
  EXPECT_EQ(ExitCode(child), 1);
  const std::string log = ReadFile(Log("restore"));
  EXPECT_TRUE(absl::StrContains(log, "hybrid-paramd: ")) << log;
  EXPECT_TRUE(absl::StrContains(log, "--restore_from=" + dir_->path() + "/no_such_store")) << log;
}

TEST_F(ServerOpsTest, UnknownRestoreVersionExitsNonZero) {
  const std::string store = dir_->path() + "/ckpt";
  {  // A store holding version 0.
    std::string address;
    const int child = Start("save", {"--model=" + model_, "--checkpoint_dir=" + store}, &address);
    ASSERT_TRUE(WaitForHealth(address, "", HealthStatus::SERVING, absl::Seconds(20)));
    const grpc::Status s = CheckpointNow(address);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(children_.Stop(child, absl::Seconds(5)), 0);
  }
  const int child = Start("restore", {"--restore_from=" + store, "--restore_version=7"}, nullptr);
  EXPECT_EQ(ExitCode(child), 1);
  const std::string log = ReadFile(Log("restore"));
  EXPECT_TRUE(absl::StrContains(log, "loading the startup model failed")) << log;
  EXPECT_TRUE(absl::StrContains(log, "7")) << log;
  // The version that is there restores.
  std::string address;
  Start("restore0", {"--restore_from=" + store, "--restore_version=0"}, &address);
  EXPECT_TRUE(WaitForHealth(address, "", HealthStatus::SERVING, absl::Seconds(20)))
      << ReadFile(Log("restore0"));
}

TEST_F(ServerOpsTest, DaemonRefusedAtJoinExitsNonZero) {
  std::string address;
  Start("both", {"--model=" + model_}, &address);  // its own daemon fills the world of 1
  ASSERT_TRUE(WaitForHealth(address, "", HealthStatus::SERVING, absl::Seconds(20)));
  const int extra = Start("extra", {"--role=daemon", "--coordinator=" + address}, nullptr);
  EXPECT_EQ(ExitCode(extra), 1);
  const std::string log = ReadFile(Log("extra"));
  EXPECT_TRUE(absl::StrContains(log, "join refused")) << log;
  EXPECT_TRUE(absl::StrContains(log, "all 1 daemons have joined")) << log;
}

TEST_F(ServerOpsTest, DaemonBeforeItsCoordinatorSaysItIsWaitingThenJoins) {
  const std::string listen = absl::StrCat("127.0.0.1:", FreePort());
  std::string daemon;
  Start("daemon", {"--role=daemon", "--coordinator=" + listen}, &daemon);
  ASSERT_FALSE(daemon.empty());
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  while (absl::Now() < give_up &&
         !absl::StrContains(ReadFile(Log("daemon")), "waiting for the coordinator at " + listen)) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(
      absl::StrContains(ReadFile(Log("daemon")), "waiting for the coordinator at " + listen))
      << ReadFile(Log("daemon"));
  EXPECT_EQ(Health(daemon, "paramd.rpc.Daemon"), HealthStatus::NOT_SERVING);
  std::string coordinator;
  Start("coordinator", {"--role=coordinator", "--model=" + model_}, &coordinator, listen);
  // Joins within a few seconds of the coordinator's start, not after a
  // 30 s call deadline.
  EXPECT_TRUE(WaitForHealth(daemon, "", HealthStatus::SERVING, absl::Seconds(8)))
      << ReadFile(Log("daemon"));
}

// Steps `n` versions with admin Steps (--expected_pushers=0).
void StepVersions(const std::string& address, int n) {
  auto coordinator =
      rpc::Coordinator::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  for (int v = 0; v < n; ++v) {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(10));
    rpc::StepRequest request;
    request.set_version(v);
    request.set_wait(true);
    rpc::StepResponse response;
    const grpc::Status s = coordinator->Step(&context, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(response.committed_version(), v + 1);
  }
}

// Daemon.Fetch of `version` at `address`, read to the end; its status.
grpc::Status FetchAll(const std::string& address, int64_t version) {
  auto daemon =
      rpc::Daemon::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(10));
  rpc::FetchRequest request;
  request.set_version(version);
  auto reader = daemon->Fetch(&context, request);
  rpc::FetchResponse message;
  while (reader->Read(&message)) {
  }
  return reader->Finish();
}

// The value of the series `series` (name{labels}) in a scrape; -1 if absent.
double Sample(const std::string& scrape, const std::string& series) {
  const size_t at = scrape.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(scrape.substr(at + series.size() + 2));
}

TEST_F(ServerOpsTest, MetricsCoverLatencyRefusalsCheckpointsMembersAndFp8Health) {
  const int metrics_port = FreePort();
  std::string address;
  Start("both",
        {"--model=" + model_, "--expected_pushers=0", "--checkpoint_dir=" + dir_->path() + "/ck",
         absl::StrCat("--metrics_listen=127.0.0.1:", metrics_port)},
        &address);
  ASSERT_TRUE(WaitForHealth(address, "", HealthStatus::SERVING, absl::Seconds(20)));
  StepVersions(address, 3);
  ASSERT_TRUE(FetchAll(address, -1).ok());
  const grpc::Status dropped = FetchAll(address, 0);  // versions 2 and 3 are held
  ASSERT_EQ(dropped.error_code(), grpc::StatusCode::NOT_FOUND) << dropped.error_message();
  ASSERT_TRUE(CheckpointNow(address).ok());
  const std::string m = HttpGet(metrics_port, "/metrics");
  const std::string who = "role=\"both\",rank=\"0\"";
  EXPECT_EQ(Sample(m, "paramd_step_seconds_count{" + who + "}"), 3) << m;
  EXPECT_GT(Sample(m, "paramd_step_seconds_sum{" + who + "}"), 0) << m;
  // Two fetches (one refused), each timed.
  EXPECT_EQ(Sample(m, "paramd_fetch_seconds_count{path=\"host\"," + who + "}"), 2) << m;
  EXPECT_EQ(Sample(m, "paramd_refused_requests_total{code=\"NOT_FOUND\",method=\"Daemon/Fetch\"," +
                          who + "}"),
            1)
      << m;
  EXPECT_EQ(Sample(m, "paramd_checkpoint_seconds_count{" + who + "}"), 1) << m;
  EXPECT_GT(Sample(m, "paramd_checkpoint_last_bytes{" + who + "}"), 64 * 32 * 4) << m;
  const double age = Sample(m, "paramd_checkpoint_age_seconds{" + who + "}");
  EXPECT_GE(age, 0) << m;
  EXPECT_LT(age, 60) << m;
  EXPECT_EQ(Sample(m, "paramd_daemons_joined{" + who + "}"), 1) << m;
  EXPECT_EQ(Sample(m, "paramd_daemons_expected{" + who + "}"), 1) << m;
  EXPECT_EQ(Sample(m, "paramd_committed_version{" + who + "}"), 3) << m;
  EXPECT_GT(Sample(m, "paramd_host_memory_bytes{" + who + "}"), 1 << 20) << m;
  EXPECT_EQ(Sample(m, "paramd_device_memory_bytes{" + who + "}"), 0) << "cpu backend\n" << m;
  EXPECT_TRUE(absl::StrContains(m, "\nparamd_build_info{version=\"")) << m;
  // FP8 health under the built-in recipe's FP8 current scaling: amax maps
  // to 448, so the largest code appears and scale = 448 / amax.
  const std::string t = "tensor=\"layers.0.mlp.weight\",direction=\"rowwise\"," + who;
  const double amax = Sample(m, "paramd_tensor_amax{" + t + "}");
  const double scale = Sample(m, "paramd_tensor_scale{" + t + "}");
  EXPECT_GT(amax, 0) << m;
  EXPECT_NEAR(scale * amax, 448, 1) << m;
  const double saturated = Sample(m, "paramd_tensor_saturated_fraction{" + t + "}");
  const double zero = Sample(m, "paramd_tensor_zero_fraction{" + t + "}");
  EXPECT_GT(saturated, 0) << m;
  EXPECT_LT(saturated, 0.01) << m;
  EXPECT_GE(zero, 0) << m;
  EXPECT_LT(zero, 0.05) << m;

  // Every metric the Grafana dashboard queries is served.
  const nlohmann::json dashboard =
      nlohmann::json::parse(ReadFile("deploy/grafana/hybrid-paramd.json"));
  const std::regex metric("paramd_[a-z_]+");
  int queried = 0;
  for (const nlohmann::json& panel : dashboard["panels"]) {
    if (!panel.contains("targets")) continue;
    for (const nlohmann::json& target : panel["targets"]) {
      const std::string expr = target["expr"];
      for (std::sregex_iterator it(expr.begin(), expr.end(), metric), end; it != end; ++it) {
        ++queried;
        const std::string name = it->str();
        EXPECT_TRUE(absl::StrContains(m, "\n" + name + "{")) << panel["title"] << ": " << name;
      }
    }
  }
  EXPECT_GT(queried, 20);
}

// Before any checkpoint, paramd_checkpoint_age_seconds is the process's
// age (so an alert "too old" fires on a cluster that never checkpointed),
// and the standard process_* series describe this process.
TEST_F(ServerOpsTest, CheckpointAgeAndProcessMetricsBeforeTheFirstCheckpoint) {
  const int metrics_port = FreePort();
  std::string address;
  const int child = Start("coordinator",
                          {"--role=coordinator", "--daemons=1",
                           absl::StrCat("--metrics_listen=127.0.0.1:", metrics_port)},
                          &address);
  ASSERT_FALSE(address.empty());
  absl::SleepFor(absl::Seconds(2));
  const std::string m = HttpGet(metrics_port, "/metrics");
  const std::string who = "{role=\"coordinator\",rank=\"-\"}";
  const double now = absl::ToUnixSeconds(absl::Now());
  const double started = Sample(m, "process_start_time_seconds" + who);
  EXPECT_GT(started, now - 60) << m;
  // The kernel gives the boot time in whole seconds, so a start time read
  // from /proc may be up to 1 s late: 2 s after the start it reads >= 1 s.
  EXPECT_LE(started, now - 0.9) << m;
  const double age = Sample(m, "paramd_checkpoint_age_seconds" + who);
  EXPECT_GE(age, 1.5) << m;
  EXPECT_NEAR(age, now - started, 1.5) << m;  // (started: see above)
  EXPECT_GT(Sample(m, "process_cpu_seconds_total" + who), 0) << m;
  EXPECT_GT(Sample(m, "process_resident_memory_bytes" + who), 1 << 20) << m;
  EXPECT_GT(Sample(m, "process_virtual_memory_bytes" + who), 1 << 20) << m;
  EXPECT_GT(Sample(m, "process_open_fds" + who), 3) << m;
  EXPECT_GT(Sample(m, "process_max_fds" + who), 0) << m;
  EXPECT_EQ(Sample(m, "paramd_recovery_failed" + who), 0) << m;
  EXPECT_EQ(Sample(m, "paramd_recovery_needs_load" + who), 0) << m;
  EXPECT_EQ(Sample(m, "paramd_recoveries_total" + who), 0) << m;
  EXPECT_TRUE(absl::StrContains(m, "# TYPE process_cpu_seconds_total counter")) << m;
  EXPECT_EQ(children_.Stop(child, absl::Seconds(5)), 0);
}

TEST_F(ServerOpsTest, CoordinatorLogsEveryNthVersionAtInfo) {
  std::string address;
  const int child = Start(
      "both", {"--model=" + model_, "--expected_pushers=0", "--log_every_versions=5"}, &address);
  ASSERT_TRUE(WaitForHealth(address, "", HealthStatus::SERVING, absl::Seconds(20)));
  StepVersions(address, 12);
  EXPECT_EQ(children_.Stop(child, absl::Seconds(5)), 0);
  const std::string log = ReadFile(Log("both"));
  for (int v : {0, 5, 10}) {
    const size_t at = log.find(absl::StrCat("coordinator: committed version ", v, "\n"));
    ASSERT_NE(at, std::string::npos) << v << "\n" << log;
    const size_t line = log.rfind('\n', at) + 1;  // npos + 1 = 0
    EXPECT_TRUE(absl::StrContains(log.substr(line, at - line), " INFO  both rank=0 pid="))
        << log.substr(line, at - line);
  }
  for (int v : {1, 4, 6, 11, 12}) {
    EXPECT_FALSE(absl::StrContains(log, absl::StrCat("committed version ", v, "\n"))) << v << "\n"
                                                                                      << log;
  }
  // Load progress and its end are logged.
  EXPECT_TRUE(absl::StrContains(log, "coordinator: loading 1 tensors")) << log;
  EXPECT_TRUE(absl::StrContains(log, "coordinator: load done in ")) << log;
}

TEST_F(ServerOpsTest, VerboseLogsEveryVersionAsJsonLines) {
  std::string address;
  const int child = Start("both",
                          {"--model=" + model_, "--expected_pushers=0", "--log_every_versions=5",
                           "--v=1", "--log_format=json"},
                          &address);
  ASSERT_TRUE(WaitForHealth(address, "", HealthStatus::SERVING, absl::Seconds(20)));
  StepVersions(address, 3);
  EXPECT_EQ(children_.Stop(child, absl::Seconds(5)), 0);
  const std::string log = ReadFile(Log("both"));
  EXPECT_TRUE(absl::StrContains(log,
                                "\"level\":\"debug\",\"role\":\"both\",\"rank\":0,"
                                "\"pid\":"))
      << log;
  EXPECT_TRUE(absl::StrContains(log, "\"tag\":\"coordinator\",\"msg\":\"committed version 2\"}"))
      << log;
}

TEST_F(ServerOpsTest, VersionOfBothBinariesNamesTheCommit) {
  for (const char* program : {kServer, "hpctl/hpctl"}) {
    const std::string name = program == std::string(kServer) ? "hybrid-paramd" : "hpctl";
    const std::string log = Log(name + "_version");
    absl::StatusOr<int> child = children_.Start({name, {program, "--version"}, log, log});
    ASSERT_TRUE(child.ok());
    EXPECT_EQ(ExitCode(*child), 0) << name;
    const std::string out = ReadFile(log);
    EXPECT_TRUE(absl::StartsWith(out, name + " ")) << out;
    EXPECT_TRUE(absl::StrContains(out, " (commit ")) << out;
    EXPECT_TRUE(absl::StrContains(out, ", -c ")) << out;
    EXPECT_FALSE(absl::StrContains(out, "Debug build")) << out;
    EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
  }
}

TEST_F(ServerOpsTest, TheSampleConfigRunsAndTheCommandLineOverridesIt) {
  const std::string sample = "deploy/config/hybrid-paramd.textproto";
  std::string address;
  // The sample listens on :7070/:9100 and checkpoints under /var/lib: the
  // command line moves them here.
  const int child = Start("sample",
                          {"--config=" + sample, "--metrics_listen=127.0.0.1:0",
                           "--checkpoint_dir=" + dir_->path() + "/ckpt"},
                          &address);
  ASSERT_FALSE(address.empty()) << ReadFile(Log("sample"));
  EXPECT_TRUE(
      WaitForHealth(address, "paramd.rpc.Coordinator", HealthStatus::SERVING, absl::Seconds(10)))
      << ReadFile(Log("sample"));
  absl::StatusOr<int64_t> committed = LoadModel(address, model_);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(*committed, 0);
  EXPECT_EQ(children_.Stop(child, absl::Seconds(5)), 0);
}

TEST_F(ServerOpsTest, ConfigValuesApplyUnlessGivenOnTheCommandLine) {
  const std::string config = dir_->path() + "/c.textproto";
  {
    std::ofstream out(config);
    out << "expected_pushers: 3\noptimizer: \"sgd\"\nlog_format: \"json\"\n"
        << "model: \"" << model_ << "\"\n";
  }
  std::string address;
  Start("c", {"--config=" + config, "--log_format=text"}, &address);
  ASSERT_TRUE(WaitForHealth(address, "", HealthStatus::SERVING, absl::Seconds(20)))
      << ReadFile(Log("c"));
  auto coordinator =
      rpc::Coordinator::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(5));
  rpc::GetManifestResponse response;
  ASSERT_TRUE(coordinator->GetManifest(&context, rpc::GetManifestRequest(), &response).ok());
  EXPECT_EQ(response.manifest().expected_pushers(), 3);
  EXPECT_EQ(response.manifest().optimizer(), "sgd");
  const std::string log = ReadFile(Log("c"));
  EXPECT_TRUE(absl::StrContains(log, " INFO  both rank=")) << "--log_format=text wins\n" << log;
  EXPECT_FALSE(absl::StrContains(log, "{\"ts\"")) << log;
}

TEST_F(ServerOpsTest, ABadConfigExitsWithFileLineAndColumn) {
  const std::string config = dir_->path() + "/bad.textproto";
  {
    std::ofstream out(config);
    out << "role: \"daemon\"\n# a comment\n  daemons: 0x\n";
  }
  const int child = Start("bad", {"--config=" + config}, nullptr);
  EXPECT_EQ(ExitCode(child), 1);
  const std::string log = ReadFile(Log("bad"));
  EXPECT_TRUE(absl::StrContains(log, "hybrid-paramd: " + config + ":3:")) << log;
}

// In --log_format=json a bad flag is reported as JSON log lines too (both
// "--log_format=json" and "--log_format json"), and the process exits 1;
// in text mode Abseil's own words stay.
TEST_F(ServerOpsTest, ABadFlagInJsonModeIsAJsonLine) {
  const std::vector<std::vector<std::string>> json_forms = {
      {"--log_format=json", "--no_such_flag=1"}, {"--no_such_flag=1", "--log_format", "json"}};
  for (size_t i = 0; i < json_forms.size(); ++i) {
    const std::string name = absl::StrCat("badflag", i);
    const int child = Start(name, json_forms[i], nullptr);
    EXPECT_EQ(ExitCode(child), 1);
    const std::string log = ReadFile(Log(name));
    int lines = 0;
    bool named = false;
    for (absl::string_view line : absl::StrSplit(log, '\n', absl::SkipEmpty())) {
      ++lines;
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      ASSERT_TRUE(j.is_object()) << "not a JSON line: " << line << "\n" << log;
      EXPECT_EQ(j.value("level", ""), "error") << line;
      if (absl::StrContains(j.value("msg", ""), "no_such_flag")) named = true;
    }
    EXPECT_GT(lines, 0);
    EXPECT_TRUE(named) << log;
  }
  const int text = Start("badflag_text", {"--no_such_flag=1"}, nullptr);
  EXPECT_EQ(ExitCode(text), 1);
  const std::string log = ReadFile(Log("badflag_text"));
  EXPECT_TRUE(absl::StrContains(log, "ERROR: Unknown command line flag 'no_such_flag'")) << log;
}

}  // namespace
}  // namespace testing
}  // namespace paramd
