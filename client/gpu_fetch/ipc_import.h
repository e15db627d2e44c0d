// File: client/gpu_fetch/ipc_import.h
//
// A trainer on a daemon's own GPU reads that daemon's published buffers in
// place (docs/ARCHITECTURE.md "Co-located trainers", proto/ipc.proto):
//
//   ASSIGN_OR_RETURN(auto ipc, gpu_fetch::IpcFetcher::Open(client.get(), /*daemon=*/0, {}));
//   ASSIGN_OR_RETURN(int64_t v, client->WaitForVersion(v + 1, timeout));
//   ASSIGN_OR_RETURN(const gpu_fetch::IpcVersion* w, ipc->Acquire(v, {{"w", kRowwise}}));
//   ... w->tensors[0].pieces[0].buffers.data: the daemon's rowwise copy of w ...
//
// No copy: the pointers are the daemon's published buffers (VMM allocations
// mapped into this process once, ipc/cuda_vmm.h), valid while the
// version stays acquired: until the next Acquire (which pins the new
// version first, then releases the old one) or Release, or until the
// session dies. While it is acquired the daemon does not rewrite it (the
// step that would reuse its buffers waits for the pin, bounded by this
// process's lease: a killed trainer's pins lapse). CopyTo copies a version
// into caller-owned memory for keeping it longer.
//
// Hand-over without an RPC: the session's pin page (ipc/pin_page.h)
// offers the daemon's published versions; once a version of a slot was
// acquired over RPC (the pointers of that slot's buffers are then known,
// and fixed for the model), later versions in that slot with the same
// targets are pinned by a store into the page and a re-check: no RPC, no
// device work. Anything else (first acquire, other targets, a version no
// longer offered, a reload) goes over PinIpc.
//
// A daemon that dies is reported at the next call (Acquire, Check, CopyTo,
// Push: UNAVAILABLE, "no longer valid"); the mappings stay mapped until this
// fetcher is destroyed, so a kernel already reading them reads the last
// published bytes, never freed memory (VMM allocations live while mapped).
//
// Gradients: GradientBuffer() allocates exportable memory that the daemon
// maps once; Push() of gradients lying in it is read by the daemon in place
// (NaN check, then the adds), with the push rules of PushGradients.
//
// Threading: thread-compatible (one caller at a time); the lease is kept
// alive by a thread of the session.
#ifndef PARAMD_CLIENT_GPU_FETCH_IPC_IMPORT_H_
#define PARAMD_CLIENT_GPU_FETCH_IPC_IMPORT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/gpu_fetch/fetch.h"
#include "client/ipc/ipc_session.h"
#include "ipc/cuda_vmm.h"
#include "ipc/pin_page.h"
#include "kernels/format.h"

namespace paramd {
namespace gpu_fetch {

struct IpcFetcherOptions {
  int device = 0;  // the trainer's CUDA device: must be the daemon's GPU
  absl::Duration lease = absl::Seconds(5);
  std::string name;  // for the daemon's logs
};

// One (tensor, direction) of an acquired version: the daemon's pieces of
// it, in row order, each in the layout of its rows (a whole tensor held by
// this daemon is one piece in the tensor's FORMATS.md layout).
struct IpcTensor {
  std::string tensor;
  Direction direction = Direction::kRowwise;
  QuantSpec spec;
  int64_t rows = 0;  // the whole tensor's M
  int64_t cols = 0;  // K
  struct Piece {
    int64_t row_begin = 0;
    int64_t row_end = 0;
    DeviceDirection buffers;  // device pointers into the daemon's buffers
  };
  std::vector<Piece> pieces;
  bool whole() const {
    return pieces.size() == 1 && pieces[0].row_begin == 0 && pieces[0].row_end == rows;
  }
};

struct IpcVersion {
  int64_t version = -1;
  std::vector<IpcTensor> tensors;  // target order
};

// A gradient of one whole tensor lying in a GradientBuffer (rows * cols
// values of `dtype`, row-major).
struct IpcGradient {
  std::string tensor;
  client::Gradient::DType dtype = client::Gradient::DType::kBf16;
  const void* data = nullptr;
};

class IpcFetcher {
 public:
  // Opens a session with daemon `daemon_rank` of `client`'s manifest.
  // FAILED_PRECONDITION: the daemon runs on another GPU than `device`
  // (different UUID), is a cpu daemon, or has no exporter.
  static absl::StatusOr<std::unique_ptr<IpcFetcher>> Open(client::Client* client, int daemon_rank,
                                                          const IpcFetcherOptions& options);
  ~IpcFetcher();

  // Pins `version` of `targets` (every tensor this daemon holds when empty)
  // and returns where they are; releases the version acquired before.
  // NOT_FOUND: the daemon does not hold it (any more); UNAVAILABLE: the
  // daemon died. The result lives in this fetcher until the next Acquire or
  // Release.
  absl::StatusOr<const IpcVersion*> Acquire(
      int64_t version, const std::vector<std::pair<std::string, Direction>>& targets);
  // Releases the acquired version (its pointers must not be used after).
  absl::Status Release();
  // OK while the acquired pointers are valid.
  absl::Status Check() const;

  // Copies an acquired whole tensor into caller-owned device buffers `dst`
  // (data, scales, scale_inv, amax as DeviceDirection) on `stream`;
  // returns once enqueued (the source stays valid until the next Acquire:
  // synchronise `stream` before that). INVALID_ARGUMENT for a split tensor
  // (DeviceFetcher assembles those).
  absl::Status CopyTo(const IpcTensor& tensor, const DeviceDirection& dst, cudaStream_t stream);

  // Exportable device memory of at least `bytes` that the daemon maps;
  // owned by the fetcher (freed with it).
  absl::StatusOr<void*> GradientBuffer(size_t bytes);
  // Whether [data, data + bytes) lies in one GradientBuffer.
  bool InGradientBuffer(const void* data, size_t bytes) const;
  // One GradientBuffer of at least `bytes` kept for copies of gradients that
  // lie elsewhere (DeviceFetcher::Push), grown (replaced) as needed.
  absl::StatusOr<void*> StagingBuffer(size_t bytes);
  // Pushes `gradients` (in GradientBuffers; this daemon's rows of each) for
  // `version`, read in place by the daemon. The push rules' codes; on
  // return the buffers may be reused.
  absl::StatusOr<rpc::PushGradientsResponse> Push(int64_t version,
                                                  const std::vector<IpcGradient>& gradients);

  int daemon_rank() const { return rank_; }
  // How the acquires so far were pinned: through the pin page (no RPC) or
  // over PinIpc.
  int64_t page_acquires() const { return page_acquires_; }
  int64_t rpc_acquires() const { return rpc_acquires_; }
  const std::string& device_uuid() const { return session_->device_uuid(); }
  int64_t acquired_version() const { return acquired_.version; }
  // Bytes of the daemon's regions mapped here (address space, not memory:
  // the memory is the daemon's).
  int64_t mapped_bytes() const;

 private:
  IpcFetcher(client::Client* client, int rank, const IpcFetcherOptions& options)
      : client_(client), rank_(rank), options_(options) {}
  absl::Status MapRegions(uint64_t epoch);
  // The page path of Acquire: the acquired version, or null when it must
  // go over RPC. UNAVAILABLE: the daemon died.
  absl::StatusOr<const IpcVersion*> AcquireFromPage(
      int64_t version, const std::vector<std::pair<std::string, Direction>>& targets);
  // Releases the pin of the acquired version (page or RPC) and forgets it.
  absl::Status ReleaseHeld();

  client::Client* const client_;
  const int rank_;
  const IpcFetcherOptions options_;
  std::unique_ptr<ipc::IpcSession> session_;
  uint64_t epoch_ = 0;
  bool mapped_ = false;
  std::vector<ipc::VmmBuffer> regions_;
  IpcVersion acquired_;
  // The pin page (null: the daemon gave none) and, per double-buffer slot,
  // the view of the last version acquired over RPC in it (its pointers).
  std::unique_ptr<ipc::PinPage> page_;
  struct SlotView {
    bool valid = false;
    uint64_t epoch = 0;
    std::vector<std::pair<std::string, Direction>> targets;
    IpcVersion view;
  };
  SlotView slot_views_[ipc::kPageSlots];
  int page_pin_ = -1;  // the acquired version's pin in the page; -1: a PinIpc pin
  int64_t page_acquires_ = 0;
  int64_t rpc_acquires_ = 0;
  struct Buffer {
    uint64_t id;
    ipc::VmmBuffer memory;
  };
  std::vector<Buffer> gradient_buffers_;
  uint64_t next_buffer_id_ = 1;
  uint64_t staging_id_ = 0;  // StagingBuffer's entry in gradient_buffers_ (0: none)
};

// The 16-byte CUDA UUID of `device`.
absl::StatusOr<std::string> DeviceUuid(int device);

}  // namespace gpu_fetch
}  // namespace paramd

#endif  // PARAMD_CLIENT_GPU_FETCH_IPC_IMPORT_H_
