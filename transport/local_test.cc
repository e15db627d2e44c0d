#include "transport/local_transport.h"

#include <vector>

#include "gtest/gtest.h"
#include "transport/conformance_test_lib.h"
#include "transport/transport.h"

namespace paramd {
namespace {

TransportConformanceParam PrivateWorlds() {
  TransportConformanceParam param;
  param.name = "local_private";
  param.make_world = CreateLocalWorld;
  return param;
}

INSTANTIATE_TEST_SUITE_P(Local, TransportConformanceTest,
                         ::testing::Values(RegistryConformanceParam("local"), PrivateWorlds()),
                         ConformanceParamName);

TEST(LocalTransportTest, RegisteredAndProbed) {
  EXPECT_TRUE(ProbeTransport("local").ok());
  bool found = false;
  for (const std::string& name : RegisteredTransports()) found |= name == "local";
  EXPECT_TRUE(found);
}

TEST(LocalTransportTest, FabricsAreSeparate) {
  TransportOptions a, b;
  a.listen_address = "fabric-a";
  b.listen_address = "fabric-b";
  absl::StatusOr<std::unique_ptr<TransportEndpoint>> ea = OpenLocalEndpoint(a);
  absl::StatusOr<std::unique_ptr<TransportEndpoint>> eb = OpenLocalEndpoint(b);
  ASSERT_TRUE(ea.ok() && eb.ok());
  EXPECT_EQ((*ea)->address().rfind("local:fabric-a/", 0), 0u) << (*ea)->address();
  // An address book that mixes fabrics is refused.
  EXPECT_EQ((*ea)->Connect(0, {(*ea)->address(), (*eb)->address()}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The wrong own address is refused; a second Connect too.
  EXPECT_EQ((*ea)->Connect(0, {"local:fabric-a/999"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*ea)->Connect(0, {(*ea)->address()}).ok());
  EXPECT_EQ((*ea)->Connect(0, {(*ea)->address()}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(LocalTransportTest, MessagesSentBeforeConnectAreKept) {
  absl::StatusOr<std::unique_ptr<TransportEndpoint>> e0 = OpenLocalEndpoint();
  absl::StatusOr<std::unique_ptr<TransportEndpoint>> e1 = OpenLocalEndpoint();
  ASSERT_TRUE(e0.ok() && e1.ok());
  const std::vector<std::string> book = {(*e0)->address(), (*e1)->address()};
  absl::StatusOr<std::unique_ptr<Transport>> t0 = (*e0)->Connect(0, book);
  ASSERT_TRUE(t0.ok());
  const std::vector<uint8_t> message = {1, 2, 3};
  ASSERT_TRUE((*t0)->Send(1, 0, message, absl::InfiniteFuture()).ok());
  absl::StatusOr<std::unique_ptr<Transport>> t1 = (*e1)->Connect(1, book);
  ASSERT_TRUE(t1.ok());
  std::vector<uint8_t> buffer(3);
  absl::StatusOr<size_t> got = (*t1)->Recv(0, 0, absl::MakeSpan(buffer), absl::Now());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(buffer, message);
}

TEST(LocalTransportTest, RejectsEmptyWorld) { EXPECT_FALSE(CreateLocalWorld(0).ok()); }

}  // namespace
}  // namespace paramd
