// File: server/daemon/daemon_device.cc
//
// The daemon's device channels (server/daemon/daemon.h): OpenDeviceChannel (a stream
// as long as the channel), FetchDevice (plan over gRPC, bytes over the
// channel's NCCL world) and PushGradientsDevice.

#include "server/daemon/daemon_internal.h"

#include <chrono>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace paramd {

using daemon_internal::kTag;

// ---- Device channels: OpenDeviceChannel (a stream as long as the channel)
// and FetchDevice (plan over gRPC, bytes over the channel's NCCL world) ----

// The OpenDeviceChannel stream. References: one held by gRPC (dropped in
// OnDone) and one by the channel (dropped when it closes); every entry point
// that may Finish() holds one more, so an OnDone run inline never deletes
// the reactor under its own lock.
class DeviceChannelReactor : public grpc::ServerWriteReactor<rpc::DeviceChannelEvent> {
 public:
  explicit DeviceChannelReactor(Daemon::Impl* daemon) : daemon_(daemon) {}

  void Ref() { refs_.fetch_add(1); }
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  // Writes the first event (channel id and the daemon's address).
  void Begin(uint64_t id, const rpc::DeviceChannelEvent& event) {
    Ref();
    {
      std::lock_guard<std::mutex> lock(mu_);
      id_ = id;
      if (!finished_ && !finish_pending_) {
        event_ = event;
        writing_ = true;
        started_ = true;
        StartWrite(&event_);
      }
    }
    Unref();
  }

  // Finishes the call (after a write in flight). Idempotent. With a
  // non-empty `reason` (the trainer is still there) a last event names it,
  // so the trainer's receive in progress fails at once.
  void Close(const grpc::Status& status, const std::string& reason = "") {
    Ref();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!finished_ && !finish_pending_) {
        if (writing_) {
          finish_pending_ = true;
          pending_status_ = status;
        } else if (!reason.empty() && started_ && !cancelled_) {
          event_.Clear();
          event_.set_channel(id_);
          event_.set_closed(reason);
          finish_pending_ = true;
          pending_status_ = status;
          writing_ = true;
          StartWrite(&event_);
        } else {
          finished_ = true;
          Finish(status);
        }
      }
    }
    Unref();
  }

  void OnWriteDone(bool ok) override {
    Ref();
    uint64_t id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      id = id_;
      writing_ = false;
      if (finish_pending_ && !finished_) {
        finished_ = true;
        Finish(pending_status_);
      }
    }
    if (!ok) daemon_->CloseDeviceChannel(id, "the channel's stream broke");
    Unref();
  }

  void OnCancel() override {
    Ref();
    uint64_t id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      id = id_;
      cancelled_ = true;
    }
    daemon_->CloseDeviceChannel(id, "the trainer closed the channel or disconnected");
    Close(grpc::Status(grpc::StatusCode::CANCELLED, "channel cancelled"));
    Unref();
  }

  void OnDone() override { Unref(); }

 private:
  Daemon::Impl* const daemon_;
  std::atomic<int> refs_{1};
  std::mutex mu_;
  uint64_t id_ = 0;
  rpc::DeviceChannelEvent event_;
  bool writing_ = false;
  bool started_ = false;  // the first event was written
  bool cancelled_ = false;
  bool finished_ = false;
  bool finish_pending_ = false;
  grpc::Status pending_status_;
};

grpc::ServerWriteReactor<rpc::DeviceChannelEvent>* Daemon::Impl::OpenDeviceChannel(
    grpc::CallbackServerContext* context, const rpc::OpenDeviceChannelRequest* request) {
  if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                       "/paramd.rpc.Daemon/OpenDeviceChannel");
      !s.ok()) {
    return auth::RefusedWriter<rpc::DeviceChannelEvent>(s);
  }
  auto* reactor = new DeviceChannelReactor(this);
  const std::string trainer =
      request->name().empty() ? request->trainer_address() : request->name();
  absl::StatusOr<std::shared_ptr<ChannelState>> opened =
      [&]() -> absl::StatusOr<std::shared_ptr<ChannelState>> {
    if (backend_ != DaemonBackend::kGpu) {
      return absl::FailedPreconditionError(
          "device fetch needs a daemon with --backend=gpu (this one runs the cpu backend); "
          "fetch over the host stream (Fetch) instead");
    }
    if (request->trainer_address().empty()) {
      return absl::InvalidArgumentError("OpenDeviceChannel without trainer_address");
    }
    const std::string secret = auth::RandomSecret();
    ASSIGN_OR_RETURN(std::unique_ptr<DeviceChannel> channel,
                     ::paramd::OpenDeviceChannel(options_.device_channel_listen,
                                                 options_.advertise_host, secret));
    auto c = std::make_shared<ChannelState>();
    c->trainer = trainer;
    c->secret = secret;
    c->channel = std::move(channel);
    c->reactor = reactor;
    reactor->Ref();  // the channel's reference
    absl::MutexLock lock(&mu_);
    if (shut_down_) {
      reactor->Unref();
      return absl::UnavailableError("daemon shutting down");
    }
    c->id = ++next_channel_;
    channels_[c->id] = c;
    return c;
  }();
  if (!opened.ok()) {
    reactor->Close(ToGrpcStatus(opened.status()));
    return reactor;
  }
  std::shared_ptr<ChannelState> c = *std::move(opened);
  rpc::DeviceChannelEvent event;
  event.set_channel(c->id);
  event.set_daemon_address(c->channel->address());
  event.set_device(c->channel->device());
  event.set_channel_secret(c->secret);
  ChannelState* raw = c.get();
  const std::string trainer_address = request->trainer_address();
  c->worker.Post([this, raw, trainer_address] {
    if (raw->closed) return;
    absl::Status s = raw->channel->Connect(trainer_address);
    if (!s.ok()) CloseDeviceChannel(raw->id, absl::StrCat("connect: ", s.ToString()));
  });
  Log(kTag, absl::StrCat("device channel ", c->id, " opened for ", trainer));
  reactor->Begin(c->id, event);
  return reactor;
}

void Daemon::Impl::CloseDeviceChannel(uint64_t id, const std::string& reason) {
  std::shared_ptr<ChannelState> c;
  {
    absl::MutexLock lock(&mu_);
    auto it = channels_.find(id);
    if (it == channels_.end()) return;
    c = it->second;
    channels_.erase(it);
  }
  c->closed = true;
  c->channel->Shutdown();
  Log(kTag, absl::StrCat("device channel ", id, " (", c->trainer, ") closed: ", reason));
  c->reactor->Close(
      grpc::Status(grpc::StatusCode::UNAVAILABLE, absl::StrCat("device channel closed: ", reason)),
      reason);
  c->reactor->Unref();
  c->reactor = nullptr;
  // The last reference may be dropped here on the channel's own worker:
  // destroy (join) it on the reaper. Moved, not copied: with a copy, the
  // reaper could run first and leave this frame the last reference, which
  // then joined the worker from itself ("Resource deadlock avoided"). After
  // Shutdown (reaper stopped), only Shutdown itself closes channels, never
  // on a channel's worker.
  reaper_.Post([c = std::move(c)] {});
}

std::optional<absl::Status> Daemon::Impl::StartDeviceFetch(
    const rpc::FetchDeviceRequest& request, absl::Time deadline, rpc::FetchDeviceResponse* response,
    const std::shared_ptr<DeviceFetchCall>& call) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("daemon shutting down");
  auto it = channels_.find(request.channel());
  if (it == channels_.end()) {
    return absl::NotFoundError(absl::StrCat("device channel ", request.channel(),
                                            " is unknown or closed; open a new one"));
  }
  RETURN_IF_ERROR(
      CheckDeviceChannelSecret(request.channel_secret(), it->second->secret, request.channel()));
  if (request.tensors().empty()) {
    return absl::InvalidArgumentError("FetchDevice without tensors");
  }
  if (request.tag() > kMaxUserTag) return absl::InvalidArgumentError("FetchDevice tag too large");
  const int64_t version = request.version();
  // The step producing `version` has enqueued its work: a trainer that
  // receives beside the call gets it tensor by tensor as it is quantized.
  const bool in_flight = call != nullptr && version >= 0 && version == in_flight_version_ &&
                         (!latest_ || version > latest_->version);
  if (!in_flight && (!latest_ || version > latest_->version)) {
    return std::nullopt;  // wait for a publish (or the step's enqueue)
  }
  int64_t resolved;
  if (in_flight) {
    resolved = version;
  } else if (version < 0 || version == latest_->version) {
    resolved = latest_->version;
  } else if (previous_ && version == previous_->version) {
    resolved = previous_->version;
  } else {
    return absl::NotFoundError(
        absl::StrCat("version ", version, " was dropped; this daemon holds versions ",
                     previous_ ? absl::StrCat(previous_->version, " and ") : "", latest_->version));
  }
  if (shards_ == nullptr || shards_->name() != "gpu") {
    return absl::FailedPreconditionError(absl::StrCat(
        "device fetch needs the gpu backend; this model runs on the ",
        shards_ ? std::string(shards_->name()) : "no", " backend (fetch over the host stream)"));
  }
  const ModelView& view = *view_;
  rpc::FetchPlan* plan = response->mutable_plan();
  plan->set_version(resolved);
  plan->set_daemon_rank(rank_);
  std::vector<DeviceFetchItem> items;
  int64_t bytes[2] = {0, 0};
  for (const rpc::TensorDirections& td : request.tensors()) {
    const int t = view.Find(td.tensor());
    if (t < 0) return UnknownTensorError(td.tensor());
    if (td.directions().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("FetchDevice of ", td.tensor(), " names no direction"));
    }
    const TensorDef& tensor = view.tensors[t];
    std::vector<Direction> dirs;
    for (int d : td.directions()) {
      absl::StatusOr<Direction> dir = DirectionFromProto(static_cast<rpc::Direction>(d));
      if (!dir.ok()) return dir.status();
      if (!(*dir == Direction::kRowwise ? tensor.spec.rowwise_usage
                                        : tensor.spec.columnwise_usage)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "tensor ", td.tensor(), " does not publish a ", DirectionName(*dir), " copy"));
      }
      dirs.push_back(*dir);
    }
    for (size_t s = 0; s < view.shards.size(); ++s) {
      const ShardDef& shard = view.shards[s];
      if (shard.tensor != t) continue;
      for (Direction dir : dirs) {
        const QuantSpec& spec =
            dir == Direction::kRowwise ? tensor.spec.rowwise : tensor.spec.columnwise;
        absl::StatusOr<Layout> layout = ComputeLayout(spec, dir, shard.rows(), tensor.cols);
        if (!layout.ok()) return layout.status();
        items.push_back({static_cast<int>(s), dir});
        rpc::FetchPiece* fp = plan->add_pieces();
        fp->set_tensor(tensor.name);
        fp->set_tensor_index(t);
        fp->set_direction(DirectionToProto(dir));
        fp->set_row_begin(shard.row_begin);
        fp->set_row_end(shard.row_end);
        fp->set_cols(tensor.cols);
        fp->set_format(FormatToProto(spec.format));
        *fp->mutable_layout() = LayoutToProto(*layout);
        fp->set_data_bytes(layout->data_bytes());
        fp->set_scale_bytes(layout->scale_bytes());
        bytes[dir == Direction::kRowwise ? 0 : 1] += layout->data_bytes() + layout->scale_bytes();
      }
    }
  }
  ChannelState* c = it->second.get();
  const int64_t generation = view.generation;
  const uint64_t tag = request.tag();
  c->worker.Post([this, c, resolved, generation, items = std::move(items), tag, deadline,
                  b0 = bytes[0], b1 = bytes[1], in_flight, call] {
    int64_t b[2] = {b0, b1};
    ServeDeviceFetch(c, resolved, generation, items, tag, deadline, b, in_flight, call);
  });
  return absl::OkStatus();
}

void Daemon::Impl::ServeDeviceFetch(ChannelState* c, int64_t version, int64_t generation,
                                    const std::vector<DeviceFetchItem>& items, uint64_t tag,
                                    absl::Time deadline, int64_t bytes[2], bool in_flight,
                                    const std::shared_ptr<DeviceFetchCall>& call) {
  absl::Status s;
  bool streamed = false;     // sent while its version was stepped
  bool beside_step = false;  // a held version sent while a step ran
  if (c->closed) {
    s = absl::UnavailableError("device channel closed before the send");
  } else {
    // Keeps a load from freeing the backend under the send.
    absl::ReaderMutexLock device_lock(&device_mu_);
    ShardBackend* backend = nullptr;
    {
      absl::MutexLock lock(&mu_);
      beside_step = stepping_;
      if (view_ != nullptr && view_->generation == generation) {
        // A running step rewrites overwriting_version_'s slot: refused even
        // though previous_ still names it until the step publishes.
        const bool held =
            (latest_ && latest_->version == version) ||
            (previous_ && previous_->version == version && version != overwriting_version_);
        streamed = !held && in_flight && in_flight_version_ == version;
        if (held || streamed) {
          backend = shards_.get();
          ++fetch_pins_[version];  // the step after next waits for it
        }
      }
    }
    if (backend == nullptr) {
      s = absl::NotFoundError(
          absl::StrCat("version ", version, " was dropped or reloaded before its send"));
      // Asked for while it was being stepped, sent only after the step
      // ended (e.g. behind the channel's connect), and never published.
      if (in_flight) s = AwaitStepOf(version, generation, /*sent=*/false, deadline);
    } else {
      s = c->channel->Send(*backend, version, items, tag, deadline, streamed);
      absl::MutexLock lock(&mu_);
      auto it = fetch_pins_.find(version);
      if (--it->second == 0) fetch_pins_.erase(it);
    }
    // The bytes left during the step: they are `version` only if it
    // publishes.
    if (s.ok() && streamed) s = AwaitStepOf(version, generation, /*sent=*/true, deadline);
  }
  if (call != nullptr) {
    {
      absl::MutexLock lock(&call->mu);
      call->result = s;
    }
    publish_waiters_.WakeAll();  // the call's poll answers with it
  }
  if (s.ok()) {
    traffic_.served[0].fetch_add(bytes[0]);
    traffic_.served[1].fetch_add(bytes[1]);
    if (streamed) {
      traffic_.device_fetches_streamed.fetch_add(1);
    } else if (beside_step) {
      traffic_.device_fetches_beside_step.fetch_add(1);
    }
    return;
  }
  LogWarning(kTag, absl::StrCat("device fetch of version ", version, " on channel ", c->id, " (",
                                c->trainer, ") failed: ", s.ToString()));
  CloseDeviceChannel(c->id, absl::StrCat("device fetch failed: ", s.ToString()));
}

absl::Status Daemon::Impl::AwaitStepOf(int64_t version, int64_t generation, bool sent,
                                       absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto settled = [this, version, generation]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return shut_down_ || view_ == nullptr || view_->generation != generation ||
           in_flight_version_ != version;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&settled), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("the step producing version ", version,
                                                    " did not finish before the deadline"));
  }
  if (shut_down_) return absl::UnavailableError("daemon shutting down");
  if (view_ == nullptr || view_->generation != generation) {
    return absl::AbortedError(
        absl::StrCat("the model was reloaded while version ", version, " was being stepped"));
  }
  if (latest_ && latest_->version >= version) {
    // Published: what was sent is that version. Not sent: it is held no
    // more (ServeDeviceFetch found it neither held nor in flight).
    return sent ? absl::OkStatus()
                : absl::NotFoundError(
                      absl::StrCat("version ", version, " was dropped before its send"));
  }
  return absl::AbortedError(
      absl::StrCat("the step producing version ", version, " failed (", last_step_error_.ToString(),
                   ")", sent ? ": the bytes sent are not a published version" : ""));
}

namespace {

// A device transfer's bound: the call's deadline, or `fallback` from now
// when the call has none.
absl::Time DeviceCallDeadline(const grpc::CallbackServerContext* context, absl::Duration fallback) {
  const auto grpc_deadline = context->deadline();
  if (grpc_deadline < std::chrono::system_clock::now() + std::chrono::hours(24 * 365)) {
    return absl::FromChrono(grpc_deadline);
  }
  return absl::Now() + fallback;
}

}  // namespace

grpc::ServerUnaryReactor* Daemon::Impl::FetchDevice(grpc::CallbackServerContext* context,
                                                    const rpc::FetchDeviceRequest* request,
                                                    rpc::FetchDeviceResponse* response) {
  if (grpc::Status s =
          auth::Authorize(options_.authenticator.get(), *context, "/paramd.rpc.Daemon/FetchDevice");
      !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  // The send is bounded by the call's deadline (no deadline: step_timeout).
  const absl::Time deadline = DeviceCallDeadline(context, options_.step_timeout);
  // reply_after_send: the answer waits for the send (and the publish of a
  // version streamed while stepped), reported through `call`.
  std::shared_ptr<DeviceFetchCall> call =
      request->reply_after_send() ? std::make_shared<DeviceFetchCall>() : nullptr;
  return StartWaitingUnary(&publish_waiters_,
                           [this, request, response, deadline, call,
                            queued = false]() mutable -> std::optional<grpc::Status> {
                             if (!queued) {
                               std::optional<absl::Status> s =
                                   StartDeviceFetch(*request, deadline, response, call);
                               if (!s.has_value()) return std::nullopt;
                               if (!s->ok() || call == nullptr) return ToGrpcStatus(*s);
                               queued = true;
                             }
                             absl::MutexLock lock(&call->mu);
                             if (!call->result.has_value()) return std::nullopt;
                             return ToGrpcStatus(*call->result);
                           });
}

// ---- Device push (PushGradientsDevice; daemon_push_test) ----

absl::Status Daemon::Impl::CheckDevicePush(const rpc::PushGradientsDeviceRequest& request,
                                           DevicePush* push,
                                           std::shared_ptr<ChannelState>* channel) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("daemon shutting down");
  // The host stream's rules first, with its codes.
  RETURN_IF_ERROR(CheckPushLocked(request.version(), request.pusher_id()));
  RETURN_IF_ERROR(CheckDevicePushAllowedLocked());
  if (request.tag() > kMaxUserTag) {
    return absl::InvalidArgumentError("PushGradientsDevice tag too large");
  }
  const ModelView& view = *view_;
  push->version = request.version();
  push->pusher = request.pusher_id();
  push->generation = view.generation;
  push->tag = request.tag();
  // As the host stream: SKIP_STEP takes NaN/Inf (the step then skips).
  push->accept_non_finite =
      view.optimizer.has_value() && view.optimizer->non_finite == NonFinitePolicy::kSkipStep;
  struct Rows {
    int tensor;
    int64_t begin, end;
  };
  std::vector<Rows> seen;
  for (const rpc::DevicePushTensor& dt : request.tensors()) {
    const int t = view.Find(dt.tensor());
    if (t < 0) return UnknownTensorError(dt.tensor());
    const TensorDef& def = view.tensors[t];
    if (dt.dtype() != rpc::DTYPE_FP32 && dt.dtype() != rpc::DTYPE_BF16) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", def.name, ": device push dtype must be DTYPE_FP32 or DTYPE_BF16"));
    }
    const bool bf16 = dt.dtype() == rpc::DTYPE_BF16;
    const int64_t b = dt.row_begin(), e = dt.row_end();
    if (b < 0 || e <= b || e > def.rows) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", def.name, ": rows [", b, ", ", e,
                                                     ") outside [0, ", def.rows, ")"));
    }
    const std::string where = absl::StrCat("tensor ", def.name, " rows [", b, ", ", e, ")");
    const int shard = view.FindShard(t, b, e);
    if (shard < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(where, " are not held by daemon rank ", view.rank,
                       " (wrong daemon or a row range spanning shards; re-read the manifest)"));
    }
    for (const Rows& r : seen) {
      if (r.tensor == t && r.begin < e && b < r.end) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, " overlap rows already in this push"));
      }
    }
    seen.push_back({t, b, e});
    DevicePushPiece piece;
    piece.shard = shard;
    piece.offset = (b - view.shards[shard].row_begin) * def.cols;
    piece.count = (e - b) * def.cols;
    piece.bf16 = bf16;
    push->pieces.push_back(piece);
    push->bytes += piece.count * (bf16 ? 2 : 4);
  }
  if (shards_ == nullptr || shards_->name() != "gpu") {
    return absl::FailedPreconditionError(
        absl::StrCat("device push needs a daemon with --backend=gpu (this model runs on the ",
                     shards_ ? std::string(shards_->name()) : "no",
                     " backend); push over the host stream (PushGradients) instead"));
  }
  channel->reset();
  if (push->pieces.empty()) return absl::OkStatus();
  auto it = channels_.find(request.channel());
  if (it == channels_.end()) {
    return absl::NotFoundError(absl::StrCat("device channel ", request.channel(),
                                            " is unknown or closed; open a new one"));
  }
  RETURN_IF_ERROR(
      CheckDeviceChannelSecret(request.channel_secret(), it->second->secret, request.channel()));
  *channel = it->second;
  return absl::OkStatus();
}

absl::Status Daemon::Impl::CommitDevicePush(ChannelState* c, const DevicePush& push,
                                            std::unique_ptr<StagedDevicePush> staged,
                                            rpc::PushGradientsResponse* response) {
  // A staged push reads the backend's device memory: keep a load from
  // freeing it (device_mu_ before mu_). Without pieces nothing is read.
  std::optional<absl::ReaderMutexLock> device_lock;
  if (staged != nullptr) device_lock.emplace(&device_mu_);
  absl::MutexLock lock(&mu_);
  // Checked again: another push of this pusher or a step may have
  // committed while the bytes travelled.
  absl::Status s = CheckPushLocked(push.version, push.pusher);
  if (s.ok() && (view_ == nullptr || view_->generation != push.generation)) {
    s = absl::FailedPreconditionError("the model was reloaded during the push");
  }
  if (s.ok() && staged != nullptr) s = c->channel->ApplyPush(*shards_, *staged, LastPushLocked());
  // Freed (stream-ordered after the adds) while the backend is alive.
  staged.reset();
  if (!s.ok()) return s;
  CountPushLocked(push.version, push.pusher, push.bytes, response);
  return absl::OkStatus();
}

void Daemon::Impl::ServeDevicePush(ChannelState* c, const DevicePush& push,
                                   rpc::PushGradientsResponse* response,
                                   grpc::ServerUnaryReactor* reactor) {
  absl::Status s;
  if (c->closed) {
    s = absl::UnavailableError("device channel closed before the push arrived; nothing applied");
  } else {
    absl::StatusOr<std::unique_ptr<StagedDevicePush>> staged =
        c->channel->ReceivePush(push.pieces, push.tag, push.deadline, push.accept_non_finite);
    if (staged.ok()) {
      s = CommitDevicePush(c, push, *std::move(staged), response);
    } else {
      s = absl::Status(staged.status().code(),
                       absl::StrCat("device push of version ", push.version, " by ", push.pusher,
                                    " failed, nothing applied: ", staged.status().message()));
      LogWarning(kTag, absl::StrCat(s.message(), " on channel ", c->id, " (", c->trainer, ")"));
      // A transfer failure may leave the channel's NCCL world broken: the
      // trainer opens a new one. INVALID_ARGUMENT (non-finite values) came
      // after the whole message: the channel is fine.
      if (!absl::IsInvalidArgument(staged.status())) {
        CloseDeviceChannel(c->id, absl::StrCat("device push failed: ", s.ToString()));
      }
    }
  }
  reactor->Finish(ToGrpcStatus(s));
}

grpc::ServerUnaryReactor* Daemon::Impl::PushGradientsDevice(
    grpc::CallbackServerContext* context, const rpc::PushGradientsDeviceRequest* request,
    rpc::PushGradientsResponse* response) {
  if (grpc::Status s = auth::Authorize(options_.authenticator.get(), *context,
                                       "/paramd.rpc.Daemon/PushGradientsDevice");
      !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  DevicePush push;
  push.deadline = DeviceCallDeadline(context, options_.step_timeout);
  std::shared_ptr<ChannelState> c;
  absl::Status s = CheckDevicePush(*request, &push, &c);
  if (s.ok() && c == nullptr) s = CommitDevicePush(nullptr, push, nullptr, response);
  if (!s.ok() || c == nullptr) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  ChannelState* raw = c.get();
  raw->worker.Post([this, raw, push = std::move(push), response, reactor] {
    ServeDevicePush(raw, push, response, reactor);
  });
  return reactor;
}

}  // namespace paramd
