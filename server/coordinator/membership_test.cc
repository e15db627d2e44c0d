#include "server/coordinator/membership.h"

#include "gtest/gtest.h"

namespace paramd {
namespace {

const absl::Duration kLease = absl::Milliseconds(1500);

rpc::JoinRequest Daemon(const std::string& address, const std::string& incarnation, int rank = -1) {
  rpc::JoinRequest r;
  r.set_role(rpc::ROLE_DAEMON);
  r.set_address(address);
  r.set_incarnation(incarnation);
  if (rank >= 0) r.set_rank(rank);
  return r;
}

rpc::HeartbeatRequest Beat(const rpc::Member& m) {
  rpc::HeartbeatRequest h;
  h.set_rank(m.rank());
  h.set_member_id(m.member_id());
  h.set_incarnation(m.incarnation());
  return h;
}

TEST(DaemonTableTest, RanksFollowJoinOrderOrTheRankAsked) {
  DaemonTable t(3, kLease);
  const absl::Time now = absl::Now();
  auto a = t.Join(Daemon("h:1", "a", 2), now, false);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->member.rank(), 2);
  auto b = t.Join(Daemon("h:2", "b"), now, false);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->member.rank(), 0);
  EXPECT_FALSE(t.all_joined());
  auto c = t.Join(Daemon("h:3", "c"), now, false);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->member.rank(), 1);
  EXPECT_TRUE(t.all_joined());
  EXPECT_TRUE(t.CheckAllReady("a step", now).ok());
  // A fourth, with every rank alive: refused without retry.
  EXPECT_TRUE(absl::IsFailedPrecondition(t.Join(Daemon("h:4", "d"), now, false).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(t.Join(Daemon("h:4", "d", 3), now, false).status()));
  // The same incarnation again: a retry, same answer.
  auto again = t.Join(Daemon("h:1", "a", 2), now, false);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->retry);
  EXPECT_EQ(again->member.member_id(), a->member.member_id());
}

TEST(DaemonTableTest, SilentDaemonGoesDownAndAReplacementTakesItsRank) {
  DaemonTable t(2, kLease);
  absl::Time now = absl::Now();
  auto a = t.Join(Daemon("h:1", "a"), now, false);
  auto b = t.Join(Daemon("h:2", "b"), now, false);
  ASSERT_TRUE(a.ok() && b.ok());
  // A replacement for rank 1 while its holder is alive: retry later.
  absl::Status early = t.Join(Daemon("h:3", "c", 1), now, true).status();
  EXPECT_TRUE(absl::IsUnavailable(early)) << early;
  EXPECT_NE(early.message().find("h:2"), std::string::npos) << early;

  now += absl::Milliseconds(1000);
  bool revived = true;
  EXPECT_EQ(t.Heartbeat(Beat(a->member), now, &revived), rpc::HEARTBEAT_OK);
  EXPECT_FALSE(revived);
  EXPECT_TRUE(t.ExpireLeases(now).empty());
  now += absl::Milliseconds(600);  // rank 1: 1.6 s without a heartbeat
  EXPECT_EQ(t.ExpireLeases(now), std::vector<int>{1});
  EXPECT_TRUE(t.ExpireLeases(now).empty());  // reported once
  EXPECT_FALSE(t.alive(1));
  absl::Status step = t.CheckAllReady("step from version 3", now);
  EXPECT_TRUE(absl::IsUnavailable(step));
  EXPECT_NE(step.message().find("rank 1 (h:2)"), std::string::npos) << step;
  EXPECT_NE(step.message().find("--rank=1"), std::string::npos) << step;

  auto c = t.Join(Daemon("h:3", "c", 1), now, /*model_loaded=*/true);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->replaced);
  EXPECT_EQ(c->member.rank(), 1);
  EXPECT_NE(c->member.member_id(), b->member.member_id());
  EXPECT_EQ(c->member.state(), rpc::MEMBER_STATE_RECOVERING);
  EXPECT_TRUE(t.slot(1).needs_state);
  EXPECT_TRUE(absl::IsUnavailable(t.CheckAllReady("a step", now)));
  // The old process, continued, learns it was replaced.
  EXPECT_EQ(t.Heartbeat(Beat(b->member), now, &revived), rpc::HEARTBEAT_REPLACED);
  t.slot(1).needs_state = false;
  t.slot(1).member.set_state(rpc::MEMBER_STATE_ALIVE);
  EXPECT_TRUE(t.CheckAllReady("a step", now).ok());
}

TEST(DaemonTableTest, DaemonWaitingInItsJoinKeepsItsLease) {
  DaemonTable t(2, kLease);
  absl::Time now = absl::Now();
  auto a = t.Join(Daemon("h:1", "a"), now, false);
  ASSERT_TRUE(a.ok());
  t.JoinWaitBegan(0, "a");  // its Join waits for rank 1
  now += absl::Seconds(3);  // twice the lease, no heartbeat (it has no member id yet)
  EXPECT_TRUE(t.ExpireLeases(now).empty());
  auto b = t.Join(Daemon("h:2", "b"), now, false);
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(t.CheckAllReady("a load", now).ok());
  t.JoinWaitEnded(0, "a", now);  // the world is complete: the Join answered
  // Until its first heartbeat (within the lease), a load finds it alive.
  now += absl::Milliseconds(250);
  EXPECT_TRUE(t.ExpireLeases(now).empty());
  EXPECT_TRUE(t.CheckAllReady("a load", now).ok()) << t.CheckAllReady("a load", now);
  // Without heartbeats after that, the usual lease applies.
  now += kLease;
  EXPECT_EQ(t.ExpireLeases(now), (std::vector<int>{0, 1}));
}

TEST(DaemonTableTest, DaemonKilledWhileWaitingInItsJoinGoesDownOneLeaseLater) {
  DaemonTable t(2, kLease);
  absl::Time now = absl::Now();
  auto a = t.Join(Daemon("h:1", "a"), now, false);
  ASSERT_TRUE(a.ok());
  t.JoinWaitBegan(0, "a");
  now += absl::Seconds(5);
  EXPECT_TRUE(t.ExpireLeases(now).empty());
  t.JoinWaitEnded(0, "a", now);  // killed: its connection closed, the Join is cancelled
  now += absl::Milliseconds(1000);
  EXPECT_TRUE(t.ExpireLeases(now).empty());
  now += absl::Milliseconds(600);  // 1.6 s after it died
  EXPECT_EQ(t.ExpireLeases(now), std::vector<int>{0});
  EXPECT_FALSE(t.alive(0));
  // A wait ended twice, or for another incarnation, changes nothing.
  t.JoinWaitEnded(0, "a", now);
  t.JoinWaitBegan(0, "stranger");
  EXPECT_EQ(t.slot(0).joins_waiting, 0);
}

TEST(DaemonTableTest, ReplacementDropsTheOldProcessJoinWait) {
  DaemonTable t(2, kLease);
  absl::Time now = absl::Now();
  ASSERT_TRUE(t.Join(Daemon("h:1", "a"), now, false).ok());
  t.JoinWaitBegan(0, "a");
  // A new process at the same address takes the rank; the old Join's wait
  // no longer holds the lease.
  ASSERT_TRUE(t.Join(Daemon("h:1", "a2"), now, false).ok());
  EXPECT_EQ(t.slot(0).joins_waiting, 0);
  t.JoinWaitEnded(0, "a", now + absl::Seconds(1));  // the old one's cancel: ignored
  now += absl::Milliseconds(1600);
  EXPECT_EQ(t.ExpireLeases(now), std::vector<int>{0});
}

TEST(DaemonTableTest, StoppedDaemonThatResumesIsAliveAgain) {
  DaemonTable t(1, kLease);
  absl::Time now = absl::Now();
  auto a = t.Join(Daemon("h:1", "a"), now, true);
  ASSERT_TRUE(a.ok());
  now += absl::Seconds(2);
  EXPECT_EQ(t.ExpireLeases(now).size(), 1u);
  EXPECT_EQ(t.Members(now)[0].state(), rpc::MEMBER_STATE_DOWN);
  EXPECT_NEAR(t.Members(now)[0].heartbeat_age_seconds(), 2.0, 1e-6);
  bool revived = false;
  EXPECT_EQ(t.Heartbeat(Beat(a->member), now, &revived), rpc::HEARTBEAT_OK);
  EXPECT_TRUE(revived);
  EXPECT_TRUE(t.alive(0));
}

TEST(DaemonTableTest, NewProcessAtTheSameAddressReplacesTheOldOne) {
  DaemonTable t(2, kLease);
  const absl::Time now = absl::Now();
  ASSERT_TRUE(t.Join(Daemon("h:1", "a"), now, false).ok());
  ASSERT_TRUE(t.Join(Daemon("h:2", "b"), now, false).ok());
  // Restarted on its port before its lease expired, without --rank.
  auto c = t.Join(Daemon("h:2", "c"), now, true);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->replaced);
  EXPECT_EQ(c->member.rank(), 1);
  EXPECT_EQ(c->member.incarnation(), "c");
}

TEST(DaemonTableTest, HeartbeatOfAnUnknownMemberAsksForAJoin) {
  DaemonTable t(2, kLease);
  rpc::HeartbeatRequest h;
  h.set_rank(0);
  h.set_member_id("daemon-0");
  h.set_incarnation("x");
  bool revived = false;
  EXPECT_EQ(t.Heartbeat(h, absl::Now(), &revived), rpc::HEARTBEAT_UNKNOWN);
  h.set_rank(7);
  EXPECT_EQ(t.Heartbeat(h, absl::Now(), &revived), rpc::HEARTBEAT_UNKNOWN);
}

// Every daemon of a world steps alike: a daemon whose --pipelined_step (or,
// pipelined, --step_bucket_elements) differs from one already joined is
// refused with both values named, and takes no rank.
TEST(DaemonTableTest, DaemonsMustAgreeOnThePipelinedStep) {
  DaemonTable t(3, kLease);
  const absl::Time now = absl::Now();
  rpc::JoinRequest a = Daemon("h:1", "a");
  a.set_pipelined_step(true);
  a.set_step_bucket_elements(4096);
  ASSERT_TRUE(t.Join(a, now, false).ok());

  rpc::JoinRequest whole = Daemon("h:2", "b");
  whole.set_step_bucket_elements(4096);
  absl::Status s = t.Join(whole, now, false).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("--pipelined_step=false"), std::string::npos) << s;
  EXPECT_NE(s.message().find("rank 0 (h:1) with --pipelined_step=true"), std::string::npos) << s;
  EXPECT_EQ(t.joined(), 1);

  rpc::JoinRequest other_buckets = Daemon("h:2", "b");
  other_buckets.set_pipelined_step(true);
  other_buckets.set_step_bucket_elements(8192);
  s = t.Join(other_buckets, now, false).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("--step_bucket_elements=8192"), std::string::npos) << s;
  EXPECT_NE(s.message().find("with --step_bucket_elements=4096"), std::string::npos) << s;
  EXPECT_EQ(t.joined(), 1);

  rpc::JoinRequest same = Daemon("h:2", "b");
  same.set_pipelined_step(true);
  same.set_step_bucket_elements(4096);
  auto b = t.Join(same, now, false);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(b->member.pipelined_step());
  EXPECT_EQ(b->member.step_bucket_elements(), 4096);
  EXPECT_EQ(t.joined(), 2);

  // Without the pipelined step the bucket size is not used: any agrees.
  DaemonTable u(2, kLease);
  rpc::JoinRequest c = Daemon("h:1", "c");
  c.set_step_bucket_elements(1);
  ASSERT_TRUE(u.Join(c, now, false).ok());
  rpc::JoinRequest d = Daemon("h:2", "d");
  d.set_step_bucket_elements(2);
  EXPECT_TRUE(u.Join(d, now, false).ok());
}

}  // namespace
}  // namespace paramd
