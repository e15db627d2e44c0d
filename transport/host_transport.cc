#include "transport/host_transport.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "auth/security.h"
#include "common/grpc_status.h"
#include "grpcpp/grpcpp.h"
#include "proto/transport.grpc.pb.h"
#include "transport/message_transport.h"

namespace paramd {
namespace {

using transport_internal::Mailbox;
using transport_internal::MessageTransport;

constexpr int64_t kMaxChunkBytes = int64_t{3} << 20;
constexpr absl::Duration kGoodbyeTimeout = absl::Milliseconds(500);
constexpr absl::Duration kServerDrain = absl::Seconds(1);
// Between retries of a call a peer refused as UNAUTHENTICATED (it has not
// learned the cluster secret yet).
constexpr absl::Duration kUnauthenticatedRetry = absl::Milliseconds(50);

// What the server's handlers and the transport share; outlives both.
struct HostNode {
  std::shared_ptr<Mailbox> mailbox = std::make_shared<Mailbox>();
  std::atomic<int> rank{-1};
  std::atomic<int> world_size{0};  // 0 until this endpoint's world is formed
  // TransportOptions::authenticator / security (null: open, plaintext).
  std::shared_ptr<auth::Authenticator> authenticator;
  std::shared_ptr<const auth::ChannelSecurity> security;
};

// A message or goodbye names its sender: a rank of this world (any rank
// >= 0 before the world is formed, when a faster peer may already send).
// Anything else is refused and queues nothing.
grpc::Status CheckSenderRank(const HostNode& node, int64_t src) {
  const int world = node.world_size.load();
  if (src < 0 || (world > 0 && src >= world)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("sender rank ", src, " is outside ",
                                     world > 0 ? absl::StrCat("the world of ", world)
                                               : std::string("every world")));
  }
  return grpc::Status::OK;
}

// Receives one message: the first chunk names it, the rest append bytes.
// Runs on gRPC's threads; deletes itself when the call is done.
class DeliverReactor final : public grpc::ServerReadReactor<transport::DeliverChunk> {
 public:
  DeliverReactor(grpc::CallbackServerContext* context, std::shared_ptr<HostNode> node)
      : context_(context), node_(std::move(node)) {
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // end of the stream (or cancellation)
      Finish(Complete());
      return;
    }
    if (!have_header_) {
      if (!chunk_.has_header()) {
        Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "first chunk has no header"));
        return;
      }
      header_ = chunk_.header();
      if (grpc::Status s = CheckSenderRank(*node_, header_.src_rank()); !s.ok()) {
        Finish(s);
        return;
      }
      have_header_ = true;
      bytes_.reserve(std::min<uint64_t>(header_.total_bytes(), uint64_t{1} << 30));
    }
    if (bytes_.size() + chunk_.data().size() > header_.total_bytes()) {
      Finish(
          grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                       absl::StrCat("more than the announced ", header_.total_bytes(), " bytes")));
      return;
    }
    bytes_.append(chunk_.data());
    StartRead(&chunk_);
  }

  void OnDone() override { delete this; }

 private:
  grpc::Status Complete() {
    if (context_->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "sender went away");
    }
    if (!have_header_) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "empty message stream");
    }
    if (bytes_.size() != header_.total_bytes()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("stream ended after ", bytes_.size(), " of ",
                                       header_.total_bytes(), " bytes"));
    }
    return ToGrpcStatus(
        node_->mailbox->Deliver(header_.src_rank(), header_.tag(), std::move(bytes_)));
  }

  grpc::CallbackServerContext* const context_;
  const std::shared_ptr<HostNode> node_;
  transport::DeliverChunk chunk_;
  transport::MessageHeader header_;
  bool have_header_ = false;
  std::string bytes_;
};

class DataPlaneService final : public transport::DataPlane::CallbackService {
 public:
  explicit DataPlaneService(std::shared_ptr<HostNode> node) : node_(std::move(node)) {}

  grpc::ServerReadReactor<transport::DeliverChunk>* Deliver(
      grpc::CallbackServerContext* context, transport::DeliverResponse* /*response*/) override {
    if (grpc::Status s = auth::Authorize(node_->authenticator.get(), *context,
                                         "/paramd.transport.DataPlane/Deliver");
        !s.ok()) {
      return auth::RefusedReader<transport::DeliverChunk>(s);
    }
    return new DeliverReactor(context, node_);
  }

  grpc::ServerUnaryReactor* Ping(grpc::CallbackServerContext* context,
                                 const transport::PingRequest* /*request*/,
                                 transport::PingResponse* response) override {
    if (grpc::Status s = auth::Authorize(node_->authenticator.get(), *context,
                                         "/paramd.transport.DataPlane/Ping");
        !s.ok()) {
      return auth::RefusedUnary(context, s);
    }
    response->set_rank(node_->rank.load());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* Goodbye(grpc::CallbackServerContext* context,
                                    const transport::GoodbyeRequest* request,
                                    transport::GoodbyeResponse* /*response*/) override {
    if (grpc::Status s = auth::Authorize(node_->authenticator.get(), *context,
                                         "/paramd.transport.DataPlane/Goodbye");
        !s.ok()) {
      return auth::RefusedUnary(context, s);
    }
    grpc::Status status = CheckSenderRank(*node_, request->src_rank());
    if (status.ok()) node_->mailbox->MarkGone(request->src_rank());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(status);
    return reactor;
  }

 private:
  const std::shared_ptr<HostNode> node_;
};

// The endpoint's gRPC server; stops (bounded) when destroyed.
class HostServer {
 public:
  static absl::StatusOr<std::unique_ptr<HostServer>> Start(const std::string& listen_address,
                                                           const std::string& advertise_host,
                                                           std::shared_ptr<HostNode> node) {
    const size_t colon = listen_address.rfind(':');
    int requested_port = -1;
    if (colon == std::string::npos ||
        !absl::SimpleAtoi(listen_address.substr(colon + 1), &requested_port)) {
      return absl::InvalidArgumentError(
          absl::StrCat("listen address '", listen_address, "' is not host:port"));
    }
    std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
    if (node->security != nullptr) {
      absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> c =
          auth::ServerCredentials(node->security->tls);
      if (!c.ok()) return c.status();
      credentials = *c;
    }
    auto server = std::unique_ptr<HostServer>(new HostServer(std::move(node)));
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(listen_address, credentials, &port);
    auth::AddKeepalive(&builder);
    builder.RegisterService(&server->service_);
    builder.SetMaxReceiveMessageSize(static_cast<int>(kMaxChunkBytes + (int64_t{64} << 10)));
    // A fixed port that is taken must fail here, not be shared.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    server->server_ = builder.BuildAndStart();
    if (server->server_ == nullptr || port == 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", listen_address));
    }
    server->address_ = AdvertisedAddress(listen_address.substr(0, colon), port, advertise_host);
    return server;
  }

  ~HostServer() {
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now() + kServerDrain));
  }

  const std::string& address() const { return address_; }

 private:
  explicit HostServer(std::shared_ptr<HostNode> node) : service_(std::move(node)) {}

  DataPlaneService service_;
  std::unique_ptr<grpc::Server> server_;  // destroyed before service_
  std::string address_;
};

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const auth::ChannelSecurity* security) {
  grpc::ChannelArguments args;
  // A peer that was down is retried soon after it comes up.
  auth::AddFastReconnect(&args);
  // Transports in one process (tests) do not share connections or backoff.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return auth::CreateChannel(address, security != nullptr ? *security : auth::ChannelSecurity(),
                             args);
}

class HostTransport final : public MessageTransport {
 public:
  HostTransport(int rank, std::vector<std::string> addresses, std::shared_ptr<HostNode> node,
                std::unique_ptr<HostServer> server, int64_t chunk_bytes)
      : MessageTransport(rank, static_cast<int>(addresses.size()), node->mailbox),
        addresses_(std::move(addresses)),
        node_(std::move(node)),
        server_(std::move(server)),
        chunk_bytes_(chunk_bytes) {
    for (const std::string& address : addresses_) {
      stubs_.push_back(transport::DataPlane::NewStub(MakeChannel(address, node_->security.get())));
    }
    node_->world_size.store(static_cast<int>(addresses_.size()));
    node_->rank.store(rank);
  }

  ~HostTransport() override { Shutdown(); }

  absl::string_view backend() const override { return "host"; }

  absl::Status CanConnect(int peer, absl::Time deadline) override {
    if (absl::Status s = CheckPeer(peer); !s.ok()) return s;
    transport::PingRequest request;
    request.set_src_rank(rank());
    transport::PingResponse response;
    grpc::Status status;
    do {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(deadline));
      status = stubs_[peer]->Ping(&context, request, &response);
    } while (RetryUnauthenticated(status, deadline));
    if (!status.ok()) return PeerError(peer, status, "ping");
    if (response.rank() != -1 && response.rank() != peer) {
      return absl::FailedPreconditionError(absl::StrCat(addresses_[peer], " answers as rank ",
                                                        response.rank(), ", not ", peer,
                                                        ": the address book is wrong"));
    }
    return absl::OkStatus();
  }

  void Shutdown() override {
    if (stopping_.exchange(true)) return;
    MessageTransport::Shutdown();  // refuse new calls, wake our Recvs
    {
      absl::MutexLock lock(&mu_);
      for (grpc::ClientContext* context : in_flight_) context->TryCancel();
    }
    SayGoodbye();
    server_.reset();
  }

 protected:
  absl::Status DoSend(int peer, uint64_t tag, absl::Span<const uint8_t> bytes,
                      absl::Time deadline) override {
    grpc::Status status;
    // A refused stream delivered nothing (the check precedes the first
    // read), so resending after UNAUTHENTICATED cannot duplicate.
    do {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(deadline));
      {
        absl::MutexLock lock(&mu_);
        if (shut_down()) return absl::FailedPreconditionError("transport is shut down");
        in_flight_.insert(&context);
      }
      status = Stream(peer, tag, bytes, context);
      {
        absl::MutexLock lock(&mu_);
        in_flight_.erase(&context);
      }
    } while (RetryUnauthenticated(status, deadline));
    if (status.ok()) return absl::OkStatus();
    return PeerError(peer, status, "send");
  }

 private:
  // Whether to call again after `status`: an UNAUTHENTICATED peer may
  // still be reading its Join reply (TransportOptions::authenticator);
  // sleeps kUnauthenticatedRetry first. False once the deadline is near.
  bool RetryUnauthenticated(const grpc::Status& status, absl::Time deadline) {
    if (status.error_code() != grpc::StatusCode::UNAUTHENTICATED || shut_down() ||
        absl::Now() + kUnauthenticatedRetry >= deadline) {
      return false;
    }
    absl::SleepFor(kUnauthenticatedRetry);
    return true;
  }

  grpc::Status Stream(int peer, uint64_t tag, absl::Span<const uint8_t> bytes,
                      grpc::ClientContext& context) {
    transport::DeliverResponse response;
    std::unique_ptr<grpc::ClientWriter<transport::DeliverChunk>> writer =
        stubs_[peer]->Deliver(&context, &response);
    transport::DeliverChunk chunk;
    transport::MessageHeader* header = chunk.mutable_header();
    header->set_src_rank(rank());
    header->set_tag(tag);
    header->set_total_bytes(bytes.size());
    size_t offset = 0;
    do {
      const size_t n = std::min<size_t>(chunk_bytes_, bytes.size() - offset);
      chunk.set_data(reinterpret_cast<const char*>(bytes.data()) + offset, n);
      offset += n;
      if (!writer->Write(chunk)) break;  // the stream broke: Finish says why
      chunk.clear_header();
    } while (offset < bytes.size());
    writer->WritesDone();
    return writer->Finish();
  }

  // A failed RPC to `peer`, in Transport's codes: a call cancelled by
  // anyone but us means the peer went away.
  absl::Status PeerError(int peer, const grpc::Status& status, absl::string_view what) {
    absl::Status s =
        FromGrpcStatus(status, absl::StrCat(what, " to rank ", peer, " at ", addresses_[peer]));
    if (s.code() == absl::StatusCode::kCancelled && !shut_down()) {
      return absl::UnavailableError(s.message());
    }
    return s;
  }

  // Tells every peer that this rank is leaving; bounded by kGoodbyeTimeout.
  void SayGoodbye() {
    struct Pending {
      grpc::ClientContext context;
      transport::GoodbyeRequest request;
      transport::GoodbyeResponse response;
    };
    struct Waiter {
      absl::Mutex mu;
      int outstanding ABSL_GUARDED_BY(mu) = 0;
    };
    auto waiter = std::make_shared<Waiter>();
    std::vector<std::unique_ptr<Pending>> calls;
    const absl::Time deadline = absl::Now() + kGoodbyeTimeout;
    for (int peer = 0; peer < world_size(); ++peer) {
      if (peer == rank()) continue;
      auto call = std::make_unique<Pending>();
      call->context.set_deadline(absl::ToChronoTime(deadline));
      call->request.set_src_rank(rank());
      {
        absl::MutexLock lock(&waiter->mu);
        ++waiter->outstanding;
      }
      stubs_[peer]->async()->Goodbye(&call->context, &call->request, &call->response,
                                     [waiter](const grpc::Status&) {
                                       absl::MutexLock lock(&waiter->mu);
                                       --waiter->outstanding;
                                     });
      calls.push_back(std::move(call));
    }
    absl::MutexLock lock(&waiter->mu);
    waiter->mu.Await(absl::Condition(
        +[](int* outstanding) { return *outstanding == 0; }, &waiter->outstanding));
  }

  const std::vector<std::string> addresses_;
  const std::shared_ptr<HostNode> node_;
  std::unique_ptr<HostServer> server_;
  const int64_t chunk_bytes_;
  std::vector<std::unique_ptr<transport::DataPlane::Stub>> stubs_;
  std::atomic<bool> stopping_{false};
  absl::Mutex mu_;
  absl::flat_hash_set<grpc::ClientContext*> in_flight_ ABSL_GUARDED_BY(mu_);
};

class HostEndpoint final : public TransportEndpoint {
 public:
  HostEndpoint(std::shared_ptr<HostNode> node, std::unique_ptr<HostServer> server,
               int64_t chunk_bytes)
      : node_(std::move(node)),
        server_(std::move(server)),
        address_(server_->address()),
        chunk_bytes_(chunk_bytes) {}

  ~HostEndpoint() override {
    if (server_ != nullptr) {
      server_.reset();
      node_->mailbox->Close();
    }
  }

  std::string address() const override { return address_; }

  absl::StatusOr<std::unique_ptr<Transport>> Connect(
      int rank, const std::vector<std::string>& addresses) override {
    if (server_ == nullptr) return absl::FailedPreconditionError("endpoint already connected");
    if (rank < 0 || rank >= static_cast<int>(addresses.size()) || addresses[rank] != address_) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rank, " is not this endpoint (", address_, ") in the book"));
    }
    return std::make_unique<HostTransport>(rank, addresses, node_, std::move(server_),
                                           chunk_bytes_);
  }

 private:
  const std::shared_ptr<HostNode> node_;
  std::unique_ptr<HostServer> server_;  // null once connected
  const std::string address_;
  const int64_t chunk_bytes_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<TransportEndpoint>> OpenHostEndpoint(
    const TransportOptions& options) {
  if (options.chunk_bytes < 1 || options.chunk_bytes > kMaxChunkBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes ", options.chunk_bytes, " is outside 1 .. ", kMaxChunkBytes));
  }
  auto node = std::make_shared<HostNode>();
  node->authenticator = options.authenticator;
  node->security = options.security;
  absl::StatusOr<std::unique_ptr<HostServer>> server =
      HostServer::Start(options.listen_address.empty() ? "127.0.0.1:0" : options.listen_address,
                        options.advertise_host, node);
  if (!server.ok()) return server.status();
  return std::make_unique<HostEndpoint>(std::move(node), *std::move(server), options.chunk_bytes);
}

namespace {
const TransportRegistration kHostRegistration("host", [](const TransportOptions& options) {
  return OpenHostEndpoint(options);
});
}  // namespace

}  // namespace paramd
