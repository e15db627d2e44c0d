// File: server/daemon/daemon_fetch.cc
//
// The daemon's Fetch (server/daemon/daemon.h): which published (or, as_ready,
// in-flight) version a fetch reads, the per-client limit on parked fetches,
// and the streaming FetchReactor (plan, then chunks).

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

namespace {

constexpr int64_t kMaxChunkBytes = int64_t{4} << 20;

}  // namespace

absl::StatusOr<Daemon::Impl::FetchTarget> Daemon::Impl::ResolveFetch(int64_t version) {
  absl::MutexLock lock(&mu_);
  FetchTarget t;
  if (shut_down_) return absl::UnavailableError("daemon shutting down");
  RETURN_IF_ERROR(CheckNotReplacedLocked());
  if (!latest_ || version > latest_->version) return t;  // wait
  t.view = view_;
  t.rank = rank_;
  if (shards_) t.host_bytes = shards_->host_bytes();
  if (version < 0 || version == latest_->version) {
    t.version = latest_;
  } else if (previous_ && version == previous_->version) {
    t.version = previous_;
  } else {
    return absl::NotFoundError(
        absl::StrCat("version ", version, " was dropped; this daemon holds versions ",
                     previous_ ? absl::StrCat(previous_->version, " and ") : "", latest_->version));
  }
  return t;
}

Daemon::Impl::ReadyPart Daemon::Impl::InFlightPart(int64_t version) {
  absl::MutexLock lock(&mu_);
  ReadyPart part;
  if (in_flight_host_.out == nullptr || in_flight_host_.out->version != version) return part;
  part.version = in_flight_host_.out;
  part.ready_tensor_end = in_flight_host_.ready_tensor_end;
  part.ready_pieces = in_flight_host_.ready_pieces;
  part.view = view_;
  part.rank = rank_;
  return part;
}

std::optional<absl::Status> Daemon::Impl::OutcomeOf(const PublishedVersion* v) {
  absl::MutexLock lock(&mu_);
  if (latest_.get() == v || previous_.get() == v) return absl::OkStatus();
  if (in_flight_host_.out.get() == v) return std::nullopt;
  return absl::AbortedError(absl::StrCat(
      "the step producing version ", v->version,
      " did not publish the bytes sent (they are not a published version; fetch again): ",
      failed_step_from_ == v->version - 1 && !last_step_error_.ok()
          ? last_step_error_.ToString()
          : "the pipelined step was started again"));
}

// ---- Fetch: plan, then chunks; waits for unpublished versions ----
//
// The published version is held by shared_ptr: a step publishing newer
// versions never changes the bytes being streamed.
class FetchReactor : public WaitingWriter<rpc::FetchResponse> {
 public:
  FetchReactor(Daemon::Impl* daemon, const rpc::FetchRequest& request, std::string client)
      : WaitingWriter(daemon->publish_waiters()),
        daemon_(daemon),
        request_(request),
        client_(std::move(client)) {}
  ~FetchReactor() override {
    if (parked_) daemon_->parked()->Unpark(client_, request_.as_ready());
  }

 private:
  struct Segment {
    int piece;
    rpc::BufferKind kind;
    const std::vector<uint8_t>* bytes;
    Direction direction;
  };

  void PumpLocked() override {
    if (started_) {
      if (awaiting_outcome_) {
        PollOutcomeLocked();
        return;
      }
      WriteNextLocked();
      return;
    }
    if (absl::Status s = CheckFetchRequest(request_, daemon_->limits()); !s.ok()) {
      started_ = true;
      FinishLocked(ToGrpcStatus(s));
      return;
    }
    // Registers before resolving so that a publish in between still wakes us.
    RegisterLocked();
    absl::StatusOr<Daemon::Impl::FetchTarget> target = daemon_->ResolveFetch(request_.version());
    if (target.ok() && target->version == nullptr) {  // wait for a publish
      if (request_.as_ready() && StartInFlightLocked()) return;
      if (!parked_ && !daemon_->parked()->Park(client_, request_.as_ready())) {
        UnregisterLocked();
        started_ = true;
        FinishLocked(ToGrpcStatus(absl::ResourceExhaustedError(
            absl::StrCat("too many fetches of unpublished versions waiting from ", client_,
                         " (--max_parked_fetches_per_client)"))));
        return;
      }
      parked_ = true;
      return;
    }
    UnregisterLocked();
    if (parked_) {
      daemon_->parked()->Unpark(client_, request_.as_ready());
      parked_ = false;
    }
    started_ = true;
    absl::Status s = target.ok() ? BuildPlan(*target) : target.status();
    if (!s.ok()) {
      FinishLocked(ToGrpcStatus(s));
      return;
    }
    WriteNextLocked();
  }

  void OnWrittenLocked() override {
    if (last_chunk_bytes_ > 0) daemon_->traffic()->AddServed(last_direction_, last_chunk_bytes_);
  }

  // FetchRequest.as_ready of a version a pipelined step is filling: once the
  // requested tensors are ready, streams them at once and answers when the
  // step ended (OutcomeOf). False: not (yet) possible, wait.
  bool StartInFlightLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Daemon::Impl::ReadyPart part = daemon_->InFlightPart(request_.version());
    if (part.version == nullptr) return false;
    bool ready = request_.tensors_size() > 0 ||
                 part.ready_tensor_end == static_cast<int>(part.view->tensors.size());
    for (const rpc::TensorDirections& td : request_.tensors()) {
      ready &= part.view->Find(td.tensor()) < part.ready_tensor_end;  // unknown: BuildPlan says
    }
    if (!ready) return false;
    UnregisterLocked();
    if (parked_) {
      daemon_->parked()->Unpark(client_, request_.as_ready());
      parked_ = false;
    }
    started_ = true;
    in_flight_ = true;
    piece_limit_ = part.ready_pieces;
    Daemon::Impl::FetchTarget target;
    target.version = part.version;
    target.view = part.view;
    target.rank = part.rank;
    absl::Status s = BuildPlan(target);
    if (!s.ok()) {
      FinishLocked(ToGrpcStatus(s));
      return true;
    }
    WriteNextLocked();
    return true;
  }

  void PollOutcomeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    RegisterLocked();  // before asking: a step ending in between still wakes us
    std::optional<absl::Status> outcome = daemon_->OutcomeOf(version_.get());
    if (!outcome.has_value()) return;
    UnregisterLocked();
    FinishLocked(ToGrpcStatus(*outcome));
  }

  absl::Status BuildPlan(const Daemon::Impl::FetchTarget& target)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (target.host_bytes) {
      ASSIGN_OR_RETURN(version_, target.host_bytes(target.version));
    } else {
      version_ = target.version;
    }
    const ModelView& view = *target.view;
    chunk_bytes_ = request_.max_chunk_bytes() > 0 ? request_.max_chunk_bytes()
                                                  : daemon_->default_chunk_bytes();
    chunk_bytes_ = std::min(chunk_bytes_, kMaxChunkBytes);
    // Selected (tensor, direction) pairs; empty = all.
    std::vector<std::pair<int, std::vector<Direction>>> wanted;
    for (const rpc::TensorDirections& td : request_.tensors()) {
      const int t = view.Find(td.tensor());
      if (t < 0) return UnknownTensorError(td.tensor());
      std::vector<Direction> dirs;
      for (int d : td.directions()) {
        ASSIGN_OR_RETURN(Direction dir, DirectionFromProto(static_cast<rpc::Direction>(d)));
        const HybridSpec& spec = view.tensors[t].spec;
        if (!(dir == Direction::kRowwise ? spec.rowwise_usage : spec.columnwise_usage)) {
          return absl::FailedPreconditionError(absl::StrCat(
              "tensor ", td.tensor(), " does not publish a ", DirectionName(dir), " copy"));
        }
        dirs.push_back(dir);
      }
      wanted.emplace_back(t, std::move(dirs));
    }
    rpc::FetchPlan* plan = plan_message_.mutable_plan();
    plan->set_version(version_->version);
    plan->set_daemon_rank(target.rank);
    auto add = [&](const PublishedPiece& p) {
      const int index = plan->pieces_size();
      rpc::FetchPiece* fp = plan->add_pieces();
      fp->set_tensor(view.tensors[p.tensor].name);
      fp->set_tensor_index(p.tensor);
      fp->set_direction(DirectionToProto(p.direction));
      fp->set_row_begin(p.row_begin);
      fp->set_row_end(p.row_end);
      fp->set_cols(view.tensors[p.tensor].cols);
      fp->set_format(FormatToProto(p.q.format));
      *fp->mutable_layout() = LayoutToProto(p.layout);
      fp->set_data_bytes(p.q.data.size());
      fp->set_scale_bytes(p.q.scales.size());
      fp->set_scale_inv(p.q.scale_inv);
      fp->set_amax(p.q.amax);
      if (!request_.plan_only()) {
        segments_.push_back({index, rpc::BUFFER_DATA, &p.q.data, p.direction});
        segments_.push_back({index, rpc::BUFFER_SCALES, &p.q.scales, p.direction});
      }
    };
    // An in-flight version: only its ready pieces.
    const absl::Span<const PublishedPiece> pieces =
        absl::MakeConstSpan(version_->pieces)
            .subspan(0, piece_limit_ >= 0 ? piece_limit_ : version_->pieces.size());
    if (wanted.empty()) {
      for (const PublishedPiece& p : pieces) add(p);
    } else {
      for (const auto& [t, dirs] : wanted) {
        for (const PublishedPiece& p : pieces) {
          if (p.tensor != t) continue;
          if (!dirs.empty() && std::find(dirs.begin(), dirs.end(), p.direction) == dirs.end()) {
            continue;
          }
          add(p);
        }
      }
    }
    plan_pending_ = true;
    return absl::OkStatus();
  }

  void WriteNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    last_chunk_bytes_ = 0;
    if (plan_pending_) {
      plan_pending_ = false;
      WriteLocked(&plan_message_);
      return;
    }
    while (segment_ < segments_.size() &&
           offset_ >= static_cast<int64_t>(segments_[segment_].bytes->size())) {
      ++segment_;
      offset_ = 0;
    }
    if (segment_ >= segments_.size()) {
      if (in_flight_) {
        awaiting_outcome_ = true;
        PollOutcomeLocked();
        return;
      }
      FinishLocked(grpc::Status::OK);
      return;
    }
    const Segment& seg = segments_[segment_];
    const int64_t n =
        std::min<int64_t>(chunk_bytes_, static_cast<int64_t>(seg.bytes->size()) - offset_);
    rpc::FetchChunk* chunk = chunk_message_.mutable_chunk();
    chunk->set_piece(seg.piece);
    chunk->set_buffer(seg.kind);
    chunk->set_offset(offset_);
    chunk->set_data(reinterpret_cast<const char*>(seg.bytes->data()) + offset_, n);
    offset_ += n;
    last_chunk_bytes_ = n;
    last_direction_ = seg.direction;
    WriteLocked(&chunk_message_);
  }

  Daemon::Impl* const daemon_;
  const rpc::FetchRequest request_;
  const std::string client_;                  // the client's host, for the parked-fetch limit
  bool parked_ ABSL_GUARDED_BY(mu_) = false;  // counted in Daemon::Impl::parked()
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  std::shared_ptr<const PublishedVersion> version_ ABSL_GUARDED_BY(mu_);
  rpc::FetchResponse plan_message_ ABSL_GUARDED_BY(mu_);
  rpc::FetchResponse chunk_message_ ABSL_GUARDED_BY(mu_);
  bool plan_pending_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Segment> segments_ ABSL_GUARDED_BY(mu_);
  size_t segment_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t offset_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t chunk_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_chunk_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  Direction last_direction_ ABSL_GUARDED_BY(mu_) = Direction::kRowwise;
  // as_ready of an in-flight version: pieces of version_ beyond piece_limit_
  // are not final (-1: all are); after the bytes, the answer waits for the
  // step's outcome.
  bool in_flight_ ABSL_GUARDED_BY(mu_) = false;
  int64_t piece_limit_ ABSL_GUARDED_BY(mu_) = -1;
  bool awaiting_outcome_ ABSL_GUARDED_BY(mu_) = false;
};

// "ipv4:127.0.0.1:5000" -> "ipv4:127.0.0.1": limits are per client host.
std::string ClientHost(const std::string& peer) {
  const size_t colon = peer.rfind(':');
  return colon == std::string::npos || colon < 5 ? peer : peer.substr(0, colon);
}

grpc::ServerWriteReactor<rpc::FetchResponse>* Daemon::Impl::Fetch(
    grpc::CallbackServerContext* context, const rpc::FetchRequest* request) {
  if (grpc::Status s =
          auth::Authorize(options_.authenticator.get(), *context, "/paramd.rpc.Daemon/Fetch");
      !s.ok()) {
    return auth::RefusedWriter<rpc::FetchResponse>(s);
  }
  auto* reactor = new FetchReactor(this, *request, ClientHost(context->peer()));
  reactor->Begin();
  return reactor;
}

}  // namespace paramd
