// File: server/rpc/fan_out.h
//
// The coordinator's calls to every daemon at once (Load, Step, GetStatus,
// recovery): one async call per stub, one callback after the last reply.
// Each call keeps its stub alive, so a rank's stub may be replaced (a
// replacement daemon joined) while calls to the old one are in flight.
//
// Threading: `done` runs once, on a gRPC thread (or the caller's, for no
// stubs), with the calls in the order of `stubs`.
#ifndef PARAMD_SERVER_RPC_FAN_OUT_H_
#define PARAMD_SERVER_RPC_FAN_OUT_H_

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "grpcpp/grpcpp.h"
#include "proto/paramd.grpc.pb.h"

namespace paramd {

// A call to every daemon at once; `done` runs once, after the last reply,
// on a gRPC thread, with the calls in rank order.
template <class Request, class Response>
struct DaemonCall {
  grpc::ClientContext context;
  Request request;
  Response response;
  grpc::Status status;
  std::shared_ptr<rpc::Daemon::Stub> stub;
};

template <class Request, class Response>
using DaemonCalls = std::vector<std::unique_ptr<DaemonCall<Request, Response>>>;

template <class Request, class Response>
void FanOut(const std::vector<std::shared_ptr<rpc::Daemon::Stub>>& stubs, absl::Duration timeout,
            std::function<void(int rank, Request*)> make_request,
            std::function<void(rpc::Daemon::Stub*, grpc::ClientContext*, const Request*, Response*,
                               std::function<void(grpc::Status)>)>
                call,
            std::function<void(DaemonCalls<Request, Response>&)> done) {
  struct State {
    absl::Mutex mu;
    size_t remaining;
    DaemonCalls<Request, Response> calls;
    std::function<void(DaemonCalls<Request, Response>&)> done;
  };
  auto state = std::make_shared<State>();
  state->remaining = stubs.size();
  state->done = std::move(done);
  for (size_t i = 0; i < stubs.size(); ++i) {
    auto c = std::make_unique<DaemonCall<Request, Response>>();
    c->context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    make_request(static_cast<int>(i), &c->request);
    state->calls.push_back(std::move(c));
  }
  if (stubs.empty()) {
    state->done(state->calls);
    return;
  }
  for (size_t i = 0; i < stubs.size(); ++i) {
    DaemonCall<Request, Response>* c = state->calls[i].get();
    c->stub = stubs[i];  // the coordinator may replace a rank's stub meanwhile
    call(stubs[i].get(), &c->context, &c->request, &c->response, [state, c](grpc::Status s) {
      c->status = std::move(s);
      bool last;
      {
        absl::MutexLock lock(&state->mu);
        last = --state->remaining == 0;
      }
      if (last) state->done(state->calls);
    });
  }
}

// The first failed call's status, naming the daemon (`ranks[i]` of call i,
// or i when empty), or OK.
template <class Request, class Response>
absl::Status FirstError(const DaemonCalls<Request, Response>& calls, absl::string_view what,
                        const std::vector<int>& ranks = {}) {
  for (size_t i = 0; i < calls.size(); ++i) {
    if (!calls[i]->status.ok()) {
      const int rank = ranks.empty() ? static_cast<int>(i) : ranks[i];
      return FromGrpcStatus(calls[i]->status, absl::StrCat(what, " on daemon rank ", rank));
    }
  }
  return absl::OkStatus();
}

}  // namespace paramd

#endif  // PARAMD_SERVER_RPC_FAN_OUT_H_
