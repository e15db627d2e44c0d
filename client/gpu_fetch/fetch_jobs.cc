#include "client/gpu_fetch/fetch_jobs.h"

#include <chrono>
#include <future>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/gpu_status.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "format/convert.h"
#include "format/fetch_plan.h"
#include "sharding/assemble.h"

namespace paramd {
namespace gpu_fetch {
namespace fetch_jobs {
namespace {

// How long a fetch whose daemon's end is gone still waits for the
// FetchDevice answer (see the receive in Fetch).
constexpr std::chrono::milliseconds kGoneGrace(50);

// Codes a call gets from gRPC itself when its server goes away, as opposed
// to a refusal by the daemon (NOT_FOUND, ABORTED, ...), which says more.
bool IsTransportCode(grpc::StatusCode code) {
  return code == grpc::StatusCode::OK || code == grpc::StatusCode::CANCELLED ||
         code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED;
}

// UNAVAILABLE naming the daemon, with what the channel knows of its end
// (its stream's last word) and the receive's own error.
absl::Status DaemonGone(DaemonJob& job, const absl::Status& received) {
  const std::string closed = job.channel->Closed();
  return absl::UnavailableError(absl::StrCat("device fetch from daemon ", job.rank, " (",
                                             job.address, "): ", received.message(),
                                             closed.empty() ? "" : absl::StrCat("; ", closed)));
}

absl::Status CheckPlan(const rpc::FetchPlan& plan, const DaemonJob& job, int64_t version) {
  if (plan.version() != version) {
    return absl::InternalError(absl::StrCat("daemon ", job.rank, " planned version ",
                                            plan.version(), ", asked ", version));
  }
  if (plan.pieces_size() != static_cast<int>(job.pieces.size())) {
    return absl::FailedPreconditionError(
        absl::StrCat("daemon ", job.rank, " holds ", plan.pieces_size(),
                     " pieces of the requested tensors, the manifest says ", job.pieces.size(),
                     ": the shard plan changed (RefreshManifest)"));
  }
  for (int i = 0; i < plan.pieces_size(); ++i) {
    const rpc::FetchPiece& p = plan.pieces(i);
    const PieceJob& want = job.pieces[i];
    if (p.row_begin() != want.row_begin || p.row_end() != want.row_end ||
        p.data_bytes() != want.into.layout.data_bytes() ||
        p.scale_bytes() != want.into.layout.scale_bytes()) {
      return absl::FailedPreconditionError(
          absl::StrCat("daemon ", job.rank, " plans piece ", p.tensor(), " rows [", p.row_begin(),
                       ", ", p.row_end(), ") of ", p.data_bytes(), "+", p.scale_bytes(),
                       " bytes, unlike the manifest: the shard plan changed (RefreshManifest)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status InDaemonContext(const absl::Status& s, absl::string_view what, int64_t version,
                             int rank, const std::string& address) {
  return absl::Status(s.code(), absl::StrCat("device ", what, " of version ", version, ", daemon ",
                                             rank, " (", address, "): ", s.message()));
}

absl::Status WaitForCallerWork(cudaStream_t stream) {
  unsigned int flags = cudaStreamDefault;
  if (stream != nullptr) GPU_RETURN_IF_ERROR(cudaStreamGetFlags(stream, &flags));
  cudaEvent_t done;
  GPU_RETURN_IF_ERROR(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  absl::Status s = GPU_STATUS(cudaEventRecord(done, stream));
  if (s.ok()) s = GPU_STATUS(cudaEventSynchronize(done));
  if (s.ok() && stream != nullptr && (flags & cudaStreamNonBlocking) == 0) {
    s = GPU_STATUS(cudaEventRecord(done, cudaStreamLegacy));
    if (s.ok()) s = GPU_STATUS(cudaEventSynchronize(done));
  }
  (void)cudaEventDestroy(done);
  return s;
}

absl::Status FetchInPlace(IpcFetcher& ipc, const DaemonJob& job, int64_t version,
                          cudaStream_t stream) {
  std::vector<std::pair<std::string, Direction>> targets;
  for (const rpc::TensorDirections& td : job.request.tensors()) {
    targets.push_back({td.tensor(), static_cast<Direction>(td.directions(0))});
  }
  ASSIGN_OR_RETURN(const IpcVersion* v, ipc.Acquire(version, targets));
  size_t k = 0;
  for (const IpcTensor& t : v->tensors) {
    for (const IpcTensor::Piece& piece : t.pieces) {
      if (k >= job.pieces.size() || job.pieces[k].row_begin != piece.row_begin ||
          job.pieces[k].row_end != piece.row_end ||
          job.pieces[k].into.layout.data_bytes() != piece.buffers.layout.data_bytes() ||
          job.pieces[k].into.layout.scale_bytes() != piece.buffers.layout.scale_bytes()) {
        (void)ipc.Release();
        return absl::FailedPreconditionError(absl::StrCat(
            "daemon ", job.rank, "'s pieces differ from the manifest's: RefreshManifest"));
      }
      const DeviceDirection& to = job.pieces[k++].into;
      const DeviceDirection& from = piece.buffers;
      GPU_RETURN_IF_ERROR(cudaMemcpyAsync(to.data, from.data, from.layout.data_bytes(),
                                          cudaMemcpyDeviceToDevice, stream));
      if (from.layout.scale_bytes() > 0) {
        GPU_RETURN_IF_ERROR(cudaMemcpyAsync(to.scales, from.scales, from.layout.scale_bytes(),
                                            cudaMemcpyDeviceToDevice, stream));
      }
      GPU_RETURN_IF_ERROR(cudaMemcpyAsync(to.scale_inv, from.scale_inv, sizeof(float),
                                          cudaMemcpyDeviceToDevice, stream));
      GPU_RETURN_IF_ERROR(
          cudaMemcpyAsync(to.amax, from.amax, sizeof(float), cudaMemcpyDeviceToDevice, stream));
    }
  }
  if (k != job.pieces.size()) {
    (void)ipc.Release();
    return absl::FailedPreconditionError(
        absl::StrCat("daemon ", job.rank, " described fewer pieces than the manifest has"));
  }
  // Copied before the pin goes (the step after next may rewrite them then).
  GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return ipc.Release();
}

absl::StatusOr<FetchJobs> PlanFetch(const client::Manifest& manifest,
                                    const std::vector<DeviceTarget>& targets, const OwnedFn& owned,
                                    DeviceFetchResult* result) {
  FetchJobs plan;
  plan.split.resize(targets.size());
  std::map<int, DaemonJob>& jobs = plan.jobs;
  std::vector<std::vector<PieceJob>>& split = plan.split;
  std::map<std::pair<std::string, Direction>, bool> seen;
  for (size_t i = 0; i < targets.size(); ++i) {
    const DeviceTarget& target = targets[i];
    const client::TensorMeta* meta = manifest.Find(target.tensor);
    if (meta == nullptr) {
      return absl::NotFoundError(absl::StrCat("unknown tensor \"", target.tensor, "\""));
    }
    if (!meta->Publishes(target.direction)) {
      return absl::FailedPreconditionError(absl::StrCat("tensor ", target.tensor,
                                                        " does not publish a ",
                                                        DirectionName(target.direction), " copy"));
    }
    if (!seen.emplace(std::make_pair(target.tensor, target.direction), true).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "target ", target.tensor, " ", DirectionName(target.direction), " given twice"));
    }
    const QuantSpec& spec = meta->SpecOf(target.direction);
    ASSIGN_OR_RETURN(Layout full, ComputeLayout(spec, target.direction, meta->rows, meta->cols));
    DeviceDirection dst = target.dst;
    const std::string key = absl::StrCat(target.tensor, "/", DirectionName(target.direction));
    if (dst.data == nullptr) {
      ASSIGN_OR_RETURN(dst, owned(key, full));
    } else if ((full.scale_bytes() > 0 && dst.scales == nullptr) || dst.scale_inv == nullptr ||
               dst.amax == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("caller buffers of ", key, " need data, ",
                                                     full.scale_bytes() > 0 ? "scales, " : "",
                                                     "scale_inv and amax"));
    }
    dst.layout = full;
    DeviceFetched fetched;
    fetched.tensor = target.tensor;
    fetched.direction = target.direction;
    fetched.spec = spec;
    fetched.rows = meta->rows;
    fetched.cols = meta->cols;
    fetched.buffers = dst;
    fetched.pieces = static_cast<int>(meta->pieces.size());
    result->tensors.push_back(fetched);
    result->received[target.direction] += full.data_bytes() + full.scale_bytes();
    for (const client::PieceLocation& p : meta->pieces) {
      PieceJob job{static_cast<int>(i), p.row_begin, p.row_end, dst};
      if (meta->pieces.size() > 1) {
        ASSIGN_OR_RETURN(Layout piece, ComputeLayout(spec, target.direction,
                                                     p.row_end - p.row_begin, meta->cols));
        ASSIGN_OR_RETURN(job.into, owned(absl::StrCat(key, "/", p.row_begin), piece));
        split[i].push_back(job);
      }
      DaemonJob& d = jobs[p.daemon_rank];
      d.rank = p.daemon_rank;
      d.address = p.daemon_address.empty() &&
                          p.daemon_rank < static_cast<int>(manifest.daemon_addresses.size())
                      ? manifest.daemon_addresses[p.daemon_rank]
                      : p.daemon_address;
      // One TensorDirections per target: the daemon plans its pieces of it
      // in row order, as the manifest lists them.
      if (d.request.tensors_size() == 0 || d.pieces.empty() ||
          d.pieces.back().target != static_cast<int>(i)) {
        rpc::TensorDirections* td = d.request.add_tensors();
        td->set_tensor(target.tensor);
        td->add_directions(DirectionToProto(target.direction));
      }
      d.pieces.push_back(job);
    }
  }
  return plan;
}

void ExchangeWithDaemon(DaemonJob* j, int device, absl::Time deadline, int64_t version,
                        bool early) {
  j->request.set_reply_after_send(early);
  cudaSetDevice(device);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  rpc::FetchDeviceResponse response;
  // The receive pieces come from the manifest (CheckPlan compares the
  // daemon's plan with them), so they are known before the answer.
  std::vector<MutableDeviceBytes> pieces;
  for (const PieceJob& p : j->pieces) {
    AppendItemPieces(p.into.layout, p.into.data, p.into.scales, p.into.scale_inv, p.into.amax,
                     &pieces);
  }
  if (early) {
    // The receive is posted beside the call: the daemon sends as soon as
    // it can (a version being stepped: tensor by tensor) and answers
    // after. A call that fails sends nothing more, so it ends the
    // receive (shutting the transport down: the channel is reopened).
    auto answered = std::make_shared<std::promise<grpc::Status>>();
    std::future<grpc::Status> answer = answered->get_future();
    j->channel->stub->async()->FetchDevice(&context, &j->request, &response,
                                           [answered, j](grpc::Status g) {
                                             if (!g.ok()) j->channel->transport->Shutdown();
                                             answered->set_value(std::move(g));
                                           });
    const absl::Status received =
        j->channel->nccl->RecvDevice(0, j->request.tag(), pieces, deadline);
    // A failed receive: the daemon's answer usually says why; a daemon
    // that does not answer soon is given up on. When the daemon's end is
    // gone (the transport saw its control connection hang up, or the
    // channel's stream ended) it will not answer: the call fails only
    // when gRPC notices too (up to ~0.5 s later), with a vaguer
    // CANCELLED or "Socket closed". So then the answer gets only a short
    // grace (a live daemon that dropped the channel while refusing the
    // fetch answers in it).
    const bool gone =
        !received.ok() && (absl::IsUnavailable(received) || !j->channel->Closed().empty());
    bool cancelled = false;
    if (!received.ok() && answer.wait_for(gone ? kGoneGrace : std::chrono::milliseconds(1000)) !=
                              std::future_status::ready) {
      context.TryCancel();
      cancelled = true;
    }
    const grpc::Status g = answer.get();
    if (gone && (cancelled || IsTransportCode(g.error_code()))) {
      j->status = DaemonGone(*j, received);
      return;
    }
    // The answer first: it says why nothing (or no published version)
    // arrived. Bytes of a failed call are never handed out.
    if (!g.ok() && !cancelled) {
      j->status = FromGrpcStatus(g, absl::StrCat("FetchDevice on daemon ", j->rank));
      return;
    }
    j->status = received.ok() ? CheckPlan(response.plan(), *j, version) : received;
  } else {
    const grpc::Status g = j->channel->stub->FetchDevice(&context, j->request, &response);
    if (!g.ok()) {
      j->status = FromGrpcStatus(g, absl::StrCat("FetchDevice on daemon ", j->rank));
      return;
    }
    j->status = CheckPlan(response.plan(), *j, version);
    if (!j->status.ok()) return;
    j->status = j->channel->nccl->RecvDevice(0, j->request.tag(), pieces, deadline);
  }
  if (!j->status.ok()) {
    const std::string closed = j->channel->Closed();
    if (!closed.empty()) {
      j->status = absl::UnavailableError(absl::StrCat("device fetch from daemon ", j->rank, ": ",
                                                      closed, " (", j->status.message(), ")"));
    }
  }
}

absl::Status AssembleSplit(const std::vector<std::vector<PieceJob>>& split,
                           const DeviceFetchResult& result, cudaStream_t stream) {
  bool copied = false;
  for (size_t i = 0; i < split.size(); ++i) {
    if (split[i].empty()) continue;
    const DeviceFetched& t = result.tensors[i];
    const DeviceDirection& dst = t.buffers;
    const QuantSpec& spec = t.spec;
    if (dst.layout.scale_bytes() > 0) {
      GPU_RETURN_IF_ERROR(cudaMemsetAsync(dst.scales, 0, dst.layout.scale_bytes(), stream));
    }
    for (const PieceJob& p : split[i]) {
      ASSIGN_OR_RETURN(
          sharding::PiecePlacement pl,
          sharding::PlacePiece(spec, t.direction, t.rows, t.cols, p.row_begin, p.row_end));
      auto copy = [&](const sharding::Copy2D& c, const void* piece, void* full) -> absl::Status {
        if (c.width == 0 || c.height == 0) return absl::OkStatus();
        return GPU_STATUS(
            cudaMemcpy2DAsync(static_cast<uint8_t*>(full) + c.full_offset, c.full_pitch,
                              static_cast<const uint8_t*>(piece) + c.piece_offset, c.piece_pitch,
                              c.width, c.height, cudaMemcpyDeviceToDevice, stream));
      };
      RETURN_IF_ERROR(copy(pl.data, p.into.data, dst.data));
      if (dst.layout.scale_bytes() > 0) RETURN_IF_ERROR(copy(pl.scales, p.into.scales, dst.scales));
    }
    // Every piece carries the tensor's agreed scale_inv and global amax.
    const PieceJob& first = split[i].front();
    GPU_RETURN_IF_ERROR(cudaMemcpyAsync(dst.scale_inv, first.into.scale_inv, sizeof(float),
                                        cudaMemcpyDeviceToDevice, stream));
    GPU_RETURN_IF_ERROR(cudaMemcpyAsync(dst.amax, first.into.amax, sizeof(float),
                                        cudaMemcpyDeviceToDevice, stream));
    copied = true;
  }
  if (copied) GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

}  // namespace fetch_jobs
}  // namespace gpu_fetch
}  // namespace paramd
