// File: server/daemon/daemon_load.cc
//
// The daemon's LoadShards (server/daemon/daemon.h, step 2 of its life): a model from
// a safetensors file, a checkpoint, a snapshot (recovery) or pushed weights,
// installed on the worker, which then publishes its first version.

#include "server/daemon/daemon_internal.h"

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "safetensors/convert.h"
#include "safetensors/safetensors.h"
#include "server/snapshot/restore.h"

namespace paramd {

using daemon_internal::kTag;

namespace {

// Rows [row_begin, row_end) of a [rows][cols] tensor of a safetensors file,
// converted to FP32.
absl::Status ReadRows(const safetensors::SafetensorsFile& file, const TensorDef& def,
                      const ShardDef& shard, absl::Span<float> out) {
  const safetensors::TensorInfo* info = file.Find(def.name);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat(file.path(), ": no tensor ", def.name));
  }
  if (info->num_elements != def.rows * def.cols) {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensor ", def.name, " has ",
                                                   info->num_elements, " elements, manifest says ",
                                                   def.rows, " x ", def.cols));
  }
  switch (info->dtype) {
    case safetensors::Dtype::kF32:
    case safetensors::Dtype::kBF16:
    case safetensors::Dtype::kF16:
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(file.path(), ": tensor ", def.name, " has dtype ",
                       safetensors::DtypeName(info->dtype), "; want F32, BF16 or F16"));
  }
  const int64_t n = shard.rows() * def.cols;
  const int elem = safetensors::DtypeSize(info->dtype);
  std::vector<uint8_t> bytes(n * elem);
  RETURN_IF_ERROR(
      file.ReadTensorBytes(*info, shard.row_begin * def.cols * elem, absl::MakeSpan(bytes)));
  return safetensors::DecodeToFloat(info->dtype, bytes, out);
}

}  // namespace

grpc::ServerUnaryReactor* Daemon::Impl::LoadShards(grpc::CallbackServerContext* context,
                                                   const rpc::LoadShardsRequest* request,
                                                   rpc::LoadShardsResponse* response) {
  if (grpc::Status s =
          auth::Authorize(options_.authenticator.get(), *context, "/paramd.rpc.Daemon/LoadShards");
      !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // Refused before anything changes: the loaded model stays.
  if (absl::Status s = CheckLoadShardsRequest(*request, options_.limits); !s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  absl::StatusOr<ModelView> view;
  {
    absl::MutexLock lock(&mu_);
    view = MakeModelView(request->manifest(), request->daemon_rank(), ++generation_);
  }
  if (!view.ok()) {
    reactor->Finish(ToGrpcStatus(view.status()));
    return reactor;
  }
  auto shared_view = std::make_shared<const ModelView>(*std::move(view));
  LoadSource source;
  for (auto [in, out] : {std::pair{&request->safetensors_path(), &source.safetensors_path},
                         std::pair{&request->checkpoint_path(), &source.checkpoint_path}}) {
    if (in->empty()) continue;
    absl::StatusOr<std::string> resolved =
        ResolveBelow(options_.limits.file_roots, *in, "--model_root");
    if (!resolved.ok()) {
      reactor->Finish(ToGrpcStatus(resolved.status()));
      return reactor;
    }
    *out = *std::move(resolved);
  }
  source.checkpoint_version = request->checkpoint_version();
  worker_.Post(
      [this, shared_view, source, pushers = request->expected_pushers(), reactor, response] {
        // The coordinator may send this as soon as it has registered our Join,
        // before the join thread has seen the reply and opened the data plane.
        const absl::Status joined = AwaitJoined(shared_view->rank);
        if (joined.ok()) snapshots_->DropAll();  // of the model this load replaces
        absl::StatusOr<int64_t> v = joined.ok() ? LoadOnWorker(shared_view, source, pushers)
                                                : absl::StatusOr<int64_t>(joined);
        if (v.ok()) response->set_published_version(*v);
        reactor->Finish(ToGrpcStatus(v.status()));
      });
  return reactor;
}

absl::Status Daemon::Impl::AwaitJoined(int rank) {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return shut_down_ || join_done_; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&done), options_.step_timeout)) {
    return absl::UnavailableError("daemon has not finished joining");
  }
  if (shut_down_) return absl::UnavailableError("daemon shutting down");
  if (!all_reduce_) {
    return absl::FailedPreconditionError(absl::StrCat("daemon not joined: ", join_error_));
  }
  if (rank != rank_) {
    return absl::FailedPreconditionError(
        absl::StrCat("LoadShards for daemon rank ", rank, " sent to rank ", rank_));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Daemon::Impl::LoadOnWorker(const std::shared_ptr<const ModelView>& view,
                                                   const LoadSource& source, int expected_pushers,
                                                   rpc::RecoveryPhases* phases) {
  rpc::RecoveryPhases unused;
  if (phases == nullptr) phases = &unused;
  absl::Time phase_start = absl::Now();
  auto end_phase = [&phase_start] {
    const absl::Time now = absl::Now();
    const double seconds = absl::ToDoubleSeconds(now - phase_start);
    phase_start = now;
    return seconds;
  };
  ShardBackendOptions backend_options;
  // The coordinator's config (every manifest it sends has one).
  backend_options.optimizer = view->optimizer.value_or(options_.optimizer);
  backend_options.step_timeout = options_.step_timeout;
  snapshots_->BeforeChange();
  const bool restore = !source.checkpoint_path.empty() || source.snapshot != nullptr;
  absl::StatusOr<std::unique_ptr<ShardBackend>> created =
      CreateShardBackend(backend_, view->tensors, view->shards, backend_options);
  // --backend=auto: the gpu where it supports the model, else the cpu
  // (logged: the operator sees why). A model that does not fit the GPU is
  // an error, not a silent move to the host.
  if (backend_auto_ && backend_ == DaemonBackend::kGpu && absl::IsUnimplemented(created.status())) {
    Log(kTag, absl::StrCat("--backend=auto: cpu backend for this model (gpu: ",
                           created.status().ToString(), ")"));
    created = CreateShardBackend(DaemonBackend::kCpu, view->tensors, view->shards, backend_options);
  }
  RETURN_IF_ERROR(created.status());
  std::unique_ptr<ShardBackend> shards = *std::move(created);
  phases->set_backend_create(end_phase());
  const bool from_file = restore || !source.safetensors_path.empty();
  std::vector<SavedDelayedState> next_delayed;
  if (restore) {
    ShardStateSink* sink = shards->state_sink();
    if (sink == nullptr) {
      return absl::UnimplementedError(
          absl::StrCat("restoring a checkpoint is not supported by the ", shards->name(),
                       " daemon backend (run the daemons with --backend=cpu)"));
    }
    if (source.snapshot != nullptr) {
      ASSIGN_OR_RETURN(next_delayed, RestoreSnapshot(*source.snapshot, *sink));
    } else {
      ASSIGN_OR_RETURN(next_delayed,
                       RestoreShardSet(source.checkpoint_path, source.checkpoint_version, *sink));
    }
  } else if (from_file) {
    ASSIGN_OR_RETURN(safetensors::SafetensorsFile file,
                     safetensors::SafetensorsFile::Open(source.safetensors_path,
                                                        options_.limits.max_tensor_name_bytes));
    absl::Time next_progress = absl::Now() + absl::Seconds(5);
    for (size_t i = 0; i < shards->shards().size(); ++i) {
      const ShardDef& d = shards->shards()[i];
      RETURN_IF_ERROR(ReadRows(file, view->tensors[d.tensor], d, shards->load_master(i)));
      if (absl::Now() >= next_progress) {  // a large model: say how far it is
        LogInfo(kTag,
                absl::StrCat("rank ", view->rank, ": read ", i + 1, " of ", shards->shards().size(),
                             " shards of ", source.safetensors_path));
        next_progress = absl::Now() + absl::Seconds(5);
      }
    }
  }
  phases->set_restore(end_phase());
  const int64_t first_version = source.snapshot != nullptr
                                    ? source.snapshot->header.version()
                                    : (restore ? source.checkpoint_version : 0);
  {
    absl::WriterMutexLock device_lock(&device_mu_);  // frees the old backend
    absl::MutexLock lock(&mu_);
    shards_ = std::move(shards);
    view_ = view;
    expected_pushers_ = expected_pushers;
    push_pipeline_ = options_.pipelined_step ? std::make_shared<PushPipeline>(
                                                   view->tensors, view->shards, expected_pushers)
                                             : nullptr;
    pipeline_attempt_ = false;
    in_flight_host_ = InFlightHost();
    latest_ = nullptr;
    previous_ = nullptr;
    pushers_.clear();
    failed_step_from_ = -2;
    rows_loaded_.clear();
    rows_missing_ = 0;
    for (const ShardDef& d : view->shards) {
      rows_loaded_.emplace_back(d.rows(), from_file);
      if (!from_file) rows_missing_ += d.rows();
    }
    awaiting_weights_ = !from_file && rows_missing_ > 0;
    if (awaiting_weights_) return -1;
    stepping_ = true;
    stepping_from_ = first_version - 1;
  }
  Log(kTag, absl::StrCat("rank ", view->rank, " (", shards_->name(),
                         " backend): ", restore ? "restored " : "loaded ", view->shards.size(),
                         " shards of ", view->tensors.size(), " tensors",
                         restore ? absl::StrCat(" at version ", first_version) : ""));
  snapshots_->SetModel(view->rank, DaemonAddresses(view->manifest),
                       ShardLayoutHash(view->tensors, view->shards),
                       view->manifest.model_generation());
  RunStep(first_version - 1, /*apply_optimizer=*/false, /*update_delayed=*/!restore);
  absl::MutexLock lock(&mu_);
  if (!latest_) return last_step_error_;
  // Back to the saved post-update scales (the worker is still ours: no
  // step can run in between).
  if (restore) RETURN_IF_ERROR(ApplyDelayedStates(next_delayed, *shards_->state_sink()));
  phases->set_republish(end_phase());
  return latest_->version;
}

}  // namespace paramd
