// Connection mistakes against real processes fail at once, in words, not
// after a timeout: hpctl and the client library against a TLS cluster
// without a CA, with another CA, against a plaintext cluster with a CA,
// at a refused port and at a daemon's port (which says where its
// coordinator is); a daemon whose TLS settings disagree with its
// coordinator's; and the environment defaults PARAMD_COORDINATOR and
// HPCTL_TLS_CA of both. Certificates by tools/make_certs.sh.
#include <stdlib.h>

#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "deploy/process.h"
#include "tests/auth_test_util.h"
#include "tests/checkpoint_test_util.h"
#include "tests/client_cluster.h"

namespace paramd {
namespace {

using testing::TestCluster;
using testing::TestClusterOptions;

// Every run is given this much time, and must fail well within it.
constexpr absl::Duration kTimeout = absl::Seconds(30);
constexpr absl::Duration kAtOnce = absl::Seconds(5);

struct HpctlRun {
  int exit_code = -1;  // -1: did not exit normally in time
  std::string out;     // stdout and stderr
  absl::Duration took;
};

class ConnectErrorsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto dir = demo::TempDir::Create("connect_errors");
    ASSERT_TRUE(dir.ok());
    dir_ = new demo::TempDir(*std::move(dir));
    certs_ = new std::string(dir_->path() + "/certs");
    ASSERT_TRUE(testing::MakeCerts(*certs_).ok());
    TestClusterOptions options;
    options.daemons = 1;
    options.expected_pushers = 1;
    auto plain = TestCluster::Start(options);
    ASSERT_TRUE(plain.ok()) << plain.status();
    plain_ = plain->release();
    const std::vector<std::string> tls = {"--tls_cert=" + *certs_ + "/server.pem",
                                          "--tls_key=" + *certs_ + "/server.key",
                                          "--tls_ca=" + *certs_ + "/ca.pem"};
    options.coordinator_flags = tls;
    options.daemon_flags = tls;
    auto secure = TestCluster::Start(options);
    ASSERT_TRUE(secure.ok()) << secure.status();
    tls_ = secure->release();
  }

  static void TearDownTestSuite() {
    delete tls_;
    delete plain_;
    delete certs_;
    delete dir_;
  }

  static std::string Ca(const std::string& name = "ca") { return *certs_ + "/" + name + ".pem"; }

  // hpctl `args` with `env` ("NAME=VALUE") in its environment.
  static HpctlRun Hpctl(std::vector<std::string> args, const std::vector<std::string>& env = {}) {
    std::vector<std::string> argv = {"/usr/bin/env"};
    argv.insert(argv.end(), env.begin(), env.end());
    argv.push_back("hpctl/hpctl");
    argv.insert(argv.end(), args.begin(), args.end());
    argv.push_back(absl::StrCat("--timeout=", absl::ToInt64Seconds(kTimeout)));
    const absl::Time start = absl::Now();
    testing::ProgramRun ran = testing::RunProgram(argv, dir_->path(), kTimeout + absl::Seconds(10));
    return {ran.exit_code, ran.out, absl::Now() - start};
  }

  static void ExpectFailsAtOnce(const HpctlRun& run, const std::string& words) {
    EXPECT_EQ(run.exit_code, 1) << run.out;
    EXPECT_TRUE(absl::StrContains(run.out, words)) << "want: " << words << "\ngot: " << run.out;
    EXPECT_LT(run.took, kAtOnce) << run.out;
  }

  // client::Client::Connect as an observer; how long it took in `took`.
  static absl::Status Connect(const std::string& address, const std::string& ca,
                              absl::Duration* took) {
    client::ClientOptions options;
    options.coordinator_address = address;
    options.role = client::ClientOptions::Role::kObserver;
    options.pusher = false;
    options.connect_timeout = kTimeout;
    options.tls.ca = ca;
    const absl::Time start = absl::Now();
    absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(options);
    *took = absl::Now() - start;
    return c.status();
  }

  static void ExpectRefusedAtOnce(const std::string& address, const std::string& ca,
                                  const std::string& words) {
    absl::Duration took;
    const absl::Status s = Connect(address, ca, &took);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), words)) << "want: " << words << "\ngot: " << s;
    EXPECT_LT(took, kAtOnce) << s;
  }

  static std::string DaemonAddress(TestCluster& c) {
    return absl::StrCat("127.0.0.1:", c.daemon_port(0));
  }

  static demo::TempDir* dir_;
  static std::string* certs_;
  static TestCluster* plain_;
  static TestCluster* tls_;
};

demo::TempDir* ConnectErrorsTest::dir_ = nullptr;
std::string* ConnectErrorsTest::certs_ = nullptr;
TestCluster* ConnectErrorsTest::plain_ = nullptr;
TestCluster* ConnectErrorsTest::tls_ = nullptr;

TEST_F(ConnectErrorsTest, HpctlNamesTlsMistakesAtOnce) {
  const std::string tls = tls_->coordinator_address();
  const std::string plain = plain_->coordinator_address();
  ExpectFailsAtOnce(Hpctl({"status", "--address=" + tls}),
                    tls + " speaks TLS, but this client speaks plaintext: give --tls_ca");
  ExpectFailsAtOnce(
      Hpctl({"status", "--address=" + tls}, {"HPCTL_TLS_CA=" + Ca("other-ca")}),
      "TLS handshake with " + tls +
          " failed: the server's certificate is not signed by HPCTL_TLS_CA=" + Ca("other-ca"));
  ExpectFailsAtOnce(Hpctl({"checkpoint", "list", "--address=" + plain, "--tls_ca=" + Ca()}),
                    plain + " speaks plaintext, but a TLS CA was given (--tls_ca=" + Ca() + ")");
  ExpectFailsAtOnce(
      Hpctl({"status", "--address=" + tls, "--tls_ca=" + Ca(), "--tls_server_name=paramd.example"}),
      "the server's certificate is not issued for paramd.example");
}

TEST_F(ConnectErrorsTest, ClientNamesTlsMistakesAtOnce) {
  const std::string tls = tls_->coordinator_address();
  const std::string plain = plain_->coordinator_address();
  ExpectRefusedAtOnce(tls, "", tls + " speaks TLS, but this client speaks plaintext");
  ExpectRefusedAtOnce(tls, Ca("other-ca"),
                      "TLS handshake with " + tls +
                          " failed: the server's certificate is not signed by the CA " +
                          Ca("other-ca"));
  ExpectRefusedAtOnce(plain, Ca(), plain + " speaks plaintext, but a TLS CA was given");
  absl::Duration took;
  EXPECT_TRUE(Connect(tls, Ca(), &took).ok());
  EXPECT_TRUE(Connect(plain, "", &took).ok());
}

// hpctl at a refused port says so at once (the client library waits for a
// coordinator that may start later, and says so after its timeout).
TEST_F(ConnectErrorsTest, RefusedPortIsNamedAtOnce) {
  ExpectFailsAtOnce(
      Hpctl({"status", "--address=127.0.0.1:1"}),
      "cannot reach the coordinator at 127.0.0.1:1 (127.0.0.1:1: Connection refused)");
}

TEST_F(ConnectErrorsTest, ADaemonsAddressNamesItsCoordinator) {
  for (TestCluster* c : {plain_, tls_}) {
    std::vector<std::string> args = {"status", "--address=" + DaemonAddress(*c)};
    if (c == tls_) args.push_back("--tls_ca=" + Ca());
    ExpectFailsAtOnce(Hpctl(args), DaemonAddress(*c) +
                                       " is a hybrid-paramd daemon (rank 0), not the "
                                       "coordinator; its coordinator is at " +
                                       c->coordinator_address());
    ExpectRefusedAtOnce(DaemonAddress(*c), c == tls_ ? Ca() : "",
                        "its coordinator is at " + c->coordinator_address());
  }
}

// A daemon whose TLS settings disagree with its coordinator's says so and
// exits at once (a restart will not mend it); the log names the flag.
TEST_F(ConnectErrorsTest, ADaemonNamesTlsMistakesAtOnce) {
  const std::string tls = tls_->coordinator_address();
  const std::string plain = plain_->coordinator_address();
  struct Case {
    std::string coordinator;
    std::vector<std::string> flags;
    std::string words;
  };
  const std::vector<Case> cases = {
      {tls,
       {},
       tls + " speaks TLS, but this client speaks plaintext: start the daemon with "
             "--tls_cert, --tls_key and the --tls_ca"},
      {tls,
       {"--tls_cert=" + *certs_ + "/server.pem", "--tls_key=" + *certs_ + "/server.key",
        "--tls_ca=" + Ca("other-ca")},
       "the server's certificate is not signed by this daemon's --tls_ca"},
      {plain,
       {"--tls_cert=" + *certs_ + "/server.pem", "--tls_key=" + *certs_ + "/server.key",
        "--tls_ca=" + Ca()},
       plain + " speaks plaintext, but a TLS CA was given (this daemon's --tls_ca)"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {"server/hybrid-paramd", "--role=daemon",
                                     "--listen=127.0.0.1:0", "--coordinator=" + c.coordinator};
    argv.insert(argv.end(), c.flags.begin(), c.flags.end());
    const absl::Time start = absl::Now();
    testing::ProgramRun ran = testing::RunProgram(argv, dir_->path(), kTimeout);
    EXPECT_NE(ran.exit_code, 0) << ran.out;
    EXPECT_TRUE(absl::StrContains(ran.out, c.words)) << "want: " << c.words << "\ngot: " << ran.out;
    EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << ran.out;
  }
}

TEST_F(ConnectErrorsTest, EnvironmentGivesTheAddressAndTheCa) {
  const std::vector<std::string> env = {"PARAMD_COORDINATOR=" + tls_->coordinator_address(),
                                        "HPCTL_TLS_CA=" + Ca()};
  HpctlRun run = Hpctl({"status"}, env);
  EXPECT_EQ(run.exit_code, 0) << run.out;
  // HPCTL_ADDRESS wins over PARAMD_COORDINATOR.
  run = Hpctl({"status"}, {"HPCTL_ADDRESS=" + plain_->coordinator_address(),
                           "PARAMD_COORDINATOR=" + tls_->coordinator_address()});
  EXPECT_EQ(run.exit_code, 0) << run.out;
  // The library: an empty address and CA come from the environment.
  ASSERT_EQ(setenv("PARAMD_COORDINATOR", tls_->coordinator_address().c_str(), 1), 0);
  ASSERT_EQ(setenv("HPCTL_TLS_CA", Ca().c_str(), 1), 0);
  absl::Duration took;
  const absl::Status s = Connect("", "", &took);
  unsetenv("PARAMD_COORDINATOR");
  unsetenv("HPCTL_TLS_CA");
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace paramd
