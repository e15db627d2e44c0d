// ProbeEndpoint against in-process gRPC servers, plaintext, TLS and mutual
// TLS (certificates by tools/make_certs.sh): every mistake is named within
// the probe's two seconds, and a right setting passes.
#include "auth/endpoint_probe.h"

#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "auth/security.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"

namespace paramd {
namespace auth {
namespace {

constexpr absl::Duration kProbe = absl::Seconds(2);

class EndpointProbeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    certs_ = new std::string(absl::StrCat(std::getenv("TEST_TMPDIR"), "/certs"));
    ASSERT_EQ(
        std::system(absl::StrCat("bash tools/make_certs.sh ", *certs_, " >/dev/null 2>&1").c_str()),
        0);
  }

  static TlsConfig Tls(const std::string& ca, const std::string& client = "") {
    TlsFiles files;
    files.ca = *certs_ + "/" + ca + ".pem";
    if (!client.empty()) {
      files.cert = *certs_ + "/" + client + ".pem";
      files.key = *certs_ + "/" + client + ".key";
    }
    absl::StatusOr<TlsConfig> tls = LoadTls(files);
    EXPECT_TRUE(tls.ok()) << tls.status();
    return tls.ok() ? *tls : TlsConfig();
  }

  // A gRPC server on loopback (TLS with the server certificate unless
  // `plaintext`; client certificates required if `mutual`); its address.
  std::string Serve(bool plaintext, bool mutual = false) {
    TlsConfig tls;
    if (!plaintext) {
      TlsFiles files{*certs_ + "/server.pem", *certs_ + "/server.key", *certs_ + "/ca.pem", mutual};
      absl::StatusOr<TlsConfig> loaded = LoadTls(files);
      EXPECT_TRUE(loaded.ok()) << loaded.status();
      tls = *loaded;
    }
    absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = ServerCredentials(tls);
    EXPECT_TRUE(credentials.ok());
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", *credentials, &port);
    servers_.push_back(builder.BuildAndStart());
    return absl::StrCat("127.0.0.1:", port);
  }

  // Probes and checks the time it took.
  static absl::Status Probe(const std::string& address, const TlsConfig& tls) {
    ProbeNames names;
    names.ca = "HPCTL_TLS_CA=ca.pem";
    names.give_ca = "give --tls_ca";
    names.server_name = "--tls_server_name";
    const absl::Time start = absl::Now();
    absl::Status s = ProbeEndpoint(address, tls, kProbe, names);
    EXPECT_LT(absl::Now() - start, kProbe + absl::Milliseconds(500)) << s;
    return s;
  }

  void TearDown() override {
    for (auto& server : servers_) server->Shutdown();
  }

  static std::string* certs_;
  std::vector<std::unique_ptr<grpc::Server>> servers_;
};

std::string* EndpointProbeTest::certs_ = nullptr;

void ExpectMismatch(const absl::Status& s, absl::string_view words) {
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), words)) << s;
}

TEST_F(EndpointProbeTest, RightSettingsPass) {
  EXPECT_TRUE(Probe(Serve(/*plaintext=*/true), TlsConfig()).ok());
  const std::string tls = Serve(/*plaintext=*/false);
  EXPECT_TRUE(Probe(tls, Tls("ca")).ok());
  TlsConfig by_name = Tls("ca");
  by_name.server_name = "localhost";  // the certificate carries it too
  EXPECT_TRUE(Probe(tls, by_name).ok());
  EXPECT_TRUE(Probe(Serve(false, /*mutual=*/true), Tls("ca", "client")).ok());
}

TEST_F(EndpointProbeTest, ProtocolMismatchesAreNamed) {
  const std::string tls = Serve(/*plaintext=*/false);
  ExpectMismatch(Probe(tls, TlsConfig()),
                 tls + " speaks TLS, but this client speaks plaintext: give --tls_ca");
  const std::string plain = Serve(/*plaintext=*/true);
  ExpectMismatch(Probe(plain, Tls("ca")),
                 plain + " speaks plaintext, but a TLS CA was given (HPCTL_TLS_CA=ca.pem)");
}

TEST_F(EndpointProbeTest, CertificateMistakesAreNamed) {
  const std::string tls = Serve(/*plaintext=*/false);
  ExpectMismatch(Probe(tls, Tls("other-ca")),
                 "TLS handshake with " + tls +
                     " failed: the server's certificate is not signed by HPCTL_TLS_CA=ca.pem");
  TlsConfig wrong_name = Tls("ca");
  wrong_name.server_name = "paramd.example";
  ExpectMismatch(Probe(tls, wrong_name),
                 "the server's certificate is not issued for paramd.example");
  const std::string mutual = Serve(false, /*mutual=*/true);
  ExpectMismatch(Probe(mutual, Tls("ca")), "the server requires a client certificate");
  ExpectMismatch(Probe(mutual, Tls("ca", "other-client")),
                 "the server refused this client's certificate");
}

// Port 1, where nothing listens: refused at once (UNAVAILABLE, the reason).
TEST_F(EndpointProbeTest, RefusedIsUnavailable) {
  absl::Status s = Probe("127.0.0.1:1", Tls("ca"));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "Connection refused")) << s;
  EXPECT_TRUE(ProbeEndpoint("unix:/nonexistent", TlsConfig(), kProbe).ok());
}

}  // namespace
}  // namespace auth
}  // namespace paramd
