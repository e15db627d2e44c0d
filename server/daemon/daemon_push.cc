// File: server/daemon/daemon_push.cc
//
// The daemon's gradient pushes and pushed weights (server/daemon/daemon.h, step 3 of
// its life): the push rules (CheckPushLocked), the host pushes' commit and
// count, the same-GPU (IpcHost) push, and the client-streaming reactors of
// PushGradients and PushWeights. Device pushes: daemon_device.cc.

#include "server/daemon/daemon_internal.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace paramd {

using daemon_internal::kTag;

absl::Status Daemon::Impl::CheckPush(int64_t version, const std::string& pusher) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("daemon shutting down");
  RETURN_IF_ERROR(CheckDevicePushAllowedLocked());
  return CheckPushLocked(version, pusher);
}

absl::Status Daemon::Impl::CommitPush(int64_t version, const std::string& pusher,
                                      int64_t generation, int64_t bytes,
                                      const std::function<absl::Status(ShardBackend&)>& apply,
                                      rpc::PushGradientsResponse* response) {
  absl::ReaderMutexLock device_lock(&device_mu_);
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckDevicePushAllowedLocked());
  RETURN_IF_ERROR(CheckPushLocked(version, pusher));
  if (view_ == nullptr || view_->generation != generation || shards_ == nullptr) {
    return absl::FailedPreconditionError("the model was reloaded during the push");
  }
  RETURN_IF_ERROR(apply(*shards_));
  CountPushLocked(version, pusher, bytes, response);
  return absl::OkStatus();
}

absl::Status Daemon::Impl::CommitPush(int64_t version, const std::string& pusher,
                                      const ModelView& view, std::vector<StagedPiece>& pieces,
                                      int64_t bytes, rpc::PushGradientsResponse* response,
                                      const PipelinedPush& live) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckPushLocked(version, pusher));
  if (view.generation != view_->generation) {
    return absl::FailedPreconditionError("the model was reloaded during the push");
  }
  if (live.stream != nullptr) {
    live.pipeline->Commit(*live.stream);
    CountPushLocked(version, pusher, bytes, response);
    return absl::OkStatus();
  }
  const bool last = LastPushLocked();
  for (StagedPiece& p : pieces) {
    // gpu backend: summed on the device (ShardBackend::AccumulateGradient).
    const ShardDef& shard = shards_->shards()[p.shard];
    const int64_t cols = view.tensors[p.tensor].cols;
    RETURN_IF_ERROR(shards_->AccumulateGradient(p.shard, (p.row_begin - shard.row_begin) * cols,
                                                p.values, last));
  }
  CountPushLocked(version, pusher, bytes, response);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const ModelView>> Daemon::Impl::BeginPush(
    int64_t version, const std::string& pusher) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckPushLocked(version, pusher));
  return view_;
}

absl::StatusOr<Daemon::Impl::PipelinedPush> Daemon::Impl::OpenPipelinedPush(
    int64_t version, const std::string& pusher) {
  absl::MutexLock lock(&mu_);
  PipelinedPush p;
  if (push_pipeline_ == nullptr) return p;
  ASSIGN_OR_RETURN(p.stream, push_pipeline_->Open(version, pusher));
  p.pipeline = push_pipeline_;
  if (!pipeline_attempt_ && !stepping_ && latest_ && latest_->version == version) {
    pipeline_attempt_ = true;
    worker_.Post([this, version] { RunStep(version, /*apply_optimizer=*/true); });
  }
  return p;
}

bool Daemon::Impl::LastPushLocked() const {
  return expected_pushers_ > 0 && static_cast<int>(pushers_.size()) + 1 >= expected_pushers_;
}

void Daemon::Impl::CountPushLocked(int64_t version, const std::string& pusher, int64_t bytes,
                                   rpc::PushGradientsResponse* response) {
  pushers_.insert(pusher);
  traffic_.pushed.fetch_add(bytes);
  response->set_version(version);
  response->set_pushers_received(static_cast<int>(pushers_.size()));
  response->set_pushers_expected(expected_pushers_);
  response->set_bytes_received(bytes);
  MaybeStartStepLocked();
}

absl::Status Daemon::Impl::CheckDevicePushAllowedLocked() const {
  if (push_pipeline_ == nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "this daemon runs --pipelined_step, which takes host pushes (PushGradients) only; "
      "push over the host stream, or run the daemons without --pipelined_step");
}

absl::Status Daemon::Impl::ClaimPusher(const std::string& pusher,
                                       const grpc::ServerContextBase& context, bool bind) {
  if (options_.authenticator == nullptr) return absl::OkStatus();
  return pusher_owners_.Claim(pusher, options_.authenticator->TokenIdentity(context), bind);
}

absl::Status Daemon::Impl::CheckPushLocked(int64_t version, const std::string& pusher) {
  if (pusher.empty()) return absl::InvalidArgumentError("push without pusher_id");
  RETURN_IF_ERROR(CheckClientId("pusher_id", pusher));  // before it is stored
  RETURN_IF_ERROR(CheckNotReplacedLocked());
  if (recovering_) {
    return absl::UnavailableError(
        "this daemon is recovering from the loss of a daemon; wait for the version the "
        "coordinator rewinds to (WaitForVersion) and push for it");
  }
  if (!latest_) {
    return absl::FailedPreconditionError("no model published on this daemon yet");
  }
  const int64_t current = latest_->version;
  if (version == current && pushers_.count(pusher) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("pusher ", QuoteForMessage(pusher),
                                                 " already pushed gradients for version ", version,
                                                 " to this daemon"));
  }
  if (version < current) {
    return absl::FailedPreconditionError(
        absl::StrCat("stale push for version ", version, ": this daemon is at version ", current));
  }
  if (version > current) {
    return absl::OutOfRangeError(absl::StrCat("push for future version ", version,
                                              ": this daemon is at version ", current,
                                              "; wait for it first"));
  }
  if (stepping_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "version ", version, " is being stepped; push for version ", version + 1, " later"));
  }
  if (static_cast<int64_t>(pushers_.size()) >= options_.limits.max_pushers_per_version) {
    return absl::ResourceExhaustedError(
        absl::StrCat("version ", version, " already has ", pushers_.size(),
                     " pushers on this daemon: the limit (--max_pushers_per_version)"));
  }
  if (expected_pushers_ > 0 && static_cast<int>(pushers_.size()) >= expected_pushers_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "all ", expected_pushers_, " expected pushers already pushed version ", version));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const ModelView>> Daemon::Impl::BeginWeights() {
  absl::MutexLock lock(&mu_);
  if (!awaiting_weights_) {
    return absl::FailedPreconditionError(
        "this daemon is not waiting for pushed weights (load with declared tensors first)");
  }
  return view_;
}

absl::Status Daemon::Impl::CommitWeights(const ModelView& view, std::vector<StagedPiece>& pieces,
                                         rpc::PushWeightsResponse* response, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (!awaiting_weights_ || view.generation != view_->generation) {
    return absl::FailedPreconditionError("the model was reloaded or published meanwhile");
  }
  for (StagedPiece& p : pieces) {
    absl::Span<float> m = shards_->load_master(p.shard);
    const ShardDef& shard = shards_->shards()[p.shard];
    const int64_t cols = view.tensors[p.tensor].cols;
    std::copy(p.values.begin(), p.values.end(), m.begin() + (p.row_begin - shard.row_begin) * cols);
    std::vector<bool>& loaded = rows_loaded_[p.shard];
    for (int64_t r = p.row_begin; r < p.row_end; ++r) {
      if (!loaded[r - shard.row_begin]) {
        loaded[r - shard.row_begin] = true;
        --rows_missing_;
      }
    }
  }
  response->set_bytes_received(bytes);
  response->set_complete(rows_missing_ == 0);
  if (rows_missing_ == 0) {
    awaiting_weights_ = false;
    stepping_ = true;
    stepping_from_ = -1;
    worker_.Post([this] { RunStep(-1, /*apply_optimizer=*/false); });
  }
  return absl::OkStatus();
}

namespace {

// ---- Client-streaming uploads of GradientChunks ----
//
// Every message is validated as it arrives; the stream's content is applied
// only on its explicit end marker (OnMessage sets finished_), for gradient
// pushes and pushed weights alike. A failed read
// is never taken for a clean end: gRPC reports a message over the size
// limit, a cancel or a broken connection the same way (ok = false) and the
// context need not say cancelled yet.
// The end marker's total against the chunk bytes the stream carried.
absl::Status CheckStreamEnd(int64_t total_bytes, int64_t carried, absl::string_view what) {
  if (total_bytes == carried) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, " end marker says ", total_bytes,
                                                 " bytes but the stream carried ", carried,
                                                 "; nothing applied"));
}

template <class Request, class Response>
class ChunkStreamReactor : public grpc::ServerReadReactor<Request> {
 public:
  ChunkStreamReactor(Daemon::Impl* daemon, grpc::CallbackServerContext* context, Response* response)
      : daemon_(daemon), context_(context), response_(response) {}

  void OnReadDone(bool ok) override {
    absl::Status s;
    if (!ok) {
      s = context_->IsCancelled() ? absl::CancelledError("upload cancelled; nothing applied")
                                  : OnStreamEnd();
      this->Finish(ToGrpcStatus(s));
      return;
    }
    s = OnMessage(request_);
    if (!s.ok() || finished_) {
      this->Finish(ToGrpcStatus(s));
      return;
    }
    this->StartRead(&request_);
  }

  void OnDone() override { delete this; }

 protected:
  virtual absl::Status OnMessage(const Request& request) = 0;
  // The read side ended without the context cancelled: a half-close, or a
  // read that failed for another reason.
  virtual absl::Status OnStreamEnd() = 0;

  Daemon::Impl* const daemon_;
  grpc::CallbackServerContext* const context_;
  Response* const response_;
  Request request_;
  std::shared_ptr<const ModelView> view_;
  std::optional<ChunkAssembler> assembler_;
  bool finished_ = false;  // OnMessage applied the stream: answer now
};

// PushGradients: one atomic contribution of one pusher for one version,
// applied only on its end marker.
class PushReactor
    : public ChunkStreamReactor<rpc::PushGradientsRequest, rpc::PushGradientsResponse> {
 public:
  using ChunkStreamReactor::ChunkStreamReactor;
  void Begin() { StartRead(&request_); }

 private:
  absl::Status OnMessage(const rpc::PushGradientsRequest& request) override {
    absl::Status s = ReadMessage(request);
    if (!s.ok() && live_.stream != nullptr) live_.pipeline->Fail(*live_.stream);
    return s;
  }

  absl::Status ReadMessage(const rpc::PushGradientsRequest& request) {
    if (view_ == nullptr) {
      version_ = request.version();
      pusher_ = request.pusher_id();
      RETURN_IF_ERROR(daemon_->ClaimPusher(pusher_, *context_, /*bind=*/false));
      ASSIGN_OR_RETURN(view_, daemon_->BeginPush(version_, pusher_));
      // non_finite: SKIP_STEP takes NaN/Inf; the step then skips.
      assembler_.emplace(view_.get(),
                         view_->optimizer.has_value() &&
                             view_->optimizer->non_finite == NonFinitePolicy::kSkipStep);
      ASSIGN_OR_RETURN(live_, daemon_->OpenPipelinedPush(version_, pusher_));
    } else if ((request.version() != 0 && request.version() != version_) ||
               (!request.pusher_id().empty() && request.pusher_id() != pusher_)) {
      return absl::InvalidArgumentError("version/pusher_id changed inside a push stream");
    }
    if (request.has_chunk()) {
      carried_ += static_cast<int64_t>(request.chunk().data().size());
      RETURN_IF_ERROR(assembler_->Add(request.chunk()));
      if (live_.stream != nullptr) {
        RETURN_IF_ERROR(live_.pipeline->Progress(*live_.stream, assembler_->pieces(),
                                                 assembler_->piece_open()));
      }
    }
    if (!request.has_end()) return absl::OkStatus();
    RETURN_IF_ERROR(CheckStreamEnd(request.end().total_bytes(), carried_, "push"));
    RETURN_IF_ERROR(assembler_->Close());
    RETURN_IF_ERROR(daemon_->ClaimPusher(pusher_, *context_, /*bind=*/false));
    RETURN_IF_ERROR(daemon_->CommitPush(version_, pusher_, *view_, assembler_->pieces(),
                                        assembler_->bytes(), response_, live_));
    // Cannot fail: binds the id to this token if no other push did meanwhile
    // (two tokens' pushes under one id and version: the second commit was
    // refused as a duplicate above).
    daemon_->ClaimPusher(pusher_, *context_, /*bind=*/true).IgnoreError();
    finished_ = true;
    return absl::OkStatus();
  }

  absl::Status OnStreamEnd() override {
    if (view_ == nullptr) return absl::InvalidArgumentError("empty push stream (no version)");
    if (live_.stream != nullptr) live_.pipeline->Fail(*live_.stream);
    return absl::InvalidArgumentError(
        "push stream ended without its end marker (PushGradientsRequest.end); nothing applied "
        "and the pusher is not counted: push again");
  }

  int64_t version_ = 0;
  std::string pusher_;
  int64_t carried_ = 0;  // chunk bytes received so far
  // Pipelined step: the stream's registration; its staged pieces go to the
  // pipeline when the stream ends (a step may still read them).
  Daemon::Impl::PipelinedPush live_;

 public:
  ~PushReactor() override {
    if (live_.stream != nullptr)
      live_.pipeline->Close(live_.stream, std::move(assembler_->pieces()));
  }
};

// PushWeights: rows of a model loaded with declared tensors.
class WeightsReactor
    : public ChunkStreamReactor<rpc::PushWeightsRequest, rpc::PushWeightsResponse> {
 public:
  using ChunkStreamReactor::ChunkStreamReactor;
  void Begin() {
    absl::StatusOr<std::shared_ptr<const ModelView>> view = daemon_->BeginWeights();
    if (!view.ok()) {
      Finish(ToGrpcStatus(view.status()));
      return;
    }
    view_ = *std::move(view);
    assembler_.emplace(view_.get(), /*allow_non_finite=*/true);
    StartRead(&request_);
  }

 private:
  absl::Status OnMessage(const rpc::PushWeightsRequest& request) override {
    if (request.has_chunk()) {
      carried_ += static_cast<int64_t>(request.chunk().data().size());
      RETURN_IF_ERROR(assembler_->Add(request.chunk()));
    }
    if (!request.has_end()) return absl::OkStatus();
    RETURN_IF_ERROR(CheckStreamEnd(request.end().total_bytes(), carried_, "weights"));
    RETURN_IF_ERROR(assembler_->Close());
    RETURN_IF_ERROR(
        daemon_->CommitWeights(*view_, assembler_->pieces(), response_, assembler_->bytes()));
    finished_ = true;
    return absl::OkStatus();
  }
  // Not even the complete pieces of a stream cut short are copied: a
  // failed upload changes nothing (the client's retry sends it again).
  absl::Status OnStreamEnd() override {
    return absl::InvalidArgumentError(
        "weights stream ended without its end marker (PushWeightsRequest.end); nothing "
        "applied: push again");
  }

  int64_t carried_ = 0;  // chunk bytes received so far
};

}  // namespace

grpc::ServerReadReactor<rpc::PushGradientsRequest>* Daemon::Impl::PushGradients(
    grpc::CallbackServerContext* context, rpc::PushGradientsResponse* response) {
  if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                       "/paramd.rpc.Daemon/PushGradients");
      !s.ok()) {
    return auth::RefusedReader<rpc::PushGradientsRequest>(s);
  }
  auto* reactor = new PushReactor(this, context, response);
  reactor->Begin();
  return reactor;
}

grpc::ServerReadReactor<rpc::PushWeightsRequest>* Daemon::Impl::PushWeights(
    grpc::CallbackServerContext* context, rpc::PushWeightsResponse* response) {
  if (grpc::Status s =
          auth::Authorize(options_.authenticator.get(), *context, "/paramd.rpc.Daemon/PushWeights");
      !s.ok()) {
    return auth::RefusedReader<rpc::PushWeightsRequest>(s);
  }
  auto* reactor = new WeightsReactor(this, context, response);
  reactor->Begin();
  return reactor;
}

}  // namespace paramd
