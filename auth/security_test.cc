#include "auth/security.h"

#include <linux/capability.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "proto/checkpoint_service.grpc.pb.h"
#include "proto/ipc.grpc.pb.h"
#include "proto/paramd.grpc.pb.h"
#include "proto/transport.grpc.pb.h"

namespace paramd {
namespace auth {
namespace {

using ::testing::HasSubstr;

TEST(TokenFile, ParsesRolesCommentsAndBlankLines) {
  auto tokens = ParseTokenFile(
      "# tokens\n\ntrainer  aaaaaaaaaaaaaaaa1\n operator\tbbbbbbbbbbbbbbbb2 \ncluster "
      "cccccccccccccccc3\n",
      "f");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_EQ(tokens->size(), 3u);
  EXPECT_EQ((*tokens)[0].role, Role::kTrainer);
  EXPECT_EQ((*tokens)[0].token, "aaaaaaaaaaaaaaaa1");
  EXPECT_EQ((*tokens)[1].role, Role::kOperator);
  EXPECT_EQ((*tokens)[1].token, "bbbbbbbbbbbbbbbb2");
  EXPECT_EQ((*tokens)[2].role, Role::kCluster);
}

TEST(TokenFile, RefusesBadLinesWithoutEchoingTokens) {
  auto unknown = ParseTokenFile("admin aaaaaaaaaaaaaaaaaaaa\n", "f");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(), HasSubstr("f:1"));
  EXPECT_THAT(unknown.status().message(), HasSubstr("trainer, operator or cluster"));
  auto short_token = ParseTokenFile("\ntrainer sekrit\n", "f");
  EXPECT_EQ(short_token.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_token.status().message(), HasSubstr("f:2"));
  EXPECT_THAT(short_token.status().message(), ::testing::Not(HasSubstr("sekrit")));
  EXPECT_FALSE(ParseTokenFile("trainer a b c d e f g h i j k l m n o p\n", "f").ok());
  EXPECT_FALSE(ParseTokenFile("# nothing\n", "f").ok());
}

// A file of `mode` holding `text` in the test's scratch directory.
std::string WriteFileWithMode(const std::string& name, const std::string& text, mode_t mode) {
  const std::string path = absl::StrCat(std::getenv("TEST_TMPDIR"), "/", name);
  std::ofstream(path, std::ios::trunc) << text;
  EXPECT_EQ(chmod(path.c_str(), mode), 0) << path;
  return path;
}

TEST(SecretFiles, FilesOthersMayReadAreRefusedAsSshDoes) {
  const std::string tokens = "trainer aaaaaaaaaaaaaaaa1\noperator bbbbbbbbbbbbbbbb2\n";
  for (mode_t mode : {0644, 0640, 0604, 0620, 0602}) {
    const std::string path = WriteFileWithMode("tokens", tokens, mode);
    const std::string want =
        absl::StrFormat("permissions %04o for %s are too open; chmod 600 %s", mode, path, path);
    for (const absl::Status& s :
         {LoadTokenFile(path).status(), LoadClientToken(path, Role::kTrainer).status(),
          ReadSecretFile(path, "--cluster_secret_file").status()}) {
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
      EXPECT_THAT(s.message(), HasSubstr(want));
      EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("aaaaaaaaaaaaaaaa1")));
    }
  }
  for (mode_t mode : {0600, 0400}) {
    const std::string path = WriteFileWithMode("tokens", tokens, mode);
    auto loaded = LoadTokenFile(path);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->size(), 2u);
    auto client = LoadClientToken(path, Role::kOperator);
    ASSERT_TRUE(client.ok()) << client.status();
    EXPECT_EQ(*client, "bbbbbbbbbbbbbbbb2");
  }
  EXPECT_EQ(LoadTokenFile("/nonexistent/tokens").status().code(), absl::StatusCode::kNotFound);
}

// The statuses `attempt` returns where the files `paths` exist but cannot
// be read, as "CODE message" lines: the files get mode 0000 and `attempt`
// runs in a child process without the capabilities that let root read any
// file (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH).
std::vector<std::string> WhereUnreadable(
    const std::vector<std::string>& paths,
    const std::function<std::vector<absl::Status>()>& attempt) {
  for (const std::string& path : paths) EXPECT_EQ(chmod(path.c_str(), 0), 0) << path;
  int fds[2];
  if (pipe(fds) != 0) return {"pipe failed"};
  const pid_t child = fork();
  if (child == 0) {
    close(fds[0]);
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct caps[_LINUX_CAPABILITY_U32S_3] = {};
    if (syscall(SYS_capget, &header, caps) != 0) _exit(2);
    caps[0].effective &= ~((1u << CAP_DAC_OVERRIDE) | (1u << CAP_DAC_READ_SEARCH));
    if (syscall(SYS_capset, &header, caps) != 0) _exit(2);
    std::string text;
    for (const absl::Status& s : attempt()) {
      absl::StrAppend(&text, absl::StatusCodeToString(s.code()), " ", s.message(), "\n");
    }
    const ssize_t n = write(fds[1], text.data(), text.size());
    _exit(n == static_cast<ssize_t>(text.size()) ? 0 : 3);
  }
  close(fds[1]);
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) text.append(buf, n);
  close(fds[0]);
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

// A file that exists but cannot be read says so (PERMISSION_DENIED
// "permission denied: PATH"); a missing one is NOT_FOUND "no such file".
TEST(SecretFiles, UnreadableIsPermissionDeniedMissingIsNotFound) {
  const std::string secret =
      WriteFileWithMode("unreadable_tokens", "trainer aaaaaaaaaaaaaaaa1\n", 0600);
  const std::string pem =
      WriteFileWithMode("unreadable.pem", "-----BEGIN CERTIFICATE-----\n", 0644);
  const std::vector<std::string> got = WhereUnreadable({secret, pem}, [&] {
    return std::vector<absl::Status>{
        LoadTokenFile(secret).status(), LoadClientToken(secret, Role::kOperator).status(),
        ReadSecretFile(secret, "--cluster_secret_file").status(), LoadTls({.ca = pem}).status(),
        LoadTls({.cert = pem, .key = pem}).status()};
  });
  ASSERT_EQ(got.size(), 5u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(got[i], absl::StrCat(i == 2 ? "PERMISSION_DENIED --cluster_secret_file"
                                          : "PERMISSION_DENIED token file",
                                   ": permission denied: ", secret));
  }
  EXPECT_EQ(got[3], "PERMISSION_DENIED --tls_ca: permission denied: " + pem);
  EXPECT_EQ(got[4], "PERMISSION_DENIED --tls_cert: permission denied: " + pem);
  for (const absl::Status& s : {LoadTokenFile("/nonexistent/tokens").status(),
                                LoadTls({.ca = "/nonexistent/ca.pem"}).status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_THAT(s.message(), HasSubstr("no such file: /nonexistent/")) << s;
  }
}

TEST(SecretFiles, WriteSecretFileMakesAnOwnerOnlyFileReadBack) {
  const std::string path = absl::StrCat(std::getenv("TEST_TMPDIR"), "/generated_secret");
  WriteFileWithMode("generated_secret", "old", 0644);  // replaced, mode and all
  const std::string secret = RandomSecret();
  ASSERT_TRUE(WriteSecretFile(path, secret).ok());
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  auto read = LoadClientToken(path, Role::kCluster);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, secret);
  EXPECT_FALSE(WriteSecretFile("/nonexistent/dir/secret", secret).ok());
}

TEST(Authenticator, RolesOfTokensAndClusterSecrets) {
  Authenticator a({{Role::kTrainer, "tttttttttttttttt"}, {Role::kOperator, "oooooooooooooooo"}});
  EXPECT_TRUE(a.tokens_required());
  EXPECT_EQ(a.RoleOf("tttttttttttttttt"), Role::kTrainer);
  EXPECT_EQ(a.RoleOf("oooooooooooooooo"), Role::kOperator);
  EXPECT_EQ(a.RoleOf("ttttttttttttttt"), std::nullopt);  // a prefix is not the token
  EXPECT_EQ(a.RoleOf(""), std::nullopt);
  const std::string secret = RandomSecret();
  EXPECT_EQ(secret.size(), 64u);
  EXPECT_NE(secret, RandomSecret());
  EXPECT_EQ(a.RoleOf(secret), std::nullopt);
  a.AddClusterSecret(secret);
  EXPECT_EQ(a.RoleOf(secret), Role::kCluster);
}

TEST(Authenticator, WithTokensEachRoleGetsExactlyItsMethods) {
  Authenticator a({{Role::kTrainer, "tttttttttttttttt"}});
  EXPECT_EQ(a.AuthorizeCaller({}, "/paramd.rpc.Daemon/Fetch").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(a.AuthorizeCaller({std::nullopt, true}, "/paramd.rpc.Daemon/Fetch").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  for (const MethodPolicy& p : AllPolicies()) {
    for (Role r : {Role::kTrainer, Role::kOperator, Role::kCluster}) {
      const grpc::Status s = a.AuthorizeCaller({r, true}, p.method);
      EXPECT_EQ(s.ok(), p.roles.contains(r)) << p.method << " as " << RoleName(r);
      if (!s.ok()) {
        EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
        EXPECT_THAT(s.error_message(), HasSubstr(p.method));
      }
    }
  }
  EXPECT_EQ(a.AuthorizeCaller({Role::kCluster, true}, "/paramd.rpc.Daemon/NoSuch").error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
}

TEST(Authenticator, WithoutTokensOnlyInternalMethodsNeedTheClusterSecret) {
  Authenticator a({});
  EXPECT_FALSE(a.tokens_required());
  int internal = 0;
  for (const MethodPolicy& p : AllPolicies()) {
    EXPECT_TRUE(a.AuthorizeCaller({Role::kCluster, true}, p.method).ok()) << p.method;
    const grpc::Status stranger = a.AuthorizeCaller({std::nullopt, true}, p.method);
    EXPECT_EQ(stranger.ok(), !p.internal) << p.method;
    if (p.internal) {
      ++internal;
      EXPECT_TRUE(p.roles.contains(Role::kCluster));
      EXPECT_EQ(stranger.error_code(), grpc::StatusCode::UNAUTHENTICATED);
      EXPECT_THAT(stranger.error_message(), HasSubstr("cluster-internal"));
    }
  }
  for (absl::string_view m : {"/paramd.rpc.Daemon/LoadShards", "/paramd.rpc.Daemon/Step",
                              "/paramd.rpc.Coordinator/ReportVersion",
                              "/paramd.checkpoint.CheckpointDaemon/WriteShard"}) {
    ASSERT_NE(FindPolicy(m), nullptr) << m;
    EXPECT_TRUE(FindPolicy(m)->internal) << m;
  }
  EXPECT_GE(internal, 4);
}

TEST(MethodTable, CoversEveryMethodOfEveryService) {
  const google::protobuf::DescriptorPool* pool = google::protobuf::DescriptorPool::generated_pool();
  std::set<std::string> listed;
  for (const MethodPolicy& p : AllPolicies()) {
    EXPECT_TRUE(listed.insert(std::string(p.method)).second) << "twice: " << p.method;
  }
  int methods = 0;
  // Every service of every proto file that declares one of the project's
  // services, so that a service added to any of them needs its rows too.
  std::set<const google::protobuf::FileDescriptor*> files;
  for (const char* service :
       {rpc::Coordinator::service_full_name(), rpc::DaemonIpc::service_full_name(),
        checkpoint::CheckpointCoordinator::service_full_name(),
        transport::DataPlane::service_full_name()}) {
    const google::protobuf::ServiceDescriptor* s = pool->FindServiceByName(service);
    ASSERT_NE(s, nullptr) << service;
    files.insert(s->file());
  }
  std::vector<const google::protobuf::ServiceDescriptor*> services;
  for (const google::protobuf::FileDescriptor* f : files) {
    for (int i = 0; i < f->service_count(); ++i) services.push_back(f->service(i));
  }
  EXPECT_GE(services.size(), 6u);
  for (const google::protobuf::ServiceDescriptor* s : services) {
    const std::string& service = s->full_name();
    for (int i = 0; i < s->method_count(); ++i, ++methods) {
      const std::string name = absl::StrCat("/", service, "/", s->method(i)->name());
      EXPECT_NE(FindPolicy(name), nullptr) << "no policy for " << name;
      listed.erase(name);
    }
  }
  listed.erase(std::string(kJoinAsDaemon));
  listed.erase(std::string(kJoinAsPusher));
  EXPECT_TRUE(listed.empty()) << "policy for a method that does not exist: " << *listed.begin();
  EXPECT_GT(methods, 20);
}

TEST(ListenAddress, PlaintextOnlyOnLoopback) {
  for (const char* ok :
       {"127.0.0.1:7070", "127.9.0.1:0", "localhost:7070", "[::1]:7070", "unix:/tmp/s"}) {
    EXPECT_TRUE(CheckListenAddress(ok, false, false).ok()) << ok;
  }
  for (const char* bad : {"0.0.0.0:7070", "[::]:7070", "10.1.2.3:7070", ":7070", "host:1"}) {
    const absl::Status s = CheckListenAddress(bad, false, false);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(s.message(), HasSubstr("--insecure_listen_anywhere"));
    EXPECT_TRUE(CheckListenAddress(bad, true, false).ok()) << bad;
    EXPECT_TRUE(CheckListenAddress(bad, false, true).ok()) << bad;
  }
}

TEST(Tls, InconsistentFlagsAreRefused) {
  EXPECT_EQ(LoadTls({.cert = "/x.pem"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadTls({.require_client_cert = true}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadTls({.ca = "/nonexistent/ca.pem"}).status().code(), absl::StatusCode::kNotFound);
  auto none = LoadTls({});
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->enabled());
  EXPECT_FALSE(ServerCredentials(TlsConfig{.ca_pem = "-----BEGIN x"}).ok());
}

}  // namespace
}  // namespace auth
}  // namespace paramd
