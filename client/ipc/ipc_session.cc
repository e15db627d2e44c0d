#include "client/ipc/ipc_session.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace paramd {
namespace ipc {
namespace {

std::string DefaultName() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return absl::StrCat(host, ":", getpid());
}

}  // namespace

IpcSession::IpcSession(std::shared_ptr<grpc::Channel> channel, const IpcSessionOptions& options)
    : channel_(std::move(channel)), stub_(rpc::DaemonIpc::NewStub(channel_)), options_(options) {}

void IpcSession::SetDeadline(grpc::ClientContext& context) const {
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.call_timeout));
}

absl::StatusOr<std::unique_ptr<IpcSession>> IpcSession::Open(std::shared_ptr<grpc::Channel> channel,
                                                             const IpcSessionOptions& options) {
  std::unique_ptr<IpcSession> s(new IpcSession(std::move(channel), options));
  rpc::OpenIpcSessionRequest request;
  request.set_name(options.name.empty() ? DefaultName() : options.name);
  request.set_lease_ms(absl::ToInt64Milliseconds(options.lease));
  grpc::ClientContext context;
  s->SetDeadline(context);
  grpc::Status g = s->stub_->OpenIpcSession(&context, request, &s->open_);
  if (!g.ok()) return FromGrpcStatus(g);
  if (options.keep_alive) {
    IpcSession* raw = s.get();
    s->keep_alive_ = std::thread([raw] { raw->KeepAlive(); });
  }
  return s;
}

IpcSession::~IpcSession() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (keep_alive_.joinable()) keep_alive_.join();
  if (Healthy().ok()) {
    rpc::CloseIpcSessionRequest request;
    request.set_session(id());
    rpc::CloseIpcSessionResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    stub_->CloseIpcSession(&context, request, &response);
  }
}

void IpcSession::KeepAlive() {
  const absl::Duration period = std::max(lease() / 4, absl::Milliseconds(10));
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stop), period)) return;
      if (!dead_.ok()) return;
    }
    rpc::IpcKeepAliveRequest request;
    request.set_session(id());
    rpc::IpcKeepAliveResponse response;
    grpc::ClientContext context;
    // Within the lease: a daemon that does not answer in time is as good
    // as gone for the pins.
    context.set_deadline(absl::ToChronoTime(absl::Now() + std::max(lease() / 2, period)));
    grpc::Status g = stub_->IpcKeepAlive(&context, request, &response);
    if (!g.ok()) (void)Failed(g, "keep-alive");
  }
}

absl::Status IpcSession::Failed(const grpc::Status& g, const char* what) {
  absl::Status s = FromGrpcStatus(g);
  // The session is gone when the daemon is (UNAVAILABLE; a keep-alive not
  // answered within the lease) or says so (NOT_FOUND naming the session).
  const bool fatal =
      absl::IsUnavailable(s) ||
      (absl::IsDeadlineExceeded(s) && std::string(what) == "keep-alive") ||
      (absl::IsNotFound(s) && s.message().find("IPC session") != absl::string_view::npos);
  if (fatal) {
    absl::MutexLock lock(&mu_);
    if (dead_.ok()) {
      dead_ = absl::UnavailableError(absl::StrCat(
          "the same-GPU session with the daemon (pid ", daemon_pid(), ") is gone (", what, ": ",
          s.message(), "); buffers mapped from it are no longer valid: open a new session"));
    }
    return dead_;
  }
  return s;
}

absl::Status IpcSession::Healthy() const {
  {
    absl::MutexLock lock(&mu_);
    if (!dead_.ok()) return dead_;
  }
  // A daemon process that died (or a zombie not yet reaped by its parent).
  bool gone = kill(daemon_pid(), 0) != 0 && errno == ESRCH;
  if (!gone) {
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/stat", daemon_pid());
    if (FILE* f = fopen(path, "r")) {
      int pid = 0;
      char comm[256] = {}, state = 0;
      if (fscanf(f, "%d %255s %c", &pid, comm, &state) == 3 && (state == 'Z' || state == 'X')) {
        gone = true;
      }
      fclose(f);
    }
  }
  if (gone) {
    absl::MutexLock lock(&mu_);
    if (dead_.ok()) {
      dead_ = absl::UnavailableError(absl::StrCat(
          "the daemon (pid ", daemon_pid(),
          ") of this same-GPU session died; buffers mapped from it are no longer valid"));
    }
    return dead_;
  }
  return absl::OkStatus();
}

absl::StatusOr<rpc::PinIpcResponse> IpcSession::Pin(
    int64_t version, const std::vector<rpc::TensorDirections>& tensors, int64_t unpin_version) {
  RETURN_IF_ERROR(Healthy());
  rpc::PinIpcRequest request;
  request.set_session(id());
  request.set_version(version);
  if (unpin_version >= 0) request.set_unpin_version(unpin_version);
  for (const rpc::TensorDirections& t : tensors) *request.add_tensors() = t;
  rpc::PinIpcResponse response;
  grpc::ClientContext context;
  SetDeadline(context);
  grpc::Status g = stub_->PinIpc(&context, request, &response);
  if (!g.ok()) return Failed(g, "pin");
  return response;
}

absl::Status IpcSession::Unpin(int64_t version) {
  RETURN_IF_ERROR(Healthy());
  rpc::UnpinIpcRequest request;
  request.set_session(id());
  request.set_version(version);
  rpc::UnpinIpcResponse response;
  grpc::ClientContext context;
  SetDeadline(context);
  grpc::Status g = stub_->UnpinIpc(&context, request, &response);
  if (!g.ok()) return Failed(g, "unpin");
  return absl::OkStatus();
}

absl::StatusOr<FdReply> IpcSession::SocketCall(FdOp op) {
  RETURN_IF_ERROR(Healthy());
  FdRequest r;
  r.op = op;
  r.secret = open_.socket_secret();
  r.session = id();
  absl::StatusOr<FdReply> reply = FdSocketCall(open_.socket_name(), r, -1, options_.call_timeout);
  if (!reply.ok()) return Failed(ToGrpcStatus(reply.status()), "socket");
  if (!reply->status.ok()) {
    for (int fd : reply->fds) close(fd);
    return reply->status;
  }
  return reply;
}

absl::StatusOr<FdReply> IpcSession::GetRegions() { return SocketCall(FdOp::kGetRegions); }

absl::StatusOr<std::unique_ptr<PinPage>> IpcSession::GetPinPage() {
  ASSIGN_OR_RETURN(FdReply reply, SocketCall(FdOp::kGetPinPage));
  if (reply.fds.size() != 1) {
    for (int fd : reply.fds) close(fd);
    return absl::InternalError("pin page reply without one descriptor");
  }
  return PinPage::Map(reply.fds[0]);
}

absl::Status IpcSession::RegisterBuffer(uint64_t id, int fd, uint64_t bytes) {
  RETURN_IF_ERROR(Healthy());
  FdRequest r;
  r.op = FdOp::kRegisterBuffer;
  r.secret = open_.socket_secret();
  r.session = this->id();
  r.arg0 = id;
  r.arg1 = bytes;
  absl::StatusOr<FdReply> reply = FdSocketCall(open_.socket_name(), r, fd, options_.call_timeout);
  if (!reply.ok()) return Failed(ToGrpcStatus(reply.status()), "socket");
  for (int f : reply->fds) close(f);
  return reply->status;
}

absl::StatusOr<rpc::PushGradientsResponse> IpcSession::Push(rpc::PushGradientsIpcRequest request) {
  RETURN_IF_ERROR(Healthy());
  request.set_session(id());
  rpc::PushGradientsResponse response;
  grpc::ClientContext context;
  SetDeadline(context);
  grpc::Status g = stub_->PushGradientsIpc(&context, request, &response);
  if (!g.ok()) return Failed(g, "push");
  return response;
}

}  // namespace ipc
}  // namespace paramd
