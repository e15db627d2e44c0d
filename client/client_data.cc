// client::Client's data streams: Fetch (one stream per daemon holding
// pieces of the targets, assembled in place) and PushGradients (one stream
// per daemon, committed by its end marker), each daemon on its own thread.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/client_internal.h"
#include "client/fetch_stream.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "format/convert.h"
#include "grpcpp/grpcpp.h"
#include "proto/paramd.grpc.pb.h"
#include "sharding/assemble.h"

namespace paramd {
namespace client {
namespace internal {

// Cancels every registered call once one of them fails, so that a dead
// daemon ends a multi-daemon call at once instead of at the deadline.
class CallGroup {
 public:
  void Register(grpc::ClientContext* context) {
    absl::MutexLock lock(&mu_);
    contexts_.push_back(context);
    if (failed_) context->TryCancel();
  }
  void Unregister(grpc::ClientContext* context) {
    absl::MutexLock lock(&mu_);
    contexts_.erase(std::find(contexts_.begin(), contexts_.end(), context));
  }
  void Fail() {
    absl::MutexLock lock(&mu_);
    failed_ = true;
    for (grpc::ClientContext* c : contexts_) c->TryCancel();
  }
  bool failed() const {
    absl::MutexLock lock(&mu_);
    return failed_;
  }

 private:
  mutable absl::Mutex mu_;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<grpc::ClientContext*> contexts_ ABSL_GUARDED_BY(mu_);
};

// The context of one call in a CallGroup, registered for its lifetime.
class GroupCall {
 public:
  GroupCall(CallGroup& group, absl::Time deadline) : group_(group) {
    context_.set_deadline(ToChrono(deadline));
    group_.Register(&context_);
  }
  ~GroupCall() { group_.Unregister(&context_); }
  grpc::ClientContext& context() { return context_; }

 private:
  CallGroup& group_;
  grpc::ClientContext context_;
};

// Runs fn(i) for i in [0, n) on n threads (the last on the caller's) and
// returns the statuses. The first error, in index order, is what callers
// report; errors caused by cancelling the group are CANCELLED and lose to
// the error that caused them.
std::vector<absl::Status> RunParallel(int n, const std::function<absl::Status(int)>& fn) {
  std::vector<absl::Status> statuses(n);
  std::vector<std::thread> threads;
  for (int i = 0; i + 1 < n; ++i) threads.emplace_back([&, i] { statuses[i] = fn(i); });
  if (n > 0) statuses[n - 1] = fn(n - 1);
  for (std::thread& t : threads) t.join();
  return statuses;
}

absl::Status FirstError(const std::vector<absl::Status>& statuses) {
  for (const absl::Status& s : statuses) {
    if (!s.ok() && s.code() != absl::StatusCode::kCancelled) return s;
  }
  for (const absl::Status& s : statuses) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace internal

namespace {

constexpr int64_t kPushChunkBytes = int64_t{1} << 20;

using internal::CallGroup;
using internal::FirstError;
using internal::GroupCall;
using internal::RunParallel;

}  // namespace

absl::StatusOr<FetchResult> Client::Impl::Fetch(
    int64_t version, const std::vector<FetchTarget>& targets, absl::Time deadline, bool as_ready,
    const std::function<void(FetchResult&)>& on_bytes_in) {
  if (version == kLatest) {
    ASSIGN_OR_RETURN(version, WaitForVersion(0, deadline));
  }
  if (version < 0) return absl::InvalidArgumentError(absl::StrCat("bad version ", version));
  Manifest manifest = this->manifest();
  bool refreshed = false;
  FetchResult result;
  result.version = version;
  result.tensors.resize(targets.size());
  std::vector<Resolved> resolved(targets.size());
  std::map<std::pair<std::string, Direction>, int> index;
  for (size_t i = 0; i < targets.size(); ++i) {
    const FetchTarget& target = targets[i];
    const TensorMeta* meta = manifest.Find(target.tensor);
    if (meta == nullptr && !refreshed) {
      ASSIGN_OR_RETURN(manifest, RefreshManifest(deadline));
      refreshed = true;
      meta = manifest.Find(target.tensor);
    }
    if (meta == nullptr) {
      return absl::NotFoundError(absl::StrCat("no tensor '", target.tensor, "' in the manifest"));
    }
    if (!index.emplace(std::make_pair(target.tensor, target.direction), i).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "target ", target.tensor, " ", DirectionName(target.direction), " given twice"));
    }
    if (!meta->Publishes(target.direction)) {
      return absl::FailedPreconditionError(absl::StrCat("tensor '", target.tensor,
                                                        "' does not publish a ",
                                                        DirectionName(target.direction), " copy"));
    }
    Resolved& r = resolved[i];
    r.meta = meta;
    r.direction = target.direction;
    r.spec = meta->SpecOf(target.direction);
    ASSIGN_OR_RETURN(r.layout, ComputeLayout(r.spec, r.direction, meta->rows, meta->cols));
    FetchedTensor& out = result.tensors[i];
    out.tensor = target.tensor;
    out.spec = r.spec;
    out.layout = r.layout;
    if (!target.data.empty() || !target.scales.empty()) {
      if (static_cast<int64_t>(target.data.size()) < r.layout.data_bytes() ||
          static_cast<int64_t>(target.scales.size()) < r.layout.scale_bytes()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "buffers for ", target.tensor, " ", DirectionName(target.direction), " hold ",
            target.data.size(), "+", target.scales.size(), " bytes; the layout needs ",
            r.layout.data_bytes(), "+", r.layout.scale_bytes()));
      }
      r.data = target.data.subspan(0, r.layout.data_bytes());
      r.scales = target.scales.subspan(0, r.layout.scale_bytes());
    } else {
      out.value.data.resize(r.layout.data_bytes());
      out.value.scales.resize(r.layout.scale_bytes());
      r.data = absl::MakeSpan(out.value.data);
      r.scales = absl::MakeSpan(out.value.scales);
    }
    std::fill(r.scales.begin(), r.scales.end(), 0);  // padding is 0 (D8)
  }

  // One request per daemon holding pieces of the targets.
  std::map<std::string, rpc::FetchRequest> requests;
  for (const Resolved& r : resolved) {
    for (const PieceLocation& p : r.meta->pieces) {
      rpc::FetchRequest& request = requests[p.daemon_address];
      request.set_version(version);
      request.set_max_chunk_bytes(options_.max_chunk_bytes);
      request.set_as_ready(as_ready);
      rpc::TensorDirections* td = nullptr;
      for (auto& existing : *request.mutable_tensors()) {
        if (existing.tensor() == r.meta->name) td = &existing;
      }
      if (td == nullptr) {
        td = request.add_tensors();
        td->set_tensor(r.meta->name);
      }
      const rpc::Direction d = DirectionToProto(r.direction);
      if (std::find(td->directions().begin(), td->directions().end(), d) ==
          td->directions().end()) {
        td->add_directions(d);
      }
    }
  }
  std::vector<std::pair<std::string, rpc::FetchRequest>> per_daemon(requests.begin(),
                                                                    requests.end());
  absl::Mutex result_mu;
  CallGroup group;
  // Every target's values once all daemons' pieces are placed.
  auto finish = [&]() -> absl::Status {
    for (size_t i = 0; i < resolved.size(); ++i) {
      const Resolved& r = resolved[i];
      if (r.rows_covered != r.meta->rows) {
        // The daemons cut the tensor differently from our manifest: the plan
        // changed under us. Re-read it; the caller retries.
        (void)RefreshManifest(deadline);
        return absl::AbortedError(absl::StrCat("fetch of ", r.meta->name, " covered ",
                                               r.rows_covered, " of ", r.meta->rows,
                                               " rows: the shard plan changed; retry"));
      }
      QuantizedTensor& v = result.tensors[i].value;
      v.format = r.spec.format;
      v.direction = r.direction;
      v.rows = r.meta->rows;
      v.cols = r.meta->cols;
      v.scale_inv = r.scale_inv;
      v.amax = r.amax;
      const int64_t elements = r.meta->rows * r.meta->cols;
      result.stats.fp32_equivalent[r.direction] += elements * 4;
      result.stats.bf16_equivalent[r.direction] += elements * 2;
    }
    return absl::OkStatus();
  };
  // as_ready: the daemon holds its stream open until the step ends; the
  // last daemon whose bytes are in finishes the result and hands it out.
  std::atomic<size_t> bytes_in{0};
  bool finished = false;
  std::function<absl::Status()> daemon_bytes_in;
  if (on_bytes_in) {
    daemon_bytes_in = [&]() -> absl::Status {
      if (bytes_in.fetch_add(1) + 1 != per_daemon.size()) return absl::OkStatus();
      RETURN_IF_ERROR(finish());
      finished = true;
      on_bytes_in(result);
      return absl::OkStatus();
    };
  }
  const std::vector<absl::Status> statuses = RunParallel(per_daemon.size(), [&](int i) {
    absl::Status s =
        FetchFromDaemon(version, per_daemon[i].first, per_daemon[i].second, index, resolved,
                        result_mu, result.stats, group, deadline, daemon_bytes_in);
    if (!s.ok()) group.Fail();
    return s;
  });
  RETURN_IF_ERROR(FirstError(statuses));
  if (!finished) RETURN_IF_ERROR(finish());
  result.stats.fetches = 1;
  absl::MutexLock lock(&mu_);
  totals_ += result.stats;
  return result;
}

absl::Status Client::Impl::FetchFromDaemon(int64_t version, const std::string& address,
                                           const rpc::FetchRequest& request,
                                           std::map<std::pair<std::string, Direction>, int>& index,
                                           std::vector<Resolved>& resolved, absl::Mutex& result_mu,
                                           FetchStats& stats, CallGroup& group, absl::Time deadline,
                                           const std::function<absl::Status()>& on_bytes_in) {
  const std::string where = absl::StrCat("fetch of version ", version, " from ", address);
  std::shared_ptr<const internal::FetchMethod> method = DaemonFetchMethod(address);
  GroupCall call(group, deadline);
  grpc::ClientContext& context = call.context();
  // Chunk payloads go from gRPC's buffers straight to their destination
  // (client/fetch_stream.h says why).
  internal::FetchStreamReader reader(*method, &context, request);

  absl::StatusOr<bool> next = reader.Next();
  if (!next.ok()) {
    context.TryCancel();
    return absl::InternalError(absl::StrCat(where, ": ", next.status().message()));
  }
  if (!*next || reader.is_chunk() || !reader.message().has_plan()) {
    absl::Status s = FromGrpcStatus(reader.Finish(), where);
    if (s.ok()) return absl::InternalError(absl::StrCat(where, ": stream without a plan"));
    if (absl::IsDeadlineExceeded(s)) {
      // A daemon answers with the plan at once for a version it holds and
      // parks the fetch of a newer one until it is published.
      return absl::DeadlineExceededError(
          absl::StrCat(where, ": no answer before the deadline (version ", version,
                       " not published by then, or the daemon is stalled)"));
    }
    return s;
  }
  const rpc::FetchPlan plan = reader.message().plan();
  if (plan.version() != version) {
    return absl::InternalError(
        absl::StrCat(where, ": the daemon answered with version ", plan.version()));
  }
  // Per plan piece: where its bytes go. A piece that is the whole tensor is
  // received straight into the destination; others into a staging buffer,
  // placed with sharding::CopyPieceIn when complete.
  struct Incoming {
    int target = 0;
    sharding::PiecePlacement placement;
    bool direct = false;
    std::vector<uint8_t> data, scales;  // staging (!direct)
    absl::Span<uint8_t> data_dst, scales_dst;
    int64_t data_received = 0, scales_received = 0;
  };
  std::vector<Incoming> pieces(plan.pieces_size());
  for (int p = 0; p < plan.pieces_size(); ++p) {
    const rpc::FetchPiece& fp = plan.pieces(p);
    ASSIGN_OR_RETURN(Direction direction, DirectionFromProto(fp.direction()));
    auto it = index.find({fp.tensor(), direction});
    if (it == index.end()) {
      return absl::InternalError(
          absl::StrCat(where, ": unrequested piece ", fp.tensor(), " ", DirectionName(direction)));
    }
    Incoming& in = pieces[p];
    in.target = it->second;
    const Resolved& r = resolved[in.target];
    auto placement = sharding::PlacePiece(r.spec, direction, r.meta->rows, r.meta->cols,
                                          fp.row_begin(), fp.row_end());
    if (!placement.ok()) {
      return absl::InternalError(
          absl::StrCat(where, ": bad piece: ", placement.status().message()));
    }
    in.placement = *placement;
    if (fp.data_bytes() != in.placement.piece.data_bytes() ||
        fp.scale_bytes() != in.placement.piece.scale_bytes()) {
      return absl::InternalError(absl::StrCat(where, ": piece ", fp.tensor(), " rows [",
                                              fp.row_begin(), ", ", fp.row_end(),
                                              ") has sizes that do not match its layout"));
    }
    in.direct = fp.row_begin() == 0 && fp.row_end() == r.meta->rows;
    if (in.direct) {
      in.data_dst = r.data;
      in.scales_dst = r.scales;
    } else {
      in.data.resize(fp.data_bytes());
      in.scales.resize(fp.scale_bytes());
      in.data_dst = absl::MakeSpan(in.data);
      in.scales_dst = absl::MakeSpan(in.scales);
    }
  }

  DirectionBytes received;
  // Pieces placed into the targets (once every byte is in).
  bool placed = false;
  auto place = [&]() -> absl::Status {
    absl::MutexLock lock(&result_mu);
    for (int p = 0; p < plan.pieces_size(); ++p) {
      const rpc::FetchPiece& fp = plan.pieces(p);
      Incoming& in = pieces[p];
      Resolved& r = resolved[in.target];
      if (in.data_received != fp.data_bytes() || in.scales_received != fp.scale_bytes()) {
        return absl::DataLossError(absl::StrCat(where, ": piece ", fp.tensor(), " rows [",
                                                fp.row_begin(), ", ", fp.row_end(),
                                                ") arrived incomplete"));
      }
      if (!in.direct) {
        RETURN_IF_ERROR(sharding::CopyPieceIn(in.placement, in.data, in.scales, r.data, r.scales));
      }
      if (r.have_scale && fp.scale_inv() != r.scale_inv) {
        return absl::InternalError(
            absl::StrCat(where, ": pieces of ", fp.tensor(), " disagree on scale_inv"));
      }
      r.have_scale = true;
      r.scale_inv = fp.scale_inv();
      r.amax = std::max(r.amax, fp.amax());
      r.rows_covered += fp.row_end() - fp.row_begin();
    }
    stats.received.rowwise += received.rowwise;
    stats.received.columnwise += received.columnwise;
    stats.pieces += plan.pieces_size();
    placed = true;
    return absl::OkStatus();
  };
  int64_t bytes_expected = 0;
  int64_t bytes_got = 0;
  for (const rpc::FetchPiece& fp : plan.pieces()) {
    bytes_expected += fp.data_bytes() + fp.scale_bytes();
  }
  // as_ready: place and report as soon as the bytes are in (the stream
  // itself ends with the step).
  auto maybe_early = [&]() -> absl::Status {
    if (!on_bytes_in || placed || bytes_got != bytes_expected) return absl::OkStatus();
    RETURN_IF_ERROR(place());
    return on_bytes_in();
  };
  if (absl::Status s = maybe_early(); !s.ok()) {
    context.TryCancel();
    return s;
  }
  while (true) {
    next = reader.Next();
    if (!next.ok()) {
      context.TryCancel();
      return absl::InternalError(absl::StrCat(where, ": ", next.status().message()));
    }
    if (!*next) break;
    if (!reader.is_chunk()) {
      context.TryCancel();
      return absl::InternalError(absl::StrCat(where, ": a second plan in the stream"));
    }
    const internal::ChunkHeader& chunk = reader.chunk();
    if (chunk.piece < 0 || chunk.piece >= static_cast<int>(pieces.size())) {
      context.TryCancel();
      return absl::InternalError(absl::StrCat(where, ": chunk of unknown piece ", chunk.piece));
    }
    Incoming& in = pieces[chunk.piece];
    const bool is_data = chunk.buffer == rpc::BUFFER_DATA;
    absl::Span<uint8_t> dst = is_data ? in.data_dst : in.scales_dst;
    int64_t& got = is_data ? in.data_received : in.scales_received;
    const int64_t size = chunk.size;
    if (chunk.offset != got || chunk.offset + size > static_cast<int64_t>(dst.size())) {
      context.TryCancel();
      return absl::InternalError(absl::StrCat(where, ": chunk at offset ", chunk.offset, " of ",
                                              size, " bytes does not fit"));
    }
    reader.CopyChunkData(dst.data() + chunk.offset);
    got += size;
    received[resolved[in.target].direction] += size;
    bytes_got += size;
    if (absl::Status s = maybe_early(); !s.ok()) {
      context.TryCancel();
      return s;
    }
  }
  RETURN_IF_ERROR(FromGrpcStatus(reader.Finish(), where));
  if (placed) return absl::OkStatus();
  return place();
}

absl::Status Client::FetchAsReady(int64_t version, const std::vector<FetchTarget>& targets,
                                  const std::function<void(int, const FetchedTensor&)>& on_ready,
                                  absl::Duration timeout) {
  const absl::Time deadline = impl_->DeadlineFor(timeout);
  absl::Mutex callback_mu;
  const std::vector<absl::Status> statuses =
      RunParallel(static_cast<int>(targets.size()), [&](int i) -> absl::Status {
        return impl_
            ->Fetch(version, {targets[i]}, deadline, /*as_ready=*/true,
                    [&, i](FetchResult& r) {
                      absl::MutexLock lock(&callback_mu);
                      on_ready(i, r.tensors[0]);
                    })
            .status();
      });
  return FirstError(statuses);
}

absl::StatusOr<PushResult> Client::Impl::PushGradients(int64_t version,
                                                       absl::Span<const Gradient> gradients,
                                                       absl::Time deadline, PushCoverage coverage) {
  const Manifest manifest = this->manifest();
  RETURN_IF_ERROR(CheckPushGradients(manifest, gradients, coverage));
  PushResult result;
  result.version = version;
  result.pushers_received = -1;
  absl::Mutex result_mu;
  CallGroup group;
  const std::vector<absl::Status> statuses = RunParallel(manifest.num_daemons, [&](int rank) {
    absl::Status s =
        PushToDaemon(version, manifest, rank, gradients, result, result_mu, group, deadline);
    if (!s.ok()) group.Fail();
    return s;
  });
  RETURN_IF_ERROR(FirstError(statuses));
  return result;
}

absl::Status Client::Impl::PushToDaemon(int64_t version, const Manifest& manifest, int rank,
                                        absl::Span<const Gradient> gradients, PushResult& result,
                                        absl::Mutex& result_mu, CallGroup& group,
                                        absl::Time deadline) {
  const std::string& address = manifest.daemon_addresses[rank];
  const std::string where = absl::StrCat("push of version ", version, " to ", address);
  std::shared_ptr<rpc::Daemon::Stub> stub = DaemonStub(address);
  GroupCall call(group, deadline);
  grpc::ClientContext& context = call.context();
  rpc::PushGradientsResponse response;
  std::unique_ptr<grpc::ClientWriter<rpc::PushGradientsRequest>> writer =
      stub->PushGradients(&context, &response);
  rpc::PushGradientsRequest message;
  message.set_version(version);
  message.set_pusher_id(member_id_);
  bool first = true;
  int64_t sent = 0;
  bool stream_ok = true;
  for (const PushRoute& p : PushRoutesTo(manifest, rank, gradients)) {
    if (!stream_ok) break;
    const Gradient& g = gradients[p.gradient];
    const uint8_t* base = g.bytes.data() + p.byte_offset;
    for (int64_t offset = 0; offset < p.bytes && stream_ok; offset += kPushChunkBytes) {
      const int64_t n = std::min(kPushChunkBytes, p.bytes - offset);
      if (!first) message.Clear();
      first = false;
      rpc::GradientChunk* chunk = message.mutable_chunk();
      chunk->set_tensor(g.tensor);
      chunk->set_row_begin(p.row_begin);
      chunk->set_row_end(p.row_end);
      chunk->set_dtype(g.dtype == Gradient::DType::kFp32 ? rpc::DTYPE_FP32 : rpc::DTYPE_BF16);
      chunk->set_offset(offset);
      chunk->set_data(base + offset, n);
      stream_ok = writer->Write(message);
      sent += n;
    }
  }
  // The end marker: the daemon applies the stream only when it arrives
  // with the right total. A daemon owning none of these rows still gets it
  // (with the version and pusher of the first message), so that it counts
  // this pusher.
  if (stream_ok) {
    if (!first) message.Clear();
    message.mutable_end()->set_total_bytes(sent);
    stream_ok = writer->Write(message);
  }
  // The daemon answers on the end marker and may have finished already.
  if (stream_ok) writer->WritesDone();
  RETURN_IF_ERROR(FromGrpcStatus(writer->Finish(), where));
  absl::MutexLock lock(&result_mu);
  result.bytes_sent += sent;
  result.pushers_received = result.pushers_received < 0
                                ? response.pushers_received()
                                : std::min(result.pushers_received, response.pushers_received());
  result.pushers_expected = response.pushers_expected();
  return absl::OkStatus();
}

}  // namespace client
}  // namespace paramd
