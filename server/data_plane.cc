#include "server/data_plane.h"

#include <numeric>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace paramd {

absl::StatusOr<std::unique_ptr<DaemonDataPlane>> DaemonDataPlane::Open(
    const std::string& transport, const std::string& listen, absl::Duration step_timeout,
    std::shared_ptr<auth::Authenticator> authenticator,
    std::shared_ptr<const auth::ChannelSecurity> security) {
  std::unique_ptr<DaemonDataPlane> d(new DaemonDataPlane());
  d->transport_name_ = transport;
  d->step_timeout_ = step_timeout;
  TransportOptions options;
  options.listen_address = listen;
  options.authenticator = std::move(authenticator);
  options.security = std::move(security);
  ASSIGN_OR_RETURN(d->endpoint_, OpenTransportEndpoint(transport, options));
  d->address_ = d->endpoint_->address();
  return d;
}

DaemonDataPlane::~DaemonDataPlane() { Shutdown(); }

void DaemonDataPlane::Shutdown() {
  if (transport_) transport_->Shutdown();
}

absl::StatusOr<AllReduceMaxFn> DaemonDataPlane::Connect(const rpc::DataPlane& data_plane,
                                                        int rank) {
  const int n = data_plane.num_daemons();
  if (rank < 0 || rank >= n) {
    return absl::InvalidArgumentError(
        absl::StrCat("daemon rank ", rank, " outside [0, ", n, ")"));
  }
  if (n == 1) return AllReduceMaxFn([](absl::Span<float>) { return absl::OkStatus(); });
  if (data_plane.transport() != transport_name_) {
    return absl::FailedPreconditionError(absl::StrCat("the coordinator uses data plane \"",
                                                      data_plane.transport(), "\", this daemon \"",
                                                      transport_name_, "\""));
  }
  if (endpoint_ == nullptr) return absl::FailedPreconditionError("data plane already connected");
  std::vector<std::string> addresses(n);
  for (int r = 0; r < n; ++r) {
    auto it = data_plane.address_book().find(r);
    if (it == data_plane.address_book().end() || it->second.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("no data-plane address for daemon ", r));
    }
    addresses[r] = it->second;
  }
  ASSIGN_OR_RETURN(transport_, endpoint_->Connect(rank, addresses));
  endpoint_.reset();
  std::vector<int> group(n);
  std::iota(group.begin(), group.end(), 0);
  Transport* t = transport_.get();
  const absl::Duration timeout = step_timeout_;
  return AllReduceMaxFn([t, group, timeout](absl::Span<float> values) {
    return t->AllReduceMax(group, values, absl::Now() + timeout);
  });
}

}  // namespace paramd
