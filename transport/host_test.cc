#include "transport/host_transport.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "auth/security.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/transport.grpc.pb.h"
#include "transport/conformance_test_lib.h"
#include "transport/transport.h"

namespace paramd {
namespace {

TransportConformanceParam SmallChunks() {
  TransportOptions options;
  options.chunk_bytes = 64 << 10;
  TransportConformanceParam param = RegistryConformanceParam("host", options);
  param.name = "host_64k_chunks";
  param.max_message_bytes = 5 << 20;
  return param;
}

INSTANTIATE_TEST_SUITE_P(Host, TransportConformanceTest,
                         ::testing::Values(RegistryConformanceParam("host"), SmallChunks()),
                         ConformanceParamName);

std::unique_ptr<TransportEndpoint> Open(const TransportOptions& options = {}) {
  absl::StatusOr<std::unique_ptr<TransportEndpoint>> e = OpenHostEndpoint(options);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? *std::move(e) : nullptr;
}

int PortOf(const std::string& address) {
  int port = 0;
  EXPECT_TRUE(absl::SimpleAtoi(address.substr(address.rfind(':') + 1), &port)) << address;
  return port;
}

TEST(HostTransportTest, ListensOnLoopbackAndReportsThePort) {
  std::unique_ptr<TransportEndpoint> e = Open();
  ASSERT_NE(e, nullptr);
  EXPECT_TRUE(absl::StartsWith(e->address(), "127.0.0.1:")) << e->address();
  EXPECT_GT(PortOf(e->address()), 0);
  EXPECT_TRUE(ProbeTransport("host").ok());
}

// A wildcard listen is dialled at the advertised host (a daemon's
// --advertise_address host), else at this machine's name; never at a
// wildcard address.
TEST(HostTransportTest, AWildcardListenAdvertisesTheGivenHost) {
  TransportOptions options;
  options.listen_address = "0.0.0.0:0";
  options.advertise_host = "daemon-3.paramd.example.svc";
  absl::StatusOr<std::unique_ptr<TransportEndpoint>> e = OpenHostEndpoint(options);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_TRUE(absl::StartsWith((*e)->address(), "daemon-3.paramd.example.svc:")) << (*e)->address();
  EXPECT_GT(PortOf((*e)->address()), 0);
  options.advertise_host.clear();
  e = OpenHostEndpoint(options);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_FALSE(absl::StartsWith((*e)->address(), "0.0.0.0:")) << (*e)->address();
  // A specific listen host is what peers dial, whatever the advertised host.
  options.listen_address = "127.0.0.1:0";
  options.advertise_host = "daemon-3.paramd.example.svc";
  e = OpenHostEndpoint(options);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_TRUE(absl::StartsWith((*e)->address(), "127.0.0.1:")) << (*e)->address();
}

TEST(HostTransportTest, RejectsBadOptions) {
  TransportOptions options;
  options.chunk_bytes = 0;
  EXPECT_EQ(OpenHostEndpoint(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.chunk_bytes = 4 << 20;
  EXPECT_EQ(OpenHostEndpoint(options).status().code(), absl::StatusCode::kInvalidArgument);
  options = TransportOptions();
  options.listen_address = "127.0.0.1";
  EXPECT_EQ(OpenHostEndpoint(options).status().code(), absl::StatusCode::kInvalidArgument);
  // A port that is taken cannot be bound a second time.
  std::unique_ptr<TransportEndpoint> first = Open();
  ASSERT_NE(first, nullptr);
  options.listen_address = first->address();
  EXPECT_EQ(OpenHostEndpoint(options).status().code(), absl::StatusCode::kUnavailable);
}

TEST(HostTransportTest, UnreachablePeerIsUnavailableQuickly) {
  std::unique_ptr<TransportEndpoint> alive = Open();
  std::unique_ptr<TransportEndpoint> dead = Open();
  ASSERT_NE(alive, nullptr);
  ASSERT_NE(dead, nullptr);
  const std::vector<std::string> book = {alive->address(), dead->address()};
  dead.reset();  // nobody listens there any more
  absl::StatusOr<std::unique_ptr<Transport>> t = alive->Connect(0, book);
  ASSERT_TRUE(t.ok()) << t.status();
  const std::vector<uint8_t> message(100, 7);
  for (int attempt = 0; attempt < 3; ++attempt) {
    const absl::Time start = absl::Now();
    EXPECT_EQ((*t)->Send(1, 0, message, start + absl::Seconds(30)).code(),
              absl::StatusCode::kUnavailable);
    EXPECT_EQ((*t)->CanConnect(1, start + absl::Seconds(30)).code(),
              absl::StatusCode::kUnavailable);
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  }
}

TEST(HostTransportTest, CanConnectDetectsAWrongAddressBook) {
  std::unique_ptr<TransportEndpoint> a = Open(), b = Open(), c = Open();
  ASSERT_TRUE(a && b && c);
  const std::vector<std::string> book = {a->address(), b->address()};
  absl::StatusOr<std::unique_ptr<Transport>> ta = a->Connect(0, book);
  absl::StatusOr<std::unique_ptr<Transport>> tb = b->Connect(1, book);
  ASSERT_TRUE(ta.ok() && tb.ok());
  // c believes rank 1 is at a's address.
  absl::StatusOr<std::unique_ptr<Transport>> tc = c->Connect(0, {c->address(), a->address()});
  ASSERT_TRUE(tc.ok());
  EXPECT_EQ((*tc)->CanConnect(1, absl::Now() + absl::Seconds(10)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*ta)->CanConnect(1, absl::Now() + absl::Seconds(10)).ok());
}

TEST(HostTransportTest, ConnectChecksTheBookAndRunsOnce) {
  std::unique_ptr<TransportEndpoint> e = Open();
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->Connect(1, {e->address()}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e->Connect(0, {"127.0.0.1:1"}).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<Transport>> t = e->Connect(0, {e->address()});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->backend(), "host");
  EXPECT_EQ(e->Connect(0, {e->address()}).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(HostTransportTest, MessagesArrivingBeforeConnectAreKept) {
  std::unique_ptr<TransportEndpoint> e0 = Open(), e1 = Open();
  ASSERT_TRUE(e0 && e1);
  const std::vector<std::string> book = {e0->address(), e1->address()};
  absl::StatusOr<std::unique_ptr<Transport>> t0 = e0->Connect(0, book);
  ASSERT_TRUE(t0.ok());
  const std::vector<uint8_t> message = {4, 5, 6};
  ASSERT_TRUE((*t0)->Send(1, 2, message, absl::Now() + absl::Seconds(10)).ok());
  absl::StatusOr<std::unique_ptr<Transport>> t1 = e1->Connect(1, book);
  ASSERT_TRUE(t1.ok());
  std::vector<uint8_t> buffer(3);
  absl::StatusOr<size_t> got = (*t1)->Recv(0, 2, absl::MakeSpan(buffer), absl::Now());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(buffer, message);
}

// The server refuses malformed streams instead of queueing garbage.
TEST(HostTransportTest, ServerValidatesStreams) {
  std::unique_ptr<TransportEndpoint> e = Open();
  ASSERT_NE(e, nullptr);
  std::unique_ptr<transport::DataPlane::Stub> stub = transport::DataPlane::NewStub(
      grpc::CreateChannel(e->address(), grpc::InsecureChannelCredentials()));
  auto send = [&](const std::vector<transport::DeliverChunk>& chunks) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    transport::DeliverResponse response;
    auto writer = stub->Deliver(&context, &response);
    for (const auto& c : chunks) writer->Write(c);
    writer->WritesDone();
    return writer->Finish().error_code();
  };
  transport::DeliverChunk no_header;
  no_header.set_data("abc");
  EXPECT_EQ(send({no_header}), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(send({}), grpc::StatusCode::INVALID_ARGUMENT);
  transport::DeliverChunk header;
  header.mutable_header()->set_src_rank(0);
  header.mutable_header()->set_tag(1);
  header.mutable_header()->set_total_bytes(2);
  header.set_data("abc");
  EXPECT_EQ(send({header}), grpc::StatusCode::INVALID_ARGUMENT);  // too many bytes
  header.set_data("a");
  EXPECT_EQ(send({header}), grpc::StatusCode::INVALID_ARGUMENT);  // too few
  header.set_data("ab");
  EXPECT_EQ(send({header}), grpc::StatusCode::OK);
  // Only the well-formed message was queued.
  absl::StatusOr<std::unique_ptr<Transport>> t = e->Connect(0, {e->address()});
  ASSERT_TRUE(t.ok());
  std::vector<uint8_t> buffer(8);
  absl::StatusOr<size_t> got = (*t)->Recv(0, 1, absl::MakeSpan(buffer), absl::Now());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, 2u);
  EXPECT_EQ((*t)->Recv(0, 1, absl::MakeSpan(buffer), absl::Now()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

// A message or goodbye from a rank outside the world is refused and
// changes nothing: a later Recv from a real rank is unaffected.
TEST(HostTransportTest, SendersOutsideTheWorldAreRefused) {
  std::unique_ptr<TransportEndpoint> e0 = Open(), e1 = Open();
  ASSERT_TRUE(e0 && e1);
  const std::vector<std::string> book = {e0->address(), e1->address()};
  absl::StatusOr<std::unique_ptr<Transport>> t0 = e0->Connect(0, book);
  ASSERT_TRUE(t0.ok()) << t0.status();
  std::unique_ptr<transport::DataPlane::Stub> stub = transport::DataPlane::NewStub(
      grpc::CreateChannel(e0->address(), grpc::InsecureChannelCredentials()));
  for (int src : {99, 2, -1}) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    transport::DeliverResponse response;
    auto writer = stub->Deliver(&context, &response);
    transport::DeliverChunk chunk;
    chunk.mutable_header()->set_src_rank(src);
    chunk.mutable_header()->set_tag(3);
    chunk.mutable_header()->set_total_bytes(1);
    chunk.set_data("x");
    writer->Write(chunk);
    writer->WritesDone();
    const grpc::Status delivered = writer->Finish();
    EXPECT_EQ(delivered.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << src;
    EXPECT_NE(delivered.error_message().find(absl::StrCat("sender rank ", src)), std::string::npos)
        << delivered.error_message();
    grpc::ClientContext bye_context;
    transport::GoodbyeRequest bye;
    bye.set_src_rank(src);
    transport::GoodbyeResponse gone;
    EXPECT_EQ(stub->Goodbye(&bye_context, bye, &gone).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT)
        << src;
  }
  // Rank 1 is a peer: its message arrives, and nothing of the refused ones.
  absl::StatusOr<std::unique_ptr<Transport>> t1 = e1->Connect(1, book);
  ASSERT_TRUE(t1.ok()) << t1.status();
  const std::vector<uint8_t> message = {7};
  ASSERT_TRUE((*t1)->Send(0, 3, message, absl::Now() + absl::Seconds(10)).ok());
  std::vector<uint8_t> buffer(1);
  absl::StatusOr<size_t> got =
      (*t0)->Recv(1, 3, absl::MakeSpan(buffer), absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(buffer, message);
}

// With an authenticator, the DataPlane service is cluster-internal: a
// stranger's Deliver/Ping/Goodbye are refused (UNAUTHENTICATED) and queue
// nothing; peers presenting the cluster secret are served, even when the
// receiving endpoint learns the secret only after the send started (a
// daemon still reading its Join reply): the refused send is retried.
TEST(HostTransportTest, StrangersAreRefusedAndPeersRetryUntilTheSecretIsKnown) {
  const std::string secret = auth::RandomSecret();
  auto a0 = std::make_shared<auth::Authenticator>(std::vector<auth::TokenEntry>());
  auto a1 = std::make_shared<auth::Authenticator>(std::vector<auth::TokenEntry>());
  a0->AddClusterSecret(secret);  // a1 learns it late
  auto security = std::make_shared<const auth::ChannelSecurity>(
      auth::ChannelSecurity{{}, std::make_shared<auth::BearerToken>(secret)});
  TransportOptions o0, o1;
  o0.authenticator = a0;
  o1.authenticator = a1;
  o0.security = o1.security = security;
  std::unique_ptr<TransportEndpoint> e0 = Open(o0), e1 = Open(o1);
  ASSERT_NE(e0, nullptr);
  ASSERT_NE(e1, nullptr);

  for (const std::string& token : {std::string(), std::string("wrong-secret-0123456789")}) {
    auto stub = transport::DataPlane::NewStub(
        auth::CreateChannel(e0->address(), {{}, std::make_shared<auth::BearerToken>(token)}));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    transport::DeliverResponse response;
    auto writer = stub->Deliver(&context, &response);
    transport::DeliverChunk forged;
    forged.mutable_header()->set_src_rank(1);
    forged.mutable_header()->set_tag(7);
    forged.mutable_header()->set_total_bytes(2);
    forged.set_data("xx");
    writer->Write(forged);
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
    grpc::ClientContext ping_context;
    transport::PingResponse pong;
    EXPECT_EQ(stub->Ping(&ping_context, transport::PingRequest(), &pong).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    grpc::ClientContext bye_context;
    transport::GoodbyeRequest bye;
    bye.set_src_rank(1);
    transport::GoodbyeResponse gone;
    EXPECT_EQ(stub->Goodbye(&bye_context, bye, &gone).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }

  const std::vector<std::string> book = {e0->address(), e1->address()};
  absl::StatusOr<std::unique_ptr<Transport>> t0 = e0->Connect(0, book);
  absl::StatusOr<std::unique_ptr<Transport>> t1 = e1->Connect(1, book);
  ASSERT_TRUE(t0.ok() && t1.ok());
  std::thread late([&] {
    absl::SleepFor(absl::Milliseconds(300));
    a1->AddClusterSecret(secret);
  });
  const absl::Time start = absl::Now();
  const std::vector<uint8_t> message = {1, 2, 3};
  const absl::Status sent = (*t0)->Send(1, 5, message, absl::Now() + absl::Seconds(10));
  late.join();
  ASSERT_TRUE(sent.ok()) << sent;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));  // it was refused first
  std::vector<uint8_t> buffer(3);
  absl::StatusOr<size_t> got =
      (*t1)->Recv(0, 5, absl::MakeSpan(buffer), absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(buffer, message);
  // The stranger's forged message (tag 7 from "rank 1") never arrived.
  EXPECT_EQ((*t0)->Recv(1, 7, absl::MakeSpan(buffer), absl::Now()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  // A peer without the secret fails at its deadline with UNAUTHENTICATED.
  auto a2 = std::make_shared<auth::Authenticator>(std::vector<auth::TokenEntry>());
  TransportOptions o2;
  o2.authenticator = a2;
  o2.security = security;
  std::unique_ptr<TransportEndpoint> e2 = Open(o2);
  ASSERT_NE(e2, nullptr);
  TransportOptions unauthenticated;
  std::unique_ptr<TransportEndpoint> e3 = Open(unauthenticated);
  ASSERT_NE(e3, nullptr);
  absl::StatusOr<std::unique_ptr<Transport>> t3 = e3->Connect(1, {e2->address(), e3->address()});
  ASSERT_TRUE(t3.ok());
  const absl::Status refused = (*t3)->Send(0, 1, message, absl::Now() + absl::Milliseconds(400));
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnauthenticated) << refused;
}

}  // namespace
}  // namespace paramd
