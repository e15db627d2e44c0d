#include "server/ipc/ipc_service.h"

#include <unistd.h>

#include <array>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace paramd {
namespace ipc {
namespace {

constexpr char kTag[] = "ipc";

std::mutex& FactoryMu() {
  static std::mutex mu;
  return mu;
}
IpcExporterFactory& Factory() {
  static IpcExporterFactory* f = new IpcExporterFactory();
  return *f;
}

bool UsesDirection(const HybridSpec& spec, Direction d) {
  return d == Direction::kRowwise ? spec.rowwise_usage : spec.columnwise_usage;
}

// Answers a unary call at once.
template <typename Fn>
grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context,
                                 const auth::Authenticator* authenticator, const char* method,
                                 Fn&& fn) {
  if (grpc::Status s = auth::Authorize(authenticator, *context, method); !s.ok()) {
    return auth::RefusedUnary(context, s);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(fn()));
  return reactor;
}

}  // namespace

bool RegisterIpcExporterFactory(IpcExporterFactory factory) {
  std::lock_guard<std::mutex> lock(FactoryMu());
  Factory() = std::move(factory);
  return true;
}

IpcService::IpcService(IpcHost* host, IpcServiceOptions options)
    : host_(host), options_(std::move(options)), pins_(options_.pins) {
  pins_.set_on_session_end([this](uint64_t session) {
    IpcExporter* exporter = nullptr;
    {
      absl::MutexLock lock(&mu_);
      exporter = exporter_.get();
    }
    if (exporter != nullptr) exporter->DropSession(session);
    VLog(1, kTag, absl::StrCat("IPC session ", session, " ended"));
  });
}

IpcService::~IpcService() { Shutdown(); }

void IpcService::Shutdown() {
  pins_.Shutdown();
  std::unique_ptr<FdSocketServer> socket;
  {
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
    socket = std::move(socket_);
  }
  socket.reset();  // joins its thread (which may call OnSocket: not under mu_)
}

IpcExporter* IpcService::ExporterOrNull() {
  {
    absl::MutexLock lock(&mu_);
    if (exporter_ != nullptr || no_exporter_) return exporter_.get();
  }
  IpcExporterFactory factory;
  {
    std::lock_guard<std::mutex> lock(FactoryMu());
    factory = Factory();
  }
  absl::MutexLock lock(&mu_);
  if (exporter_ == nullptr && !no_exporter_) {
    absl::StatusOr<std::unique_ptr<IpcExporter>> e =
        factory ? factory()
                : absl::StatusOr<std::unique_ptr<IpcExporter>>(
                      absl::FailedPreconditionError("no exporter"));
    if (e.ok()) {
      exporter_ = *std::move(e);
    } else {
      no_exporter_ = true;
    }
  }
  return exporter_.get();
}

void IpcService::Published(int64_t generation, ShardBackend* backend, int64_t latest,
                           int64_t previous) {
  std::array<uint64_t, kPageSlots> slots = {};
  // (A backend that does not export answers SlotOf with an error: nothing
  // is offered.)
  IpcExporter* exporter = backend != nullptr ? ExporterOrNull() : nullptr;
  if (exporter != nullptr) {
    for (int64_t v : {latest, previous}) {
      if (v < 0) continue;
      absl::StatusOr<int> slot = exporter->SlotOf(*backend, v);
      if (slot.ok() && *slot >= 0 && *slot < kPageSlots) slots[*slot] = PackPin(generation, v);
    }
  }
  pins_.SetPageSlots(slots);
}

absl::StatusOr<IpcExporter*> IpcService::Ready() {
  IpcExporterFactory factory;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return absl::UnavailableError("daemon shutting down");
    if (exporter_ != nullptr && socket_ != nullptr) return exporter_.get();
  }
  {
    std::lock_guard<std::mutex> lock(FactoryMu());
    factory = Factory();
  }
  if (!factory) {
    return absl::FailedPreconditionError(
        "this daemon has no same-GPU exporter (hybrid-paramd built without --config=cuda); "
        "fetch over gRPC or NCCL instead");
  }
  absl::MutexLock lock(&mu_);
  if (exporter_ == nullptr) {
    ASSIGN_OR_RETURN(exporter_, factory());
  }
  if (socket_ == nullptr) {
    ASSIGN_OR_RETURN(socket_, FdSocketServer::Start(
                                  [this](const FdRequest& r, int fd) { return OnSocket(r, fd); }));
  }
  return exporter_.get();
}

FdReply IpcService::OnSocket(const FdRequest& request, int fd) {
  FdReply reply;
  IpcExporter* exporter;
  {
    absl::MutexLock lock(&mu_);
    exporter = exporter_.get();
  }
  if (absl::Status s = pins_.Renew(request.session); !s.ok() || exporter == nullptr) {
    if (fd >= 0) close(fd);
    reply.status = s.ok() ? absl::FailedPreconditionError("no exporter") : s;
    return reply;
  }
  switch (request.op) {
    case FdOp::kGetRegions:
      if (fd >= 0) close(fd);
      reply.status = host_->WithSnapshot([&](const IpcSnapshot& snap) -> absl::Status {
        if (snap.backend == nullptr || snap.view == nullptr) {
          return absl::FailedPreconditionError("no model loaded on this daemon");
        }
        reply.epoch = static_cast<uint64_t>(snap.view->generation);
        return exporter->Export(*snap.backend, &reply.fds, &reply.sizes);
      });
      if (!reply.status.ok()) {
        for (int f : reply.fds) close(f);
        reply.fds.clear();
        reply.sizes.clear();
      }
      return reply;
    case FdOp::kGetPinPage: {
      if (fd >= 0) close(fd);
      absl::StatusOr<std::shared_ptr<PinPage>> page = pins_.Page(request.session);
      if (!page.ok()) {
        reply.status = page.status();
      } else if (*page == nullptr) {
        reply.status = absl::NotFoundError("this session has no pin page");
      } else {
        absl::StatusOr<int> dup = (*page)->Dup();
        if (dup.ok()) {
          reply.fds.push_back(*dup);
          reply.sizes.push_back(4096);
        } else {
          reply.status = dup.status();
        }
      }
      return reply;
    }
    case FdOp::kRegisterBuffer:
      if (fd < 0) {
        reply.status = absl::InvalidArgumentError("register buffer without a descriptor");
      } else {
        reply.status = exporter->ImportBuffer(request.session, request.arg0, fd, request.arg1);
      }
      return reply;
  }
  if (fd >= 0) close(fd);
  reply.status = absl::InvalidArgumentError("unknown IPC socket operation");
  return reply;
}

absl::Status IpcService::RetireForStep(int64_t generation, int64_t version) {
  if (version < 0) return absl::OkStatus();
  return pins_.Retire({generation, version}, absl::InfiniteFuture(),
                      [version](const std::string& holders) {
                        LogWarning(kTag, absl::StrCat("the step waits: version ", version,
                                                      " (whose buffers it rewrites) is pinned "
                                                      "over IPC by ",
                                                      holders));
                      });
}

void IpcService::EndRetire(int64_t generation, int64_t version) {
  if (version >= 0) pins_.EndRetire({generation, version});
}

absl::Status IpcService::Open(const rpc::OpenIpcSessionRequest& request,
                              rpc::OpenIpcSessionResponse* response) {
  ASSIGN_OR_RETURN(IpcExporter * exporter, Ready());
  ASSIGN_OR_RETURN(std::string uuid, exporter->DeviceUuid());
  const absl::Duration lease =
      request.lease_ms() == 0 ? options_.default_lease : absl::Milliseconds(request.lease_ms());
  if (request.name().size() > 1024) return absl::InvalidArgumentError("session name too long");
  ASSIGN_OR_RETURN(uint64_t id, pins_.Open(request.name(), lease));
  // Its pin page (no RPC for the common hand-over); a session without one
  // pins over PinIpc only.
  if (absl::StatusOr<std::unique_ptr<PinPage>> page = PinPage::Create(); page.ok()) {
    pins_.AttachPage(id, std::shared_ptr<PinPage>(*std::move(page))).IgnoreError();
  } else {
    LogWarning(kTag, absl::StrCat("IPC session ", id, ": no pin page (", page.status().message(),
                                  "); versions are pinned over RPC"));
  }
  response->set_session(id);
  response->set_lease_ms(absl::ToInt64Milliseconds(lease));
  response->set_device_uuid(uuid);
  {
    absl::MutexLock lock(&mu_);
    response->set_socket_name(socket_->name());
    response->set_socket_secret(socket_->secret());
  }
  response->set_daemon_pid(getpid());
  LogInfo(kTag, absl::StrCat("IPC session ", id, " opened by ", request.name(), " (lease ",
                             absl::FormatDuration(lease), ")"));
  return absl::OkStatus();
}

absl::Status IpcService::Pin(const rpc::PinIpcRequest& request, rpc::PinIpcResponse* response) {
  ASSIGN_OR_RETURN(IpcExporter * exporter, Ready());
  int64_t generation = -1;
  RETURN_IF_ERROR(host_->WithSnapshot([&](const IpcSnapshot& snap) -> absl::Status {
    if (snap.view == nullptr || snap.backend == nullptr) {
      return absl::FailedPreconditionError("no model loaded on this daemon");
    }
    const ModelView& view = *snap.view;
    generation = view.generation;
    const int64_t version = request.version() < 0 ? snap.latest : request.version();
    if (version < 0) return absl::UnavailableError("no version published on this daemon yet");
    if (version != snap.latest && version != snap.previous) {
      return absl::NotFoundError(absl::StrCat(
          "version ", version, " is not held by this daemon (it holds ", snap.latest,
          snap.previous >= 0 ? absl::StrCat(" and ", snap.previous) : std::string(), ")"));
    }
    // Pinned before the buffers are described, under the daemon's lock: a
    // step that rewrites `version` either sees this pin and waits, or
    // marked it retiring first and the pin is refused.
    const PinKey key{generation, version};
    const bool was_pinned = [&] {
      absl::StatusOr<std::vector<PinKey>> p = pins_.Pins(request.session());
      if (!p.ok()) return false;
      for (const PinKey& k : *p) {
        if (k == key) return true;
      }
      return false;
    }();
    // Pins of an earlier model (a load came between) hold nothing back.
    RETURN_IF_ERROR(pins_.DropOtherGenerations(request.session(), generation));
    RETURN_IF_ERROR(pins_.Pin(request.session(), key));
    auto fail = [&](absl::Status s) {
      if (!was_pinned) pins_.Unpin(request.session(), key).IgnoreError();
      response->Clear();
      return s;
    };
    response->set_version(version);
    response->set_regions_epoch(static_cast<uint64_t>(generation));
    auto add_tensor = [&](int t, const rpc::TensorDirections* td) -> absl::Status {
      const TensorDef& def = view.tensors[t];
      std::vector<Direction> dirs;
      if (td == nullptr || td->directions().empty()) {
        for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
          if (UsesDirection(def.spec, d)) dirs.push_back(d);
        }
      } else {
        for (int d : td->directions()) {
          if (d != 0 && d != 1) return absl::InvalidArgumentError("bad direction");
          const Direction dir = static_cast<Direction>(d);
          if (!UsesDirection(def.spec, dir)) {
            return absl::FailedPreconditionError(absl::StrCat("tensor ", def.name, ": direction ",
                                                              d == 0 ? "rowwise" : "columnwise",
                                                              " is not published"));
          }
          dirs.push_back(dir);
        }
      }
      for (size_t i = 0; i < view.shards.size(); ++i) {
        const ShardDef& shard = view.shards[i];
        if (shard.tensor != t) continue;
        for (Direction dir : dirs) {
          ASSIGN_OR_RETURN(IpcDirectionRefs refs,
                           exporter->Describe(*snap.backend, version, static_cast<int>(i), dir));
          rpc::IpcPiece* p = response->add_pieces();
          p->set_tensor(def.name);
          p->set_direction(static_cast<rpc::Direction>(dir));
          p->set_row_begin(shard.row_begin);
          p->set_row_end(shard.row_end);
          auto set = [](rpc::IpcRef* r, const IpcBufferRef& b) {
            r->set_region(b.region);
            r->set_offset(b.offset);
          };
          set(p->mutable_data(), refs.data);
          p->set_data_bytes(refs.data_bytes);
          if (refs.scale_bytes > 0) set(p->mutable_scales(), refs.scales);
          p->set_scale_bytes(refs.scale_bytes);
          set(p->mutable_scale_inv(), refs.scale_inv);
          set(p->mutable_amax(), refs.amax);
        }
      }
      return absl::OkStatus();
    };
    if (request.tensors().empty()) {
      std::vector<bool> seen(view.tensors.size(), false);
      for (const ShardDef& s : view.shards) {
        if (seen[s.tensor]) continue;
        seen[s.tensor] = true;
        if (absl::Status s2 = add_tensor(s.tensor, nullptr); !s2.ok()) return fail(s2);
      }
    } else {
      for (const rpc::TensorDirections& td : request.tensors()) {
        const int t = view.Find(td.tensor());
        if (t < 0) {
          return fail(absl::NotFoundError(absl::StrCat("unknown tensor \"", td.tensor(), "\"")));
        }
        if (absl::Status s = add_tensor(t, &td); !s.ok()) return fail(s);
      }
    }
    return absl::OkStatus();
  }));
  if (request.has_unpin_version() && request.unpin_version() != response->version()) {
    RETURN_IF_ERROR(pins_.UnpinVersion(request.session(), request.unpin_version()));
  }
  return absl::OkStatus();
}

absl::Status IpcService::Push(const rpc::PushGradientsIpcRequest& request,
                              rpc::PushGradientsResponse* response) {
  ASSIGN_OR_RETURN(IpcExporter * exporter, Ready());
  RETURN_IF_ERROR(pins_.Renew(request.session()));
  // The push rules first, with their codes (nothing is read yet).
  RETURN_IF_ERROR(host_->CheckPush(request.version(), request.pusher_id()));
  std::vector<IpcPushPiece> pieces;
  int64_t generation = -1;
  int64_t bytes = 0;
  RETURN_IF_ERROR(host_->WithSnapshot([&](const IpcSnapshot& snap) -> absl::Status {
    if (snap.view == nullptr || snap.backend == nullptr) {
      return absl::FailedPreconditionError("no model loaded on this daemon");
    }
    const ModelView& view = *snap.view;
    generation = view.generation;
    struct Rows {
      int tensor;
      int64_t begin, end;
    };
    std::vector<Rows> seen;
    for (const rpc::IpcPushTensor& pt : request.tensors()) {
      const int t = view.Find(pt.tensor());
      if (t < 0) return absl::NotFoundError(absl::StrCat("unknown tensor \"", pt.tensor(), "\""));
      const TensorDef& def = view.tensors[t];
      if (pt.dtype() != rpc::DTYPE_FP32 && pt.dtype() != rpc::DTYPE_BF16) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", def.name, ": push dtype must be DTYPE_FP32 or DTYPE_BF16"));
      }
      const int64_t b = pt.row_begin(), e = pt.row_end();
      if (b < 0 || e <= b || e > def.rows) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", def.name, ": rows [", b, ", ", e,
                                                       ") outside [0, ", def.rows, ")"));
      }
      const int shard = view.FindShard(t, b, e);
      if (shard < 0) {
        return absl::FailedPreconditionError(absl::StrCat("tensor ", def.name, " rows [", b, ", ",
                                                          e, ") are not held by daemon rank ",
                                                          view.rank, " (re-read the manifest)"));
      }
      for (const Rows& r : seen) {
        if (r.tensor == t && r.begin < e && b < r.end) {
          return absl::InvalidArgumentError(
              absl::StrCat("tensor ", def.name, " rows overlap rows already in this push"));
        }
      }
      seen.push_back({t, b, e});
      IpcPushPiece p;
      p.shard = shard;
      p.offset = (b - view.shards[shard].row_begin) * def.cols;
      p.count = (e - b) * def.cols;
      p.bf16 = pt.dtype() == rpc::DTYPE_BF16;
      p.buffer = pt.buffer();
      p.buffer_offset = pt.offset();
      bytes += p.count * (p.bf16 ? 2 : 4);
      pieces.push_back(p);
    }
    // Reads only: a refused push changes nothing.
    return exporter->CheckPush(request.session(), *snap.backend, pieces);
  }));
  return host_->CommitPush(
      request.version(), request.pusher_id(), generation, bytes,
      [&](ShardBackend& backend) {
        return exporter->ApplyPush(request.session(), backend, pieces);
      },
      response);
}

grpc::ServerUnaryReactor* IpcService::OpenIpcSession(grpc::CallbackServerContext* context,
                                                     const rpc::OpenIpcSessionRequest* request,
                                                     rpc::OpenIpcSessionResponse* response) {
  return Answer(context, options_.authenticator.get(), "/paramd.rpc.DaemonIpc/OpenIpcSession",
                [&] { return Open(*request, response); });
}

grpc::ServerUnaryReactor* IpcService::IpcKeepAlive(grpc::CallbackServerContext* context,
                                                   const rpc::IpcKeepAliveRequest* request,
                                                   rpc::IpcKeepAliveResponse* response) {
  return Answer(context, options_.authenticator.get(), "/paramd.rpc.DaemonIpc/IpcKeepAlive",
                [&]() -> absl::Status {
                  ASSIGN_OR_RETURN(std::vector<PinKey> pins, pins_.Pins(request->session()));
                  for (const PinKey& k : pins) response->add_pinned_versions(k.second);
                  return absl::OkStatus();
                });
}

grpc::ServerUnaryReactor* IpcService::CloseIpcSession(grpc::CallbackServerContext* context,
                                                      const rpc::CloseIpcSessionRequest* request,
                                                      rpc::CloseIpcSessionResponse* response) {
  return Answer(context, options_.authenticator.get(), "/paramd.rpc.DaemonIpc/CloseIpcSession",
                [&] { return pins_.Close(request->session()); });
}

grpc::ServerUnaryReactor* IpcService::PinIpc(grpc::CallbackServerContext* context,
                                             const rpc::PinIpcRequest* request,
                                             rpc::PinIpcResponse* response) {
  return Answer(context, options_.authenticator.get(), "/paramd.rpc.DaemonIpc/PinIpc",
                [&] { return Pin(*request, response); });
}

grpc::ServerUnaryReactor* IpcService::UnpinIpc(grpc::CallbackServerContext* context,
                                               const rpc::UnpinIpcRequest* request,
                                               rpc::UnpinIpcResponse* response) {
  return Answer(context, options_.authenticator.get(), "/paramd.rpc.DaemonIpc/UnpinIpc",
                [&] { return pins_.UnpinVersion(request->session(), request->version()); });
}

grpc::ServerUnaryReactor* IpcService::PushGradientsIpc(grpc::CallbackServerContext* context,
                                                       const rpc::PushGradientsIpcRequest* request,
                                                       rpc::PushGradientsResponse* response) {
  return Answer(context, options_.authenticator.get(), "/paramd.rpc.DaemonIpc/PushGradientsIpc",
                [&] { return Push(*request, response); });
}

}  // namespace ipc
}  // namespace paramd
