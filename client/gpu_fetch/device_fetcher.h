// File: client/gpu_fetch/device_fetcher.h
//
// Device fetch through hybrid-paramd daemons (docs/ARCHITECTURE.md,
// "Device fetch through the daemon"): the
// published directions of a version land straight in the trainer's GPU
// memory, over NCCL, in exactly the layouts of docs/FORMATS.md
// (ComputeLayout(spec, direction, M, K) of the WHOLE tensor), whatever the
// number of daemons holding pieces of a tensor. --config=cuda only; the
// daemons must run --backend=gpu (a cpu daemon answers FAILED_PRECONDITION:
// use client::Client::Fetch there).
//
//   ASSIGN_OR_RETURN(auto client, client::Client::Connect(options));
//   ASSIGN_OR_RETURN(auto fetcher, gpu_fetch::DeviceFetcher::Create(client.get(), {.device = 1}));
//   ASSIGN_OR_RETURN(gpu_fetch::DeviceFetchResult r,
//                    fetcher->Fetch(v, {{"w", Direction::kRowwise}}, stream));
//   ... r.tensors[0].buffers.data is the rowwise copy of w on device 1 ...
//
// How: per daemon, one device channel (Daemon.OpenDeviceChannel: a 2-rank
// NCCL transport world, daemon rank 0, this trainer rank 1; the NCCL unique
// ids travel over the transport's gRPC header channel). A fetch sends one
// Daemon.FetchDevice per daemon involved (in parallel): the daemon answers
// with the plan (its pieces, in the order of fetch_plan.h) and sends them as
// one NCCL message, which this side receives with one RecvDevice posted
// beside the call (stream_in_flight: a version the daemon is still stepping
// streams tensor by tensor, the answer comes once it is published). A tensor in
// one piece is received straight into the destination; the pieces of a
// tensor split across daemons are received into scratch buffers and placed
// with strided device copies (cudaMemcpy2DAsync) from the piece geometry of
// //sharding:assemble (PlacePiece): rowwise pieces are row ranges,
// transposed columnwise pieces are column blocks, scale entries go to their
// block offsets and scale padding is zero (D8). scale_inv and amax are the
// tensor's (every piece carries the agreed global values).
//
// Memory: a target with `dst.data` set receives into those caller-owned
// device buffers (on `device`, sized from Client::LayoutOf: data_bytes,
// scale_bytes when > 0, one float each for scale_inv and amax); otherwise
// into buffers this fetcher owns, one set per (tensor, direction), reused
// (overwritten) by the next fetch of that target and freed with the
// fetcher. Scratch buffers for split tensors are owned and reused likewise.
//
// Streams: Fetch first waits for `stream` (host synchronisation), so work
// the caller enqueued there that still reads the destination finishes
// before it is overwritten; when Fetch returns the bytes are in place, and
// work enqueued on any stream afterwards sees them. `stream` nullptr means
// CUDA's default stream (legacy or per-thread, as the caller is built),
// which is waited for like any other; Push likewise waits for it before
// reading the gradients.
//
// Errors: UNAVAILABLE (a daemon is down or its channel broke: the channel
// is closed and reopened by the next fetch), DEADLINE_EXCEEDED (the timeout
// passed first; never a hang), NOT_FOUND (unknown tensor, dropped version),
// FAILED_PRECONDITION (direction not published, a cpu daemon, a manifest
// that no longer matches the daemons: RefreshManifest, two daemons on ONE
// GPU other than the trainer's without NCCL_P2P_DISABLE=1 in the trainer's
// environment: that case delivered wrong bytes, docs/ARCHITECTURE.md),
// INVALID_ARGUMENT
// (duplicate targets, buffers on no device). On error the destinations may
// be partly written.
//
// Threading: thread-safe; fetches through one fetcher are serialised.
// Destroying it closes the channels (the daemons drop their ends).
#ifndef PARAMD_CLIENT_GPU_FETCH_DEVICE_FETCHER_H_
#define PARAMD_CLIENT_GPU_FETCH_DEVICE_FETCHER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/gpu_fetch/fetch.h"
#include "client/gpu_fetch/ipc_import.h"
#include "kernels/format.h"

namespace paramd {
namespace gpu_fetch {

struct DeviceFetcherOptions {
  // The trainer's CUDA device: destinations, scratch and the NCCL endpoints.
  int device = 0;
  // Timeout of a Fetch given none.
  absl::Duration timeout = absl::Seconds(30);
  // For the daemons' logs; empty: "<hostname>:<pid>".
  std::string name;
  // Where this side's NCCL endpoints listen for control messages ("" =
  // 127.0.0.1:0: daemons on this machine; "0.0.0.0:0" across machines).
  std::string listen_address;
  // Receive from the daemons of one fetch concurrently (one thread each);
  // false: one daemon after the other.
  bool parallel = true;
  // Post the receive beside the FetchDevice call (reply_after_send of
  // proto/paramd.proto): a version the daemon is still stepping arrives
  // tensor by tensor as the step quantizes it, and Fetch returns once the
  // daemon has published it (a failed step fails the Fetch: its bytes are
  // never handed out). false: the plan first, the receive after, so a
  // version not yet published is waited for before any byte moves.
  bool stream_in_flight = true;
  // A daemon on this trainer's own GPU (same CUDA UUID) is read through a
  // same-GPU session instead of NCCL (gpu_fetch::IpcFetcher, ipc_import.h:
  // its published buffers mapped in place, copied into the destinations by
  // device copies; split tensors assembled as usual). Found out once per
  // daemon, at its first fetch; false: NCCL for every daemon.
  bool same_gpu_ipc = true;
};

// Which path the calls so far took, per daemon reached (tests, stats).
struct DevicePathStats {
  int64_t fetch_same_gpu = 0;  // daemon fetches read in place (same-GPU session)
  int64_t fetch_nccl = 0;      // daemon fetches received over NCCL
  int64_t push_same_gpu = 0;   // daemon pushes read in place by the daemon
  int64_t push_nccl = 0;       // daemon pushes sent over NCCL
};

// One (tensor, direction) to fetch.
struct DeviceTarget {
  std::string tensor;
  Direction direction = Direction::kRowwise;
  // Caller-owned destination (dst.data non-null; dst.layout is filled in by
  // the fetcher), or null data for fetcher-owned buffers.
  DeviceDirection dst;
};

struct DeviceFetched {
  std::string tensor;
  Direction direction = Direction::kRowwise;
  QuantSpec spec;           // of this direction
  int64_t rows = 0;         // M
  int64_t cols = 0;         // K
  DeviceDirection buffers;  // where the bytes are (caller's or owned)
  int pieces = 0;           // shard pieces it was assembled from
};

struct DeviceFetchResult {
  int64_t version = 0;
  std::vector<DeviceFetched> tensors;  // one per target, in target order
  client::DirectionBytes received;     // payload bytes (data + scales)
  int daemons = 0;                     // daemons that sent
};

// A gradient of one whole tensor in device memory of the fetcher's device
// (rows * cols little-endian FP32 or BF16 values, row-major), for Push.
struct DeviceGradient {
  std::string tensor;
  client::Gradient::DType dtype = client::Gradient::DType::kFp32;
  const void* data = nullptr;
  size_t bytes = 0;  // the buffer's size (checked against the manifest)
};

class DeviceFetcher {
 public:
  // `client` must outlive the fetcher (its manifest and versions are used).
  // Opens no channel yet (the first fetch from a daemon does).
  static absl::StatusOr<std::unique_ptr<DeviceFetcher>> Create(client::Client* client,
                                                               const DeviceFetcherOptions& options);
  ~DeviceFetcher();
  DeviceFetcher(const DeviceFetcher&) = delete;
  DeviceFetcher& operator=(const DeviceFetcher&) = delete;

  // Fetches `targets` of `version` (client::Client::kLatest: the committed
  // version) into device memory; see the file comment.
  absl::StatusOr<DeviceFetchResult> Fetch(int64_t version, const std::vector<DeviceTarget>& targets,
                                          cudaStream_t stream = nullptr,
                                          absl::Duration timeout = absl::ZeroDuration());

  // Pushes `gradients` (whole tensors, device buffers) for `version` to the
  // daemons: a daemon on this GPU (same_gpu_ipc) reads them in place
  // through its same-GPU session (IpcFetcher::Push: gradients lying in a
  // GradientBuffer() of this fetcher are read where they are, others are
  // first copied into one, whole tensors, on the fetcher's copy stream);
  // the others over the device channels (Daemon.PushGradientsDevice):
  // routed by row range exactly as client::Client::
  // PushGradients routes (client::PushRoutesTo), one PushGradientsDevice
  // call and one SendDevice message per daemon holding rows (in parallel
  // when `parallel`), and a call without tensors (nothing sent) to every
  // other daemon, so that each daemon counts this pusher (pusher id: the
  // client's member_id()). Same statuses as PushGradients (stale, duplicate,
  // early push, ...), plus FAILED_PRECONDITION from a cpu daemon; a tensor
  // left out is refused unless `coverage` is kPartial. Waits for
  // `stream` first (host synchronisation); on return the buffers may be
  // reused. On error some daemons may have committed the push and others
  // not, as with the host stream; a daemon whose receive failed applied
  // nothing and its channel is reopened by the next call.
  absl::StatusOr<client::PushResult> Push(
      int64_t version, const std::vector<DeviceGradient>& gradients, cudaStream_t stream = nullptr,
      absl::Duration timeout = absl::ZeroDuration(),
      client::PushCoverage coverage = client::PushCoverage::kEveryTensor);

  // Device memory of at least `bytes` on the fetcher's device that a
  // daemon on this GPU maps once (IpcFetcher::GradientBuffer of the first
  // such daemon): gradients pushed from it are read there, no copy. Owned
  // by the fetcher. FAILED_PRECONDITION when no daemon of the manifest
  // runs on this GPU (use cudaMalloc then).
  absl::StatusOr<void*> GradientBuffer(size_t bytes);

  // Channels currently open (for tests and stats).
  int open_channels() const;
  DevicePathStats path_stats() const;
  // Daemons read through a same-GPU session (DeviceFetcherOptions::same_gpu_ipc).
  int same_gpu_daemons() const;
  // The CUDA device the fetcher receives on.
  int device() const { return options_.device; }

  class Channel;

 private:
  DeviceFetcher(client::Client* client, const DeviceFetcherOptions& options);
  absl::StatusOr<Channel*> ChannelTo(int daemon, const std::string& address, absl::Time deadline);
  void CloseChannel(int daemon);
  // FAILED_PRECONDITION when `channel`'s daemon is on the same GPU as the
  // daemon of another open channel, both reached over NCCL, unless
  // NCCL_P2P_DISABLE=1 (transport/nccl_address.h) or, for diagnostics
  // only, PARAMD_ALLOW_SHARED_GPU_NCCL=1.
  absl::Status CheckSharedGpu(int daemon, const std::string& address, const Channel& channel) const;
  absl::StatusOr<DeviceDirection> Owned(const std::string& key, const Layout& layout);
  // The same-GPU session with daemon `daemon` when it runs on this GPU, else
  // null (decided at the first call; a session that died is reopened).
  IpcFetcher* LocalDaemon(int daemon);
  // Push's gradients for same-GPU daemon `rank`, in its session's buffers.
  absl::StatusOr<std::vector<IpcGradient>> InPlaceGradients(
      IpcFetcher& ipc, int rank, const client::Manifest& manifest,
      const std::vector<DeviceGradient>& gradients);

  client::Client* const client_;
  const DeviceFetcherOptions options_;
  mutable std::mutex mu_;                             // serialises Fetch; guards everything below
  std::map<int, std::unique_ptr<Channel>> channels_;  // by daemon rank
  std::map<int, std::unique_ptr<IpcFetcher>> local_;  // by daemon rank; null: not on this GPU
  DevicePool pool_;
  std::map<std::string, DeviceDirection> owned_;  // by key (tensor, direction, piece)
  cudaStream_t copy_stream_ = nullptr;
  uint64_t next_tag_ = 1;
  DevicePathStats stats_;
};

}  // namespace gpu_fetch
}  // namespace paramd

#endif  // PARAMD_CLIENT_GPU_FETCH_DEVICE_FETCHER_H_
