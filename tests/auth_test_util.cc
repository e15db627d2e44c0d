#include "tests/auth_test_util.h"

#include <sys/stat.h>

#include <cstdlib>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"

namespace paramd {
namespace testing {

absl::Status MakeCerts(const std::string& dir) {
  const std::string command =
      absl::StrCat("bash tools/make_certs.sh '", dir, "' > '", dir, ".log' 2>&1");
  if (std::system(command.c_str()) != 0) {
    std::ifstream log(dir + ".log");
    std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    return absl::InternalError(absl::StrCat("tools/make_certs.sh failed: ", text));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> WriteTokenFile(const std::string& dir) {
  const std::string path = dir + "/tokens";
  std::ofstream out(path);
  out << "# role token\n"
      << "trainer " << kTrainerToken << "\n"
      << "trainer " << kTrainer2Token << "\n"
      << "operator " << kOperatorToken << "\n"
      << "cluster " << kClusterToken << "\n";
  out.close();
  // Token files others may read are refused (auth::ReadSecretFile).
  if (!out || chmod(path.c_str(), 0600) != 0) {
    return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  return path;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> Channel(const std::string& address,
                                                       const std::string& token,
                                                       const std::string& cert_dir,
                                                       const std::string& client_name,
                                                       const std::string& ca_name) {
  auth::ChannelSecurity security;
  if (!cert_dir.empty()) {
    auth::TlsFiles files;
    files.ca = absl::StrCat(cert_dir, "/", ca_name, ".pem");
    if (!client_name.empty()) {
      files.cert = absl::StrCat(cert_dir, "/", client_name, ".pem");
      files.key = absl::StrCat(cert_dir, "/", client_name, ".key");
    }
    ASSIGN_OR_RETURN(security.tls, auth::LoadTls(files));
  }
  security.token = std::make_shared<auth::BearerToken>(token);
  grpc::ChannelArguments args;
  // Fail fast instead of backing off between the probes of a refused
  // handshake.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 200);
  return auth::CreateChannel(address, security, args);
}

grpc::Status CallRaw(grpc::Channel* channel, const std::string& method,
                     const google::protobuf::Message& request, absl::Duration timeout) {
  return CallRawBytes(channel, method, {request.SerializeAsString()}, timeout);
}

grpc::Status CallRawBytes(grpc::Channel* channel, const std::string& method,
                          const std::vector<std::string>& messages, absl::Duration timeout) {
  grpc::GenericStub stub(channel->shared_from_this());
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::CompletionQueue cq;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      stub.PrepareCall(&context, method, &cq);
  void* tag = nullptr;
  bool ok = false;
  auto step = [&](void* want) {
    cq.Next(&tag, &ok);
    return tag == want && ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  bool sent = step(reinterpret_cast<void*>(1));
  for (size_t i = 0; sent && i < messages.size(); ++i) {
    grpc::Slice slice(messages[i]);
    grpc::ByteBuffer buffer(&slice, 1);
    call->Write(buffer, reinterpret_cast<void*>(2));
    sent = step(reinterpret_cast<void*>(2));
  }
  if (sent) {
    call->WritesDone(reinterpret_cast<void*>(3));
    if (step(reinterpret_cast<void*>(3))) {
      grpc::ByteBuffer response;
      for (;;) {
        call->Read(&response, reinterpret_cast<void*>(4));
        if (!step(reinterpret_cast<void*>(4))) break;
      }
    }
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  while (cq.Next(&tag, &ok)) {
    if (tag == reinterpret_cast<void*>(5)) break;
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

}  // namespace testing
}  // namespace paramd
