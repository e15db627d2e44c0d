// Test-only server for the multi-process checkpoint tests: serves the
// checkpoint services over fake state (checkpoint/fake_daemon.h), so that
// daemons and the coordinator can be killed with SIGKILL at any moment
// without a model, a data plane or trainers.
//
//   fake_cluster --role=daemon --rank=R --world=W --root=DIR --port_file=F
//   fake_cluster --role=coordinator --root=DIR --daemons=HOST:PORT,... --port_file=F
//
// Daemons hold the pieces SimplePlan gives rank R of the model below, with
// the values of model seed = version; a WriteShard or ExportRows of any
// version v >= the current one first "steps" the daemon to v. The
// coordinator reports every version as committed, so a Checkpoint request
// must name its version.
#include <signal.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "checkpoint/fake_daemon.h"
#include "checkpoint/service.h"
#include "checkpoint/test_util.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, role, "daemon", "daemon | coordinator");
ABSL_FLAG(std::string, root, "", "checkpoint directory");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "listen address");
ABSL_FLAG(std::string, port_file, "", "write the bound port here");
ABSL_FLAG(int32_t, rank, 0, "daemon rank");
ABSL_FLAG(int32_t, world, 2, "number of daemons");
ABSL_FLAG(std::string, daemons, "", "coordinator: daemon addresses by rank, comma-separated");
ABSL_FLAG(int32_t, write_delay_ms, 0, "daemon: sleep before writing a shard");

namespace paramd {
namespace checkpoint {
namespace {

// The model of the multi-process tests (tests/checkpoint_kill_test.cc).
std::vector<TensorInfo> Model() {
  return testing::FakeTensors({{512, 512}, {130, 97}, {1, 1000}, {3, 7}});
}

// A fake daemon that follows whatever version it is asked for.
class FollowingDaemon : public testing::FakeDaemon {
 public:
  using FakeDaemon::FakeDaemon;
  absl::Status WithState(int64_t version,
                         const std::function<absl::Status(const DaemonStateView&)>& fn) override {
    if (version > this->version()) SetVersion(version);
    return FakeDaemon::WithState(version, fn);
  }
  absl::Status ReadRows(int64_t version, ExportValuesKind kind, const std::string& tensor,
                        int64_t row_begin, int64_t row_end, absl::Span<float> out) override {
    if (version > this->version()) SetVersion(version);
    return FakeDaemon::ReadRows(version, kind, tensor, row_begin, row_end, out);
  }
};

absl::Status WritePortFile(const std::string& path, int port) {
  if (path.empty()) return absl::OkStatus();
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << port << "\n";
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename ", tmp));
  }
  return absl::OkStatus();
}

absl::Status Run() {
  CheckpointServiceOptions options;
  options.root = absl::GetFlag(FLAGS_root);
  const std::vector<TensorInfo> tensors = Model();
  const int world = absl::GetFlag(FLAGS_world);
  std::unique_ptr<FollowingDaemon> daemon;
  std::unique_ptr<CheckpointDaemonService> daemon_service;
  std::unique_ptr<CheckpointCoordinatorService> coordinator_service;
  grpc::Service* service = nullptr;
  if (absl::GetFlag(FLAGS_role) == "daemon") {
    daemon = std::make_unique<FollowingDaemon>(
        tensors, testing::SimplePlan(tensors, world)[absl::GetFlag(FLAGS_rank)], 0);
    daemon->set_write_delay(absl::Milliseconds(absl::GetFlag(FLAGS_write_delay_ms)));
    auto created = CheckpointDaemonService::Create(options, daemon.get());
    if (!created.ok()) return created.status();
    daemon_service = *std::move(created);
    service = daemon_service->service();
  } else {
    std::vector<std::string> addresses =
        absl::StrSplit(absl::GetFlag(FLAGS_daemons), ',', absl::SkipEmpty());
    if (static_cast<int>(addresses.size()) != world) {
      return absl::InvalidArgumentError("--daemons must list --world addresses");
    }
    auto view = std::make_unique<testing::FakeClusterView>(testing::FakeClusterManifest(
        tensors, testing::SimplePlan(tensors, world), addresses, int64_t{1} << 40));
    auto created = CheckpointCoordinatorService::Create(options, std::move(view));
    if (!created.ok()) return created.status();
    coordinator_service = *std::move(created);
    service = coordinator_service->service();
  }
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", absl::GetFlag(FLAGS_listen)));
  }
  if (absl::Status s = WritePortFile(absl::GetFlag(FLAGS_port_file), port); !s.ok()) return s;
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  int sig = 0;
  sigwait(&signals, &sig);
  server->Shutdown();
  return absl::OkStatus();
}

}  // namespace
}  // namespace checkpoint
}  // namespace paramd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::Status status = paramd::checkpoint::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "fake_cluster: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
