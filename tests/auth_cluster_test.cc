// Authentication and transport security of real hybrid-paramd processes
// (coordinator + 2 daemons on loopback; docs/SECURITY.md):
//   1. without a token file (the default): a stranger's cluster-internal
//      RPCs (Daemon.LoadShards with an empty manifest, a forged
//      ReportVersion, Daemon.Step, WriteShard, a daemon rejoin, taking a
//      lost daemon's rank) are refused with UNAUTHENTICATED and change
//      nothing; the cluster keeps training and every other RPC stays open
//      as before; a replacement given the cluster secret takes the rank;
//   2. with TLS and a token file: each role (trainer, operator, cluster)
//      is allowed exactly the RPCs of auth/method_policy.cc and refused
//      the rest (PERMISSION_DENIED), no or an unknown token is
//      UNAUTHENTICATED, an insecure client and a client trusting another CA
//      are refused by the TLS servers, and the cluster's own calls (load,
//      commit) work through TLS + tokens;
//   3. mutual TLS: without a client certificate, or with one from another
//      CA, nothing is served; with one it is;
//   4. plaintext on a non-loopback address is a startup error unless
//      --insecure_listen_anywhere.
// Certificates are made at test time by tools/make_certs.sh (openssl).
#include <sys/stat.h>

#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "auth/security.h"
#include "gtest/gtest.h"
#include "proto/checkpoint_service.grpc.pb.h"
#include "proto/paramd.grpc.pb.h"
#include "tests/auth_test_util.h"
#include "tests/checkpoint_test_util.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

const std::vector<TestTensor>& Model() {
  static const auto* model = new std::vector<TestTensor>{{"w", {64, 32}, RandomValues(64 * 32, 11)},
                                                         {"b", {40}, RandomValues(40, 12)}};
  return *model;
}

// ---------------------------------------------------------------------------
// 1. No token file: strangers cannot reach the cluster-internal RPCs.

TEST(StrangerTest, ClusterInternalRpcsNeedTheClusterSecret) {
  TestClusterOptions options;
  options.daemons = 2;
  options.expected_pushers = 1;
  auto started = RawCluster::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  RawCluster& cluster = **started;
  const std::string path = cluster.cluster().dir() + "/model.safetensors";
  ASSERT_TRUE(WriteModel(path, Model()).ok());
  ASSERT_TRUE(cluster.Load(path, "").ok()) << cluster.cluster().Logs();
  auto before = cluster.FetchAssembled(0, "w", Direction::kRowwise);
  ASSERT_TRUE(before.ok()) << before.status();

  auto plain = Channel(cluster.cluster().coordinator_address(), "");
  auto forged = Channel(cluster.cluster().coordinator_address(), "not-the-cluster-secret-at-all");
  ASSERT_TRUE(plain.ok() && forged.ok());
  const std::string daemon0 = cluster.manifest().daemons(0).address();
  auto plain_daemon = Channel(daemon0, "");
  auto forged_daemon = Channel(daemon0, "not-the-cluster-secret-at-all");
  ASSERT_TRUE(plain_daemon.ok() && forged_daemon.ok());

  for (grpc::Channel* coordinator : {plain->get(), forged->get()}) {
    rpc::ReportVersionRequest report;  // D5: member ids are public (GetStatus)
    report.set_member_id("daemon-0");
    report.set_daemon_rank(0);
    report.set_published_version(57);
    grpc::Status s =
        CallRaw(coordinator, "/paramd.rpc.Coordinator/ReportVersion", report, absl::Seconds(5));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), "cluster-internal")) << s.error_message();
    report.set_member_id("daemon-1");
    report.set_daemon_rank(1);
    EXPECT_EQ(
        CallRaw(coordinator, "/paramd.rpc.Coordinator/ReportVersion", report, absl::Seconds(5))
            .error_code(),
        grpc::StatusCode::UNAUTHENTICATED);
    rpc::HeartbeatRequest beat;  // would keep a dead daemon's lease alive
    beat.set_member_id("daemon-0");
    beat.set_rank(0);
    EXPECT_EQ(CallRaw(coordinator, "/paramd.rpc.Coordinator/Heartbeat", beat, absl::Seconds(5))
                  .error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    // Taking over daemon 0's rank would hand out the cluster secret.
    rpc::JoinRequest join;
    join.set_role(rpc::ROLE_DAEMON);
    join.set_address(daemon0);
    join.set_member_secret("attacker-chosen-secret-0123456789");
    s = CallRaw(coordinator, "/paramd.rpc.Coordinator/Join", join, absl::Seconds(5));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
    join.set_address("127.0.0.1:1");
    join.set_member_id("daemon-1");
    EXPECT_EQ(
        CallRaw(coordinator, "/paramd.rpc.Coordinator/Join", join, absl::Seconds(5)).error_code(),
        grpc::StatusCode::UNAUTHENTICATED);
  }
  for (grpc::Channel* daemon : {plain_daemon->get(), forged_daemon->get()}) {
    rpc::LoadShardsRequest wipe;  // D4: an empty manifest wiped the model
    wipe.set_daemon_rank(0);
    grpc::Status s = CallRaw(daemon, "/paramd.rpc.Daemon/LoadShards", wipe, absl::Seconds(5));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
    rpc::LoadShardsRequest open_file = wipe;
    open_file.set_safetensors_path("/etc/passwd");
    EXPECT_EQ(
        CallRaw(daemon, "/paramd.rpc.Daemon/LoadShards", open_file, absl::Seconds(5)).error_code(),
        grpc::StatusCode::UNAUTHENTICATED);
    rpc::DaemonStepRequest step;
    step.set_version(0);
    EXPECT_EQ(CallRaw(daemon, "/paramd.rpc.Daemon/Step", step, absl::Seconds(5)).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    checkpoint::WriteShardRequest write;
    write.set_dir("x");
    write.set_version(0);
    write.set_world_size(2);
    EXPECT_EQ(
        CallRaw(daemon, "/paramd.checkpoint.CheckpointDaemon/WriteShard", write, absl::Seconds(5))
            .error_code(),
        grpc::StatusCode::UNAUTHENTICATED);
  }

  // Nothing changed: same committed version, same model, no step.
  ASSERT_TRUE(cluster.RefreshManifest().ok());
  EXPECT_EQ(cluster.manifest().committed_version(), 0);
  auto after = cluster.FetchAssembled(0, "w", Direction::kRowwise);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->data, before->data);
  for (int rank = 0; rank < 2; ++rank) {
    auto stats = cluster.Stats(rank);
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->published_version(), 0) << "daemon " << rank;
  }
  // ... and the cluster's own internal calls still work: a push steps
  // both daemons, which report v1 (ReportVersion with the secret).
  std::map<std::string, std::vector<float>> g;
  for (const TestTensor& t : Model()) g[t.name] = RandomValues(t.values.size(), 5, 0.1f);
  ASSERT_TRUE(cluster.PushAll(0, "trainer", g).ok()) << cluster.cluster().Logs();
  auto v1 = cluster.WaitForVersion(1);
  ASSERT_TRUE(v1.ok()) << v1.status() << cluster.cluster().Logs();
  EXPECT_EQ(*v1, 1);
}

// The member of daemon rank `rank` in the coordinator's status ("" address
// when none).
rpc::Member DaemonMember(rpc::Coordinator::Stub& coordinator, int rank) {
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(5));
  rpc::GetStatusResponse status;
  EXPECT_TRUE(coordinator.GetStatus(&context, rpc::GetStatusRequest(), &status).ok());
  for (const rpc::Member& m : status.members()) {
    if (m.role() == rpc::ROLE_DAEMON && m.rank() == rank) return m;
  }
  return rpc::Member();
}

// Without a token file, the generated cluster secret goes to each rank's
// first daemon only: once a daemon is lost, a process taking its rank must
// present the secret (the coordinator's --cluster_secret_out file), else it
// is refused, learns nothing and changes nothing.
TEST(StrangerTest, TakingALostDaemonsRankNeedsTheClusterSecret) {
  TestClusterOptions options;
  options.daemons = 2;
  options.expected_pushers = 1;
  options.coordinator_flags = {"--daemon_lease_ms=600"};
  options.daemon_flags = {"--heartbeat_interval_ms=50"};
  auto started = TestCluster::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  TestCluster& cluster = **started;
  auto channel = Channel(cluster.coordinator_address(), "");
  ASSERT_TRUE(channel.ok());
  auto coordinator = rpc::Coordinator::NewStub(*channel);
  // The rank of daemon process 1, once both have joined.
  const std::string victim_address = absl::StrCat("127.0.0.1:", cluster.daemon_port(1));
  int rank = -1;
  for (absl::Time end = absl::Now() + absl::Seconds(20); rank < 0 && absl::Now() < end;) {
    for (int r = 0; r < 2; ++r) {
      if (DaemonMember(*coordinator, r).address() == victim_address) rank = r;
    }
    if (rank < 0) absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_GE(rank, 0) << cluster.Logs();
  cluster.KillDaemon(1);
  rpc::Member lost;
  for (absl::Time end = absl::Now() + absl::Seconds(10); absl::Now() < end;) {
    lost = DaemonMember(*coordinator, rank);
    if (lost.state() == rpc::MEMBER_STATE_DOWN) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(lost.state(), rpc::MEMBER_STATE_DOWN) << cluster.Logs();

  rpc::JoinRequest join;
  join.set_role(rpc::ROLE_DAEMON);
  join.set_rank(rank);
  join.set_address("127.0.0.1:1");
  join.set_incarnation("stranger-incarnation");
  join.set_member_secret("attacker-chosen-secret-0123456789");
  for (const std::string& token : {std::string(), std::string("not-the-cluster-secret-at-all")}) {
    auto stranger = Channel(cluster.coordinator_address(), token);
    ASSERT_TRUE(stranger.ok());
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(5));
    rpc::JoinResponse reply;
    const grpc::Status s = rpc::Coordinator::NewStub(*stranger)->Join(&context, join, &reply);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), "--cluster_secret_file")) << s.error_message();
    EXPECT_TRUE(reply.cluster_secret().empty());
    // Nothing changed: the rank is still the lost daemon's.
    const rpc::Member now = DaemonMember(*coordinator, rank);
    EXPECT_EQ(now.member_id(), lost.member_id());
    EXPECT_EQ(now.address(), victim_address);
    EXPECT_EQ(now.state(), rpc::MEMBER_STATE_DOWN);
  }
  // Without --rank the stranger would get the DOWN rank too.
  join.clear_rank();
  {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(5));
    rpc::JoinResponse reply;
    EXPECT_EQ(coordinator->Join(&context, join, &reply).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_TRUE(reply.cluster_secret().empty());
  }

  // The operator's way: a replacement given the coordinator's secret file
  // (owner-only) takes the rank.
  struct stat st {};
  ASSERT_EQ(stat((cluster.dir() + "/cluster_secret").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto replacement = cluster.StartDaemon({absl::StrCat("--rank=", rank)});
  ASSERT_TRUE(replacement.ok()) << replacement.status();
  rpc::Member replaced;
  for (absl::Time end = absl::Now() + absl::Seconds(10); absl::Now() < end;) {
    replaced = DaemonMember(*coordinator, rank);
    if (replaced.state() == rpc::MEMBER_STATE_ALIVE) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(replaced.state(), rpc::MEMBER_STATE_ALIVE) << cluster.Logs();
  EXPECT_EQ(replaced.address(), absl::StrCat("127.0.0.1:", cluster.daemon_port(*replacement)));
}

// ---------------------------------------------------------------------------
// 2. TLS + tokens.

// A probe request per method: harmless where the call is allowed (it is
// refused by the handler's own checks, or waits out its short deadline).
std::unique_ptr<google::protobuf::Message> ProbeFor(absl::string_view method) {
  if (method == "/paramd.rpc.Daemon/LoadShards") {
    auto r = std::make_unique<rpc::LoadShardsRequest>();
    r->set_daemon_rank(99);
    return r;
  }
  if (method == "/paramd.rpc.Daemon/Step") {
    auto r = std::make_unique<rpc::DaemonStepRequest>();
    r->set_version(12345);
    return r;
  }
  if (method == "/paramd.rpc.Coordinator/Step") {
    auto r = std::make_unique<rpc::StepRequest>();
    r->set_version(12345);
    return r;
  }
  if (method == "/paramd.rpc.Coordinator/Load") {
    auto r = std::make_unique<rpc::LoadRequest>();
    r->set_safetensors_path("/nonexistent/model.safetensors");
    return r;
  }
  if (method == "/paramd.rpc.Coordinator/ReportVersion") {
    auto r = std::make_unique<rpc::ReportVersionRequest>();
    r->set_daemon_rank(99);
    return r;
  }
  if (method == "/paramd.rpc.Coordinator/WaitForVersion") {
    auto r = std::make_unique<rpc::WaitForVersionRequest>();
    r->set_min_version(1000);
    return r;
  }
  return std::make_unique<rpc::GetManifestRequest>();  // empty: any request's defaults
}

bool OnDaemon(absl::string_view method) {
  return absl::StartsWith(method, "/paramd.rpc.Daemon/") ||
         absl::StartsWith(method, "/paramd.rpc.DaemonIpc/") ||
         absl::StartsWith(method, "/paramd.checkpoint.CheckpointDaemon/");
}

class TlsTokenTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto dir = demo::TempDir::Create("auth_tls");
    ASSERT_TRUE(dir.ok());
    dir_ = new demo::TempDir(*std::move(dir));
    certs_ = dir_->path() + "/certs";
    ASSERT_TRUE(MakeCerts(certs_).ok());
    auto tokens = WriteTokenFile(dir_->path());
    ASSERT_TRUE(tokens.ok());
    const std::vector<std::string> security = {
        "--tls_cert=" + certs_ + "/server.pem", "--tls_key=" + certs_ + "/server.key",
        "--tls_ca=" + certs_ + "/ca.pem", "--auth_token_file=" + *tokens};
    TestClusterOptions options;
    options.daemons = 2;
    options.expected_pushers = 1;
    options.coordinator_flags = security;
    options.coordinator_flags.push_back("--listen=0.0.0.0:0");  // TLS: any address is fine
    options.daemon_flags = security;
    auto cluster = TestCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = cluster->release();
    // Both daemons joined (through TLS, with the cluster token).
    auto op = Channel(cluster_->coordinator_address(), kOperatorToken, certs_);
    ASSERT_TRUE(op.ok());
    auto stub = rpc::Coordinator::NewStub(*op);
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    for (;;) {
      grpc::ClientContext context;
      SetDeadline(context, absl::Seconds(2));
      rpc::GetStatusResponse status;
      grpc::Status s = stub->GetStatus(&context, rpc::GetStatusRequest(), &status);
      int daemons = 0;
      for (const rpc::DaemonStats& d : status.daemons()) daemons += d.error().empty() ? 1 : 0;
      if (s.ok() && daemons == 2) break;
      ASSERT_LT(absl::Now(), give_up) << s.error_message() << "\n" << cluster_->Logs();
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
  static void TearDownTestSuite() {
    delete cluster_;
    delete dir_;
  }

  std::string AddressOf(absl::string_view method) const {
    return OnDaemon(method) ? absl::StrCat("127.0.0.1:", cluster_->daemon_port(0))
                            : cluster_->coordinator_address();
  }

  static demo::TempDir* dir_;
  static std::string certs_;
  static TestCluster* cluster_;
};
demo::TempDir* TlsTokenTest::dir_ = nullptr;
std::string TlsTokenTest::certs_;
TestCluster* TlsTokenTest::cluster_ = nullptr;

TEST_F(TlsTokenTest, EachRoleIsAllowedExactlyItsRpcs) {
  const std::map<auth::Role, std::string> tokens = {{auth::Role::kTrainer, kTrainerToken},
                                                    {auth::Role::kOperator, kOperatorToken},
                                                    {auth::Role::kCluster, kClusterToken}};
  int probed = 0;
  for (const auth::MethodPolicy& policy : auth::AllPolicies()) {
    const std::string method(policy.method);
    // Sub-policies (tested below) and the data plane (its own port:
    // tests/auth_channel_test) are not methods of these ports.
    if (absl::StrContains(method, "#") || absl::StartsWith(method, "/paramd.transport.")) {
      continue;
    }
    // A cluster-role probe of the recovery RPCs would open a new world on
    // the shared test cluster; their row is checked by //auth:security_test.
    if (absl::StrContains(method, "Recover")) continue;
    std::unique_ptr<google::protobuf::Message> probe = ProbeFor(method);
    for (const auto& [role, token] : tokens) {
      auto channel = Channel(AddressOf(method), token, certs_);
      ASSERT_TRUE(channel.ok());
      const grpc::Status s = CallRaw(channel->get(), method, *probe, absl::Milliseconds(600));
      SCOPED_TRACE(absl::StrCat(method, " as ", auth::RoleName(role), ": ", s.error_code(), " ",
                                s.error_message()));
      if (policy.roles.contains(role)) {
        EXPECT_FALSE(Refused(s));
        EXPECT_NE(s.error_code(), grpc::StatusCode::UNIMPLEMENTED);
        EXPECT_NE(s.error_code(), grpc::StatusCode::UNAVAILABLE);
      } else {
        EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
        EXPECT_TRUE(absl::StrContains(s.error_message(), method));
      }
    }
    ++probed;
  }
  EXPECT_GE(probed, 24);  // 10 Coordinator + 9 Daemon + 5 checkpoint methods
  // The rows that matter most, spelled out.
  EXPECT_FALSE(
      auth::FindPolicy("/paramd.rpc.Coordinator/Load")->roles.contains(auth::Role::kTrainer));
  EXPECT_FALSE(
      auth::FindPolicy("/paramd.rpc.Daemon/PushGradients")->roles.contains(auth::Role::kOperator));
  EXPECT_FALSE(
      auth::FindPolicy("/paramd.rpc.Daemon/LoadShards")->roles.contains(auth::Role::kOperator));
  EXPECT_FALSE(auth::FindPolicy("/paramd.rpc.Coordinator/ReportVersion")
                   ->roles.contains(auth::Role::kOperator));
}

TEST_F(TlsTokenTest, JoinAsPusherNeedsTrainerAndAsDaemonNeedsCluster) {
  auto join = [&](const std::string& token, rpc::Role role, bool pusher) {
    auto channel = Channel(cluster_->coordinator_address(), token, certs_);
    EXPECT_TRUE(channel.ok());
    rpc::JoinRequest r;
    r.set_role(role);
    r.set_pusher(pusher);
    r.set_name("auth_cluster_test");
    if (role == rpc::ROLE_DAEMON) r.set_address("127.0.0.1:1");  // world is full
    return CallRaw(channel->get(), "/paramd.rpc.Coordinator/Join", r, absl::Seconds(5));
  };
  EXPECT_TRUE(join(kTrainerToken, rpc::ROLE_TRAINER, true).ok());
  EXPECT_EQ(join(kOperatorToken, rpc::ROLE_TRAINER, true).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(join(kOperatorToken, rpc::ROLE_OBSERVER, false).ok());
  EXPECT_EQ(join(kTrainerToken, rpc::ROLE_DAEMON, false).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(join(kOperatorToken, rpc::ROLE_DAEMON, false).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // Allowed, and then refused for what it is: the world is complete.
  EXPECT_EQ(join(kClusterToken, rpc::ROLE_DAEMON, false).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(join("", rpc::ROLE_OBSERVER, false).error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(TlsTokenTest, MissingOrUnknownTokenIsUnauthenticated) {
  for (const std::string& token : {std::string(), std::string("unknown-token-0123456789abc")}) {
    for (const char* method :
         {"/paramd.rpc.Coordinator/GetStatus", "/paramd.rpc.Coordinator/GetManifest",
          "/paramd.rpc.Daemon/Fetch", "/paramd.rpc.Daemon/PushGradients",
          "/paramd.rpc.Daemon/OpenDeviceChannel", "/paramd.rpc.Daemon/FetchDevice",
          "/paramd.rpc.Daemon/PushGradientsDevice", "/paramd.rpc.Daemon/LoadShards",
          "/paramd.checkpoint.CheckpointCoordinator/Checkpoint"}) {
      auto channel = Channel(AddressOf(method), token, certs_);
      ASSERT_TRUE(channel.ok());
      const grpc::Status s =
          CallRaw(channel->get(), method, rpc::GetManifestRequest(), absl::Seconds(5));
      EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
          << method << " token '" << token << "': " << s.error_message();
      EXPECT_FALSE(token.empty() == false && absl::StrContains(s.error_message(), token));
    }
  }
}

TEST_F(TlsTokenTest, InsecureClientsAndForeignCasAreRefused) {
  for (const std::string& address :
       {cluster_->coordinator_address(), absl::StrCat("127.0.0.1:", cluster_->daemon_port(1))}) {
    // Plaintext to a TLS port: no HTTP/2 connection at all.
    auto plain = Channel(address, kOperatorToken);
    ASSERT_TRUE(plain.ok());
    grpc::Status s = CallRaw(plain->get(), "/paramd.rpc.Coordinator/GetManifest",
                             rpc::GetManifestRequest(), absl::Seconds(3));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE)
        << address << ": " << s.error_message();
    // A client that trusts another CA does not accept the server.
    auto foreign = Channel(address, kOperatorToken, certs_, "", "other-ca");
    ASSERT_TRUE(foreign.ok());
    s = CallRaw(foreign->get(), "/paramd.rpc.Coordinator/GetManifest", rpc::GetManifestRequest(),
                absl::Seconds(3));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE)
        << address << ": " << s.error_message();
  }
  // Health checking stays open (no token), over TLS.
  auto tls = Channel(cluster_->coordinator_address(), "", certs_);
  ASSERT_TRUE(tls.ok());
  rpc::GetManifestRequest empty;  // == grpc.health.v1.HealthCheckRequest{service: ""}
  EXPECT_TRUE(CallRaw(tls->get(), "/grpc.health.v1.Health/Check", empty, absl::Seconds(3)).ok());
}

TEST_F(TlsTokenTest, TheClusterLoadsAndCommitsThroughTlsAndTokens) {
  const std::string path = dir_->path() + "/model.safetensors";
  ASSERT_TRUE(WriteModel(path, Model()).ok());
  auto op = Channel(cluster_->coordinator_address(), kOperatorToken, certs_);
  auto trainer = Channel(cluster_->coordinator_address(), kTrainerToken, certs_);
  ASSERT_TRUE(op.ok() && trainer.ok());
  {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(30));
    rpc::LoadRequest load;
    load.set_safetensors_path(path);
    rpc::LoadResponse response;
    const grpc::Status s = rpc::Coordinator::NewStub(*op)->Load(&context, load, &response);
    ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << cluster_->Logs();
  }
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(20));
  rpc::WaitForVersionRequest wait;
  wait.set_min_version(0);
  rpc::WaitForVersionResponse committed;
  const grpc::Status s =
      rpc::Coordinator::NewStub(*trainer)->WaitForVersion(&context, wait, &committed);
  ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << cluster_->Logs();
  EXPECT_EQ(committed.committed_version(), 0);
}

// A push of the whole of Model()'s "b" (one daemon holds it all) under
// `pusher` with `token`, straight to the daemon.
grpc::Status PushB(const std::string& daemon, const std::string& token, int64_t version,
                   const std::string& pusher) {
  auto channel = Channel(daemon, token);
  EXPECT_TRUE(channel.ok());
  const std::vector<float> g = RandomValues(40, 7, 0.1f);
  std::vector<rpc::PushGradientsRequest> messages = {
      GradientMessage(version, pusher, "b", 0, 1, g.data(), 40)};  // [40]: 1 row
  messages.push_back(EndMessage(messages));
  std::vector<std::string> raw;
  for (const auto& m : messages) raw.push_back(m.SerializeAsString());
  return CallRawBytes(channel->get(), "/paramd.rpc.Daemon/PushGradients", raw, absl::Seconds(10));
}

// With a token file a pusher id belongs to the token that first pushed
// under it: another trainer token can neither add to that pusher's count
// nor take the id over at a later version; it is refused, naming the id,
// and the version steps only on the two real pushers.
TEST(PusherIdentityTest, PusherIdsAreBoundToTheirToken) {
  auto dir = demo::TempDir::Create("auth_pushers");
  ASSERT_TRUE(dir.ok());
  auto tokens = WriteTokenFile(dir->path());
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  TestClusterOptions options;
  options.daemons = 1;
  options.expected_pushers = 2;
  options.coordinator_flags = {"--auth_token_file=" + *tokens};
  options.daemon_flags = {"--auth_token_file=" + *tokens};
  auto started = TestCluster::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  TestCluster& cluster = **started;
  const std::string path = dir->path() + "/model.safetensors";
  ASSERT_TRUE(WriteModel(path, Model()).ok());
  auto op = Channel(cluster.coordinator_address(), kOperatorToken);
  ASSERT_TRUE(op.ok());
  auto coordinator = rpc::Coordinator::NewStub(*op);
  {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(30));
    rpc::LoadRequest load;
    load.set_safetensors_path(path);
    load.set_recipe_text(kFp32PassthroughRecipe);
    rpc::LoadResponse response;
    const grpc::Status s = coordinator->Load(&context, load, &response);
    ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << cluster.Logs();
  }
  rpc::GetManifestResponse manifest;
  {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(5));
    ASSERT_TRUE(coordinator->GetManifest(&context, rpc::GetManifestRequest(), &manifest).ok());
  }
  const std::string daemon = manifest.manifest().daemons(0).address();
  auto committed = [&](int64_t min_version) {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(20));
    rpc::WaitForVersionRequest wait;
    wait.set_min_version(min_version);
    rpc::WaitForVersionResponse response;
    EXPECT_TRUE(coordinator->WaitForVersion(&context, wait, &response).ok()) << cluster.Logs();
    return response.committed_version();
  };

  grpc::Status pushed = PushB(daemon, kTrainerToken, 0, "pusher-a");
  ASSERT_TRUE(pushed.ok()) << pushed.error_message() << cluster.Logs();
  grpc::Status stolen = PushB(daemon, kTrainer2Token, 0, "pusher-a");
  EXPECT_EQ(stolen.error_code(), grpc::StatusCode::PERMISSION_DENIED) << stolen.error_message();
  EXPECT_TRUE(absl::StrContains(stolen.error_message(), "\"pusher-a\"")) << stolen.error_message();
  EXPECT_FALSE(absl::StrContains(stolen.error_message(), kTrainerToken));
  ASSERT_TRUE(PushB(daemon, kTrainer2Token, 0, "pusher-b").ok());
  EXPECT_EQ(committed(1), 1);
  // Version 1: the second token pushes first under the first one's id.
  stolen = PushB(daemon, kTrainer2Token, 1, "pusher-a");
  EXPECT_EQ(stolen.error_code(), grpc::StatusCode::PERMISSION_DENIED) << stolen.error_message();
  ASSERT_TRUE(PushB(daemon, kTrainer2Token, 1, "pusher-b").ok());
  // Nothing counted for pusher-a: its owner's push is what completes v2.
  {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(5));
    rpc::WaitForVersionRequest wait;
    wait.set_min_version(2);
    rpc::WaitForVersionResponse response;
    SetDeadline(context, absl::Milliseconds(300));
    EXPECT_EQ(coordinator->WaitForVersion(&context, wait, &response).error_code(),
              grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  ASSERT_TRUE(PushB(daemon, kTrainerToken, 1, "pusher-a").ok());
  EXPECT_EQ(committed(2), 2);
}

// ---------------------------------------------------------------------------
// 3. Mutual TLS.

TEST(MutualTlsTest, ClientsNeedACertificateFromTheCa) {
  auto dir = demo::TempDir::Create("auth_mtls");
  ASSERT_TRUE(dir.ok());
  const std::string certs = dir->path() + "/certs";
  ASSERT_TRUE(MakeCerts(certs).ok());
  const std::vector<std::string> security = {
      "--tls_cert=" + certs + "/server.pem", "--tls_key=" + certs + "/server.key",
      "--tls_ca=" + certs + "/ca.pem", "--tls_require_client_cert"};
  TestClusterOptions options;
  options.daemons = 1;
  options.expected_pushers = 1;
  options.coordinator_flags = security;
  options.daemon_flags = security;
  auto cluster = TestCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string address = (*cluster)->coordinator_address();
  const std::string method = "/paramd.rpc.Coordinator/GetStatus";
  auto with_cert = Channel(address, "", certs, "client");
  ASSERT_TRUE(with_cert.ok());
  // The daemon joined (its server certificate is its client certificate).
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  for (;;) {
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(2));
    rpc::GetStatusResponse status;
    grpc::Status s = rpc::Coordinator::NewStub(*with_cert)
                         ->GetStatus(&context, rpc::GetStatusRequest(), &status);
    ASSERT_TRUE(s.ok() || s.error_code() == grpc::StatusCode::UNAVAILABLE) << s.error_message();
    if (s.ok() && status.daemons_size() == 1 && status.daemons(0).error().empty()) break;
    ASSERT_LT(absl::Now(), give_up) << s.error_message() << "\n" << (*cluster)->Logs();
    absl::SleepFor(absl::Milliseconds(100));
  }
  auto no_cert = Channel(address, "", certs);
  auto foreign_cert = Channel(address, "", certs, "other-client");
  ASSERT_TRUE(no_cert.ok() && foreign_cert.ok());
  for (grpc::Channel* refused : {no_cert->get(), foreign_cert->get()}) {
    const grpc::Status s = CallRaw(refused, method, rpc::GetStatusRequest(), absl::Seconds(3));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  }
}

// ---------------------------------------------------------------------------
// 4. Plaintext listens on loopback only.

TEST(ListenTest, PlaintextOnANonLoopbackAddressIsAStartupError) {
  auto dir = demo::TempDir::Create("auth_listen");
  ASSERT_TRUE(dir.ok());
  ProgramRun refused =
      RunProgram({"server/hybrid-paramd", "--listen=0.0.0.0:0"}, dir->path(), absl::Seconds(20));
  EXPECT_EQ(refused.exit_code, 1) << refused.out;
  EXPECT_TRUE(absl::StrContains(refused.out, "--insecure_listen_anywhere")) << refused.out;
  EXPECT_TRUE(absl::StrContains(refused.out, "loopback")) << refused.out;
  ProgramRun data_plane =
      RunProgram({"server/hybrid-paramd", "--listen=127.0.0.1:0", "--data_plane_listen=0.0.0.0:0"},
                 dir->path(), absl::Seconds(20));
  EXPECT_EQ(data_plane.exit_code, 1) << data_plane.out;
  EXPECT_TRUE(absl::StrContains(data_plane.out, "--data_plane_listen")) << data_plane.out;
  // Device channels are plaintext too: the same rule.
  ProgramRun device_channels = RunProgram(
      {"server/hybrid-paramd", "--listen=127.0.0.1:0", "--device_channel_listen=0.0.0.0:0"},
      dir->path(), absl::Seconds(20));
  EXPECT_EQ(device_channels.exit_code, 1) << device_channels.out;
  EXPECT_TRUE(absl::StrContains(device_channels.out, "--device_channel_listen"))
      << device_channels.out;
  ProgramRun bad_tokens = RunProgram(
      {"server/hybrid-paramd", "--listen=127.0.0.1:0", "--auth_token_file=/nonexistent/tokens"},
      dir->path(), absl::Seconds(20));
  EXPECT_EQ(bad_tokens.exit_code, 1) << bad_tokens.out;
  EXPECT_TRUE(absl::StrContains(bad_tokens.out, "/nonexistent/tokens")) << bad_tokens.out;
  // Secret files others may read are refused at start, as ssh does.
  auto tokens = WriteTokenFile(dir->path());
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_EQ(chmod(tokens->c_str(), 0644), 0);
  for (const std::string flag : {"--auth_token_file=", "--cluster_secret_file="}) {
    ProgramRun open_file =
        RunProgram({"server/hybrid-paramd", "--listen=127.0.0.1:0", flag + *tokens}, dir->path(),
                   absl::Seconds(20));
    EXPECT_EQ(open_file.exit_code, 1) << open_file.out;
    EXPECT_TRUE(absl::StrContains(
        open_file.out,
        absl::StrCat("permissions 0644 for ", *tokens, " are too open; chmod 600 ", *tokens)))
        << open_file.out;
  }
  // --insecure_listen_anywhere: it binds (a single-node process that serves).
  TestClusterOptions options;
  options.daemons = 1;
  options.expected_pushers = 1;
  options.coordinator_flags = {"--listen=0.0.0.0:0", "--insecure_listen_anywhere"};
  auto cluster = TestCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto channel = Channel((*cluster)->coordinator_address(), "");
  ASSERT_TRUE(channel.ok());
  EXPECT_TRUE(CallRaw(channel->get(), "/paramd.rpc.Coordinator/GetManifest",
                      rpc::GetManifestRequest(), absl::Seconds(5))
                  .ok());
}

}  // namespace
}  // namespace testing
}  // namespace paramd
