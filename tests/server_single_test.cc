// `hybrid-paramd` alone (coordinator + daemon in one process, one port) is
// a working single-node setup: it loads --model, serves fetches, steps on
// a push and reports status; --help and bad flags behave.
#include <sys/wait.h>

#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "deploy/process.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/paramd.grpc.pb.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

constexpr char kServer[] = "server/hybrid-paramd";  // runfiles-relative

TEST(ServerSingleTest, OneProcessLoadsServesAndSteps) {
  absl::StatusOr<demo::TempDir> dir = demo::TempDir::Create("paramd_single");
  ASSERT_TRUE(dir.ok());
  const std::string model = dir->path() + "/model.safetensors";
  const std::vector<float> w = RandomValues(300 * 64, 9);
  ASSERT_TRUE(WriteModel(model, {{"layers.0.mlp.weight", {300, 64}, w}}).ok());
  demo::ChildProcesses children;
  const std::string port_file = dir->path() + "/port";
  absl::StatusOr<int> child =
      children.Start({"hybrid-paramd",
                      {kServer, "--listen=127.0.0.1:0", "--port_file=" + port_file,
                       "--model=" + model, "--optimizer=sgd", "--lr=1"},
                      dir->path() + "/log",
                      dir->path() + "/log"});
  ASSERT_TRUE(child.ok()) << child.status();
  absl::StatusOr<int> port = demo::WaitForPortFile(port_file, absl::Seconds(20), &children, *child);
  ASSERT_TRUE(port.ok()) << port.status();
  const std::string address = absl::StrCat("127.0.0.1:", *port);
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  auto coordinator = rpc::Coordinator::NewStub(channel);
  auto daemon = rpc::Daemon::NewStub(channel);

  {  // Version 0 is committed from --model.
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(20));
    rpc::WaitForVersionRequest request;
    rpc::WaitForVersionResponse response;
    ASSERT_TRUE(coordinator->WaitForVersion(&context, request, &response).ok());
    EXPECT_EQ(response.committed_version(), 0);
  }
  rpc::Manifest manifest;
  {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(5));
    rpc::GetManifestResponse response;
    ASSERT_TRUE(coordinator->GetManifest(&context, rpc::GetManifestRequest(), &response).ok());
    manifest = response.manifest();
  }
  ASSERT_EQ(manifest.daemons_size(), 1);
  EXPECT_EQ(manifest.daemons(0).address(), address) << "one port serves both roles";
  ASSERT_EQ(manifest.tensors_size(), 1);
  EXPECT_EQ(manifest.tensors(0).spec().rowwise().format(), rpc::FORMAT_FP8_CURRENT)
      << "the built-in recipe: FP8 current scaling for *weight";

  {  // A push from the one expected pusher steps to version 1.
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(10));
    rpc::PushGradientsResponse response;
    auto writer = daemon->PushGradients(&context, &response);
    const std::vector<float> g(w.size(), 0.125f);
    const rpc::PushGradientsRequest m =
        GradientMessage(0, "trainer", "layers.0.mlp.weight", 0, 300, g.data(), 64);
    ASSERT_TRUE(writer->Write(m));
    writer->Write(EndMessage({m}));
    writer->WritesDone();
    ASSERT_TRUE(writer->Finish().ok());
    EXPECT_EQ(response.pushers_received(), 1);
    EXPECT_EQ(response.pushers_expected(), 1);
  }
  {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(10));
    rpc::FetchRequest request;
    request.set_version(1);
    auto reader = daemon->Fetch(&context, request);
    rpc::FetchResponse message;
    ASSERT_TRUE(reader->Read(&message));
    ASSERT_TRUE(message.has_plan());
    EXPECT_EQ(message.plan().version(), 1);
    EXPECT_EQ(message.plan().pieces_size(), 2);  // rowwise + columnwise
    while (reader->Read(&message)) {
    }
    EXPECT_TRUE(reader->Finish().ok());
  }
  {  // The daemon has published 1; the coordinator commits it once its report
     // is checked, which can land just after the fetch above: wait for it.
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(10));
    rpc::WaitForVersionRequest request;
    request.set_min_version(1);
    rpc::WaitForVersionResponse response;
    ASSERT_TRUE(coordinator->WaitForVersion(&context, request, &response).ok());
    EXPECT_EQ(response.committed_version(), 1);
  }
  {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(5));
    rpc::GetStatusRequest request;
    request.set_include_shards(true);
    rpc::GetStatusResponse response;
    ASSERT_TRUE(coordinator->GetStatus(&context, request, &response).ok());
    EXPECT_EQ(response.committed_version(), 1);
    ASSERT_EQ(response.daemons_size(), 1);
    EXPECT_EQ(response.daemons(0).steps(), 1);
    EXPECT_GT(response.daemons(0).bytes_served_rowwise(), 0);
    EXPECT_GT(response.daemons(0).bytes_pushed(), 0);
    ASSERT_EQ(response.daemons(0).shards_size(), 1);
    EXPECT_EQ(response.daemons(0).shards(0).directions_size(), 2);
  }
  // SIGTERM shuts down cleanly (exit 0).
  const int status = children.Stop(*child, absl::Seconds(5));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

int RunAndWait(const std::vector<std::string>& argv, std::string* output) {
  absl::StatusOr<demo::TempDir> dir = demo::TempDir::Create("paramd_flags");
  EXPECT_TRUE(dir.ok());
  demo::ChildProcesses children;
  const std::string log = dir->path() + "/out";
  absl::StatusOr<int> child = children.Start({"hybrid-paramd", argv, log, log});
  EXPECT_TRUE(child.ok());
  absl::StatusOr<int> status = children.Wait(*child, absl::Seconds(20));
  EXPECT_TRUE(status.ok()) << status.status();
  std::ifstream in(log);
  output->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return status.ok() && WIFEXITED(*status) ? WEXITSTATUS(*status) : -1;
}

TEST(ServerSingleTest, HelpListsTheFlags) {
  std::string out;
  EXPECT_EQ(RunAndWait({kServer, "--help"}, &out), 0) << out;
  for (const char* flag :
       {"--role", "--listen", "--coordinator", "--recipe", "--model", "--optimizer",
        "--expected_pushers", "--data_plane", "--metrics_port", "--port_file"}) {
    EXPECT_NE(out.find(flag), std::string::npos) << flag;
  }
}

TEST(ServerSingleTest, BadFlagsExitWithAMessage) {
  std::string out;
  EXPECT_EQ(RunAndWait({kServer, "--role=bogus", "--listen=127.0.0.1:0"}, &out), 1);
  EXPECT_NE(out.find("--role must be"), std::string::npos) << out;
  EXPECT_EQ(RunAndWait({kServer, "--optimizer=adam", "--listen=127.0.0.1:0"}, &out), 1);
  EXPECT_NE(out.find("unknown optimizer"), std::string::npos) << out;
  EXPECT_EQ(RunAndWait({kServer, "--recipe=/no/such/recipe", "--listen=127.0.0.1:0"}, &out), 1);
  // Named by the flag the user gave, not by an internal option.
  EXPECT_EQ(
      RunAndWait({kServer, "--role=coordinator", "--daemons=0", "--listen=127.0.0.1:0"}, &out), 1);
  EXPECT_NE(out.find("--daemons must be >= 1, got 0"), std::string::npos) << out;
  EXPECT_EQ(RunAndWait({kServer, "--expected_pushers=-2", "--listen=127.0.0.1:0"}, &out), 1);
  EXPECT_NE(out.find("--expected_pushers must be >= 0"), std::string::npos) << out;
  // A daemon's --coordinator without a port: refused at once, not after
  // minutes of join retries.
  const absl::Time start = absl::Now();
  EXPECT_EQ(
      RunAndWait({kServer, "--role=daemon", "--coordinator=node0", "--listen=127.0.0.1:0"}, &out),
      1);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_NE(out.find("--coordinator=node0: "), std::string::npos) << out;
  EXPECT_EQ(RunAndWait({kServer, "--advertise_address=node1:port", "--listen=127.0.0.1:0"}, &out),
            1);
  EXPECT_NE(out.find("--advertise_address=node1:port: "), std::string::npos) << out;
}

}  // namespace
}  // namespace testing
}  // namespace paramd
