#include "transport/nccl_transport_impl.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "common/gpu_status.h"
#include "common/scoped_device.h"
#include "common/status_macros.h"
#include "transport/nccl_amax_keys.h"

namespace paramd {
namespace nccl_internal {

using transport_internal::StartComm;

namespace {

uint64_t GroupTag(absl::Span<const int> group) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (int r : group) {
    h ^= static_cast<uint64_t>(r) + 0x9E3779B97F4A7C15ull;
    h *= 1099511628211ull;
  }
  return kGroupTagBase + (h & ((uint64_t{1} << 56) - 1));
}

}  // namespace

absl::Status NcclTransportImpl::AllReduceMax(absl::Span<const int> group, absl::Span<float> values,
                                             absl::Time deadline) {
  RETURN_IF_ERROR(CheckGroup(group));
  if (group.size() == 1) return absl::OkStatus();
  if (!DistinctGpus(group)) return sync_->AllReduceMax(group, values, deadline);
  return OnGroupComm(group, values.size(), deadline, [&](Comm& c) -> absl::Status {
    const size_t bytes = values.size() * sizeof(float);
    RETURN_IF_ERROR(c.EnsureStaging(bytes, /*host=*/true));
    std::memcpy(c.pinned, values.data(), bytes);
    GPU_RETURN_IF_ERROR(cudaMemcpyAsync(c.dev, c.pinned, bytes, cudaMemcpyHostToDevice, c.stream));
    RETURN_IF_ERROR(EnqueueKeyAllReduce(c, c.dev, values.size(), deadline));
    GPU_RETURN_IF_ERROR(cudaMemcpyAsync(c.pinned, c.dev, bytes, cudaMemcpyDeviceToHost, c.stream));
    GPU_RETURN_IF_ERROR(cudaEventRecord(c.done, c.stream));
    RETURN_IF_ERROR(Poll(c, c.done, deadline, "all-reduce"));
    std::memcpy(values.data(), c.pinned, bytes);
    return absl::OkStatus();
  });
}

absl::Status NcclTransportImpl::AllReduceMaxDevice(absl::Span<const int> group, float* values,
                                                   size_t count, cudaStream_t stream,
                                                   absl::Time deadline) {
  RETURN_IF_ERROR(CheckGroup(group));
  if (group.size() == 1) return absl::OkStatus();
  if (!DistinctGpus(group)) {
    return absl::UnimplementedError("device all-reduce over a group with two ranks on one GPU");
  }
  return OnGroupComm(group, count, deadline, [&](Comm& c) -> absl::Status {
    GPU_RETURN_IF_ERROR(cudaEventRecord(c.ready, stream));
    GPU_RETURN_IF_ERROR(cudaStreamWaitEvent(c.stream, c.ready, 0));
    RETURN_IF_ERROR(EnqueueKeyAllReduce(c, values, count, deadline));
    GPU_RETURN_IF_ERROR(cudaEventRecord(c.done, c.stream));
    GPU_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, c.done, 0));
    return absl::OkStatus();
  });
}

absl::Status NcclTransportImpl::OnGroupComm(absl::Span<const int> group, size_t count,
                                            absl::Time deadline,
                                            absl::FunctionRef<absl::Status(Comm&)> reduce) {
  ScopedDevice guard(device_);
  GroupState& g = GetGroup(group);
  absl::MutexLock lock(&g.mu);
  RETURN_IF_ERROR(EnsureGroupComm(g, group, deadline));
  absl::Status s = AgreeOnCount(g, count, deadline);
  if (s.ok() && count > 0) s = reduce(*g.comm);
  if (!s.ok() && s.code() != absl::StatusCode::kInvalidArgument) Retire(std::move(g.comm));
  return s;
}

absl::Status NcclTransportImpl::WaitStream(cudaStream_t stream, absl::Time deadline) {
  if (shut_down_.load()) return absl::FailedPreconditionError("transport is shut down");
  ScopedDevice guard(device_);
  cudaEvent_t event;
  GPU_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  absl::Status s = GPU_STATUS(cudaEventRecord(event, stream));
  for (int spin = 0; s.ok(); ++spin) {
    cudaError_t q = cudaEventQuery(event);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) {
      s = GPU_STATUS(q);
      break;
    }
    s = GroupAsyncErrors();
    if (!s.ok()) break;
    if (shut_down_.load())
      s = absl::CancelledError("transport shut down");
    else if (absl::Now() >= deadline)
      s = absl::DeadlineExceededError("stream wait");
    if (!s.ok()) break;
    Backoff(spin);
  }
  if (!s.ok()) AbortGroups();
  cudaEventDestroy(event);
  return s;
}

GroupState& NcclTransportImpl::GetGroup(absl::Span<const int> group) {
  absl::MutexLock lock(&groups_mu_);
  std::unique_ptr<GroupState>& g = groups_[std::vector<int>(group.begin(), group.end())];
  if (g == nullptr) g = std::make_unique<GroupState>();
  return *g;
}

absl::Status NcclTransportImpl::EnsureGroupComm(GroupState& g, absl::Span<const int> group,
                                                absl::Time deadline) {
  if (g.comm != nullptr) return absl::OkStatus();
  ncclUniqueId id;
  const uint64_t tag = GroupTag(group);
  int index = 0;
  while (group[index] != rank_) ++index;
  if (index == 0) {
    GPU_RETURN_IF_ERROR(ncclGetUniqueId(&id));
    for (size_t i = 1; i < group.size(); ++i) {
      RETURN_IF_ERROR(sync_->Send(
          group[i], tag, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(&id), sizeof(id)),
          deadline));
    }
  } else {
    ASSIGN_OR_RETURN(
        size_t got,
        sync_->Recv(group[0], tag, absl::MakeSpan(reinterpret_cast<uint8_t*>(&id), sizeof(id)),
                    deadline));
    if (got != sizeof(id)) return absl::InternalError("bad group id message");
  }
  ASSIGN_OR_RETURN(g.comm, StartComm(device_, static_cast<int>(group.size()), index, id));
  for (int r : group) {
    if (r != rank_) g.comm->peers.push_back(r);
  }
  g.agreed_count = ~size_t{0};
  absl::Status s = Poll(*g.comm, nullptr, deadline, "group communicator init");
  if (!s.ok()) g.comm.reset();
  return s;
}

absl::Status NcclTransportImpl::AgreeOnCount(GroupState& g, size_t count, absl::Time deadline) {
  if (g.agreed_count == count) return absl::OkStatus();
  Comm& c = *g.comm;
  RETURN_IF_ERROR(c.EnsureStaging(std::max<size_t>(16, 4 * count), /*host=*/true));
  uint64_t words[2] = {count, ~uint64_t{count}};
  std::memcpy(c.pinned, words, 16);
  GPU_RETURN_IF_ERROR(cudaMemcpyAsync(c.dev, c.pinned, 16, cudaMemcpyHostToDevice, c.stream));
  RETURN_IF_ERROR(Enqueued(c, ncclAllReduce(c.dev, c.dev, 2, ncclUint64, ncclMax, c.comm, c.stream),
                           deadline, "count all-reduce"));
  GPU_RETURN_IF_ERROR(cudaMemcpyAsync(c.pinned, c.dev, 16, cudaMemcpyDeviceToHost, c.stream));
  GPU_RETURN_IF_ERROR(cudaEventRecord(c.done, c.stream));
  RETURN_IF_ERROR(Poll(c, c.done, deadline, "count all-reduce"));
  std::memcpy(words, c.pinned, 16);
  if (words[0] != count || ~words[1] != count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group members disagree on the all-reduce size (", ~words[1], " .. ", words[0], ")"));
  }
  g.agreed_count = count;
  return absl::OkStatus();
}

absl::Status NcclTransportImpl::EnqueueKeyAllReduce(Comm& c, void* values, size_t count,
                                                    absl::Time deadline) {
  GPU_RETURN_IF_ERROR(nccl_internal::LaunchEncodeAmaxKeys(values, count, c.stream));
  RETURN_IF_ERROR(
      Enqueued(c, ncclAllReduce(values, values, count, ncclUint32, ncclMax, c.comm, c.stream),
               deadline, "amax all-reduce"));
  GPU_RETURN_IF_ERROR(nccl_internal::LaunchDecodeAmaxKeys(values, count, c.stream));
  return absl::OkStatus();
}

absl::Status NcclTransportImpl::GroupAsyncErrors() {
  absl::MutexLock lock(&groups_mu_);
  for (auto& [members, g] : groups_) {
    if (!g->mu.TryLock()) continue;  // busy: its own call polls it
    absl::Status s;
    if (g->comm != nullptr) {
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(g->comm->comm, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        s = absl::UnavailableError(absl::StrCat("group communicator: ", ncclGetErrorString(async)));
      } else if (const int gone = GonePeer(g->comm->peers); gone >= 0) {
        s = PeerGoneError("group communicator", gone);
      }
    }
    g->mu.Unlock();
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

void NcclTransportImpl::AbortGroups() {
  absl::MutexLock lock(&groups_mu_);
  for (auto& [members, g] : groups_) {
    absl::MutexLock group_lock(&g->mu);
    g->comm.reset();
  }
}

}  // namespace nccl_internal
}  // namespace paramd
