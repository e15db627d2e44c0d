#include "transport/nccl_comm.h"

#include <cstdlib>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/gpu_status.h"
#include "common/scoped_device.h"
#include "common/status_macros.h"

namespace paramd {
namespace transport_internal {

Comm::~Comm() {
  if (creation != nullptr) {
    absl::MutexLock lock(&creation->mu);
    if (creation->done) {
      comm = creation->comm;  // not taken yet: aborted below
      creation->comm = nullptr;
    } else {
      creation->abandoned = true;
    }
  }
  ScopedDevice guard(device);
  if (comm != nullptr) ncclCommAbort(comm);
  if (stream != nullptr) cudaStreamDestroy(stream);
  if (done != nullptr) cudaEventDestroy(done);
  if (ready != nullptr) cudaEventDestroy(ready);
  for (cudaEvent_t e : group_done) cudaEventDestroy(e);
  if (dev != nullptr) cudaFree(dev);
  if (pinned != nullptr) cudaFreeHost(pinned);
}

absl::Status Comm::EnsureStaging(size_t bytes, bool host) {
  if (dev_size < bytes) {
    if (dev != nullptr) GPU_RETURN_IF_ERROR(cudaFree(dev));
    dev = nullptr;
    dev_size = 0;
    GPU_RETURN_IF_ERROR(cudaMalloc(&dev, bytes));
    dev_size = bytes;
  }
  if (host && pinned_size < bytes) {
    if (pinned != nullptr) GPU_RETURN_IF_ERROR(cudaFreeHost(pinned));
    pinned = nullptr;
    pinned_size = 0;
    GPU_RETURN_IF_ERROR(cudaHostAlloc(&pinned, bytes, cudaHostAllocDefault));
    pinned_size = bytes;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Comm>> StartComm(int device, int nranks, int rank,
                                                const ncclUniqueId& id) {
  auto c = std::make_unique<Comm>(device);
  GPU_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
  GPU_RETURN_IF_ERROR(cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming));
  GPU_RETURN_IF_ERROR(cudaEventCreateWithFlags(&c->ready, cudaEventDisableTiming));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclUniqueId copy = id;
  ncclResult_t r = ncclCommInitRankConfig(&c->comm, nranks, copy, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    return absl::UnavailableError(absl::StrCat("ncclCommInitRankConfig: ", ncclGetErrorString(r)));
  }
  return c;
}

bool BlockingPairsFromEnv() {
  const char* v = std::getenv("PARAMD_NCCL_BLOCKING");
  return v == nullptr || std::string(v) != "0";
}

namespace {

// The helper thread of a blocking pair communicator: init (blocking), one
// warm-up transfer (rank 0 sends 16 bytes to rank 1: connects every p2p
// channel NCCL uses for the pair), its completion polled against
// `deadline`. On failure the helper aborts what it made.
void CreatePair(std::shared_ptr<Creation> creation, int device, int rank, ncclUniqueId id,
                absl::Time deadline) {
  cudaSetDevice(device);
  ncclComm_t comm = nullptr;
  absl::Status s = [&]() -> absl::Status {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    ncclResult_t r = ncclCommInitRankConfig(&comm, 2, id, rank, &config);
    if (r != ncclSuccess) {
      return absl::UnavailableError(
          absl::StrCat("ncclCommInitRankConfig: ", ncclGetErrorString(r)));
    }
    cudaStream_t stream = nullptr;
    GPU_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    void* buf = nullptr;
    // Stream-ordered: no device-wide synchronisation (cudaFree would wait
    // for every stream, transfers in flight included).
    absl::Status w = GPU_STATUS(cudaMallocAsync(&buf, 16, stream));
    if (w.ok()) {
      ncclGroupStart();
      r = rank == 0 ? ncclSend(buf, 16, ncclUint8, 1, comm, stream)
                    : ncclRecv(buf, 16, ncclUint8, 0, comm, stream);
      ncclResult_t end = ncclGroupEnd();
      if (r == ncclSuccess) r = end;
      if (r != ncclSuccess) {
        w = absl::UnavailableError(absl::StrCat("warm-up transfer: ", ncclGetErrorString(r)));
      }
      for (int spin = 0; w.ok(); ++spin) {
        cudaError_t q = cudaStreamQuery(stream);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) w = GPU_STATUS(q);
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(comm, &async);
        if (w.ok() && async != ncclSuccess) {
          w = absl::UnavailableError(absl::StrCat("warm-up transfer: ", ncclGetErrorString(async)));
        }
        if (w.ok() && absl::Now() >= deadline) {
          w = absl::DeadlineExceededError("warm-up transfer: deadline exceeded");
        }
        {
          absl::MutexLock lock(&creation->mu);
          if (w.ok() && creation->abandoned) w = absl::CancelledError("warm-up abandoned");
        }
        if (spin > 1000) absl::SleepFor(absl::Microseconds(50));
      }
    }
    if (!w.ok()) {
      ncclCommAbort(comm);  // a hung warm-up kernel quits
      comm = nullptr;
    }
    if (buf != nullptr) cudaFreeAsync(buf, stream);
    cudaStreamDestroy(stream);
    return w;
  }();
  if (!s.ok() && comm != nullptr) {
    ncclCommAbort(comm);
    comm = nullptr;
  }
  bool abandoned = false;
  {
    absl::MutexLock lock(&creation->mu);
    creation->done = true;
    creation->status = s;
    abandoned = creation->abandoned;
    if (!abandoned) creation->comm = comm;
  }
  if (abandoned && comm != nullptr) ncclCommAbort(comm);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Comm>> StartPairComm(int device, int rank, const ncclUniqueId& id,
                                                    absl::Time deadline) {
  auto c = std::make_unique<Comm>(device);
  GPU_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
  GPU_RETURN_IF_ERROR(cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming));
  GPU_RETURN_IF_ERROR(cudaEventCreateWithFlags(&c->ready, cudaEventDisableTiming));
  c->creation = std::make_shared<Creation>();
  std::thread(CreatePair, c->creation, device, rank, id, deadline).detach();
  return c;
}

}  // namespace transport_internal
}  // namespace paramd
