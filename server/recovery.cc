#include "server/recovery.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/status_macros.h"
#include "server/fan_out.h"

namespace paramd {
namespace {

// FanOut, waited for: the calls in rank order.
template <class Request, class Response>
DaemonCalls<Request, Response> CallAll(
    const std::vector<std::shared_ptr<rpc::Daemon::Stub>>& stubs, absl::Duration timeout,
    std::function<void(int rank, Request*)> make_request,
    std::function<void(rpc::Daemon::Stub*, grpc::ClientContext*, const Request*, Response*,
                       std::function<void(grpc::Status)>)>
        call) {
  absl::Notification done;
  DaemonCalls<Request, Response> result;
  FanOut<Request, Response>(stubs, timeout, std::move(make_request), std::move(call),
                            [&](DaemonCalls<Request, Response>& calls) {
                              result = std::move(calls);
                              done.Notify();
                            });
  done.WaitForNotification();
  return result;
}

}  // namespace

absl::StatusOr<RecoveryResult> RunRecovery(const RecoveryPlan& plan) {
  RecoveryResult result;
  const int n = static_cast<int>(plan.stubs.size());
  auto prepared = CallAll<rpc::PrepareRecoveryRequest, rpc::PrepareRecoveryResponse>(
      plan.stubs, plan.prepare_timeout,
      [&](int, rpc::PrepareRecoveryRequest* r) { r->set_epoch(plan.epoch); },
      [](rpc::Daemon::Stub* stub, grpc::ClientContext* c, const rpc::PrepareRecoveryRequest* req,
         rpc::PrepareRecoveryResponse* resp, std::function<void(grpc::Status)> cb) {
        stub->async()->PrepareRecovery(c, req, resp, std::move(cb));
      });
  RETURN_IF_ERROR(FirstError(prepared, "PrepareRecovery"));
  rpc::DataPlane world;
  world.set_transport(plan.transport);
  world.set_num_daemons(n);
  world.set_world_size(n);
  for (int r = 0; r < n; ++r) {
    result.data_plane_addresses.push_back(prepared[r]->response.data_plane_address());
    (*world.mutable_address_book())[r] = prepared[r]->response.data_plane_address();
  }
  auto recovered = CallAll<rpc::RecoverRequest, rpc::RecoverResponse>(
      plan.stubs, plan.recover_timeout,
      [&](int rank, rpc::RecoverRequest* r) {
        r->set_epoch(plan.epoch);
        *r->mutable_data_plane() = world;
        rpc::LoadShardsRequest* load = r->mutable_load();
        *load->mutable_manifest() = plan.manifest;
        load->set_daemon_rank(rank);
        load->set_expected_pushers(plan.expected_pushers);
        load->set_checkpoint_path(plan.checkpoint_path);
        load->set_checkpoint_version(plan.checkpoint_version);
      },
      [](rpc::Daemon::Stub* stub, grpc::ClientContext* c, const rpc::RecoverRequest* req,
         rpc::RecoverResponse* resp, std::function<void(grpc::Status)> cb) {
        stub->async()->Recover(c, req, resp, std::move(cb));
      });
  RETURN_IF_ERROR(FirstError(recovered, "Recover"));
  for (int r = 0; r < n; ++r) {
    const int64_t v = recovered[r]->response.published_version();
    if (r > 0 && v != result.published_version) {
      return absl::InternalError(absl::StrCat("Recover: daemon rank ", r, " published version ", v,
                                              ", rank 0 ", result.published_version));
    }
    result.published_version = v;
  }
  return result;
}

}  // namespace paramd
