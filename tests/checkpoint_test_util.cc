#include "tests/checkpoint_test_util.h"

#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "deploy/process.h"
#include "proto/checkpoint_service.grpc.pb.h"

namespace paramd {
namespace testing {

grpc::Status CheckpointVia(const std::string& address, int64_t version, absl::Duration timeout,
                           checkpoint::CheckpointResponse* response, int keep) {
  auto stub = checkpoint::CheckpointCoordinator::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  SetDeadline(context, timeout);
  checkpoint::CheckpointRequest request;
  request.set_version(version);
  request.set_keep(keep);
  checkpoint::CheckpointResponse ignored;
  return stub->Checkpoint(&context, request, response != nullptr ? response : &ignored);
}

grpc::Status Checkpoint(RawCluster& cluster, int64_t version) {
  return CheckpointVia(cluster.cluster().coordinator_address(), version, absl::Seconds(30));
}

absl::StatusOr<int64_t> Restore(RawCluster& cluster, const std::string& path, bool force) {
  rpc::LoadRequest request;
  request.set_force(force);
  request.set_checkpoint_path(path);
  request.set_checkpoint_version(-1);
  for (int attempt = 0;; ++attempt) {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(30));
    rpc::LoadResponse response;
    const grpc::Status s = cluster.coordinator().Load(&context, request, &response);
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE && attempt < 200) {
      absl::SleepFor(absl::Milliseconds(50));  // daemons still joining
      continue;
    }
    if (!s.ok()) return FromGrpcStatus(s, "restore");
    RETURN_IF_ERROR(cluster.RefreshManifest());
    return response.committed_version();
  }
}

absl::StatusOr<std::vector<float>> ExportMasters(RawCluster& cluster, int64_t version,
                                                 const std::string& tensor) {
  const rpc::TensorInfo& info = cluster.tensor(tensor);
  if (info.name().empty()) return absl::NotFoundError(absl::StrCat("no tensor ", tensor));
  std::vector<float> out(static_cast<size_t>(info.rows() * info.cols()));
  int64_t covered = 0;
  for (const rpc::ShardPiece& piece : cluster.manifest().pieces()) {
    if (piece.tensor() != tensor) continue;
    auto daemon = checkpoint::CheckpointDaemon::NewStub(
        grpc::CreateChannel(piece.daemon_address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(30));
    checkpoint::ExportRowsRequest request;
    request.set_version(static_cast<uint64_t>(version));
    request.set_tensor(tensor);
    request.set_row_begin(piece.row_begin());
    request.set_row_end(piece.row_end());
    request.set_cols(info.cols());
    request.set_dtype(checkpoint::EXPORT_DTYPE_FP32);
    request.set_values(checkpoint::EXPORT_VALUES_MASTER);
    auto reader = daemon->ExportRows(&context, request);
    std::string bytes;
    checkpoint::ExportRowsChunk chunk;
    while (reader->Read(&chunk)) bytes += chunk.data();
    RETURN_IF_ERROR(
        FromGrpcStatus(reader->Finish(),
                       absl::StrCat("ExportRows of ", tensor, " from ", piece.daemon_address())));
    const size_t want = static_cast<size_t>((piece.row_end() - piece.row_begin()) * info.cols());
    if (bytes.size() != want * 4) {
      return absl::InternalError(
          absl::StrCat("ExportRows of ", tensor, ": ", bytes.size(), " bytes, want ", want * 4));
    }
    std::memcpy(out.data() + piece.row_begin() * info.cols(), bytes.data(), bytes.size());
    covered += piece.row_end() - piece.row_begin();
  }
  if (covered != info.rows()) {
    return absl::InternalError(
        absl::StrCat(tensor, ": pieces cover ", covered, " of ", info.rows(), " rows"));
  }
  return out;
}

absl::StatusOr<Snapshot> TakeSnapshot(RawCluster& cluster, int64_t version) {
  Snapshot snapshot;
  for (const rpc::TensorInfo& t : cluster.manifest().tensors()) {
    ASSIGN_OR_RETURN(std::vector<float> masters, ExportMasters(cluster, version, t.name()));
    snapshot[t.name() + "/master"] =
        std::string(reinterpret_cast<const char*>(masters.data()), masters.size() * 4);
    const HybridSpec spec = cluster.spec(t.name());
    for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
      if (!(d == Direction::kRowwise ? spec.rowwise_usage : spec.columnwise_usage)) continue;
      ASSIGN_OR_RETURN(QuantizedTensor q, cluster.FetchAssembled(version, t.name(), d));
      const std::string key = absl::StrCat(t.name(), "/", DirectionName(d), "/");
      snapshot[key + "data"].assign(q.data.begin(), q.data.end());
      snapshot[key + "scales"].assign(q.scales.begin(), q.scales.end());
      snapshot[key + "scale_inv"].assign(reinterpret_cast<const char*>(&q.scale_inv), 4);
    }
  }
  return snapshot;
}

std::string CompareSnapshots(const Snapshot& want, const Snapshot& got) {
  for (const auto& [key, bytes] : want) {
    auto it = got.find(key);
    if (it == got.end()) return absl::StrCat(key, " missing");
    if (it->second.size() != bytes.size()) {
      return absl::StrCat(key, ": ", it->second.size(), " bytes, want ", bytes.size());
    }
    for (size_t i = 0; i < bytes.size(); ++i) {
      if (it->second[i] != bytes[i]) return absl::StrCat(key, ": byte ", i, " differs");
    }
  }
  if (got.size() != want.size()) return absl::StrCat(got.size(), " entries, want ", want.size());
  return "";
}

namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Field 3 (state) and 4 (ppid) of /proc/<pid>/stat; the name in field 2
// may hold spaces, so split after its closing parenthesis.
bool ProcState(pid_t pid, char* state, pid_t* ppid) {
  const std::string stat = ReadFile(absl::StrCat("/proc/", pid, "/stat"));
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return false;
  std::vector<std::string> fields = absl::StrSplit(stat.substr(close + 2), ' ');
  if (fields.size() < 2 || fields[0].empty()) return false;
  *state = fields[0][0];
  *ppid = static_cast<pid_t>(std::stol(fields[1]));
  return true;
}

}  // namespace

absl::Status KillCoordinator(TestCluster& cluster) {
  const std::string flag = "--port_file=" + cluster.dir() + "/coordinator.port";
  pid_t found = -1;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return absl::InternalError("cannot open /proc");
  while (dirent* entry = readdir(proc)) {
    char* end = nullptr;
    const long pid = strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0') continue;
    char state;
    pid_t ppid;
    if (!ProcState(static_cast<pid_t>(pid), &state, &ppid) || ppid != getpid()) continue;
    const std::string cmdline = ReadFile(absl::StrCat("/proc/", pid, "/cmdline"));
    for (absl::string_view arg : absl::StrSplit(cmdline, '\0')) {
      if (arg == flag) found = static_cast<pid_t>(pid);
    }
  }
  closedir(proc);
  if (found < 0) return absl::NotFoundError("no coordinator process of this cluster");
  if (kill(found, SIGKILL) != 0) return absl::InternalError("kill failed");
  // Dead = a zombie (its parent, TestCluster, reaps it) or gone.
  for (int i = 0; i < 2000; ++i) {
    char state;
    pid_t ppid;
    if (!ProcState(found, &state, &ppid) || state == 'Z' || state == 'X') return absl::OkStatus();
    absl::SleepFor(absl::Milliseconds(5));
  }
  return absl::DeadlineExceededError("the coordinator did not die");
}

ProgramRun RunProgram(const std::vector<std::string>& argv, const std::string& scratch_dir,
                      absl::Duration timeout) {
  static int runs = 0;
  const std::string log = absl::StrCat(scratch_dir, "/run", ++runs, ".out");
  ProgramRun run;
  demo::ChildProcesses children;
  absl::StatusOr<int> index = children.Start({argv.at(0), argv, log, log});
  if (!index.ok()) {
    run.out = std::string(index.status().message());
    return run;
  }
  absl::StatusOr<int> status = children.Wait(*index, timeout);
  if (status.ok() && WIFEXITED(*status)) run.exit_code = WEXITSTATUS(*status);
  run.out = ReadFile(log);
  return run;
}

std::string FindOnPath(const std::string& name) {
  const char* path = getenv("PATH");
  std::vector<std::string> dirs = absl::StrSplit(path != nullptr ? path : "", ':');
  dirs.push_back("/usr/bin");
  for (const std::string& dir : dirs) {
    const std::string candidate = dir + "/" + name;
    if (!dir.empty() && access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

}  // namespace testing
}  // namespace paramd
