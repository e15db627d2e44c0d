#include "checkpoint/service.h"

#include <dirent.h>
#include <google/protobuf/text_format.h>

#include <cstdio>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <list>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "checkpoint/daemon_io.h"
#include "checkpoint/export.h"
#include "checkpoint/file_util.h"
#include "checkpoint/store.h"
#include "common/grpc_status.h"
#include "common/log.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "common/telemetry.h"
#include "proto/checkpoint_service.grpc.pb.h"
#include "proto/paramd.grpc.pb.h"

namespace paramd {
namespace checkpoint {
namespace {

constexpr char kTag[] = "checkpoint";

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Runs each task on its own thread, so that slow file work never holds a
// gRPC thread. Finished threads are joined on the next Run; the destructor
// joins the rest.
class TaskThreads {
 public:
  ~TaskThreads() {
    std::list<Task> tasks;
    {
      absl::MutexLock lock(&mu_);
      tasks.swap(tasks_);
    }
    for (Task& task : tasks) task.thread.join();
  }

  void Run(std::function<void()> fn) {
    std::list<Task> finished;
    absl::MutexLock lock(&mu_);
    for (auto it = tasks_.begin(); it != tasks_.end();) {
      if (it->done->load()) {
        finished.splice(finished.end(), tasks_, it++);
      } else {
        ++it;
      }
    }
    for (Task& task : finished) task.thread.join();
    auto done = std::make_shared<std::atomic<bool>>(false);
    tasks_.push_back(Task{std::thread([fn = std::move(fn), done] {
                            fn();
                            done->store(true);
                          }),
                          done});
  }

 private:
  struct Task {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  absl::Mutex mu_;
  std::list<Task> tasks_ ABSL_GUARDED_BY(mu_);
};

absl::Status NoRoot() {
  return absl::FailedPreconditionError(
      "checkpoints are off: start hybrid-paramd with --checkpoint_dir=DIR");
}

ExportDtype FromProto(ExportRowsDtype dtype);

}  // namespace

// ===========================================================================
// Daemon side

class CheckpointDaemonService::Impl : public CheckpointDaemon::CallbackService {
 public:
  Impl(CheckpointServiceOptions options, CheckpointableDaemon* daemon)
      : options_(std::move(options)), daemon_(daemon) {}

  grpc::ServerUnaryReactor* WriteShard(grpc::CallbackServerContext* context,
                                       const WriteShardRequest* request,
                                       WriteShardResponse* response) override {
    if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                         "/paramd.checkpoint.CheckpointDaemon/WriteShard");
        !s.ok()) {
      return auth::RefusedUnary(context, s);
    }
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    threads_.Run([this, reactor, request, response] {
      const auto start = std::chrono::steady_clock::now();
      absl::Status status = DoWriteShard(*request, response);
      response->set_seconds(SecondsSince(start));
      reactor->Finish(ToGrpcStatus(status));
    });
    return reactor;
  }

  grpc::ServerWriteReactor<ExportRowsChunk>* ExportRows(grpc::CallbackServerContext* context,
                                                        const ExportRowsRequest* request) override;

  const CheckpointServiceOptions& options() const { return options_; }
  CheckpointableDaemon* daemon() { return daemon_; }
  TaskThreads& threads() { return threads_; }

 private:
  absl::Status DoWriteShard(const WriteShardRequest& request, WriteShardResponse* response) {
    if (options_.root.empty()) {
      return absl::FailedPreconditionError(
          "this daemon runs without --checkpoint_dir, so it writes no checkpoint shards: start "
          "every hybrid-paramd of the cluster with --checkpoint_dir=DIR (a directory all of them "
          "share)");
    }
    // Another rank's shard written from this daemon's state would pass for
    // that rank's in the checkpoint: refused before anything is created.
    if (const int rank = daemon_->rank(); rank >= 0 && request.daemon_rank() != rank) {
      return absl::FailedPreconditionError(
          absl::StrCat("this daemon holds rank ", rank, ", not rank ", request.daemon_rank()));
    }
    // A refused request changes nothing: the names are checked before a
    // directory is made (WithState refuses a version this daemon does not
    // hold before calling back), and what was made for a write that fails
    // later is removed again.
    if (request.world_size() < 1 || request.daemon_rank() < 0 ||
        request.daemon_rank() >= request.world_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("daemon rank ", request.daemon_rank(), " of world ", request.world_size()));
    }
    {
      ASSIGN_OR_RETURN(CheckpointStore root, CheckpointStore::Open(options_.root, false));
      RETURN_IF_ERROR(SafeJoin(root.root(), request.dir()).status());
    }
    std::vector<std::string> created;
    absl::Status status = daemon_->WithState(
        static_cast<int64_t>(request.version()), [&](const DaemonStateView& state) -> absl::Status {
          // Version numbers start again with every load: a version of the
          // model the checkpoint is for, not of the one that replaced it.
          if (request.model_generation() > 0 &&
              state.model_generation != request.model_generation()) {
            return absl::AbortedError(
                absl::StrCat("this daemon serves model generation ", state.model_generation,
                             ", not ", request.model_generation(),
                             " (a load replaced the model while the checkpoint "
                             "was taken): nothing written"));
          }
          ASSIGN_OR_RETURN(CheckpointStore store,
                           CheckpointStore::OpenUnder(options_.root, request.dir(),
                                                      /*create=*/true, options_.modes, &created));
          ASSIGN_OR_RETURN(*response->mutable_shard(),
                           WriteDaemonShard(store, request.daemon_rank(), request.world_size(),
                                            state, &created));
          return absl::OkStatus();
        });
    if (!status.ok()) RemoveCreatedDirs(created);
    return status;
  }

  const CheckpointServiceOptions options_;
  CheckpointableDaemon* const daemon_;
  TaskThreads threads_;  // last member: joined first
};

namespace {

ExportDtype FromProto(ExportRowsDtype dtype) {
  return dtype == EXPORT_DTYPE_FP32 ? ExportDtype::kFp32 : ExportDtype::kBf16;
}

// Streams rows of one export request. A producer thread reads and encodes
// one chunk at a time and hands it to gRPC; at most one write is in flight.
class ExportReactor : public grpc::ServerWriteReactor<ExportRowsChunk> {
 public:
  ExportReactor(CheckpointDaemonService::Impl* service, const ExportRowsRequest* request)
      : service_(service), request_(*request) {}

  void Begin() {
    service_->threads().Run([this] { Produce(); });
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) broken_ = true;
  }
  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    broken_ = true;
  }
  void OnDone() override { delete this; }

 private:
  // Reads rows [row, end) as FP32 from the daemon's memory or, for a
  // version the daemon no longer holds, from a checkpoint of it.
  absl::Status ReadRows(int64_t row, int64_t end, absl::Span<float> out) {
    const ExportValuesKind kind = static_cast<ExportValuesKind>(request_.values());
    const int64_t version = static_cast<int64_t>(request_.version());
    if (checkpoint_ == nullptr) {
      absl::Status status =
          service_->daemon()->ReadRows(version, kind, request_.tensor(), row, end, out);
      if (!absl::IsFailedPrecondition(status) || kind != ExportValuesKind::kMaster) return status;
      if (row != request_.row_begin()) {
        return absl::AbortedError(absl::StrCat("version ", version,
                                               " moved on during the export; retry, or "
                                               "checkpoint first and export from it"));
      }
      // Not the daemon's current version: a checkpoint of it may have it.
      if (service_->options().root.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            status.message(), "; the masters of an older version come only from a checkpoint ",
            "of it, and this daemon runs without --checkpoint_dir"));
      }
      auto store = CheckpointStore::OpenUnder(service_->options().root, request_.checkpoint_dir(),
                                              /*create=*/false);
      if (!store.ok()) return store.status();
      auto reader = CheckpointReader::Open(*store, static_cast<uint64_t>(version));
      if (!reader.ok()) {
        return absl::FailedPreconditionError(
            absl::StrCat(status.message(), "; and no checkpoint of version ", version, ": ",
                         reader.status().message()));
      }
      checkpoint_ = *std::move(reader);
    }
    return checkpoint_->ReadRows(request_.tensor(), kMasterSection, row, end, out);
  }

  absl::Status Stream() {
    // Checked whether or not an older version will need it: a bad name is
    // refused up front, not only when the export falls back to it.
    if (!request_.checkpoint_dir().empty()) {
      RETURN_IF_ERROR(ValidateRelativePath(request_.checkpoint_dir()));
    }
    // Proto3 enums keep unknown numbers: one this daemon does not know is
    // refused, never read as the default.
    if (!ExportRowsDtype_IsValid(request_.dtype())) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown export dtype ", request_.dtype(), " (BF16 = 0, FP32 = 1)"));
    }
    if (!ExportValues_IsValid(request_.values())) {
      return absl::InvalidArgumentError(absl::StrCat("unknown export values ", request_.values(),
                                                     " (MASTER = 0, ROWWISE = 1, COLUMNWISE = 2)"));
    }
    const int64_t cols = request_.cols();
    if (cols < 1 || request_.row_begin() < 0 || request_.row_end() <= request_.row_begin()) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad rows [", request_.row_begin(), ", ", request_.row_end(), ") x ", cols));
    }
    const ExportDtype dtype = FromProto(request_.dtype());
    const int64_t chunk_bytes = request_.max_chunk_bytes() > 0
                                    ? request_.max_chunk_bytes()
                                    : service_->options().export_chunk_bytes;
    const int64_t rows_per_chunk =
        std::max<int64_t>(1, chunk_bytes / (cols * ExportDtypeSize(dtype)));
    std::vector<float> values;
    int64_t offset = 0;
    for (int64_t row = request_.row_begin(); row < request_.row_end(); row += rows_per_chunk) {
      const int64_t end = std::min(request_.row_end(), row + rows_per_chunk);
      values.resize(static_cast<size_t>((end - row) * cols));
      RETURN_IF_ERROR(ReadRows(row, end, absl::MakeSpan(values)));
      bytes_.clear();
      AppendForExport(values, dtype, bytes_);
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](ExportReactor* r)
                 ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu_) { return !r->writing_ || r->broken_; },
            this));
        if (broken_) return absl::CancelledError("export stream cancelled");
        writing_ = true;
        chunk_.set_offset(offset);
        chunk_.set_data(bytes_.data(), bytes_.size());
      }
      StartWrite(&chunk_);
      offset += static_cast<int64_t>(bytes_.size());
    }
    return absl::OkStatus();
  }

  void Produce() {
    const absl::Time start = absl::Now();
    absl::Status status = Stream();
    const std::string what = absl::StrCat("export of ", QuoteForMessage(request_.tensor()),
                                          " rows [", request_.row_begin(), ", ", request_.row_end(),
                                          ") at version ", request_.version());
    telemetry::ObserveExport(absl::ToDoubleSeconds(absl::Now() - start));
    if (status.ok()) {
      VLog(1, kTag, absl::StrCat(what, " done in ", absl::FormatDuration(absl::Now() - start)));
    } else {
      LogWarning(kTag, absl::StrCat(what, " failed: ", status.ToString()));
    }
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ExportReactor* r)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu_) { return !r->writing_ || r->broken_; },
          this));
      if (status.ok() && broken_) status = absl::CancelledError("export stream cancelled");
    }
    Finish(ToGrpcStatus(status));  // may run OnDone (delete this) inline: nothing after
  }

  CheckpointDaemonService::Impl* const service_;
  const ExportRowsRequest request_;
  std::unique_ptr<CheckpointReader> checkpoint_;  // producer thread only
  std::vector<uint8_t> bytes_;                    // producer thread only
  absl::Mutex mu_;
  ExportRowsChunk chunk_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

grpc::ServerWriteReactor<ExportRowsChunk>* CheckpointDaemonService::Impl::ExportRows(
    grpc::CallbackServerContext* context, const ExportRowsRequest* request) {
  if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                       "/paramd.checkpoint.CheckpointDaemon/ExportRows");
      !s.ok()) {
    return auth::RefusedWriter<ExportRowsChunk>(s);
  }
  auto* reactor = new ExportReactor(this, request);
  reactor->Begin();
  return reactor;
}

// The stale temporary files of killed writers in the store `dir` and the
// stores below it (request dirs, up to `depth` levels): a daemon's start.
static int SweepStaleTempFiles(const std::string& dir, int depth) {
  absl::StatusOr<CheckpointStore> store = CheckpointStore::Open(dir, /*create=*/false);
  if (!store.ok()) return 0;
  absl::StatusOr<int> removed = store->RemoveStaleTempFilesEverywhere();
  int total = removed.ok() ? *removed : 0;
  if (depth <= 0) return total;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return total;
  std::vector<std::string> subdirs;
  while (struct dirent* e = ::readdir(d)) {
    const absl::string_view name = e->d_name;
    if (name.empty() || name[0] == '.' || name[0] == 'v' || e->d_type != DT_DIR) continue;
    subdirs.push_back(absl::StrCat(dir, "/", name));
  }
  ::closedir(d);
  for (const std::string& sub : subdirs) total += SweepStaleTempFiles(sub, depth - 1);
  return total;
}

absl::StatusOr<std::unique_ptr<CheckpointDaemonService>> CheckpointDaemonService::Create(
    CheckpointServiceOptions options, CheckpointableDaemon* daemon) {
  if (daemon == nullptr) return absl::InvalidArgumentError("no daemon");
  if (!options.root.empty()) {
    RETURN_IF_ERROR(CheckpointStore::Open(options.root, true, options.modes).status());
  }
  if (!options.root.empty()) {
    if (const int n = SweepStaleTempFiles(options.root, 3); n > 0) {
      LogInfo(kTag, absl::StrCat("removed ", n, " temporary files of killed writers under ",
                                 options.root));
    }
  }
  return std::unique_ptr<CheckpointDaemonService>(
      new CheckpointDaemonService(std::make_unique<Impl>(std::move(options), daemon)));
}

CheckpointDaemonService::CheckpointDaemonService(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}
CheckpointDaemonService::~CheckpointDaemonService() = default;
grpc::Service* CheckpointDaemonService::service() { return impl_.get(); }

// ===========================================================================
// Coordinator side

namespace {

// How long a second WriteShard attempt waits for a reset channel to
// reconnect (a daemon restarted on its address); see WriteShards.
constexpr absl::Duration kReconnectWait = absl::Seconds(3);

class GrpcClusterView : public ClusterView {
 public:
  GrpcClusterView(const std::string& address, absl::Duration timeout)
      : stub_(rpc::Coordinator::NewStub(
            grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))),
        timeout_(timeout) {}

  absl::StatusOr<rpc::Manifest> GetManifest() override {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout_));
    rpc::GetManifestRequest request;
    request.set_with_frozen_data(true);  // a checkpoint keeps the frozen buffers
    rpc::GetManifestResponse response;
    RETURN_IF_ERROR(
        FromGrpcStatus(stub_->GetManifest(&context, request, &response), "GetManifest"));
    return response.manifest();
  }

 private:
  std::unique_ptr<rpc::Coordinator::Stub> stub_;
  absl::Duration timeout_;
};

}  // namespace

std::unique_ptr<ClusterView> NewGrpcClusterView(const std::string& address,
                                                absl::Duration timeout) {
  return std::make_unique<GrpcClusterView>(address, timeout);
}

std::vector<TensorInfo> CheckpointTensorsOf(const rpc::Manifest& manifest) {
  std::vector<TensorInfo> tensors;
  for (const rpc::TensorInfo& t : manifest.tensors()) {
    TensorInfo info;
    info.set_name(t.name());
    for (int64_t d : t.shape()) info.add_shape(d);
    info.set_rows(t.rows());
    info.set_cols(t.cols());
    info.set_spec(t.spec().SerializeAsString());
    info.set_spec_type(rpc::HybridSpec::descriptor()->full_name());
    tensors.push_back(std::move(info));
  }
  return tensors;
}

namespace {
// OK when checkpoint `existing` of `store` holds the state of the model
// `served` (the cluster's manifest): of its generation (none recorded
// counts as 0), or the very checkpoint that model was restored from.
absl::Status CheckSameModel(const CheckpointStore& store, const Manifest& existing,
                            const rpc::Manifest& served) {
  int64_t generation = 0;
  auto it = existing.metadata().find(kModelGenerationKey);
  if (it != existing.metadata().end() && !absl::SimpleAtoi(it->second, &generation)) {
    generation = -1;  // damaged: of no model
  }
  if (generation == served.model_generation()) return absl::OkStatus();
  if (served.has_restored_from() &&
      served.restored_from().version() == static_cast<int64_t>(existing.version())) {
    absl::StatusOr<CheckpointStore> from =
        CheckpointStore::Open(served.restored_from().path(), /*create=*/false);
    if (from.ok() && from->root() == store.root()) return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      absl::StrCat("checkpoint ", existing.version(), " in ", store.root(),
                   " belongs to another model (generation ", generation,
                   "; the cluster serves generation ", served.model_generation(),
                   "): checkpoint into another directory (hpctl checkpoint "
                   "--dir) or remove ",
                   store.VersionDir(existing.version())));
}

// A requested version is a version (>= 0) or -1, which means `minus_one`.
absl::Status CheckRequestedVersion(int64_t version, absl::string_view minus_one) {
  if (version >= -1) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("version ", version, " is out of range: a version >= 0, or -1 for ", minus_one));
}
}  // namespace

class CheckpointCoordinatorService::Impl : public CheckpointCoordinator::CallbackService {
 public:
  Impl(CheckpointServiceOptions options, std::unique_ptr<ClusterView> cluster)
      : options_(std::move(options)), cluster_(std::move(cluster)) {}

  grpc::ServerUnaryReactor* Checkpoint(grpc::CallbackServerContext* context,
                                       const CheckpointRequest* request,
                                       CheckpointResponse* response) override {
    if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                         "/paramd.checkpoint.CheckpointCoordinator/Checkpoint");
        !s.ok()) {
      return auth::RefusedUnary(context, s);
    }
    return RunOnThread(context, [this, request, response] {
      const absl::Time start = absl::Now();
      absl::StatusOr<CheckpointResponse> r = DoCheckpoint(*request);
      telemetry::ObserveCheckpoint(r.ok(), absl::ToDoubleSeconds(absl::Now() - start),
                                   r.ok() ? r->total_bytes() : 0);
      if (!r.ok()) {
        LogError(kTag, absl::StrCat("checkpoint failed: ", r.status().ToString()));
        return r.status();
      }
      LogInfo(kTag,
              absl::StrCat("checkpoint of version ", r->version(),
                           r->already_existed() ? " already existed" : "", ": ", r->total_bytes(),
                           " bytes in ", absl::StrFormat("%.3f", r->seconds()), " s at ", r->path(),
                           r->removed_versions_size() > 0
                               ? absl::StrCat(" (removed ", r->removed_versions_size(), " older)")
                               : ""));
      *response = *std::move(r);
      return absl::OkStatus();
    });
  }

  grpc::ServerUnaryReactor* ListCheckpoints(grpc::CallbackServerContext* context,
                                            const ListCheckpointsRequest* request,
                                            ListCheckpointsResponse* response) override {
    if (grpc::Status s =
            auth::Authorize(options_.authenticator.get(), *context,
                            "/paramd.checkpoint.CheckpointCoordinator/ListCheckpoints");
        !s.ok()) {
      return auth::RefusedUnary(context, s);
    }
    return RunOnThread(context, [this, request, response]() -> absl::Status {
      ASSIGN_OR_RETURN(CheckpointStore store, OpenStore(request->dir(), /*create=*/false));
      ASSIGN_OR_RETURN(std::vector<CheckpointSummary> list, store.List());
      for (const CheckpointSummary& summary : list) {
        CheckpointEntry* entry = response->add_checkpoints();
        entry->set_version(summary.version);
        entry->set_world_size(summary.world_size);
        entry->set_created_unix_micros(summary.created_unix_micros);
        entry->set_total_bytes(summary.total_bytes);
        entry->set_num_tensors(summary.num_tensors);
        entry->set_path(summary.path);
      }
      return absl::OkStatus();
    });
  }

  grpc::ServerUnaryReactor* DescribeCheckpoint(grpc::CallbackServerContext* context,
                                               const DescribeCheckpointRequest* request,
                                               DescribeCheckpointResponse* response) override {
    if (grpc::Status s =
            auth::Authorize(options_.authenticator.get(), *context,
                            "/paramd.checkpoint.CheckpointCoordinator/DescribeCheckpoint");
        !s.ok()) {
      return auth::RefusedUnary(context, s);
    }
    return RunOnThread(context, [this, request, response]() -> absl::Status {
      RETURN_IF_ERROR(CheckRequestedVersion(request->version(), "the newest complete one"));
      ASSIGN_OR_RETURN(CheckpointStore store, OpenStore(request->dir(), /*create=*/false));
      uint64_t version = static_cast<uint64_t>(request->version());
      if (request->version() < 0) {
        ASSIGN_OR_RETURN(version, store.LatestVersion());
      }
      ASSIGN_OR_RETURN(*response->mutable_manifest(), store.ReadManifest(version));
      // Frozen buffers are described (name, dtype, shape), not shipped.
      for (FrozenTensor& f : *response->mutable_manifest()->mutable_frozen()) f.clear_data();
      if (request->verify()) {
        RETURN_IF_ERROR(store.Verify(version));
        response->set_verified(true);
      }
      response->set_path(store.VersionDir(version));
      return absl::OkStatus();
    });
  }

  // FAILED_PRECONDITION unless the model of `manifest` has committed the
  // version `request` asks for (-1: the newest).
  static absl::Status CheckCommitted(const CheckpointRequest& request,
                                     const rpc::Manifest& manifest) {
    if (manifest.committed_version() < 0) {
      return absl::FailedPreconditionError("no model loaded: nothing to checkpoint");
    }
    if (request.version() > manifest.committed_version()) {
      // After a load --force the versions start again: a version asked
      // for by number may be one of the model that was replaced.
      return absl::FailedPreconditionError(
          absl::StrCat("version ", request.version(),
                       " is not committed (committed: ", manifest.committed_version(),
                       manifest.model_generation() > 1
                           ? absl::StrCat(" by model generation ", manifest.model_generation(),
                                          ", loaded from ", manifest.loaded_from(),
                                          "; the versions of a model a load replaced cannot be "
                                          "checkpointed any more")
                           : "",
                       ")"));
    }
    return absl::OkStatus();
  }

  // The checkpoint's metadata: optimizer, plan, pushers, the model
  // generation, and the optimizer config with its per-tensor overrides.
  static std::map<std::string, std::string> CheckpointMetadata(const rpc::Manifest& manifest) {
    std::map<std::string, std::string> metadata = {
        {"optimizer", manifest.optimizer()},
        {"plan_fingerprint", absl::StrCat(manifest.plan_fingerprint())},
        {"expected_pushers", absl::StrCat(manifest.expected_pushers())}};
    // Which model this is (server/coordinator/model_generation.h): a recovery never
    // restores another generation's checkpoint. None recorded for a model
    // loaded before generations were.
    if (manifest.model_generation() > 0) {
      metadata[kModelGenerationKey] = absl::StrCat(manifest.model_generation());
    }
    // The optimizer config and per-tensor overrides the model steps with
    // (a restore steps on with them: server/coordinator/coordinator_load.cc).
    if (manifest.has_optimizer_config()) {
      std::string config, tensors;
      rpc::Manifest overrides;
      for (const rpc::TensorInfo& t : manifest.tensors()) {
        rpc::TensorInfo* o = overrides.add_tensors();
        o->set_name(t.name());
        *o->mutable_optimizer() = t.optimizer();
      }
      google::protobuf::TextFormat::PrintToString(manifest.optimizer_config(), &config);
      google::protobuf::TextFormat::PrintToString(overrides, &tensors);
      metadata["optimizer_config"] = config;
      metadata["optimizer_tensors"] = tensors;
    }
    return metadata;
  }

  absl::StatusOr<CheckpointResponse> DoCheckpoint(const CheckpointRequest& request) {
    const auto start = std::chrono::steady_clock::now();
    // Before anything is created: a refused checkpoint leaves no directory.
    RETURN_IF_ERROR(CheckRequestedVersion(request.version(), "the committed version"));
    if (request.keep() < -1) {
      return absl::InvalidArgumentError(
          absl::StrCat("keep ", request.keep(),
                       " is out of range: > 0 keeps that many, 0 the server's --keep_checkpoints, "
                       "-1 every checkpoint"));
    }
    {
      ASSIGN_OR_RETURN(rpc::Manifest manifest, cluster_->GetManifest());
      RETURN_IF_ERROR(CheckCommitted(request, manifest));
    }
    ASSIGN_OR_RETURN(CheckpointStore store, OpenStore(request.dir(), /*create=*/true));
    // One checkpoint at a time: KeepLast must not see another's files.
    absl::MutexLock serial(&checkpoint_mu_);
    absl::Status last;
    for (int attempt = 0; attempt <= options_.version_retries; ++attempt) {
      ASSIGN_OR_RETURN(rpc::Manifest manifest, cluster_->GetManifest());
      // Again: a load may have replaced the model meanwhile.
      RETURN_IF_ERROR(CheckCommitted(request, manifest));
      const uint64_t version = static_cast<uint64_t>(
          request.version() >= 0 ? request.version() : manifest.committed_version());
      CheckpointResponse response;
      response.set_version(version);
      response.set_path(store.VersionDir(version));
      if (absl::StatusOr<Manifest> existing = store.ReadManifest(version); existing.ok()) {
        // Only this model's own: another model's checkpoint of the same
        // version (before a load --force) is not its state.
        RETURN_IF_ERROR(CheckSameModel(store, *existing, manifest));
        response.set_already_existed(true);
        response.set_seconds(SecondsSince(start));
        return response;
      }
      absl::StatusOr<std::vector<ShardFileInfo>> shards =
          WriteShards(request.dir(), version, manifest);
      if (!shards.ok()) {
        last = shards.status();
        // Only a daemon that moved past the version (NotAtVersion: ABORTED)
        // is worth a retry, with the new committed version, and only if the
        // caller asked for "the committed version"; a version asked for by
        // number is gone for good. Anything else (a daemon without
        // --checkpoint_dir, a bad directory) is the answer.
        if (!absl::IsAborted(last)) return last;
        if (request.version() < 0) continue;
        return absl::FailedPreconditionError(last.message());
      }
      const std::map<std::string, std::string> metadata = CheckpointMetadata(manifest);
      Manifest written =
          BuildManifest(version, CheckpointTensorsOf(manifest), *std::move(shards), metadata);
      *written.mutable_frozen() = manifest.frozen();
      for (const ShardFileInfo& shard : written.shards()) {
        response.set_total_bytes(response.total_bytes() + shard.size_bytes());
      }
      RETURN_IF_ERROR(store.CommitManifest(std::move(written)));
      const int keep = request.keep() == 0 ? options_.keep : request.keep();
      if (keep > 0) {
        ASSIGN_OR_RETURN(std::vector<uint64_t> removed, store.KeepLast(keep));
        for (uint64_t v : removed) response.add_removed_versions(v);
      }
      response.set_seconds(SecondsSince(start));
      return response;
    }
    return absl::AbortedError(
        absl::StrCat("the daemons kept moving past the committed version (", last.message(), ")"));
  }

 private:
  absl::StatusOr<CheckpointStore> OpenStore(const std::string& dir, bool create) {
    if (options_.root.empty()) return NoRoot();
    return CheckpointStore::OpenUnder(options_.root, dir, create, options_.modes);
  }

  grpc::ServerUnaryReactor* RunOnThread(grpc::CallbackServerContext* context,
                                        std::function<absl::Status()> fn) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    threads_.Run([reactor, fn = std::move(fn)] { reactor->Finish(ToGrpcStatus(fn())); });
    return reactor;
  }

  rpc::DaemonInfo DaemonOf(const rpc::Manifest& manifest, int rank) {
    for (const rpc::DaemonInfo& daemon : manifest.daemons()) {
      if (daemon.rank() == rank) return daemon;
    }
    return rpc::DaemonInfo();
  }

  struct DaemonChannel {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<CheckpointDaemon::Stub> stub;
  };
  DaemonChannel* ChannelFor(const std::string& address) {
    absl::MutexLock lock(&stubs_mu_);
    DaemonChannel& c = stubs_[address];
    if (c.stub == nullptr) {
      c.channel = auth::CreateChannel(address, options_.daemon_channel);
      c.stub = CheckpointDaemon::NewStub(c.channel);
    }
    return &c;
  }

  // WriteShard on every daemon in parallel; the first error (by rank) wins.
  absl::StatusOr<std::vector<ShardFileInfo>> WriteShards(const std::string& dir, uint64_t version,
                                                         const rpc::Manifest& manifest) {
    const int world = manifest.daemons_size();
    if (world < 1) return absl::FailedPreconditionError("no daemons in the manifest");
    std::vector<absl::Status> statuses(world);
    std::vector<ShardFileInfo> shards(world);
    std::vector<std::thread> calls;
    for (int rank = 0; rank < world; ++rank) {
      const std::string address = DaemonOf(manifest, rank).address();
      calls.emplace_back([&, rank, address] {
        if (address.empty()) {
          statuses[rank] =
              absl::FailedPreconditionError(absl::StrCat("daemon ", rank, " has no address"));
          return;
        }
        WriteShardRequest request;
        request.set_dir(dir);
        request.set_version(version);
        request.set_daemon_rank(rank);
        request.set_world_size(world);
        request.set_model_generation(manifest.model_generation());
        WriteShardResponse response;
        grpc::Status status;
        // A daemon restarted on the same address leaves this channel in
        // TRANSIENT_FAILURE (its old connection was reset), where an RPC
        // fails at once with UNAVAILABLE. So after an UNAVAILABLE, wait a
        // short while for the channel to connect and, if it does, try once
        // more; a dead daemon still fails the checkpoint quickly with
        // UNAVAILABLE. Rewriting a shard file is idempotent (temp file +
        // rename of the same bytes).
        DaemonChannel* daemon = ChannelFor(address);
        for (int attempt = 0; attempt < 2; ++attempt) {
          if (attempt > 0 &&
              !daemon->channel->WaitForConnected(std::chrono::system_clock::now() +
                                                 absl::ToChronoMilliseconds(kReconnectWait))) {
            break;
          }
          grpc::ClientContext context;
          context.set_deadline(std::chrono::system_clock::now() +
                               absl::ToChronoMilliseconds(options_.daemon_call_timeout));
          status = daemon->stub->WriteShard(&context, request, &response);
          if (status.error_code() != grpc::StatusCode::UNAVAILABLE) break;
        }
        statuses[rank] =
            FromGrpcStatus(status, absl::StrCat("WriteShard on daemon ", rank, " at ", address));
        shards[rank] = response.shard();
      });
    }
    for (std::thread& call : calls) call.join();
    for (const absl::Status& status : statuses) RETURN_IF_ERROR(status);
    return shards;
  }

  const CheckpointServiceOptions options_;
  const std::unique_ptr<ClusterView> cluster_;
  absl::Mutex checkpoint_mu_;
  absl::Mutex stubs_mu_;
  std::map<std::string, DaemonChannel> stubs_ ABSL_GUARDED_BY(stubs_mu_);
  TaskThreads threads_;  // last member: joined first
};

absl::StatusOr<std::unique_ptr<CheckpointCoordinatorService>> CheckpointCoordinatorService::Create(
    CheckpointServiceOptions options, std::unique_ptr<ClusterView> cluster) {
  if (cluster == nullptr) return absl::InvalidArgumentError("no cluster view");
  if (options.keep < 0) return absl::InvalidArgumentError("keep must be >= 0");
  if (!options.root.empty()) {
    RETURN_IF_ERROR(CheckpointStore::Open(options.root, true, options.modes).status());
  }
  return std::unique_ptr<CheckpointCoordinatorService>(new CheckpointCoordinatorService(
      std::make_unique<Impl>(std::move(options), std::move(cluster))));
}

CheckpointCoordinatorService::CheckpointCoordinatorService(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}
CheckpointCoordinatorService::~CheckpointCoordinatorService() = default;
grpc::Service* CheckpointCoordinatorService::service() { return impl_.get(); }

absl::StatusOr<CheckpointResponse> CheckpointCoordinatorService::Checkpoint(
    const CheckpointRequest& request) {
  return impl_->DoCheckpoint(request);
}

}  // namespace checkpoint
}  // namespace paramd
