#include "auth/security.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/client_interceptor.h"

namespace paramd {
namespace auth {
namespace {

// "<what>: no such file: PATH", "<what>: permission denied: PATH", ...
absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view what) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return WithContext(text.status(), what);
  return text;
}

std::array<uint8_t, 32> Sha256(absl::string_view data) {
  std::array<uint8_t, 32> out{};
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), out.data(), &len, EVP_sha256(), nullptr);
  return out;
}

bool PrintableToken(absl::string_view token) {
  for (unsigned char c : token) {
    if (c <= 0x20 || c >= 0x7f) return false;
  }
  return true;
}

}  // namespace

absl::string_view RoleName(Role role) {
  switch (role) {
    case Role::kTrainer:
      return "trainer";
    case Role::kOperator:
      return "operator";
    case Role::kCluster:
      return "cluster";
  }
  return "?";
}

absl::StatusOr<Role> ParseRole(absl::string_view name) {
  for (Role r : {Role::kTrainer, Role::kOperator, Role::kCluster}) {
    if (name == RoleName(r)) return r;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown role \"",
                                                 absl::CHexEscape(name.substr(0, 32)),
                                                 "\"; want trainer, operator or cluster"));
}

std::string Roles::ToString() const {
  std::vector<absl::string_view> names;
  for (Role r : {Role::kTrainer, Role::kOperator, Role::kCluster}) {
    if (contains(r)) names.push_back(RoleName(r));
  }
  return names.empty() ? "none" : absl::StrJoin(names, ", ");
}

absl::StatusOr<std::vector<TokenEntry>> ParseTokenFile(absl::string_view text,
                                                       absl::string_view where) {
  std::vector<TokenEntry> out;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ":", line_no, ": want `ROLE TOKEN` (2 fields), got ", fields.size()));
    }
    absl::StatusOr<Role> role = ParseRole(fields[0]);
    if (!role.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ":", line_no, ": ", role.status().message()));
    }
    if (fields[1].size() < kMinTokenLength || !PrintableToken(fields[1])) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ":", line_no, ": the token must be at least ", kMinTokenLength,
                       " printable characters (e.g. `openssl rand -hex 32`)"));
    }
    out.push_back({*role, std::string(fields[1])});
  }
  if (out.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": no tokens (want `ROLE TOKEN` lines)"));
  }
  return out;
}

absl::StatusOr<std::string> ReadSecretFile(const std::string& path, absl::string_view what) {
  absl::StatusOr<int> fd = OpenForReading(path);
  if (!fd.ok()) return WithContext(fd.status(), what);
  // The mode of the file opened, not of whatever the path names later.
  struct stat st {};
  if (fstat(*fd, &st) != 0) {
    const absl::Status s = ErrnoStatus(errno, "cannot stat", path);
    close(*fd);
    return WithContext(s, what);
  }
  if ((st.st_mode & 077) != 0) {
    close(*fd);
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: permissions %04o for %s are too open; chmod 600 %s (it holds secrets: only its "
        "owner may read it)",
        what, st.st_mode & 07777, path, path));
  }
  absl::StatusOr<std::string> text = ReadAll(*fd, path);
  close(*fd);
  if (!text.ok()) return WithContext(text.status(), what);
  return text;
}

absl::Status WriteSecretFile(const std::string& path, absl::string_view secret) {
  return WriteFileAtomically(path, absl::StrCat(secret, "\n"), 0600);
}

absl::StatusOr<std::vector<TokenEntry>> LoadTokenFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadSecretFile(path, "token file"));
  return ParseTokenFile(text, path);
}

absl::StatusOr<std::string> LoadClientToken(const std::string& path, Role preferred) {
  ASSIGN_OR_RETURN(std::string text, ReadSecretFile(path, "token file"));
  std::vector<absl::string_view> lines;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (!line.empty() && line[0] != '#') lines.push_back(line);
  }
  if (lines.size() == 1 && absl::StrContains(lines[0], ' ') == false &&
      absl::StrContains(lines[0], '\t') == false) {
    if (lines[0].size() < kMinTokenLength || !PrintableToken(lines[0])) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": the token must be at least ",
                                                     kMinTokenLength, " printable characters"));
    }
    return std::string(lines[0]);
  }
  ASSIGN_OR_RETURN(std::vector<TokenEntry> entries, ParseTokenFile(text, path));
  for (const TokenEntry& e : entries) {
    if (e.role == preferred) return e.token;
  }
  if (entries.size() == 1) return entries[0].token;
  return absl::NotFoundError(
      absl::StrCat(path, ": no token of role ", RoleName(preferred), " among ", entries.size()));
}

std::string RandomSecret() {
  std::array<uint8_t, 32> bytes{};
  if (RAND_bytes(bytes.data(), static_cast<int>(bytes.size())) != 1) {
    // No entropy is not a state to run a cluster in.
    std::abort();
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (uint8_t b : bytes) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

bool SecretMatches(absl::string_view presented, absl::string_view expected) {
  if (expected.empty()) return false;
  // Digests: equal lengths whatever was presented, so the comparison's time
  // says nothing about the secret.
  const std::array<uint8_t, 32> a = Sha256(presented), b = Sha256(expected);
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

// ---------------------------------------------------------------------------

Authenticator::Authenticator(const std::vector<TokenEntry>& tokens)
    : tokens_required_(!tokens.empty()) {
  absl::MutexLock lock(&mu_);
  for (const TokenEntry& t : tokens) digests_.emplace_back(Sha256(t.token), t.role);
}

absl::StatusOr<std::shared_ptr<Authenticator>> Authenticator::FromTokenFile(
    const std::string& path) {
  std::vector<TokenEntry> tokens;
  if (!path.empty()) {
    ASSIGN_OR_RETURN(tokens, LoadTokenFile(path));
  }
  return std::make_shared<Authenticator>(tokens);
}

void Authenticator::AddClusterSecret(const std::string& secret) {
  if (secret.empty()) return;
  const Digest d = Sha256(secret);
  absl::MutexLock lock(&mu_);
  for (const auto& [digest, role] : digests_) {
    if (digest == d && role == Role::kCluster) return;
  }
  digests_.emplace_back(d, Role::kCluster);
}

std::optional<Role> Authenticator::RoleOf(absl::string_view token) const {
  if (token.empty()) return std::nullopt;
  const Digest d = Sha256(token);
  std::optional<Role> found;
  absl::MutexLock lock(&mu_);
  // Every digest is compared, whatever matched before: the time taken does
  // not depend on which token (if any) matches.
  for (const auto& [digest, role] : digests_) {
    const bool match = CRYPTO_memcmp(digest.data(), d.data(), d.size()) == 0;
    if (match && !found.has_value()) found = role;
  }
  return found;
}

Caller Authenticator::Identify(const grpc::ServerContextBase& context) const {
  Caller caller;
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return caller;
  caller.presented = true;
  absl::string_view value(it->second.data(), it->second.size());
  value = absl::StripLeadingAsciiWhitespace(value);
  if (value.size() < 7 || !absl::EqualsIgnoreCase(value.substr(0, 7), "bearer ")) return caller;
  caller.role = RoleOf(absl::StripAsciiWhitespace(value.substr(7)));
  return caller;
}

std::string Authenticator::TokenIdentity(const grpc::ServerContextBase& context) const {
  if (!tokens_required_) return "";
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return "";
  absl::string_view value(it->second.data(), it->second.size());
  value = absl::StripLeadingAsciiWhitespace(value);
  if (value.size() < 7 || !absl::EqualsIgnoreCase(value.substr(0, 7), "bearer ")) return "";
  // Domain-separated from the digests kept for authentication.
  const std::array<uint8_t, 32> d =
      Sha256(absl::StrCat("paramd-identity:", absl::StripAsciiWhitespace(value.substr(7))));
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(d.data()), d.size()));
}

grpc::Status Authenticator::Authorize(const grpc::ServerContextBase& context,
                                      absl::string_view method) const {
  return AuthorizeCaller(Identify(context), method);
}

grpc::Status Authenticator::AuthorizeCaller(const Caller& caller, absl::string_view method) const {
  const MethodPolicy* policy = FindPolicy(method);
  if (policy == nullptr) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat(method, ": no access policy for this method"));
  }
  if (!tokens_required_) {
    if (!policy->internal || caller.role == Role::kCluster) return grpc::Status::OK;
    return grpc::Status(
        grpc::StatusCode::UNAUTHENTICATED,
        absl::StrCat(method,
                     " is cluster-internal: only the coordinator and its daemons may call it (",
                     caller.presented ? "the presented secret is not the cluster's"
                                      : "no cluster secret presented",
                     ")"));
  }
  if (!caller.role.has_value()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        absl::StrCat(method, ": ",
                                     caller.presented ? "unknown bearer token"
                                                      : "missing `authorization: Bearer` token",
                                     " (allowed roles: ", policy->roles.ToString(), ")"));
  }
  if (!policy->roles.contains(*caller.role)) {
    return grpc::Status(
        grpc::StatusCode::PERMISSION_DENIED,
        absl::StrCat(method, ": role ", RoleName(*caller.role),
                     " may not call this (allowed: ", policy->roles.ToString(), ")"));
  }
  return grpc::Status::OK;
}

// ---------------------------------------------------------------------------
// TLS

absl::StatusOr<TlsConfig> LoadTls(const TlsFiles& files) {
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert and --tls_key go together (a certificate and its private key)");
  }
  if (files.require_client_cert && files.ca.empty()) {
    return absl::InvalidArgumentError(
        "requiring client certificates needs --tls_ca (the CA that signs them)");
  }
  TlsConfig config;
  config.require_client_cert = files.require_client_cert;
  config.server_name = files.server_name;
  auto read_pem = [](const std::string& path, absl::string_view what,
                     std::string* out) -> absl::Status {
    if (path.empty()) return absl::OkStatus();
    ASSIGN_OR_RETURN(*out, ReadFile(path, what));
    if (!absl::StrContains(*out, "-----BEGIN ")) {
      return absl::InvalidArgumentError(absl::StrCat(what, " ", path, ": not a PEM file"));
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(read_pem(files.cert, "--tls_cert", &config.cert_pem));
  RETURN_IF_ERROR(read_pem(files.key, "--tls_key", &config.key_pem));
  RETURN_IF_ERROR(read_pem(files.ca, "--tls_ca", &config.ca_pem));
  return config;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const TlsConfig& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  if (tls.cert_pem.empty() || tls.key_pem.empty()) {
    return absl::InvalidArgumentError(
        "a TLS server needs --tls_cert and --tls_key (its certificate and private key)");
  }
  grpc_ssl_client_certificate_request_type request = GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
  if (tls.require_client_cert) {
    request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  } else if (!tls.ca_pem.empty()) {
    request = GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  grpc::SslServerCredentialsOptions options(request);
  options.pem_root_certs = tls.ca_pem;
  options.pem_key_cert_pairs.push_back({tls.key_pem, tls.cert_pem});
  return grpc::SslServerCredentials(options);
}

absl::Status CheckListenAddress(absl::string_view listen, bool tls, bool insecure_listen_anywhere,
                                absl::string_view flag) {
  if (tls || insecure_listen_anywhere) return absl::OkStatus();
  if (absl::StartsWith(listen, "unix:")) return absl::OkStatus();
  absl::string_view host = listen;
  if (absl::ConsumePrefix(&host, "[")) {
    host = host.substr(0, host.find(']'));
  } else if (size_t colon = host.rfind(':'); colon != absl::string_view::npos) {
    host = host.substr(0, colon);
  }
  bool loopback = host == "localhost" || host == "::1";
  in_addr v4{};
  const std::string h(host);
  if (!loopback && inet_pton(AF_INET, h.c_str(), &v4) == 1) {
    loopback = (ntohl(v4.s_addr) >> 24) == 127;
  }
  if (loopback) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(flag, "=", listen,
                   " is not a loopback address: without TLS a server listens on loopback only "
                   "(127.0.0.1, ::1, localhost). Give --tls_cert/--tls_key (docs/SECURITY.md), or "
                   "--insecure_listen_anywhere to serve plaintext to the network anyway"));
}

// ---------------------------------------------------------------------------
// Channels

void BearerToken::Set(std::string token) {
  absl::MutexLock lock(&mu_);
  token_ = std::move(token);
}

std::string BearerToken::Get() const {
  absl::MutexLock lock(&mu_);
  return token_;
}

void AddFastReconnect(grpc::ChannelArguments* args) {
  args->SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args->SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, kMinConnectTimeoutMs);
  args->SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
}

void AddKeepalive(grpc::ChannelArguments* args) {
  args->SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  args->SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  // Keep pinging while a call waits without data (a parked WaitForVersion,
  // a push stuck in flow control): that is when a vanished peer matters.
  args->SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  args->SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
}

void AddKeepalive(grpc::ServerBuilder* builder) {
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Accept our clients' pings (every kKeepaliveTimeMs) and those of
  // clients that ping between calls, without counting them as abuse.
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                              kKeepaliveTimeMs / 2);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
}

namespace {

class TokenInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit TokenInterceptor(std::shared_ptr<BearerToken> token) : token_(std::move(token)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      std::string token = token_->Get();
      if (!token.empty()) {
        methods->GetSendInitialMetadata()->insert({"authorization", "Bearer " + token});
      }
    }
    methods->Proceed();
  }

 private:
  std::shared_ptr<BearerToken> token_;
};

class TokenInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit TokenInterceptorFactory(std::shared_ptr<BearerToken> token) : token_(std::move(token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* /*info*/) override {
    return new TokenInterceptor(token_);
  }

 private:
  std::shared_ptr<BearerToken> token_;
};

}  // namespace

std::shared_ptr<grpc::Channel> CreateChannel(const std::string& address,
                                             const ChannelSecurity& security,
                                             grpc::ChannelArguments args) {
  AddKeepalive(&args);
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (security.tls.enabled()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = security.tls.ca_pem;
    ssl.pem_private_key = security.tls.key_pem;
    ssl.pem_cert_chain = security.tls.cert_pem;
    credentials = grpc::SslCredentials(ssl);
    if (!security.tls.server_name.empty()) {
      args.SetSslTargetNameOverride(security.tls.server_name);
    }
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  if (security.token != nullptr) {
    interceptors.push_back(std::make_unique<TokenInterceptorFactory>(security.token));
  }
  return grpc::experimental::CreateCustomChannelWithInterceptors(address, credentials, args,
                                                                 std::move(interceptors));
}

}  // namespace auth
}  // namespace paramd
