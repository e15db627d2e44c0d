// File: server/ipc/ipc_service.h
//
// The daemon's same-GPU service (paramd.rpc.DaemonIpc, proto/ipc.proto;
// docs/ARCHITECTURE.md "Co-located trainers"). A trainer on the daemon's
// GPU opens a session (a lease), maps the daemon's exported regions (the
// published buffers of both double-buffer slots; file descriptors over the
// FdSocket), pins a version and reads its buffers in place; it pushes
// gradients from a buffer of its own that the daemon maps the same way.
//
// Every session also gets a shared-memory pin page (ipc/pin_page.h,
// over the FdSocket): the daemon offers the published versions there
// (Published) and the trainer pins one by a store into its page, so the
// common hand-over of v+1 needs no RPC; PinIpc is the fallback (first
// acquire, other tensors, a version no longer offered).
//
// Split: this class does sessions, pins (PinTable), validation and the
// push rules (through IpcHost, the daemon); the device work is behind
// IpcExporter, registered by the gpu backend's library
// (server/gpu_backend/ipc_export.cc, alwayslink) or by a test's fake. A
// binary without an exporter answers FAILED_PRECONDITION.
//
// Threading: RPC handlers run on gRPC threads and do not wait on peers; a
// pin is a table update plus pointer arithmetic; a push waits for its own
// device work (a NaN check, then the adds). RetireForStep blocks the
// daemon's step thread while a live session pins the version.
#ifndef PARAMD_SERVER_IPC_IPC_SERVICE_H_
#define PARAMD_SERVER_IPC_IPC_SERVICE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "auth/security.h"
#include "ipc/fd_socket.h"
#include "ipc/pin_page.h"
#include "kernels/format.h"
#include "proto/ipc.grpc.pb.h"
#include "server/backend/shard_backend.h"
#include "server/ipc/pin_table.h"
#include "server/step/chunks.h"

namespace paramd {
namespace ipc {

// Where one buffer lies: region index and byte offset.
struct IpcBufferRef {
  uint32_t region = 0;
  uint64_t offset = 0;
};

// One published direction of one shard, in the exported regions.
struct IpcDirectionRefs {
  IpcBufferRef data;
  uint64_t data_bytes = 0;
  IpcBufferRef scales;  // when scale_bytes > 0
  uint64_t scale_bytes = 0;
  IpcBufferRef scale_inv;
  IpcBufferRef amax;
};

// One piece of an in-place push: `count` elements (BF16 when `bf16`, else
// FP32) at byte `buffer_offset` of the session's buffer `buffer`, added
// into shard `shard`'s accumulator from element `offset` on.
struct IpcPushPiece {
  int shard = 0;
  int64_t offset = 0;
  int64_t count = 0;
  bool bf16 = false;
  uint64_t buffer = 0;
  uint64_t buffer_offset = 0;
};

// The device side. One per daemon process; called with the backend kept
// alive by the caller (IpcHost::WithSnapshot / CommitPush).
class IpcExporter {
 public:
  virtual ~IpcExporter() = default;
  // 16 bytes: the UUID of the backend's GPU.
  virtual absl::StatusOr<std::string> DeviceUuid() = 0;
  // New descriptors (the caller owns them) and sizes of `backend`'s
  // exported regions. FAILED_PRECONDITION: not the gpu backend.
  virtual absl::Status Export(ShardBackend& backend, std::vector<int>* fds,
                              std::vector<uint64_t>* sizes) = 0;
  // Where `version`'s direction `direction` of shard `shard` lies.
  // NOT_FOUND: the backend no longer (or not yet) holds that version.
  virtual absl::StatusOr<IpcDirectionRefs> Describe(ShardBackend& backend, int64_t version,
                                                    int shard, Direction direction) = 0;
  // Maps the trainer buffer `fd` (owned from now on) of `bytes` as the
  // session's buffer `id` (replacing an older one of that id).
  virtual absl::Status ImportBuffer(uint64_t session, uint64_t id, int fd, uint64_t bytes) = 0;
  // Unmaps the session's buffers (session closed or expired).
  virtual void DropSession(uint64_t session) = 0;
  // Checks `pieces` against the session's buffers, and may check them for
  // NaN/Inf (reads only). INVALID_ARGUMENT names the problem.
  virtual absl::Status CheckPush(uint64_t session, ShardBackend& backend,
                                 absl::Span<const IpcPushPiece> pieces) = 0;
  // Adds `pieces` into the accumulators; returns once the adds completed
  // (the trainer may reuse its buffer then). An exporter whose CheckPush
  // left the NaN/Inf check to this call refuses here (INVALID_ARGUMENT)
  // with nothing added.
  virtual absl::Status ApplyPush(uint64_t session, ShardBackend& backend,
                                 absl::Span<const IpcPushPiece> pieces) = 0;
  // The double-buffer slot (0 or 1) of the published buffers holding
  // `version` (the pin page's slot index). NOT_FOUND: not held.
  virtual absl::StatusOr<int> SlotOf(ShardBackend& backend, int64_t version) = 0;
};

using IpcExporterFactory = std::function<absl::StatusOr<std::unique_ptr<IpcExporter>>()>;
// Called once at static init by the exporter's library. Returns true.
bool RegisterIpcExporterFactory(IpcExporterFactory factory);

// What the service sees of the daemon, consistent for one callback.
struct IpcSnapshot {
  const ModelView* view = nullptr;  // null: no model
  ShardBackend* backend = nullptr;  // null: no model
  int64_t latest = -1;              // published versions (-1: none)
  int64_t previous = -1;
};

// Implemented by the daemon (server/daemon/daemon.cc, server/daemon/daemon_push.cc).
class IpcHost {
 public:
  virtual ~IpcHost() = default;
  // Runs `fn` with the backend kept alive and no publish in between.
  virtual absl::Status WithSnapshot(const std::function<absl::Status(const IpcSnapshot&)>& fn) = 0;
  // The push rules of PushGradients for (version, pusher), now.
  virtual absl::Status CheckPush(int64_t version, const std::string& pusher) = 0;
  // Checks the rules again and that the model is still `generation`, runs
  // `apply` on the backend, then counts the pusher (`bytes` pushed), all
  // under the daemon's push lock; `apply`'s error is returned.
  virtual absl::Status CommitPush(int64_t version, const std::string& pusher, int64_t generation,
                                  int64_t bytes,
                                  const std::function<absl::Status(ShardBackend&)>& apply,
                                  rpc::PushGradientsResponse* response) = 0;
};

struct IpcServiceOptions {
  std::shared_ptr<auth::Authenticator> authenticator;  // null: no checks
  PinTableOptions pins;
  absl::Duration default_lease = absl::Seconds(5);
};

class IpcService : public rpc::DaemonIpc::CallbackService {
 public:
  // `host` must outlive the service.
  IpcService(IpcHost* host, IpcServiceOptions options);
  ~IpcService() override;

  // The daemon's step, before it rewrites the buffers of `version`
  // (model `generation`): waits while a live session pins it (logging the
  // holders); CANCELLED once Shutdown. Pair with EndRetire after the
  // step's outcome is recorded.
  absl::Status RetireForStep(int64_t generation, int64_t version);
  void EndRetire(int64_t generation, int64_t version);
  // The daemon's step thread, after EndRetire (or a load's first publish):
  // `backend` publishes `latest` and `previous` (-1: none) of `generation`
  // now; the sessions' pin pages offer them for pinning without an RPC
  // (ipc/pin_page.h). Before the daemon answers waiters of `latest`.
  void Published(int64_t generation, ShardBackend* backend, int64_t latest, int64_t previous);
  // Refuses new sessions, fails a RetireForStep, stops the socket.
  void Shutdown();

  PinTable& pins() { return pins_; }

  grpc::ServerUnaryReactor* OpenIpcSession(grpc::CallbackServerContext* context,
                                           const rpc::OpenIpcSessionRequest* request,
                                           rpc::OpenIpcSessionResponse* response) override;
  grpc::ServerUnaryReactor* IpcKeepAlive(grpc::CallbackServerContext* context,
                                         const rpc::IpcKeepAliveRequest* request,
                                         rpc::IpcKeepAliveResponse* response) override;
  grpc::ServerUnaryReactor* CloseIpcSession(grpc::CallbackServerContext* context,
                                            const rpc::CloseIpcSessionRequest* request,
                                            rpc::CloseIpcSessionResponse* response) override;
  grpc::ServerUnaryReactor* PinIpc(grpc::CallbackServerContext* context,
                                   const rpc::PinIpcRequest* request,
                                   rpc::PinIpcResponse* response) override;
  grpc::ServerUnaryReactor* UnpinIpc(grpc::CallbackServerContext* context,
                                     const rpc::UnpinIpcRequest* request,
                                     rpc::UnpinIpcResponse* response) override;
  grpc::ServerUnaryReactor* PushGradientsIpc(grpc::CallbackServerContext* context,
                                             const rpc::PushGradientsIpcRequest* request,
                                             rpc::PushGradientsResponse* response) override;

 private:
  // The exporter and the socket, created on the first session.
  absl::StatusOr<IpcExporter*> Ready();
  // The exporter alone (created if the factory exists; null if none).
  IpcExporter* ExporterOrNull();
  absl::Status Open(const rpc::OpenIpcSessionRequest& request,
                    rpc::OpenIpcSessionResponse* response);
  absl::Status Pin(const rpc::PinIpcRequest& request, rpc::PinIpcResponse* response);
  absl::Status Push(const rpc::PushGradientsIpcRequest& request,
                    rpc::PushGradientsResponse* response);
  FdReply OnSocket(const FdRequest& request, int fd);

  IpcHost* const host_;
  const IpcServiceOptions options_;
  PinTable pins_;
  absl::Mutex mu_;
  std::unique_ptr<IpcExporter> exporter_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<FdSocketServer> socket_ ABSL_GUARDED_BY(mu_);
  bool no_exporter_ ABSL_GUARDED_BY(mu_) = false;  // the factory failed or is absent
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace ipc
}  // namespace paramd

#endif  // PARAMD_SERVER_IPC_IPC_SERVICE_H_
