// File: tests/auth_test_util.h
//
// Helpers for the security integration tests (tests/auth_*_test.cc):
// certificates made at test time by tools/make_certs.sh (openssl), a token
// file, channels with TLS and tokens, and a raw call of any RPC by its full
// method name (so that one loop probes every row of auth/method_policy.cc).
//
// Not thread-safe; use from the test's main thread.
#ifndef PARAMD_TESTS_AUTH_TEST_UTIL_H_
#define PARAMD_TESTS_AUTH_TEST_UTIL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "auth/security.h"
#include "google/protobuf/message.h"
#include "grpcpp/grpcpp.h"

namespace paramd {
namespace testing {

// Runs tools/make_certs.sh into `dir` (runfiles-relative script; the test
// needs data = ["//tools:make_certs.sh"]). Files: see the script.
absl::Status MakeCerts(const std::string& dir);

// The tokens of the tests' token file, one per role.
inline constexpr char kTrainerToken[] = "trainer-token-0123456789abcdef";
inline constexpr char kOperatorToken[] = "operator-token-0123456789abcdef";
inline constexpr char kClusterToken[] = "cluster-token-0123456789abcdef";
// A second trainer (pusher ids are bound to the token that pushed first).
inline constexpr char kTrainer2Token[] = "trainer2-token-0123456789abcdef";
// Writes `dir`/tokens (mode 0600) with the four tokens; returns its path.
absl::StatusOr<std::string> WriteTokenFile(const std::string& dir);

// A channel to `address` presenting `token` ("" = none), with TLS from the
// PEM files in `cert_dir` when non-empty (ca.pem as roots, and
// `client_name`.pem/.key as client certificate when `client_name` is set).
absl::StatusOr<std::shared_ptr<grpc::Channel>> Channel(const std::string& address,
                                                       const std::string& token,
                                                       const std::string& cert_dir = "",
                                                       const std::string& client_name = "",
                                                       const std::string& ca_name = "ca");

// Calls `method` ("/paramd.rpc.Daemon/Fetch") with `request` as its one
// request message whatever its kind (unary, client/server/bidi streaming:
// one message, half-close, responses read and dropped), and returns the
// call's status.
grpc::Status CallRaw(grpc::Channel* channel, const std::string& method,
                     const google::protobuf::Message& request, absl::Duration timeout);
// The same with `messages` as the raw request messages, written in order
// before the half-close: serialized requests or any bytes at all.
grpc::Status CallRawBytes(grpc::Channel* channel, const std::string& method,
                          const std::vector<std::string>& messages, absl::Duration timeout);

// Whether `s` is an authentication/authorization refusal.
inline bool Refused(const grpc::Status& s) {
  return s.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
         s.error_code() == grpc::StatusCode::PERMISSION_DENIED;
}

}  // namespace testing
}  // namespace paramd

#endif  // PARAMD_TESTS_AUTH_TEST_UTIL_H_
