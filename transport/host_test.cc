#include "transport/host_transport.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
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

}  // namespace
}  // namespace paramd
