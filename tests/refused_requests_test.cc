// File: tests/refused_requests_test.cc
//
// A refused request changes nothing. One table: for every mutating RPC of
// the coordinator, the daemons and the checkpoint services, requests that
// must be refused; around each, a digest of the cluster's state (the
// coordinator's status with its members, manifest, optimizer config and
// recovery record, every daemon's versions, pushers and optimizer progress,
// the published masters, and every file under the cluster's directory:
// checkpoints and the coordinator's state file) must be equal before and
// after. Statistics (bytes served, timings, heartbeat ages) are left out:
// they are counters, not state.
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/hash/hash.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "auth/security.h"
#include "deploy/process.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "proto/checkpoint_service.grpc.pb.h"
#include "tests/checkpoint_test_util.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

namespace fs = std::filesystem;

constexpr char kClusterSecret[] = "refused-requests-test-cluster-secret";

const std::vector<TestTensor>& Model() {
  static const auto* model = new std::vector<TestTensor>{{"w", {24, 16}, RandomValues(24 * 16, 51)},
                                                         {"b", {16}, RandomValues(16, 52)}};
  return *model;
}

std::map<std::string, std::vector<float>> Gradients(uint32_t seed) {
  std::map<std::string, std::vector<float>> g;
  for (const TestTensor& t : Model()) g[t.name] = RandomValues(t.values.size(), seed, 0.1f);
  return g;
}

// Text of a message with maps in key order (TextFormat sorts them).
std::string Text(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::TextFormat::PrintToString(m, &out);
  return out;
}

class RefusedRequestsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<demo::TempDir> dir = demo::TempDir::Create("refused_requests");
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = std::make_unique<demo::TempDir>(*std::move(dir));
    TestClusterOptions o = TwoDaemonSgd(0.5);
    o.cluster_secret = kClusterSecret;  // to reach the internal RPCs' own checks
    o.coordinator_flags = {"--checkpoint_dir=" + dir_->path() + "/ckpt",
                           "--state_file=" + dir_->path() + "/state"};
    o.daemon_flags = {"--checkpoint_dir=" + dir_->path() + "/ckpt"};
    absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = *std::move(c);
    model_path_ = dir_->path() + "/model.safetensors";
    ASSERT_TRUE(WriteModel(model_path_, Model()).ok());
    absl::StatusOr<int64_t> v = cluster_->Load(model_path_, kFp32PassthroughRecipe);
    ASSERT_TRUE(v.ok()) << v.status() << cluster_->cluster().Logs();
    ASSERT_TRUE(cluster_->PushAll(0, "p0", Gradients(53)).ok());
    ASSERT_TRUE(cluster_->PushAll(0, "p1", Gradients(54)).ok());
    ASSERT_TRUE(cluster_->WaitForVersion(1).ok()) << cluster_->cluster().Logs();
    const std::string address = cluster_->cluster().coordinator_address();
    ASSERT_TRUE(CheckpointVia(address, 1, absl::Seconds(30)).ok());
    // Pusher p0 has pushed for version 1: a refusal must not count or drop it.
    ASSERT_TRUE(cluster_->PushAll(1, "p0", Gradients(55)).ok());
    auto insecure = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
    checkpoints_ = checkpoint::CheckpointCoordinator::NewStub(insecure);
    for (int r = 0; r < cluster_->num_daemons(); ++r) {
      auto member = auth::CreateChannel(cluster_->manifest().daemons(r).address(),
                                        {{}, std::make_shared<auth::BearerToken>(kClusterSecret)});
      shard_writers_.push_back(checkpoint::CheckpointDaemon::NewStub(member));
      daemons_as_member_.push_back(rpc::Daemon::NewStub(member));
    }
    coordinator_as_member_ = rpc::Coordinator::NewStub(
        auth::CreateChannel(address, {{}, std::make_shared<auth::BearerToken>(kClusterSecret)}));
  }

  // The cluster's state; see the file comment.
  std::string Digest() {
    std::ostringstream out;
    rpc::GetStatusRequest request;
    rpc::GetStatusResponse status;
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(10));
    const grpc::Status s = cluster_->coordinator().GetStatus(&context, request, &status);
    if (!s.ok()) return "GetStatus failed: " + s.error_message();
    for (rpc::Member& m : *status.mutable_members()) m.clear_heartbeat_age_seconds();
    for (rpc::DaemonStats& d : *status.mutable_daemons()) {
      d.clear_bytes_served_rowwise();
      d.clear_bytes_served_columnwise();
      d.clear_bytes_pushed();
      d.clear_last_step_seconds();
      d.clear_snapshot_block_seconds();
      d.clear_snapshot_copy_seconds();
    }
    status.mutable_recovery()->clear_seconds();
    out << "== status\n" << Text(status);
    rpc::GetManifestRequest manifest_request;
    rpc::GetManifestResponse manifest;
    grpc::ClientContext manifest_context;
    SetDeadline(manifest_context, absl::Seconds(10));
    const grpc::Status m =
        cluster_->coordinator().GetManifest(&manifest_context, manifest_request, &manifest);
    out << "== manifest " << m.error_code() << "\n" << Text(manifest);
    std::vector<std::string> names;
    for (const TestTensor& t : Model()) names.push_back(t.name);
    absl::StatusOr<std::map<std::string, std::vector<float>>> masters =
        cluster_->Fp32Masters(status.committed_version(), names);
    out << "== masters of v" << status.committed_version() << "\n";
    if (!masters.ok()) {
      out << masters.status() << "\n";
    } else {
      for (const auto& [name, values] : *masters) {
        out << name << " " << values.size() << " " << absl::HashOf(values) << "\n";
      }
    }
    out << "== files\n";
    for (const auto& e : fs::recursive_directory_iterator(dir_->path())) {
      const std::string path = e.path().string();
      out << path.substr(dir_->path().size());
      if (e.is_regular_file()) {
        std::ifstream in(path, std::ios::binary);
        std::stringstream bytes;
        bytes << in.rdbuf();
        out << " " << e.file_size() << " " << absl::HashOf(bytes.str()) << " "
            << static_cast<int>(e.status().permissions());
      }
      out << "\n";
    }
    return out.str();
  }

  template <class Stub, class Request, class Response>
  static grpc::Status Unary(Stub& stub,
                            grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&,
                                                         Response*),
                            const Request& request) {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(20));
    Response response;
    return (stub.*method)(&context, request, &response);
  }

  std::unique_ptr<demo::TempDir> dir_;  // checkpoints, state file, model
  std::unique_ptr<RawCluster> cluster_;
  std::string model_path_;
  std::unique_ptr<checkpoint::CheckpointCoordinator::Stub> checkpoints_;
  std::vector<std::unique_ptr<checkpoint::CheckpointDaemon::Stub>> shard_writers_;
  std::vector<std::unique_ptr<rpc::Daemon::Stub>> daemons_as_member_;
  std::unique_ptr<rpc::Coordinator::Stub> coordinator_as_member_;
};

// The lines of `before` missing from `after` (-) and the new ones (+).
std::string LineDiff(const std::string& before, const std::string& after) {
  auto lines = [](const std::string& text) {
    std::multiset<std::string> out;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) out.insert(line);
    return out;
  };
  const std::multiset<std::string> a = lines(before), b = lines(after);
  std::string diff;
  for (const std::string& line : a) {
    if (a.count(line) > b.count(line)) absl::StrAppend(&diff, "- ", line, "\n");
  }
  for (const std::string& line : b) {
    if (b.count(line) > a.count(line)) absl::StrAppend(&diff, "+ ", line, "\n");
  }
  return diff;
}

struct Refused {
  std::string what;
  std::function<grpc::Status()> call;
};

TEST_F(RefusedRequestsTest, EveryRefusedRequestLeavesTheClusterAsItWas) {
  using Coordinator = rpc::Coordinator::Stub;
  using Daemon = rpc::Daemon::Stub;
  using Checkpoints = checkpoint::CheckpointCoordinator::Stub;
  using ShardWriter = checkpoint::CheckpointDaemon::Stub;
  Coordinator& coordinator = cluster_->coordinator();
  const rpc::TensorInfo& w = cluster_->tensor("w");
  const std::vector<float> rows(static_cast<size_t>(w.rows() * w.cols()), 0.25f);

  auto load = [&](std::function<void(rpc::LoadRequest&)> edit) {
    return [&, edit] {
      rpc::LoadRequest r;
      r.set_safetensors_path(model_path_);
      r.set_recipe_text(kFp32PassthroughRecipe);
      edit(r);
      return Unary(coordinator, &Coordinator::Load, r);
    };
  };
  auto push = [&](std::vector<rpc::PushGradientsRequest> messages, bool add_end = true) {
    return [this, messages, add_end] { return cluster_->PushRaw(0, messages, nullptr, add_end); };
  };
  auto checkpoint = [&](int64_t version, int32_t keep, const std::string& dir) {
    return [&, version, keep, dir] {
      checkpoint::CheckpointRequest r;
      r.set_version(version);
      r.set_keep(keep);
      r.set_dir(dir);
      return Unary(*checkpoints_, &Checkpoints::Checkpoint, r);
    };
  };
  auto schedule = [&](std::function<void(rpc::SetOptimizerScheduleRequest&)> edit) {
    return [&, edit] {
      rpc::SetOptimizerScheduleRequest r;
      edit(r);
      return Unary(coordinator, &Coordinator::SetOptimizerSchedule, r);
    };
  };

  const std::vector<Refused> table = {
      // Coordinator.Load
      {"Load without force while a model is loaded, with a recipe that changes the optimizer",
       load([](rpc::LoadRequest& r) {
         r.set_recipe_text(absl::StrCat(kFp32PassthroughRecipe,
                                        " optimizer { kind: ADAMW lr: 0.125 weight_decay: 0.5 }"));
       })},
      {"Load without force", load([](rpc::LoadRequest&) {})},
      {"Load with force of a missing file",
       load([&](rpc::LoadRequest& r) {
         r.set_force(true);
         r.set_safetensors_path(dir_->path() + "/missing.safetensors");
       })},
      {"Load with force of a recipe that does not parse",
       load([](rpc::LoadRequest& r) {
         r.set_force(true);
         r.set_recipe_text("default_spec { rowwise { format: NO_SUCH_FORMAT } }");
       })},
      {"Load with force of a checkpoint version that does not exist",
       load([&](rpc::LoadRequest& r) {
         r.set_force(true);
         r.clear_safetensors_path();
         r.clear_recipe_text();
         r.set_checkpoint_path(dir_->path() + "/ckpt");
         r.set_checkpoint_version(42);
       })},
      {"Load with force of a checkpoint and a safetensors path",
       load([&](rpc::LoadRequest& r) {
         r.set_force(true);
         r.clear_recipe_text();
         r.set_checkpoint_path(dir_->path() + "/ckpt");
         r.set_checkpoint_version(1);
       })},
      // Coordinator.Step
      {"Step from a version that is not the committed one",
       [&] {
         rpc::StepRequest r;
         r.set_version(0);
         return Unary(coordinator, &Coordinator::Step, r);
       }},
      {"Step from version -1",
       [&] {
         rpc::StepRequest r;
         r.set_version(-1);
         return Unary(coordinator, &Coordinator::Step, r);
       }},
      // Coordinator.SetOptimizerSchedule
      {"SetOptimizerSchedule with a negative lr",
       schedule([](rpc::SetOptimizerScheduleRequest& r) { r.set_lr(-1.0f); })},
      {"SetOptimizerSchedule with a negative warmup",
       schedule([](rpc::SetOptimizerScheduleRequest& r) {
         r.mutable_schedule()->set_warmup_steps(-5);
       })},
      // Coordinator.ReportVersion (a member's call)
      {"ReportVersion of a version no daemon published",
       [&] {
         rpc::ReportVersionRequest r;
         r.set_member_id(cluster_->manifest().daemons(0).address());
         r.set_daemon_rank(0);
         r.set_published_version(7);
         return Unary(*coordinator_as_member_, &Coordinator::ReportVersion, r);
       }},
      // Daemon.PushGradients
      {"PushGradients of an unknown tensor",
       push({GradientMessage(1, "p1", "nope", 0, 1, rows.data(), w.cols())})},
      {"PushGradients for a version already stepped from",
       push({GradientMessage(0, "p1", "w", 0, 1, rows.data(), w.cols())})},
      {"PushGradients for a future version",
       push({GradientMessage(5, "p1", "w", 0, 1, rows.data(), w.cols())})},
      {"PushGradients of rows beyond the tensor",
       push({GradientMessage(1, "p1", "w", w.rows() - 1, w.rows() + 1, rows.data(), w.cols())})},
      {"PushGradients without an end marker",
       push({GradientMessage(1, "p1", "w", 0, 1, rows.data(), w.cols())}, /*add_end=*/false)},
      {"PushGradients again from a pusher that already pushed this version",
       push({GradientMessage(1, "p0", "w", 0, 1, rows.data(), w.cols())})},
      // Daemon.PushWeights (no streamed load is waiting)
      {"PushWeights with no load waiting for weights",
       [&] {
         grpc::ClientContext context;
         SetDeadline(context, absl::Seconds(10));
         rpc::PushWeightsResponse response;
         auto writer = cluster_->daemon(0).PushWeights(&context, &response);
         rpc::PushWeightsRequest r;
         r.mutable_chunk()->set_tensor("w");
         r.mutable_chunk()->set_row_begin(0);
         r.mutable_chunk()->set_row_end(1);
         r.mutable_chunk()->set_dtype(rpc::DTYPE_FP32);
         r.mutable_chunk()->set_data(std::string(static_cast<size_t>(w.cols()) * 4, '\0'));
         r.mutable_end()->set_total_bytes(r.chunk().data().size());
         writer->Write(r);
         writer->WritesDone();
         return writer->Finish();
       }},
      // Daemon internal calls, as a cluster member
      {"Daemon.LoadShards with an empty manifest",
       [&] {
         rpc::LoadShardsRequest r;
         r.set_daemon_rank(0);
         return Unary(*daemons_as_member_[0], &Daemon::LoadShards, r);
       }},
      {"Daemon.Step from a version it does not publish",
       [&] {
         rpc::DaemonStepRequest r;
         r.set_version(7);
         return Unary(*daemons_as_member_[0], &Daemon::Step, r);
       }},
      {"Daemon.SetOptimizer that changes the optimizer's kind",
       [&] {
         rpc::SetOptimizerRequest r;
         r.mutable_optimizer()->set_kind(recipe::ADAMW);
         r.mutable_optimizer()->set_lr(0.125f);
         return Unary(*daemons_as_member_[0], &Daemon::SetOptimizer, r);
       }},
      // CheckpointCoordinator.Checkpoint
      {"Checkpoint of version -7", checkpoint(-7, 0, "")},
      {"Checkpoint keeping -3", checkpoint(1, -3, "other")},
      {"Checkpoint of a version not committed yet", checkpoint(9, 0, "later")},
      {"Checkpoint outside the checkpoint directory", checkpoint(1, 0, "../escape")},
      // CheckpointDaemon.WriteShard, as a (rogue) cluster member
      {"WriteShard outside the checkpoint directory",
       [&] {
         checkpoint::WriteShardRequest r;
         r.set_dir("../escape");
         r.set_version(1);
         r.set_daemon_rank(0);
         r.set_world_size(2);
         return Unary(*shard_writers_[0], &ShardWriter::WriteShard, r);
       }},
      {"WriteShard of a version the daemon does not hold",
       [&] {
         checkpoint::WriteShardRequest r;
         r.set_dir("rogue");
         r.set_version(5);
         r.set_daemon_rank(0);
         r.set_world_size(2);
         return Unary(*shard_writers_[0], &ShardWriter::WriteShard, r);
       }},
      {"WriteShard naming another daemon's rank",
       [&] {
         checkpoint::WriteShardRequest r;
         r.set_dir("rogue");
         r.set_version(1);
         r.set_daemon_rank(1);
         r.set_world_size(2);
         return Unary(*shard_writers_[0], &ShardWriter::WriteShard, r);
       }},
  };

  std::string before = Digest();
  ASSERT_TRUE(absl::StrContains(before, "committed_version: 1")) << before;
  for (const Refused& r : table) {
    SCOPED_TRACE(r.what);
    const grpc::Status s = r.call();
    EXPECT_FALSE(s.ok()) << "accepted";
    const std::string after = Digest();
    EXPECT_EQ(LineDiff(before, after), "")
        << "status: " << s.error_code() << " " << s.error_message();
    before = after;  // one failure is reported once, not by every later row
  }
  // Still serving: pusher p1 completes version 1 and the step commits 2.
  ASSERT_TRUE(cluster_->PushAll(1, "p1", Gradients(56)).ok());
  EXPECT_TRUE(cluster_->WaitForVersion(2).ok()) << cluster_->cluster().Logs();
}

// The refusals the checkpoint service and the daemons' exports owe an
// out-of-range number: a version below -1, keep below -1, an export enum
// this build does not know. (Read-only calls: refused, not misread.)
TEST_F(RefusedRequestsTest, OutOfRangeNumbersAreRefusedNotReadAsDefaults) {
  checkpoint::DescribeCheckpointRequest describe;
  describe.set_version(-9);
  checkpoint::DescribeCheckpointResponse described;
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(10));
  const grpc::Status d = checkpoints_->DescribeCheckpoint(&context, describe, &described);
  EXPECT_EQ(d.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << d.error_message();
  EXPECT_TRUE(absl::StrContains(d.error_message(), "version -9")) << d.error_message();

  const rpc::TensorInfo& w = cluster_->tensor("w");
  for (int field : {0, 1}) {
    checkpoint::ExportRowsRequest r;
    r.set_version(1);
    r.set_tensor("w");
    r.set_row_begin(0);
    r.set_row_end(1);
    r.set_cols(w.cols());
    if (field == 0) r.set_dtype(static_cast<checkpoint::ExportRowsDtype>(7));
    if (field == 1) r.set_values(static_cast<checkpoint::ExportValues>(9));
    grpc::ClientContext export_context;
    SetDeadline(export_context, absl::Seconds(10));
    auto reader = shard_writers_[0]->ExportRows(&export_context, r);
    checkpoint::ExportRowsChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    const grpc::Status e = reader->Finish();
    EXPECT_EQ(e.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field << e.error_message();
    EXPECT_TRUE(absl::StrContains(e.error_message(), "unknown export")) << e.error_message();
  }
}

}  // namespace
}  // namespace testing
}  // namespace paramd
