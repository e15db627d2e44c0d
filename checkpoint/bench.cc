// Throughput of checkpoint write, verify, restore and export on this
// machine, for a synthetic model of --master_mb MB of FP32 masters (AdamW:
// two moments beside each master, so a checkpoint holds three times that).
//
//   bazel run -c opt //checkpoint:bench -- --master_mb=1024 --dir=/var/tmp/ckbench
//
// Prints one table row per phase: bytes, seconds, MB/s (MB = 10^6 bytes).
// "cold" phases evict the files from the page cache first
// (posix_fadvise DONTNEED after fsync), so they read from the disk.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/daemon_io.h"
#include "checkpoint/export.h"
#include "checkpoint/remote_export.h"
#include "checkpoint/service.h"
#include "checkpoint/store.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "proto/checkpoint_service.grpc.pb.h"

ABSL_FLAG(int64_t, master_mb, 1024, "FP32 master bytes of the model, in MiB");
ABSL_FLAG(int32_t, daemons, 2, "daemons writing the checkpoint (one thread each)");
ABSL_FLAG(int32_t, tensors, 16, "number of tensors (equal shapes, 4096 columns)");
ABSL_FLAG(std::string, dir, "/var/tmp/paramd_checkpoint_bench", "scratch directory (emptied)");
ABSL_FLAG(bool, keep, false, "keep the files afterwards");

namespace paramd {
namespace checkpoint {
namespace {

constexpr int64_t kCols = 4096;
const char* const kSections[] = {"master", "exp_avg", "exp_avg_sq"};

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void Row(const std::string& phase, uint64_t bytes, double seconds) {
  std::printf("| %-44s | %9.1f | %7.2f | %8.0f |\n", phase.c_str(), bytes / 1e6, seconds,
              bytes / 1e6 / seconds);
  std::fflush(stdout);
}

// Cheap deterministic values (an LCG), different per tensor and section.
void Fill(std::vector<float>& values, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ULL + 1;
  for (float& v : values) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    v = static_cast<float>(static_cast<int32_t>(x >> 32)) * 1e-9f;
  }
}

void EvictFromCache(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// A daemon whose state is rows [begin, end) of every tensor of the bench's
// in-memory model, at version 1: the gRPC phases go through the same
// services a real daemon registers.
class MemoryDaemon : public CheckpointableDaemon {
 public:
  MemoryDaemon(const Manifest* manifest, const std::vector<std::vector<std::vector<float>>>* data,
               int64_t begin, int64_t end)
      : manifest_(manifest), data_(data), begin_(begin), end_(end) {}

  absl::Status WithState(int64_t version,
                         const std::function<absl::Status(const DaemonStateView&)>& fn) override {
    if (version != 1) return absl::FailedPreconditionError("the bench daemon is at version 1");
    DaemonStateView view;
    view.version = 1;
    for (int t = 0; t < manifest_->tensors_size(); ++t) {
      if (end_ <= begin_) break;
      PieceView piece;
      piece.tensor = manifest_->tensors(t).name();
      piece.row_begin = begin_;
      piece.row_end = end_;
      piece.cols = kCols;
      auto rows = [&](int s) {
        return absl::MakeConstSpan((*data_)[t][s]).subspan(begin_ * kCols, (end_ - begin_) * kCols);
      };
      piece.master = rows(0);
      piece.moments = {{kSections[1], rows(1)}, {kSections[2], rows(2)}};
      view.pieces.push_back(std::move(piece));
      view.tensor_states[manifest_->tensors(t).name()].set_optimizer_step(1);
    }
    return fn(view);
  }

  absl::Status ReadRows(int64_t version, ExportValuesKind kind, const std::string& tensor,
                        int64_t row_begin, int64_t row_end, absl::Span<float> out) override {
    if (version != 1 || kind != ExportValuesKind::kMaster) {
      return absl::FailedPreconditionError("the bench daemon has only masters of version 1");
    }
    const int t = std::stoi(tensor.substr(7));
    std::memcpy(out.data(), (*data_)[t][0].data() + row_begin * kCols, out.size() * 4);
    return absl::OkStatus();
  }

 private:
  const Manifest* manifest_;
  const std::vector<std::vector<std::vector<float>>>* data_;
  int64_t begin_, end_;
};

class StaticClusterView : public ClusterView {
 public:
  explicit StaticClusterView(rpc::Manifest manifest) : manifest_(std::move(manifest)) {}
  absl::StatusOr<rpc::Manifest> GetManifest() override { return manifest_; }

 private:
  rpc::Manifest manifest_;
};

std::unique_ptr<grpc::Server> Serve(grpc::Service* service, std::string* address) {
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(service);
  auto server = builder.BuildAndStart();
  *address = absl::StrCat("127.0.0.1:", port);
  return server;
}

absl::Status Run() {
  const int world = absl::GetFlag(FLAGS_daemons);
  const int num_tensors = absl::GetFlag(FLAGS_tensors);
  const int64_t total_elems = absl::GetFlag(FLAGS_master_mb) * (1 << 20) / 4;
  const int64_t rows = std::max<int64_t>(1, total_elems / num_tensors / kCols);
  const std::string root = absl::GetFlag(FLAGS_dir);
  if (root.size() < 5) return absl::InvalidArgumentError("--dir looks unsafe to empty");
  std::system(absl::StrCat("rm -rf '", root, "'").c_str());
  ASSIGN_OR_RETURN(CheckpointStore store, CheckpointStore::Open(root + "/ckpt", true));

  // The model: tensor t has [rows, kCols]; daemon d holds rows
  // [d*rows/world, (d+1)*rows/world) of every tensor.
  std::vector<std::vector<std::vector<float>>> data(num_tensors);  // [tensor][section]
  for (int t = 0; t < num_tensors; ++t) {
    for (int s = 0; s < 3; ++s) {
      data[t].emplace_back(static_cast<size_t>(rows * kCols));
      Fill(data[t][s], t * 3 + s);
    }
  }
  const uint64_t master_bytes = static_cast<uint64_t>(num_tensors) * rows * kCols * 4;
  std::printf(
      "model: %d tensors x [%lld, %lld] FP32 = %.1f MB of masters (%.1f MB with AdamW "
      "moments); %d daemons; %u hardware threads; dir %s\n\n",
      num_tensors, static_cast<long long>(rows), static_cast<long long>(kCols), master_bytes / 1e6,
      3 * master_bytes / 1e6, world, std::thread::hardware_concurrency(), root.c_str());
  std::printf("| %-44s | %9s | %7s | %8s |\n", "phase", "MB", "s", "MB/s");
  std::printf("|%s|%s|%s|%s|\n", std::string(46, '-').c_str(), std::string(11, '-').c_str(),
              std::string(9, '-').c_str(), std::string(10, '-').c_str());

  Manifest manifest;
  manifest.set_version(1);
  manifest.set_world_size(world);
  for (int t = 0; t < num_tensors; ++t) {
    TensorInfo* info = manifest.add_tensors();
    info->set_name(absl::StrCat("layers.", t, ".weight"));
    info->add_shape(rows);
    info->add_shape(kCols);
    info->set_rows(rows);
    info->set_cols(kCols);
  }

  // 1. Checkpoint write: every daemon (a thread) writes its shard file,
  // then the coordinator commits the manifest.
  auto start = std::chrono::steady_clock::now();
  std::vector<absl::StatusOr<ShardFileInfo>> infos(world, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int d = 0; d < world; ++d) {
    threads.emplace_back([&, d] {
      infos[d] = [&]() -> absl::StatusOr<ShardFileInfo> {
        ASSIGN_OR_RETURN(auto writer, store.NewShardWriter(1, d, world));
        const int64_t begin = rows * d / world, end = rows * (d + 1) / world;
        for (int t = 0; t < num_tensors; ++t) {
          if (end <= begin) continue;
          for (int s = 0; s < 3; ++s) {
            RETURN_IF_ERROR(writer->AddRows(
                manifest.tensors(t).name(), kSections[s], begin, end, kCols,
                absl::MakeConstSpan(data[t][s]).subspan(begin * kCols, (end - begin) * kCols)));
          }
          TensorState state;
          state.set_optimizer_step(1);
          state.mutable_rowwise()->mutable_amax_history()->Resize(1024, 0.5f);
          RETURN_IF_ERROR(writer->AddBlob(manifest.tensors(t).name(), kTensorStateSection,
                                          state.SerializeAsString()));
        }
        return writer->Finish();
      }();
    });
  }
  for (auto& thread : threads) thread.join();
  uint64_t file_bytes = 0;
  for (auto& info : infos) {
    RETURN_IF_ERROR(info.status());
    file_bytes += info->size_bytes();
    *manifest.add_shards() = *info;
  }
  RETURN_IF_ERROR(store.CommitManifest(manifest));
  Row(absl::StrCat("checkpoint write (", world, " daemons, fsync)"), file_bytes, Seconds(start));

  // 2. Verify, warm (just written) and cold (evicted).
  start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(store.Verify(1));
  Row("verify XXH3, page cache warm", file_bytes, Seconds(start));
  for (const ShardFileInfo& shard : manifest.shards()) {
    EvictFromCache(store.VersionDir(1) + "/" + shard.name());
  }
  start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(store.Verify(1));
  Row("verify XXH3, cold", file_bytes, Seconds(start));

  // 3. Restore onto one daemon (reshard world -> 1), cold: every section.
  for (const ShardFileInfo& shard : manifest.shards()) {
    EvictFromCache(store.VersionDir(1) + "/" + shard.name());
  }
  start = std::chrono::steady_clock::now();
  {
    ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(store, 1));
    std::vector<float> out(static_cast<size_t>(rows * kCols));
    for (int t = 0; t < num_tensors; ++t) {
      for (int s = 0; s < 3; ++s) {
        RETURN_IF_ERROR(reader->ReadRows(manifest.tensors(t).name(), kSections[s], 0, rows,
                                         absl::MakeSpan(out)));
        if (std::memcmp(out.data(), data[t][s].data(), out.size() * 4) != 0) {
          return absl::InternalError("restored data differs");
        }
      }
    }
  }
  Row(absl::StrCat("restore read ", world, " -> 1 daemon, cold"), 3 * master_bytes, Seconds(start));

  // 4. Export BF16 from memory (what a daemon-backed export does locally:
  // convert + write), and from the checkpoint on disk. MB are master bytes.
  auto export_from = [&](ExportSource& source, const std::string& out,
                         ExportDtype dtype) -> absl::Status {
    ExportOptions options;
    options.out_dir = out;
    options.dtype = dtype;
    options.max_shard_bytes = 5'000'000'000;
    return ExportSafetensors(ExportTensorsOf(manifest), source, options).status();
  };
  FloatRowSource memory(
      [&](const ExportTensor& tensor, int64_t row_begin, int64_t row_end, absl::Span<float> out) {
        const int t = std::stoi(tensor.name.substr(7));
        std::memcpy(out.data(), data[t][0].data() + row_begin * kCols, out.size() * 4);
        return absl::OkStatus();
      });
  start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(export_from(memory, root + "/export_mem", ExportDtype::kBf16));
  Row("export BF16 from memory (MB of FP32 masters)", master_bytes, Seconds(start));

  for (const ShardFileInfo& shard : manifest.shards()) {
    EvictFromCache(store.VersionDir(1) + "/" + shard.name());
  }
  start = std::chrono::steady_clock::now();
  {
    ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(store, 1));
    auto source = NewCheckpointExportSource(reader.get());
    RETURN_IF_ERROR(export_from(*source, root + "/export_ckpt", ExportDtype::kBf16));
  }
  Row("export BF16 from checkpoint, cold (MB FP32)", master_bytes, Seconds(start));

  start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(export_from(memory, root + "/export_fp32", ExportDtype::kFp32));
  Row("export FP32 from memory", master_bytes, Seconds(start));

  // 5. The same through the gRPC services, in-process over localhost: a
  // coordinator service asking two daemon services to write (hpctl
  // checkpoint), and hpctl export's remote source streaming BF16 from them.
  {
    CheckpointServiceOptions options;
    options.root = root + "/ckpt";
    std::vector<std::unique_ptr<MemoryDaemon>> daemons;
    std::vector<std::unique_ptr<CheckpointDaemonService>> services;
    std::vector<std::unique_ptr<grpc::Server>> servers;
    std::vector<std::string> addresses(world);
    rpc::Manifest cluster;
    cluster.set_committed_version(1);
    for (int t = 0; t < num_tensors; ++t) {
      rpc::TensorInfo* info = cluster.add_tensors();
      info->set_name(manifest.tensors(t).name());
      info->add_shape(rows);
      info->add_shape(kCols);
      info->set_rows(rows);
      info->set_cols(kCols);
    }
    std::map<std::string, std::vector<RemotePiece>> pieces;
    for (int d = 0; d < world; ++d) {
      const int64_t begin = rows * d / world, end = rows * (d + 1) / world;
      daemons.push_back(std::make_unique<MemoryDaemon>(&manifest, &data, begin, end));
      ASSIGN_OR_RETURN(auto service,
                       CheckpointDaemonService::Create(options, daemons.back().get()));
      services.push_back(std::move(service));
      servers.push_back(Serve(services.back()->service(), &addresses[d]));
      rpc::DaemonInfo* info = cluster.add_daemons();
      info->set_rank(d);
      info->set_address(addresses[d]);
      for (int t = 0; t < num_tensors && end > begin; ++t) {
        pieces[manifest.tensors(t).name()].push_back({begin, end, addresses[d]});
      }
    }
    ASSIGN_OR_RETURN(auto coordinator, CheckpointCoordinatorService::Create(
                                           options, std::make_unique<StaticClusterView>(cluster)));
    std::string coordinator_address;
    auto coordinator_server = Serve(coordinator->service(), &coordinator_address);
    auto stub = CheckpointCoordinator::NewStub(
        grpc::CreateChannel(coordinator_address, grpc::InsecureChannelCredentials()));
    start = std::chrono::steady_clock::now();
    grpc::ClientContext context;
    CheckpointRequest request;
    request.set_dir("grpc");
    request.set_version(1);
    CheckpointResponse response;
    RETURN_IF_ERROR(FromGrpcStatus(stub->Checkpoint(&context, request, &response), "Checkpoint"));
    Row("checkpoint via gRPC services (hpctl path)", response.total_bytes(), Seconds(start));

    RemoteExportOptions remote;
    remote.version = 1;
    auto source = NewRemoteExportSource(pieces, remote);
    start = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(export_from(*source, root + "/export_grpc", ExportDtype::kBf16));
    Row("export BF16 via gRPC from daemons (MB FP32)", master_bytes, Seconds(start));
    coordinator_server->Shutdown();
    for (auto& server : servers) server->Shutdown();
  }

  if (!absl::GetFlag(FLAGS_keep)) std::system(absl::StrCat("rm -rf '", root, "'").c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace checkpoint
}  // namespace paramd

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Checkpoint and export throughput (see checkpoint/bench.cc).");
  absl::ParseCommandLine(argc, argv);
  absl::Status status = paramd::checkpoint::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "bench: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
