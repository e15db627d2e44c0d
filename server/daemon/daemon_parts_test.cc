// The daemon's small parts on their own: pusher ids bound to tokens,
// parked fetches per client, traffic counters, and the switch between
// data-plane worlds that a recovery makes.
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "server/daemon/data_plane_worlds.h"
#include "server/daemon/parked_fetches.h"
#include "server/daemon/pusher_owners.h"
#include "server/daemon/traffic_counters.h"

namespace paramd {
namespace {

TEST(PusherOwnersTest, TheFirstCommittedTokenOwnsTheId) {
  PusherOwners owners(2);
  // A refused push (bind false) binds nothing.
  EXPECT_TRUE(owners.Claim("trainer-0", "token-a", false).ok());
  EXPECT_EQ(owners.size(), 0u);
  EXPECT_TRUE(owners.Claim("trainer-0", "token-a", true).ok());
  EXPECT_TRUE(owners.Claim("trainer-0", "token-a", false).ok());
  const absl::Status other = owners.Claim("trainer-0", "token-b", false);
  EXPECT_EQ(other.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(other.message().find("trainer-0"), std::string::npos) << other;
  // A commit of another token does not take the id over either.
  EXPECT_EQ(owners.Claim("trainer-0", "token-b", true).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(owners.Claim("trainer-0", "token-b", false).code(),
            absl::StatusCode::kPermissionDenied);
  // Without a token there is no owner to check.
  EXPECT_TRUE(owners.Claim("trainer-0", "", false).ok());
}

TEST(PusherOwnersTest, TheTableIsBounded) {
  PusherOwners owners(2);
  ASSERT_TRUE(owners.Claim("a", "t", true).ok());
  ASSERT_TRUE(owners.Claim("b", "t", true).ok());
  EXPECT_EQ(owners.Claim("c", "t", false).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(owners.Claim("a", "t", false).ok());  // a bound id still pushes
  EXPECT_EQ(owners.size(), 2u);
}

TEST(ParkedFetchesTest, PerClientLimitAndAsReadyCount) {
  ParkedFetches parked(2);
  EXPECT_FALSE(parked.AsReadyParked());
  EXPECT_TRUE(parked.Park("host-a", false));
  EXPECT_TRUE(parked.Park("host-a", true));
  EXPECT_TRUE(parked.AsReadyParked());
  EXPECT_FALSE(parked.Park("host-a", false));  // at its limit
  EXPECT_TRUE(parked.Park("host-b", false));   // another host has its own
  EXPECT_EQ(parked.clients(), 2u);
  parked.Unpark("host-a", true);
  EXPECT_FALSE(parked.AsReadyParked());
  EXPECT_TRUE(parked.Park("host-a", false));
  parked.Unpark("host-a", false);
  parked.Unpark("host-a", false);
  parked.Unpark("host-b", false);
  EXPECT_EQ(parked.clients(), 0u);
  ParkedFetches none(0);
  EXPECT_FALSE(none.Park("host-a", false));
  EXPECT_EQ(none.clients(), 0u);  // a refused park leaves no entry behind
}

TEST(TrafficCountersTest, FillsTheStats) {
  TrafficCounters t;
  t.AddServed(Direction::kRowwise, 10);
  t.AddServed(Direction::kColumnwise, 7);
  t.AddServed(Direction::kRowwise, 5);
  t.pushed.fetch_add(3);
  t.device_fetches_streamed.fetch_add(2);
  rpc::DaemonStats stats;
  t.Fill(&stats);
  EXPECT_EQ(stats.bytes_served_rowwise(), 15);
  EXPECT_EQ(stats.bytes_served_columnwise(), 7);
  EXPECT_EQ(stats.bytes_pushed(), 3);
  EXPECT_EQ(stats.device_fetches_streamed(), 2);
  EXPECT_EQ(stats.device_fetches_beside_step(), 0);
}

DataPlaneWorlds::OpenFn OpenLocal(int* opens) {
  return [opens]() -> absl::StatusOr<std::unique_ptr<DaemonDataPlane>> {
    ++*opens;
    return DaemonDataPlane::Open("local", TransportOptions(), absl::Seconds(5));
  };
}

rpc::RecoverRequest RecoverOf(int64_t epoch, int rank, const std::string& address) {
  rpc::RecoverRequest r;
  r.set_epoch(epoch);
  if (!address.empty()) (*r.mutable_data_plane()->mutable_address_book())[rank] = address;
  return r;
}

TEST(DataPlaneWorldsTest, ARecoveryOpensTheNextWorldOncePerAttempt) {
  int opens = 0;
  DataPlaneWorlds worlds(OpenLocal(&opens));
  EXPECT_EQ(worlds.current(), nullptr);
  ASSERT_TRUE(worlds.OpenFirst().ok());
  DaemonDataPlane* const first_plane = worlds.current();
  ASSERT_NE(first_plane, nullptr);
  EXPECT_EQ(opens, 1);

  // Without its PrepareRecovery a Recover changes nothing.
  absl::StatusOr<std::unique_ptr<DaemonDataPlane>> refused =
      worlds.SwitchToNext(RecoverOf(3, 0, ""), 0);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(worlds.current(), first_plane);

  bool opened = false;
  absl::StatusOr<std::string> next = worlds.OpenNext(3, &opened);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_TRUE(opened);
  // The same epoch again (a retried call): the same endpoint.
  absl::StatusOr<std::string> again = worlds.OpenNext(3, &opened);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(opened);
  EXPECT_EQ(*again, *next);
  EXPECT_EQ(opens, 2);

  // A Recover naming another endpoint for this rank changes nothing.
  refused = worlds.SwitchToNext(RecoverOf(3, 0, "elsewhere:1"), 0);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find(*next), std::string::npos) << refused.status();
  EXPECT_EQ(worlds.current(), first_plane);

  // Once a Recover claimed it, the same epoch is the coordinator's next
  // attempt: a new endpoint.
  worlds.Claim(3);
  absl::StatusOr<std::string> retry = worlds.OpenNext(3, &opened);
  ASSERT_TRUE(retry.ok());
  EXPECT_TRUE(opened);
  EXPECT_EQ(opens, 3);

  absl::StatusOr<std::unique_ptr<DaemonDataPlane>> old =
      worlds.SwitchToNext(RecoverOf(3, 0, *retry), 0);
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_EQ(old->get(), first_plane);
  EXPECT_EQ(worlds.current()->address(), *retry);
  // Switched: the next world is used up.
  EXPECT_FALSE(worlds.SwitchToNext(RecoverOf(3, 0, *retry), 0).ok());
}

}  // namespace
}  // namespace paramd
