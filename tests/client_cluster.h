// File: tests/client_cluster.h
//
// A real hybrid-paramd cluster for integration tests: one coordinator
// process and N daemon processes on loopback (ports 0 + port files), from
// the //server:hybrid-paramd binary in the test's runfiles. The processes
// are killed when the object is destroyed (and die with the test process if
// it crashes: deploy/process.h).
//
// Not thread-safe; use from the test's main thread.
#ifndef PARAMD_TESTS_CLIENT_CLUSTER_H_
#define PARAMD_TESTS_CLIENT_CLUSTER_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "deploy/process.h"

namespace paramd {
namespace testing {

struct TestClusterOptions {
  int daemons = 2;
  int expected_pushers = 2;
  // Optimizer flags (hybrid-paramd --optimizer/--lr/...) of the coordinator
  // (its config) and of every daemon (checked against it at join).
  // false: no optimizer flags at all (the coordinator's config then comes
  // from its --recipe / --optimizer file in coordinator_flags, or a restored
  // checkpoint, or the defaults).
  bool optimizer_flags = true;
  std::string optimizer = "sgd";
  double lr = 0.5;
  double momentum = 0.0;
  // Further flags of the coordinator / of every daemon (e.g. --recipe,
  // --model, --data_plane).
  std::vector<std::string> coordinator_flags;
  // Optimizer flags among daemon_flags (--weight_decay, --beta1, ...) are
  // given to the coordinator too.
  std::vector<std::string> daemon_flags;
  // Further flags of daemon process i only (e.g. --gpu=i); may be shorter.
  std::vector<std::vector<std::string>> per_daemon_flags;
  // Non-empty: every process gets it as --cluster_secret_file, so that a
  // test can call the cluster-internal RPCs as a member would (e.g. a
  // rogue coordinator's WriteShard). Empty: the coordinator generates one
  // and writes it to DIR/cluster_secret (--cluster_secret_out).
  std::string cluster_secret;
};

// Flags that name paths in the cluster's scratch directory (see Start).
struct TestClusterFlags {
  std::vector<std::string> coordinator;
  std::vector<std::string> daemons;
};

class TestCluster {
 public:
  static absl::StatusOr<std::unique_ptr<TestCluster>> Start(const TestClusterOptions& options);
  // With more flags made from the scratch directory (e.g.
  // --checkpoint_dir=DIR/ckpt), appended to the options' flags.
  static absl::StatusOr<std::unique_ptr<TestCluster>> Start(
      TestClusterOptions options,
      const std::function<TestClusterFlags(const std::string& dir)>& more_flags);

  const std::string& coordinator_address() const { return coordinator_address_; }
  // A scratch directory removed with the cluster.
  const std::string& dir() const { return dir_.path(); }
  // The gRPC port of daemon process `d` (the order of starting, which is
  // not necessarily its rank: ranks go by the order of joining).
  int daemon_port(int d) const { return daemon_ports_[d]; }
  // Daemon processes started so far (replacements included).
  int num_daemon_processes() const { return static_cast<int>(daemon_ports_.size()); }
  // SIGKILLs daemon `d` and reaps it.
  void KillDaemon(int d);
  // SIGKILLs the coordinator (if it still runs) and starts it again with
  // the same flags plus `extra_flags` on the same port (a restart; give it
  // --state_file to take the cluster back).
  absl::Status RestartCoordinator(const std::vector<std::string>& extra_flags = {});
  // SIGKILLs the coordinator and reaps it (RestartCoordinator brings it back).
  void KillCoordinator();
  // Sends `sig` to daemon `d` (SIGSTOP / SIGCONT: a silent daemon).
  void SignalDaemon(int d, int sig);
  // Starts one more daemon process (the options' daemon flags plus
  // `extra_flags`, e.g. --rank=1 for a replacement) and waits for its port;
  // returns its index for daemon_port() / KillDaemon(). It is given the
  // cluster secret (--cluster_secret_file: the options' secret, else the
  // file the coordinator wrote with --cluster_secret_out), which a daemon
  // taking a rank that has joined before must present.
  absl::StatusOr<int> StartDaemon(const std::vector<std::string>& extra_flags = {});
  // The last lines of every process's log, for failure messages.
  std::string Logs() const;
  // The processes of the cluster that have exited (reaping them), each as
  // "NAME: exit N" or "NAME: signal N" (a crash); empty while all run.
  std::vector<std::string> Exited();

 private:
  explicit TestCluster(demo::TempDir dir) : dir_(std::move(dir)) {}
  // Starts daemon process number daemons_.size() without waiting for it.
  absl::StatusOr<int> SpawnDaemon(const std::vector<std::string>& extra_flags);
  TestClusterOptions options_;
  demo::TempDir dir_;
  demo::ChildProcesses children_;
  std::vector<int> daemons_;
  std::vector<int> daemon_ports_;
  std::vector<std::string> names_;
  std::string coordinator_address_;
  std::vector<std::string> coordinator_argv_;
  int coordinator_ = -1;  // index in children_
  int coordinator_starts_ = 1;
};

}  // namespace testing
}  // namespace paramd

#endif  // PARAMD_TESTS_CLIENT_CLUSTER_H_
