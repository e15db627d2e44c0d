#include "tests/client_cluster.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <fstream>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace paramd {
namespace testing {

absl::StatusOr<std::unique_ptr<TestCluster>> TestCluster::Start(const TestClusterOptions& options) {
  return Start(options, nullptr);
}

absl::StatusOr<std::unique_ptr<TestCluster>> TestCluster::Start(
    TestClusterOptions options,
    const std::function<TestClusterFlags(const std::string& dir)>& more_flags) {
  demo::InstallCleanupSignalHandlers();
  ASSIGN_OR_RETURN(demo::TempDir dir, demo::TempDir::Create("paramd_cluster"));
  std::unique_ptr<TestCluster> c(new TestCluster(std::move(dir)));
  if (more_flags) {
    TestClusterFlags flags = more_flags(c->dir());
    options.coordinator_flags.insert(options.coordinator_flags.end(), flags.coordinator.begin(),
                                     flags.coordinator.end());
    options.daemon_flags.insert(options.daemon_flags.end(), flags.daemons.begin(),
                                flags.daemons.end());
  }
  const std::string server = "server/hybrid-paramd";  // runfiles-relative (test cwd)
  const std::string d = c->dir();
  auto log = [&](const std::string& name) { return d + "/" + name + ".log"; };
  std::vector<std::string> coordinator_argv = {
      server,
      "--role=coordinator",
      "--listen=127.0.0.1:0",
      "--port_file=" + d + "/coordinator.port",
      absl::StrCat("--daemons=", options.daemons),
      absl::StrCat("--expected_pushers=", options.expected_pushers)};
  // The config is the coordinator's; the daemons' same flags are checked
  // against it at join.
  std::vector<std::string> optimizer_flags;
  if (options.optimizer_flags) {
    optimizer_flags = {"--optimizer=" + options.optimizer, absl::StrFormat("--lr=%.9g", options.lr),
                       absl::StrFormat("--momentum=%.9g", options.momentum)};
  }
  coordinator_argv.insert(coordinator_argv.end(), optimizer_flags.begin(), optimizer_flags.end());
  for (const std::string& flag : options.daemon_flags) {
    for (const char* name : {"--weight_decay=", "--beta1=", "--beta2=", "--adam_eps="}) {
      if (absl::StartsWith(flag, name)) coordinator_argv.push_back(flag);
    }
  }
  std::vector<std::string> secret_flag;
  const std::string secret_path = d + "/cluster_secret";
  if (!options.cluster_secret.empty()) {
    std::ofstream out(secret_path);
    out << options.cluster_secret << "\n";
    out.close();
    // Secret files others may read are refused (auth::ReadSecretFile).
    if (!out || chmod(secret_path.c_str(), 0600) != 0) {
      return absl::InternalError(absl::StrCat("cannot write ", secret_path));
    }
    secret_flag.push_back("--cluster_secret_file=" + secret_path);
  } else {
    // The generated secret, for the replacements StartDaemon starts.
    secret_flag.push_back("--cluster_secret_out=" + secret_path);
  }
  coordinator_argv.insert(coordinator_argv.end(), secret_flag.begin(), secret_flag.end());
  coordinator_argv.insert(coordinator_argv.end(), options.coordinator_flags.begin(),
                          options.coordinator_flags.end());
  c->coordinator_argv_ = coordinator_argv;
  ASSIGN_OR_RETURN(const int coordinator,
                   c->children_.Start({"coordinator", std::move(coordinator_argv),
                                       log("coordinator"), log("coordinator")}));
  c->coordinator_ = coordinator;
  c->names_.push_back("coordinator");
  ASSIGN_OR_RETURN(const int port, demo::WaitForPortFile(d + "/coordinator.port", absl::Seconds(20),
                                                         &c->children_, coordinator));
  c->coordinator_address_ = absl::StrCat("127.0.0.1:", port);
  c->options_ = options;
  for (int i = 0; i < options.daemons; ++i) {
    std::vector<std::string> extra;
    if (i < static_cast<int>(options.per_daemon_flags.size())) extra = options.per_daemon_flags[i];
    RETURN_IF_ERROR(c->SpawnDaemon(extra).status());
  }
  for (int i = 0; i < options.daemons; ++i) {
    ASSIGN_OR_RETURN(const int port,
                     demo::WaitForPortFile(absl::StrCat(d, "/daemon", i, ".port"),
                                           absl::Seconds(20), &c->children_, c->daemons_[i]));
    c->daemon_ports_.push_back(port);
  }
  return c;
}

absl::StatusOr<int> TestCluster::SpawnDaemon(const std::vector<std::string>& extra_flags) {
  const int i = static_cast<int>(daemons_.size());
  const std::string name = absl::StrCat("daemon", i);
  const std::string d = dir();
  std::vector<std::string> argv = {"server/hybrid-paramd", "--role=daemon", "--listen=127.0.0.1:0",
                                   "--port_file=" + d + "/" + name + ".port",
                                   "--coordinator=" + coordinator_address_};
  if (options_.optimizer_flags) {
    argv.push_back("--optimizer=" + options_.optimizer);
    argv.push_back(absl::StrFormat("--lr=%.9g", options_.lr));
    argv.push_back(absl::StrFormat("--momentum=%.9g", options_.momentum));
  }
  if (!options_.cluster_secret.empty()) {
    argv.push_back("--cluster_secret_file=" + d + "/cluster_secret");
  }
  argv.insert(argv.end(), options_.daemon_flags.begin(), options_.daemon_flags.end());
  argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
  const std::string log = d + "/" + name + ".log";
  ASSIGN_OR_RETURN(const int index, children_.Start({name, std::move(argv), log, log}));
  daemons_.push_back(index);
  names_.push_back(name);
  return i;
}

absl::StatusOr<int> TestCluster::StartDaemon(const std::vector<std::string>& extra_flags) {
  std::vector<std::string> flags = extra_flags;
  // A daemon started later may replace one: it proves the cluster secret
  // (the coordinator's --cluster_secret_out) as docs/SECURITY.md says.
  if (options_.cluster_secret.empty()) {
    flags.insert(flags.begin(), "--cluster_secret_file=" + dir() + "/cluster_secret");
  }
  ASSIGN_OR_RETURN(const int i, SpawnDaemon(flags));
  ASSIGN_OR_RETURN(const int port,
                   demo::WaitForPortFile(absl::StrCat(dir(), "/daemon", i, ".port"),
                                         absl::Seconds(20), &children_, daemons_[i]));
  daemon_ports_.push_back(port);
  return i;
}

void TestCluster::KillCoordinator() {
  children_.Signal(coordinator_, SIGKILL);
  (void)children_.Wait(coordinator_, absl::Seconds(10));
}

absl::Status TestCluster::RestartCoordinator(const std::vector<std::string>& extra_flags) {
  KillCoordinator();
  std::vector<std::string> argv = coordinator_argv_;
  argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
  const std::string port_file = absl::StrCat(dir(), "/coordinator", coordinator_starts_, ".port");
  for (std::string& a : argv) {
    if (absl::StartsWith(a, "--listen=")) a = "--listen=" + coordinator_address_;
    if (absl::StartsWith(a, "--port_file=")) a = "--port_file=" + port_file;
  }
  const std::string name = absl::StrCat("coordinator", coordinator_starts_++);
  const std::string log = dir() + "/" + name + ".log";
  ASSIGN_OR_RETURN(coordinator_, children_.Start({name, std::move(argv), log, log}));
  names_.push_back(name);
  return demo::WaitForPortFile(port_file, absl::Seconds(20), &children_, coordinator_).status();
}

void TestCluster::SignalDaemon(int d, int sig) { children_.Signal(daemons_[d], sig); }

void TestCluster::KillDaemon(int d) {
  children_.Signal(daemons_[d], SIGKILL);
  (void)children_.Wait(daemons_[d], absl::Seconds(10));
}

std::vector<std::string> TestCluster::Exited() {
  std::vector<std::string> out;
  for (size_t i = 0; i < names_.size(); ++i) {
    const std::optional<int> status = children_.Poll(static_cast<int>(i));
    if (!status) continue;
    out.push_back(WIFSIGNALED(*status) ? absl::StrCat(names_[i], ": signal ", WTERMSIG(*status))
                                       : absl::StrCat(names_[i], ": exit ", WEXITSTATUS(*status)));
  }
  return out;
}

std::string TestCluster::Logs() const {
  std::string out;
  for (const std::string& name : names_) {
    std::ifstream in(dir_.path() + "/" + name + ".log");
    std::string line;
    std::vector<std::string> lines;
    while (std::getline(in, line)) lines.push_back(line);
    absl::StrAppend(&out, "---- ", name, " ----\n");
    for (size_t i = lines.size() > 30 ? lines.size() - 30 : 0; i < lines.size(); ++i) {
      absl::StrAppend(&out, lines[i], "\n");
    }
  }
  return out;
}

}  // namespace testing
}  // namespace paramd
