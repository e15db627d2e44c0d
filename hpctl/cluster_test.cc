#include "hpctl/cluster.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "client/client.h"
#include "hpctl/command.h"

namespace paramd::hpctl {
namespace {

// The TLS CA a command would connect with after parsing `words`, with
// HPCTL_TLS_CA set to `environment`.
std::string CaAfter(std::vector<std::string> words, const char* environment) {
  setenv("HPCTL_TLS_CA", environment, /*overwrite=*/1);
  ClusterOptions cluster;
  OptionParser opts("hpctl x", "");
  cluster.AddTo(opts);
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  absl::Status parsed = opts.Parse(static_cast<int>(argv.size()), argv.data());
  unsetenv("HPCTL_TLS_CA");
  EXPECT_TRUE(parsed.ok()) << parsed;
  client::ClientOptions options;
  EXPECT_TRUE(cluster.ApplySecurity(&options).ok());
  return options.tls.ca;
}

TEST(ClusterOptions, TlsCaComesFromTheEnvironmentByDefault) {
  EXPECT_EQ(CaAfter({"x"}, "env-ca.pem"), "env-ca.pem");
  EXPECT_EQ(CaAfter({"x"}, ""), "");
}

TEST(ClusterOptions, GivenTlsCaWinsOverTheEnvironment) {
  EXPECT_EQ(CaAfter({"x", "--tls_ca=flag-ca.pem"}, "env-ca.pem"), "flag-ca.pem");
  EXPECT_EQ(CaAfter({"x", "--tls_ca", "flag-ca.pem"}, "env-ca.pem"), "flag-ca.pem");
}

TEST(ClusterOptions, EmptyTlsCaFlagTurnsTheEnvironmentsOff) {
  // Plaintext to a server that does not speak TLS, whatever HPCTL_TLS_CA
  // says; the next argument is not taken as the CA.
  EXPECT_EQ(CaAfter({"x", "--tls_ca="}, "env-ca.pem"), "");
  EXPECT_EQ(CaAfter({"x", "--tls_ca=", "--address=h:1"}, "env-ca.pem"), "");
  EXPECT_EQ(CaAfter({"x", "--tls_ca", ""}, "env-ca.pem"), "");
}

}  // namespace
}  // namespace paramd::hpctl
