// hpctl checkpoint: save a committed version on every daemon (FP32 masters,
// optimizer state, scaling state), list the complete checkpoints, describe
// (and verify) one. Talks to the coordinator's CheckpointCoordinator service
// (proto/checkpoint_service.proto).
#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "checkpoint/service.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "google/protobuf/text_format.h"
#include "grpcpp/grpcpp.h"
#include "hpctl/cluster.h"
#include "hpctl/command.h"
#include "hpctl/progress.h"
#include "proto/checkpoint_service.grpc.pb.h"
#include "proto/optimizer.pb.h"
#include "proto/paramd.pb.h"

namespace paramd {
namespace hpctl {
namespace {

using checkpoint::CheckpointCoordinator;

std::string Size(uint64_t bytes) { return absl::StrFormat("%.1f MB", bytes / 1e6); }

// The optimizer_config metadata (a text-format recipe::OptimizerConfig) on
// one line; the raw text if it does not parse.
std::string OptimizerConfigLine(const std::string& text) {
  recipe::OptimizerConfig config;
  if (!google::protobuf::TextFormat::ParseFromString(text, &config)) return text;
  return config.ShortDebugString();
}

// The optimizer_tensors metadata (a text-format rpc::Manifest: every
// tensor's resolved optimizer settings) as the tensors whose settings
// differ from the model's (`config`, the optimizer_config metadata), and
// how many of all; the raw text if it does not parse.
std::string TensorOverrides(const std::string& text, const std::string& config_text) {
  rpc::Manifest tensors;
  recipe::OptimizerConfig config;
  if (!google::protobuf::TextFormat::ParseFromString(text, &tensors) ||
      !google::protobuf::TextFormat::ParseFromString(config_text, &config)) {
    return text;
  }
  std::vector<std::string> own;
  for (const rpc::TensorInfo& t : tensors.tensors()) {
    const rpc::TensorOptimizer& o = t.optimizer();
    std::vector<std::string> what;
    if (o.frozen()) what.push_back("frozen");
    if (o.lr_multiplier() != 1.0f) what.push_back(absl::StrCat("lr x", o.lr_multiplier()));
    if (o.weight_decay() != config.weight_decay()) {
      what.push_back(absl::StrCat("weight_decay ", o.weight_decay()));
    }
    if (!what.empty()) own.push_back(absl::StrCat(t.name(), " (", absl::StrJoin(what, ", "), ")"));
  }
  if (own.empty()) {
    return absl::StrCat("all ", tensors.tensors_size(), " tensors step with optimizer_config");
  }
  return absl::StrCat(own.size(), " of ", tensors.tensors_size(),
                      " tensors with settings of their own: ", absl::StrJoin(own, ", "));
}

std::string When(int64_t unix_micros) {
  return absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixMicros(unix_micros),
                          absl::LocalTimeZone());
}

template <class Request, class Response, class Call>
absl::Status Invoke(const ClusterOptions& cluster, Call call, const Request& request,
                    Response* response, absl::Duration timeout) {
  RETURN_IF_ERROR(cluster.Probe());
  ASSIGN_OR_RETURN(auth::ChannelSecurity security, cluster.Security());
  auto stub = CheckpointCoordinator::NewStub(auth::CreateChannel(cluster.address(), security));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
  return FromGrpcStatus((stub.get()->*call)(&context, request, response),
                        absl::StrCat("coordinator at ", cluster.address()));
}

int RunCheckpoint(int argc, char** argv) {
  ClusterOptions cluster;
  std::string dir;
  int64_t version = -1;
  int64_t keep = 0;
  bool verify = false;
  double write_timeout = 3600;
  OptionParser opts(
      "hpctl checkpoint [create|list|describe] [--dir D] [--version V] [--keep K] [--verify]",
      "create (default): every daemon writes its shards of a committed version (FP32 master, "
      "optimizer state, scaling state) into <checkpoint_dir>/<D>/v<V>/, each file checksummed "
      "(XXH3), fsynced and renamed; the coordinator writes the manifest last.\n"
      "list: the complete checkpoints in D. describe: the manifest of version V (default the "
      "newest), with --verify every file's checksum.\n"
      "D is relative to the servers' --checkpoint_dir (no '..', not absolute).");
  cluster.AddTo(opts);
  opts.AddString("dir", &dir, "directory below the servers' --checkpoint_dir");
  opts.AddInt("version", &version, "version; -1 = the committed one (create) / newest (describe)");
  opts.AddInt("keep", &keep,
              "create: keep only the newest K checkpoints (0 = server default, "
              "-1 = all)");
  opts.AddBool("verify", &verify, "describe: read every shard file and compare its checksum");
  opts.AddDouble("write_timeout", &write_timeout, "create: seconds to wait for the daemons");
  if (int rc = opts.ParseOrExit(argc, argv); rc >= 0) return rc;
  const std::string verb = opts.positional().empty() ? "create" : opts.positional()[0];
  if (opts.positional().size() > 1 || (verb != "create" && verb != "list" && verb != "describe")) {
    std::cerr << "hpctl checkpoint: expected create, list or describe\n\n" << opts.Usage();
    return kExitUsage;
  }

  if (verb == "create") {
    checkpoint::CheckpointRequest request;
    request.set_dir(dir);
    request.set_version(version);
    request.set_keep(static_cast<int32_t>(keep));
    checkpoint::CheckpointResponse response;
    Spinner spinner(version >= 0 ? absl::StrCat("checkpointing version ", version)
                                 : std::string("checkpointing the committed version"),
                    StderrIsTerminal());
    absl::Status status = Invoke(cluster, &CheckpointCoordinator::Stub::Checkpoint, request,
                                 &response, absl::Seconds(write_timeout));
    spinner.Stop();
    if (!status.ok()) return ReportFailure("checkpoint", status);
    if (response.already_existed()) {
      std::cout << "version " << response.version()
                << " is already checkpointed: " << response.path() << "\n";
      return kExitOk;
    }
    std::cout << absl::StrFormat("checkpoint of version %d: %s, %s in %.2f s (%.0f MB/s)\n",
                                 response.version(), response.path(), Size(response.total_bytes()),
                                 response.seconds(),
                                 response.total_bytes() / 1e6 / std::max(response.seconds(), 1e-9));
    for (uint64_t removed : response.removed_versions()) {
      std::cout << "removed old checkpoint v" << removed << "\n";
    }
    return kExitOk;
  }
  if (verb == "list") {
    checkpoint::ListCheckpointsRequest request;
    request.set_dir(dir);
    checkpoint::ListCheckpointsResponse response;
    absl::Status status = Invoke(cluster, &CheckpointCoordinator::Stub::ListCheckpoints, request,
                                 &response, cluster.timeout());
    if (!status.ok()) return ReportFailure("checkpoint", status);
    std::cout << absl::StrFormat("%-10s %-8s %-8s %-12s %-20s %s\n", "VERSION", "DAEMONS",
                                 "TENSORS", "SIZE", "CREATED", "PATH");
    for (const auto& entry : response.checkpoints()) {
      std::cout << absl::StrFormat("%-10d %-8d %-8d %-12s %-20s %s\n", entry.version(),
                                   entry.world_size(), entry.num_tensors(),
                                   Size(entry.total_bytes()), When(entry.created_unix_micros()),
                                   entry.path());
    }
    return kExitOk;
  }
  checkpoint::DescribeCheckpointRequest request;
  request.set_dir(dir);
  request.set_version(version);
  request.set_verify(verify);
  checkpoint::DescribeCheckpointResponse response;
  absl::Status status =
      Invoke(cluster, &CheckpointCoordinator::Stub::DescribeCheckpoint, request, &response,
             verify ? absl::Seconds(write_timeout) : cluster.timeout());
  if (!status.ok()) return ReportFailure("checkpoint", status);
  const auto& manifest = response.manifest();
  std::cout << "checkpoint " << response.path() << "\n"
            << "  version " << manifest.version() << ", " << manifest.world_size()
            << " daemon(s), created " << When(manifest.created_unix_micros()) << "\n";
  // In key order (a proto map has none of its own).
  const std::map<std::string, std::string> metadata(manifest.metadata().begin(),
                                                    manifest.metadata().end());
  const auto config = metadata.find("optimizer_config");
  for (const auto& [key, value] : metadata) {
    std::string shown = value;
    if (key == "optimizer_config") shown = OptimizerConfigLine(value);
    if (key == "optimizer_tensors" && config != metadata.end()) {
      shown = TensorOverrides(value, config->second);
    }
    std::cout << "  " << key << ": " << shown << "\n";
  }
  for (const auto& shard : manifest.shards()) {
    std::cout << absl::StrFormat("  %s  daemon %d  %s  xxh3 %016x  %d piece(s)\n", shard.name(),
                                 shard.daemon_rank(), Size(shard.size_bytes()), shard.xxh3_64(),
                                 shard.pieces_size());
  }
  std::cout << "  " << manifest.tensors_size() << " tensor(s):\n";
  for (const auto& tensor : manifest.tensors()) {
    std::cout << "    " << tensor.name() << " [" << absl::StrJoin(tensor.shape(), ", ") << "]\n";
  }
  if (verify) std::cout << "verified: every shard file's size and XXH3-64 match\n";
  return kExitOk;
}

}  // namespace

HPCTL_REGISTER_COMMAND(checkpoint, "save, list or describe checkpoints of committed versions",
                       RunCheckpoint);

}  // namespace hpctl
}  // namespace paramd
