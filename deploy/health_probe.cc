// hybrid-paramd-health: asks a hybrid-paramd process for its gRPC health
// (grpc.health.v1 Check), over TLS when given a CA, and exits 0 only when it
// answers SERVING. With --wait it asks again every 500 ms until SERVING or
// the time is up. What the deploy kit's readiness checks run (Kubernetes
// exec probes, which unlike the built-in gRPC probe speak TLS; the Slurm
// launcher before it starts the trainers).
//
//   hybrid-paramd-health --address=HOST:PORT [--service=NAME] [--wait=SECONDS]
//                        [--tls_ca=FILE [--tls_cert=FILE --tls_key=FILE]
//                         [--tls_server_name=NAME]]
//
// Services (server/server.h): "" (the process: every role here ready and a
// model loaded), "paramd.rpc.Coordinator" (every expected daemon joined),
// "paramd.rpc.Daemon" (joined and publishing). Health needs no token.
//
// Exit codes: 0 SERVING; 1 anything else by the deadline (the last answer
// on stderr: NOT_SERVING, or why the call failed); 2 bad flags.
#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "auth/security.h"
#include "common/cli.h"
#include "grpc/support/log.h"
#include "grpcpp/grpcpp.h"
#include "proto/health.grpc.pb.h"

ABSL_FLAG(std::string, address, "127.0.0.1:7070", "the process to ask, HOST:PORT");
ABSL_FLAG(std::string, service, "",
          "the health service: \"\" (the process), paramd.rpc.Coordinator or paramd.rpc.Daemon");
ABSL_FLAG(double, wait, 0, "seconds to keep asking until SERVING (0 = ask once)");
ABSL_FLAG(double, timeout, 2, "seconds one Check may take");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA certificates: use TLS and check the server with them");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate (servers requiring mutual TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "the name the server's certificate must carry (default: the host of --address)");
ABSL_FLAG(bool, quiet, false, "print nothing on success");

namespace {

using grpc::health::v1::HealthCheckResponse;

std::string StatusName(HealthCheckResponse::ServingStatus s) {
  return HealthCheckResponse::ServingStatus_Name(s);
}

int Run() {
  const std::string address = absl::GetFlag(FLAGS_address);
  const std::string service = absl::GetFlag(FLAGS_service);
  if (absl::GetFlag(FLAGS_wait) < 0 || absl::GetFlag(FLAGS_timeout) <= 0) {
    std::cerr << "hybrid-paramd-health: --wait must be >= 0 and --timeout > 0\n";
    return 2;
  }
  absl::StatusOr<paramd::auth::TlsConfig> tls = paramd::auth::LoadTls({
      .cert = absl::GetFlag(FLAGS_tls_cert),
      .key = absl::GetFlag(FLAGS_tls_key),
      .ca = absl::GetFlag(FLAGS_tls_ca),
      .server_name = absl::GetFlag(FLAGS_tls_server_name),
  });
  if (!tls.ok()) {
    std::cerr << "hybrid-paramd-health: " << tls.status().message() << "\n";
    return 2;
  }
  if (tls->enabled() && tls->ca_pem.empty()) {
    std::cerr << "hybrid-paramd-health: --tls_cert without --tls_ca: give the CA that signed "
                 "the server's certificate\n";
    return 2;
  }
  auto stub = grpc::health::v1::Health::NewStub(
      paramd::auth::CreateChannel(address, paramd::auth::ChannelSecurity{*tls, nullptr}));
  const absl::Time give_up = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_wait));
  const std::string what =
      absl::StrCat(address, " health", service.empty() ? "" : absl::StrCat(" ", service));
  std::string last;
  for (;;) {
    grpc::ClientContext context;
    context.set_deadline(
        absl::ToChronoTime(absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_timeout))));
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    HealthCheckResponse response;
    const grpc::Status s = stub->Check(&context, request, &response);
    if (s.ok() && response.status() == HealthCheckResponse::SERVING) {
      if (!absl::GetFlag(FLAGS_quiet)) std::cout << what << ": SERVING\n";
      return 0;
    }
    last = s.ok() ? StatusName(response.status())
                  : absl::StrCat("no answer (", s.error_code(), ": ", s.error_message(), ")");
    if (absl::Now() >= give_up) break;
    absl::SleepFor(std::min(absl::Milliseconds(500), give_up - absl::Now()));
  }
  std::cerr << what << ": " << last;
  if (absl::GetFlag(FLAGS_wait) > 0) {
    std::cerr << " after " << absl::GetFlag(FLAGS_wait) << " s";
  }
  std::cerr << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> positional = paramd::ParseAbslFlagsOrExit(
      argc, argv,
      {"hybrid-paramd-health",
       "exits 0 if a hybrid-paramd process answers SERVING to a gRPC health check.\n"
       "Usage: hybrid-paramd-health --address=HOST:PORT [--service=NAME] [--wait=SECONDS] "
       "[--tls_ca=FILE]",
       "deploy/health_probe.cc"});
  // gRPC's own log lines (a failed TLS handshake, ...) would repeat what
  // the one line on stderr says.
  gpr_set_log_function([](gpr_log_func_args*) {});
  if (positional.size() > 1) {
    std::cerr << "hybrid-paramd-health: unexpected argument '" << positional[1] << "'\n";
    return 2;
  }
  return Run();
}
