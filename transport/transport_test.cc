#include "transport/transport.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "gtest/gtest.h"

namespace paramd {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// A backend that only exists in this test, to exercise the registry.
class FakeEndpoint : public TransportEndpoint {
 public:
  explicit FakeEndpoint(std::string address) : address_(std::move(address)) {}
  std::string address() const override { return address_; }
  absl::StatusOr<std::unique_ptr<Transport>> Connect(int,
                                                     const std::vector<std::string>&) override {
    return absl::UnimplementedError("fake");
  }

 private:
  std::string address_;
};

const TransportRegistration kFake(
    "fake",
    [](const TransportOptions& options) -> absl::StatusOr<std::unique_ptr<TransportEndpoint>> {
      return std::make_unique<FakeEndpoint>("fake:" + options.listen_address);
    });
const TransportRegistration kBroken(
    "broken",
    [](const TransportOptions&) -> absl::StatusOr<std::unique_ptr<TransportEndpoint>> {
      return absl::UnavailableError("no device");
    },
    [] { return absl::UnavailableError("no device"); });

TEST(TransportRegistryTest, OpensByName) {
  TransportOptions options;
  options.listen_address = "x";
  absl::StatusOr<std::unique_ptr<TransportEndpoint>> e = OpenTransportEndpoint("fake", options);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ((*e)->address(), "fake:x");
  EXPECT_TRUE(ProbeTransport("fake").ok());
  EXPECT_EQ(RegisteredTransports(), (std::vector<std::string>{"broken", "fake"}));
}

TEST(TransportRegistryTest, UnknownAndFailingBackends) {
  absl::StatusOr<std::unique_ptr<TransportEndpoint>> e = OpenTransportEndpoint("carrier-pigeon");
  EXPECT_EQ(e.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(e.status().message().find("broken, fake"), std::string::npos) << e.status();
  EXPECT_EQ(ProbeTransport("carrier-pigeon").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ProbeTransport("broken").code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(OpenTransportEndpoint("broken").status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(ConnectInProcessWorld("fake", 2).status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(ConnectInProcessWorld("fake", 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MaxIgnoringNanTest, FollowsTheAmaxRule) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(MaxIgnoringNan(nan, 2.0f), 2.0f);
  EXPECT_EQ(MaxIgnoringNan(2.0f, nan), 2.0f);
  EXPECT_TRUE(std::isnan(MaxIgnoringNan(nan, nan)));
  EXPECT_EQ(MaxIgnoringNan(inf, 2.0f), inf);
  EXPECT_EQ(MaxIgnoringNan(-inf, -2.0f), -2.0f);
  EXPECT_EQ(Bits(MaxIgnoringNan(-0.0f, 0.0f)), 0u);
  EXPECT_EQ(Bits(MaxIgnoringNan(0.0f, -0.0f)), 0u);
  EXPECT_EQ(Bits(MaxIgnoringNan(-0.0f, -0.0f)), 0x80000000u);
  EXPECT_EQ(MaxIgnoringNan(-3.0f, -7.0f), -3.0f);
}

}  // namespace
}  // namespace paramd

namespace paramd {
namespace {

TEST(AdvertisedAddressTest, WildcardsBecomeTheAdvertisedHost) {
  EXPECT_EQ(AdvertisedAddress("0.0.0.0", 7070, "pod-0.svc"), "pod-0.svc:7070");
  EXPECT_EQ(AdvertisedAddress("[::]", 1, "pod-0.svc"), "pod-0.svc:1");
  EXPECT_EQ(AdvertisedAddress("::", 1, "fd00::5"), "[fd00::5]:1");
  EXPECT_EQ(AdvertisedAddress("10.0.0.4", 9, "pod-0.svc"), "10.0.0.4:9");
  EXPECT_EQ(AdvertisedAddress("::1", 9, ""), "[::1]:9");
  EXPECT_EQ(AdvertisedAddress("[::1]", 9, ""), "[::1]:9");
  const std::string own = AdvertisedAddress("0.0.0.0", 5, "");
  EXPECT_NE(own, "0.0.0.0:5");
  EXPECT_TRUE(own.size() > 2 && own.substr(own.size() - 2) == ":5") << own;
}

}  // namespace
}  // namespace paramd
