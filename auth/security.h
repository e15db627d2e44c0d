// File: auth/security.h
//
// Transport security and authentication of every gRPC server and channel
// of hybrid-paramd (docs/SECURITY.md is the user's view):
//
//  * TLS with gRPC's SSL credentials (TlsConfig): a server certificate, and
//    optionally client certificates checked against a CA (mutual TLS).
//  * Bearer tokens with roles (Authenticator): `authorization: Bearer T`
//    call metadata, checked by every RPC handler against one table of which
//    roles may call which method (method_policy.cc).
//  * The cluster's own secrets (Authenticator::AddClusterSecret): the
//    coordinator's cluster secret and each daemon's member secret, handed
//    out in the Join exchange, carried by every cluster-internal call. They
//    authenticate the internal RPCs (LoadShards, ReportVersion, Step, ...)
//    even when no token file is given.
//  * Keepalive and listen-address policy shared by every server/channel.
//
// Threading: every function is thread-safe; Authenticator and BearerToken
// may be shared by any number of threads. Nothing here blocks except the
// file reads of the loaders.
#ifndef PARAMD_AUTH_SECURITY_H_
#define PARAMD_AUTH_SECURITY_H_

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"

namespace paramd {
namespace auth {

// ---------------------------------------------------------------------------
// Roles and tokens

enum class Role : uint8_t { kTrainer = 0, kOperator = 1, kCluster = 2 };
absl::string_view RoleName(Role role);  // "trainer" | "operator" | "cluster"
// InvalidArgument naming the accepted roles.
absl::StatusOr<Role> ParseRole(absl::string_view name);

// A set of roles (bit i = Role i).
class Roles {
 public:
  constexpr Roles() = default;
  constexpr Roles(std::initializer_list<Role> roles) {
    for (Role r : roles) bits_ |= Bit(r);
  }
  constexpr bool contains(Role r) const { return (bits_ & Bit(r)) != 0; }
  std::string ToString() const;  // "trainer, operator"

 private:
  static constexpr uint8_t Bit(Role r) { return static_cast<uint8_t>(1u << static_cast<int>(r)); }
  uint8_t bits_ = 0;
};

struct TokenEntry {
  Role role;
  std::string token;
};

// Shortest token accepted from a file (a guessable token is no token).
inline constexpr size_t kMinTokenLength = 16;

// Parses a token file: one `ROLE TOKEN` per line (ROLE = trainer, operator
// or cluster; TOKEN = at least kMinTokenLength printable non-space
// characters); blank lines and lines starting with '#' are ignored.
// InvalidArgument naming `where` and the line for anything else (the token
// itself is never echoed). An empty result is an error too.
absl::StatusOr<std::vector<TokenEntry>> ParseTokenFile(absl::string_view text,
                                                       absl::string_view where);
// Every file of secrets (a token file, a cluster secret file, a client's
// token file) is read through ReadSecretFile, which refuses, as ssh does, a
// file that its group or others may read or write: FailedPrecondition
// "permissions 0644 for PATH are too open; chmod 600 PATH". A file that
// cannot be opened is NotFound "WHAT: no such file: PATH" or
// PermissionDenied "WHAT: permission denied: PATH" (common/file_util.h
// OpenForReading).
absl::StatusOr<std::string> ReadSecretFile(const std::string& path, absl::string_view what);
absl::StatusOr<std::vector<TokenEntry>> LoadTokenFile(const std::string& path);

// The token a client presents, from a file holding either one bare token
// or `ROLE TOKEN` lines (then the first line of role `preferred`, else the
// only line). NotFound/InvalidArgument when the file has no usable token.
absl::StatusOr<std::string> LoadClientToken(const std::string& path, Role preferred);

// Writes `secret` and a newline to `path` with mode 0600 through
// common/file_util's WriteFileAtomically (a fresh temporary name, never a
// link followed, fsynced and renamed over `path`), so that no reader sees a
// partial secret or a file others may read. Blocks on the file system.
absl::Status WriteSecretFile(const std::string& path, absl::string_view secret);

// 32 random bytes (OpenSSL RAND_bytes) as 64 hex characters.
std::string RandomSecret();

// Whether `presented` equals `expected`, in time that depends only on the
// lengths (CRYPTO_memcmp over SHA-256 digests). An empty `expected` matches
// nothing.
bool SecretMatches(absl::string_view presented, absl::string_view expected);

// ---------------------------------------------------------------------------
// Server side: who may call what

// Outcome of authenticating one call.
struct Caller {
  // The role of the presented token; nullopt = no or an unknown token.
  std::optional<Role> role;
  // Whether a token was presented at all.
  bool presented = false;
};

// The role table (method_policy.cc). `method` is the full gRPC method name
// ("/paramd.rpc.Daemon/LoadShards") or one of the sub-policies
// kJoinAsDaemon / kJoinAsPusher. Null for a method not in the table.
struct MethodPolicy {
  absl::string_view method;
  // Roles allowed when tokens are required (--auth_token_file).
  Roles roles;
  // Cluster-internal: only callers holding a cluster secret (or a
  // `cluster` token) are let in, with or without a token file.
  bool internal = false;
};
const MethodPolicy* FindPolicy(absl::string_view method);
// Every entry of the table (for tests and docs).
const std::vector<MethodPolicy>& AllPolicies();

// Sub-policies checked inside Coordinator.Join.
inline constexpr absl::string_view kJoinAsDaemon = "/paramd.rpc.Coordinator/Join#daemon";
inline constexpr absl::string_view kJoinAsPusher = "/paramd.rpc.Coordinator/Join#pusher";

// Checks bearer tokens. Tokens are kept as SHA-256 digests and compared in
// constant time (CRYPTO_memcmp over every known digest, no early exit), so
// neither the timing nor a memory dump gives a token away.
class Authenticator {
 public:
  // `tokens` empty: no token file ("open"): every method but the internal
  // ones is open; internal ones need a cluster secret.
  explicit Authenticator(const std::vector<TokenEntry>& tokens);
  // LoadTokenFile(path); "" = open.
  static absl::StatusOr<std::shared_ptr<Authenticator>> FromTokenFile(const std::string& path);

  // Whether every call needs a token (a token file was given).
  bool tokens_required() const { return tokens_required_; }

  // Accept `secret` as role cluster from now on (the coordinator's cluster
  // secret, a daemon's member secret). Empty secrets are ignored.
  void AddClusterSecret(const std::string& secret);

  // The role of `token` (constant time in the tokens known).
  std::optional<Role> RoleOf(absl::string_view token) const;
  // The caller of a server call, from its `authorization` metadata.
  Caller Identify(const grpc::ServerContextBase& context) const;
  // What binds a name to the token that claimed it (pusher ids): with a
  // token file, 64 hex characters of SHA-256 over the presented bearer
  // token (never the token itself); "" without a token file or token.
  std::string TokenIdentity(const grpc::ServerContextBase& context) const;

  // OK if the caller may call `method` (a name of the table). Else
  // UNAUTHENTICATED (no or an unknown token where one is needed) or
  // PERMISSION_DENIED (a known token of a role the method does not allow;
  // a method missing from the table). The message names the method and
  // the allowed roles, never a token.
  grpc::Status Authorize(const grpc::ServerContextBase& context, absl::string_view method) const;
  grpc::Status AuthorizeCaller(const Caller& caller, absl::string_view method) const;

 private:
  using Digest = std::array<uint8_t, 32>;
  bool tokens_required_;
  mutable absl::Mutex mu_;
  std::vector<std::pair<Digest, Role>> digests_ ABSL_GUARDED_BY(mu_);
};

// Authorize through a possibly null authenticator (null = no checks: unit
// tests that build a role without a server).
inline grpc::Status Authorize(const Authenticator* authenticator,
                              const grpc::ServerContextBase& context, absl::string_view method) {
  return authenticator == nullptr ? grpc::Status::OK : authenticator->Authorize(context, method);
}

// ---------------------------------------------------------------------------
// TLS

// PEM file paths (flags --tls_cert, --tls_key, --tls_ca).
struct TlsFiles {
  std::string cert;  // this endpoint's certificate chain
  std::string key;   // its private key
  std::string ca;    // roots: a server checks client certificates with it,
                     // a client the server's certificate
  // Server: refuse clients without a certificate signed by `ca` (mutual
  // TLS). Needs `ca`.
  bool require_client_cert = false;
  // Client: the name the server's certificate must carry instead of the
  // host of the address ("" = the address's host).
  std::string server_name;
};

// Loaded PEM contents. Empty = insecure (plaintext) endpoint.
struct TlsConfig {
  std::string cert_pem, key_pem, ca_pem;
  bool require_client_cert = false;
  std::string server_name;
  bool enabled() const { return !cert_pem.empty() || !ca_pem.empty(); }
};

// Reads the files. InvalidArgument for inconsistent flags (a cert without
// its key, require_client_cert without a CA, ...), NotFound/PermissionDenied
// for unreadable files, InvalidArgument for a file that is not PEM.
absl::StatusOr<TlsConfig> LoadTls(const TlsFiles& files);

// Server credentials: SSL when `tls.enabled()` (needs cert_pem/key_pem;
// client certificates requested and verified when ca_pem is set, required
// with require_client_cert), insecure otherwise.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const TlsConfig& tls);

// Without TLS a server listens on loopback only: OK for 127.0.0.0/8, ::1,
// "localhost" (and any host with TLS or with `insecure_listen_anywhere`);
// InvalidArgument naming the flags otherwise.
// `flag` names the address in the error.
absl::Status CheckListenAddress(absl::string_view listen, bool tls, bool insecure_listen_anywhere,
                                absl::string_view flag = "--listen");

// ---------------------------------------------------------------------------
// Channels

// The token a channel presents on every call. Settable later (a daemon
// learns the cluster secret from its Join reply), thread-safe.
class BearerToken {
 public:
  BearerToken() = default;
  explicit BearerToken(std::string token) : token_(std::move(token)) {}
  void Set(std::string token) ABSL_LOCKS_EXCLUDED(mu_);
  std::string Get() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  std::string token_ ABSL_GUARDED_BY(mu_);
};

// How a process talks to a hybrid-paramd endpoint.
struct ChannelSecurity {
  TlsConfig tls;                       // !enabled() = plaintext
  std::shared_ptr<BearerToken> token;  // null or empty = no authorization metadata
};

// Keepalive on every channel and server (gRPC pings an idle connection and
// drops it when the peer stops answering): pings after 10 s without
// activity, a ping unanswered for 5 s kills the connection; servers accept
// pings that often (else they would GOAWAY such clients).
inline constexpr int kKeepaliveTimeMs = 10000;
inline constexpr int kKeepaliveTimeoutMs = 5000;
void AddKeepalive(grpc::ChannelArguments* args);
void AddKeepalive(grpc::ServerBuilder* builder);

// Reconnect soon after a peer comes (back) up: the first retry after
// 100 ms, then backoff growing to at most 1 s (gRPC's default grows to two
// minutes). Each connection attempt, TCP and TLS handshake included, gets
// kMinConnectTimeoutMs: gRPC takes its minimum connect timeout from
// GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, so that one stays large (a 100 ms
// attempt never completes a TLS handshake on a loaded machine or a slow
// link, and the peer then looks down for as long as the load lasts).
inline constexpr int kMinConnectTimeoutMs = 2000;
void AddFastReconnect(grpc::ChannelArguments* args);

// A channel to `address` with `security` (SSL or insecure credentials, the
// token added to every call by an interceptor) and keepalive; `args` may
// carry further settings (message sizes, backoff).
std::shared_ptr<grpc::Channel> CreateChannel(const std::string& address,
                                             const ChannelSecurity& security,
                                             grpc::ChannelArguments args = {});

// ---------------------------------------------------------------------------
// Refusing a callback-API call before its handler does anything

// A reactor that finishes at once with `status` (not OK) and deletes itself
// when done: return it from a streaming handler whose Authorize failed.
template <class StreamReactor>
StreamReactor* RefusedStream(const grpc::Status& status) {
  class Reactor : public StreamReactor {
   public:
    explicit Reactor(const grpc::Status& s) { this->Finish(s); }
    void OnDone() override { delete this; }
  };
  return new Reactor(status);
}
template <class Response>
grpc::ServerWriteReactor<Response>* RefusedWriter(const grpc::Status& status) {
  return RefusedStream<grpc::ServerWriteReactor<Response>>(status);
}
template <class Request>
grpc::ServerReadReactor<Request>* RefusedReader(const grpc::Status& status) {
  return RefusedStream<grpc::ServerReadReactor<Request>>(status);
}
inline grpc::ServerUnaryReactor* RefusedUnary(grpc::CallbackServerContext* context,
                                              const grpc::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

}  // namespace auth
}  // namespace paramd

#endif  // PARAMD_AUTH_SECURITY_H_
