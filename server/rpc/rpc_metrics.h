// File: server/rpc/rpc_metrics.h
//
// A gRPC server interceptor that records, for every RPC the process
// answers, its error code (paramd_refused_requests_total{method,code}) and,
// for pushes and fetches, its duration from start to status
// (paramd_push_seconds / paramd_fetch_seconds, common/telemetry.h).
//
// Thread-safe; the factory is owned by the grpc::ServerBuilder it is given
// to.
#ifndef PARAMD_SERVER_RPC_RPC_METRICS_H_
#define PARAMD_SERVER_RPC_RPC_METRICS_H_

#include <memory>

#include "grpcpp/support/server_interceptor.h"

namespace paramd {

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> NewRpcMetricsFactory();

}  // namespace paramd

#endif  // PARAMD_SERVER_RPC_RPC_METRICS_H_
