// File: client/gpu_fetch/fetch_jobs.h
//
// What one DeviceFetcher::Fetch does per daemon, private to
// //client/gpu_fetch:device_fetcher: the device channel to a daemon (its
// OpenDeviceChannel stream and 2-rank NCCL transport), the plan of a fetch
// (which pieces of which targets each daemon sends, and where they land),
// the exchange with one daemon (FetchDevice call and NCCL receive), the
// same-GPU read in place, and the assembly of tensors split over daemons.
//
// Threading: ExchangeWithDaemon runs on its own thread per daemon (it
// touches only its DaemonJob and that job's channel); everything else on
// the fetcher's calling thread, under its lock.
#ifndef PARAMD_CLIENT_GPU_FETCH_FETCH_JOBS_H_
#define PARAMD_CLIENT_GPU_FETCH_FETCH_JOBS_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/gpu_fetch/device_fetcher.h"
#include "client/gpu_fetch/ipc_import.h"
#include "grpcpp/grpcpp.h"
#include "kernels/format.h"
#include "proto/paramd.grpc.pb.h"
#include "transport/nccl_transport.h"

namespace paramd {
namespace gpu_fetch {

// One device channel to one daemon: the OpenDeviceChannel stream (kept open
// for the channel's life) and the 2-rank NCCL transport (this side rank 1).
class DeviceFetcher::Channel {
 public:
  ~Channel() { Close(); }

  // Watches the stream after the first event: when it ends (the daemon
  // closed the channel or died), shuts the transport down so that a
  // receive in progress returns at once instead of at its deadline.
  void StartWatch() {
    watcher = std::thread([this] {
      rpc::DeviceChannelEvent event;
      while (reader->Read(&event)) {
        if (!event.closed().empty()) SetClosed(event.closed());
      }
      SetClosed("the daemon ended the device channel (daemon gone or it closed the channel)");
      transport->Shutdown();
    });
  }

  void SetClosed(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu);
    if (closed.empty()) closed = why;
  }
  // Non-empty once the daemon's side is gone.
  std::string Closed() {
    std::lock_guard<std::mutex> lock(mu);
    return closed;
  }

  void Close() {
    if (transport != nullptr) transport->Shutdown();
    if (context != nullptr) context->TryCancel();
    if (watcher.joinable()) watcher.join();
    if (reader != nullptr) reader->Finish();
    reader.reset();
    transport.reset();
    context.reset();
  }

  std::shared_ptr<grpc::Channel> grpc_channel;
  std::unique_ptr<rpc::Daemon::Stub> stub;
  std::unique_ptr<grpc::ClientContext> context;
  std::unique_ptr<grpc::ClientReader<rpc::DeviceChannelEvent>> reader;
  std::unique_ptr<Transport> transport;
  NcclTransport* nccl = nullptr;
  uint64_t id = 0;
  std::string secret;  // the channel's (DeviceChannelEvent.channel_secret)
  // The nccl addresses of the two ends (for the shared-GPU guard).
  std::string daemon_address;
  std::string trainer_address;
  std::thread watcher;
  std::mutex mu;
  std::string closed;
};

namespace fetch_jobs {

// One (target, piece) on one daemon.
struct PieceJob {
  int target = 0;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  DeviceDirection into;  // where this piece is received
};

struct DaemonJob {
  int rank = 0;
  std::string address;
  rpc::FetchDeviceRequest request;
  std::vector<PieceJob> pieces;  // in plan order
  absl::Status status;
  DeviceFetcher::Channel* channel = nullptr;
};

// A fetch's work: per daemon rank its job, per target the receive buffers
// of its pieces when the tensor is split over daemons (empty: received in
// place).
struct FetchJobs {
  std::map<int, DaemonJob> jobs;
  std::vector<std::vector<PieceJob>> split;
};

// The fetcher's own device buffers by key (DeviceFetcher::Owned).
using OwnedFn = std::function<absl::StatusOr<DeviceDirection>(const std::string&, const Layout&)>;

// Checks `targets` against `manifest` (known tensor, published direction,
// no target twice, caller buffers complete) and plans them: fills
// result->tensors and result->received, nothing else is touched.
absl::StatusOr<FetchJobs> PlanFetch(const client::Manifest& manifest,
                                    const std::vector<DeviceTarget>& targets, const OwnedFn& owned,
                                    DeviceFetchResult* result);

// One daemon's FetchDevice call and NCCL receive of `version` into the
// job's pieces; the outcome in j->status. `early` (DeviceFetcherOptions::
// stream_in_flight): the receive is posted beside the call.
void ExchangeWithDaemon(DaemonJob* j, int device, absl::Time deadline, int64_t version, bool early);

// A daemon's pieces of `job` read in place through `ipc` (a daemon on this
// GPU) and copied into their receive buffers on `stream`, in plan order.
absl::Status FetchInPlace(IpcFetcher& ipc, const DaemonJob& job, int64_t version,
                          cudaStream_t stream);

// The tensors split over daemons copied from their pieces' buffers into
// the targets (FORMATS.md layouts, //sharding:assemble), on `stream`.
absl::Status AssembleSplit(const std::vector<std::vector<PieceJob>>& split,
                           const DeviceFetchResult& result, cudaStream_t stream);

// `s` (not OK) with the daemon it concerns in front of its message, code
// kept: "device same-GPU fetch of version 3, daemon 0 (ADDR): ...".
absl::Status InDaemonContext(const absl::Status& s, absl::string_view what, int64_t version,
                             int rank, const std::string& address);

// Waits on the host for the work a call on `stream` must follow: the
// stream's own and, where `stream` is a blocking stream (cudaStreamCreate)
// or the default stream, the legacy default stream's before it (a plain
// cudaMemset / cudaMemcpy of the caller). cudaStreamSynchronize of an
// empty blocking stream returns at once without waiting for the latter,
// and this fetcher's own streams are cudaStreamNonBlocking, which never
// wait for it.
absl::Status WaitForCallerWork(cudaStream_t stream);

}  // namespace fetch_jobs
}  // namespace gpu_fetch
}  // namespace paramd

#endif  // PARAMD_CLIENT_GPU_FETCH_FETCH_JOBS_H_
