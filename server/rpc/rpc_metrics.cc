#include "server/rpc/rpc_metrics.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/telemetry.h"

namespace paramd {
namespace {

using grpc::experimental::InterceptionHookPoints;

enum class Kind { kOther, kPush, kFetch };

class RpcMetrics : public grpc::experimental::Interceptor {
 public:
  explicit RpcMetrics(grpc::experimental::ServerRpcInfo* info) : start_(absl::Now()) {
    // "/paramd.rpc.Daemon/Fetch" -> "Daemon/Fetch".
    absl::string_view m = info->method();
    absl::ConsumePrefix(&m, "/");
    for (absl::string_view package : {"paramd.rpc.", "paramd.checkpoint."}) {
      if (absl::ConsumePrefix(&m, package)) break;
    }
    method_ = std::string(m);
    if (method_ == "Daemon/PushGradients" || method_ == "Daemon/PushGradientsDevice") {
      kind_ = Kind::kPush;
    } else if (method_ == "Daemon/Fetch" || method_ == "Daemon/FetchDevice") {
      kind_ = Kind::kFetch;
    }
    device_ = absl::EndsWith(method_, "Device");
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      if (!status.ok()) {
        telemetry::CountRefused(
            method_, absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())));
      }
      const double seconds = absl::ToDoubleSeconds(absl::Now() - start_);
      if (kind_ == Kind::kPush) telemetry::ObservePush(seconds, device_);
      if (kind_ == Kind::kFetch) telemetry::ObserveFetch(seconds, device_);
    }
    methods->Proceed();
  }

 private:
  const absl::Time start_;
  std::string method_;
  Kind kind_ = Kind::kOther;
  bool device_ = false;
};

class Factory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new RpcMetrics(info);
  }
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> NewRpcMetricsFactory() {
  return std::make_unique<Factory>();
}

}  // namespace paramd
