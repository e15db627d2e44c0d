#include "transport/channel_secret.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "transport/host_transport.h"

namespace paramd {
namespace {

std::unique_ptr<TransportEndpoint> Open(const TransportOptions& options) {
  absl::StatusOr<std::unique_ptr<TransportEndpoint>> e = OpenHostEndpoint(options);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? *std::move(e) : nullptr;
}

absl::Time In(absl::Duration d) { return absl::Now() + d; }

// The bootstrap of a device channel: the daemon's endpoint (rank 0) knows
// the secret from the start, the trainer's (rank 1) learns it after its
// endpoint is open. Before that the trainer's endpoint refuses the daemon
// (whose send is retried until it gets through); afterwards both directions
// flow. A stranger's endpoint -- without a secret, or with another
// channel's -- that claims rank 1 in the same address book gets
// UNAUTHENTICATED from the daemon's endpoint, and nothing it sent arrives.
TEST(ChannelSecretTest, OnlyTheChannelsTwoEndsTalk) {
  const std::string secret = auth::RandomSecret();
  ChannelSecret daemon_secret(secret);
  ChannelSecret trainer_secret;
  std::unique_ptr<TransportEndpoint> daemon = Open(daemon_secret.Apply({}));
  std::unique_ptr<TransportEndpoint> trainer = Open(trainer_secret.Apply({}));
  ASSERT_NE(daemon, nullptr);
  ASSERT_NE(trainer, nullptr);
  const std::vector<std::string> book = {daemon->address(), trainer->address()};
  absl::StatusOr<std::unique_ptr<Transport>> t0 = daemon->Connect(0, book);
  absl::StatusOr<std::unique_ptr<Transport>> t1 = trainer->Connect(1, book);
  ASSERT_TRUE(t0.ok() && t1.ok());

  std::thread late([&] {
    absl::SleepFor(absl::Milliseconds(300));
    trainer_secret.Set(secret);
  });
  const absl::Time start = absl::Now();
  const std::vector<uint8_t> plan = {1, 2, 3};
  const absl::Status sent = (*t0)->Send(1, 5, plan, In(absl::Seconds(10)));
  late.join();
  ASSERT_TRUE(sent.ok()) << sent;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));  // refused until Set
  std::vector<uint8_t> buffer(3);
  absl::StatusOr<size_t> got = (*t1)->Recv(0, 5, absl::MakeSpan(buffer), In(absl::Seconds(5)));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(buffer, plan);
  const std::vector<uint8_t> back = {9, 8, 7};
  ASSERT_TRUE((*t1)->Send(0, 6, back, In(absl::Seconds(10))).ok());
  got = (*t0)->Recv(1, 6, absl::MakeSpan(buffer), In(absl::Seconds(5)));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(buffer, back);

  ChannelSecret other_channel(auth::RandomSecret());
  for (const TransportOptions& options : {TransportOptions(), other_channel.Apply({})}) {
    std::unique_ptr<TransportEndpoint> stranger = Open(options);
    ASSERT_NE(stranger, nullptr);
    absl::StatusOr<std::unique_ptr<Transport>> ts =
        stranger->Connect(1, {daemon->address(), stranger->address()});
    ASSERT_TRUE(ts.ok());
    const std::vector<uint8_t> forged = {6, 6, 6};
    const absl::Status refused = (*ts)->Send(0, 7, forged, In(absl::Milliseconds(400)));
    EXPECT_EQ(refused.code(), absl::StatusCode::kUnauthenticated) << refused;
  }
  EXPECT_EQ((*t0)->Recv(1, 7, absl::MakeSpan(buffer), absl::Now()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST(ChannelSecretTest, ApplyKeepsTheBaseOptionsAndDropsTls) {
  TransportOptions base;
  base.listen_address = "127.0.0.1:0";
  base.chunk_bytes = 1 << 16;
  auth::ChannelSecurity tls_security;
  tls_security.tls.ca_pem = "not used";
  base.security = std::make_shared<const auth::ChannelSecurity>(tls_security);
  ChannelSecret secret("a-secret-of-the-channel-0123456789");
  const TransportOptions applied = secret.Apply(base);
  EXPECT_EQ(applied.listen_address, base.listen_address);
  EXPECT_EQ(applied.chunk_bytes, base.chunk_bytes);
  ASSERT_NE(applied.security, nullptr);
  EXPECT_FALSE(applied.security->tls.enabled());
  ASSERT_NE(applied.security->token, nullptr);
  EXPECT_EQ(applied.security->token->Get(), "a-secret-of-the-channel-0123456789");
  ASSERT_NE(applied.authenticator, nullptr);
  EXPECT_EQ(applied.authenticator->RoleOf("a-secret-of-the-channel-0123456789"),
            auth::Role::kCluster);
  EXPECT_EQ(applied.authenticator->RoleOf("another-secret-0123456789"), std::nullopt);
}

}  // namespace
}  // namespace paramd
