#include "server/daemon/data_plane.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace paramd {

absl::StatusOr<std::unique_ptr<DaemonDataPlane>> DaemonDataPlane::Open(
    const std::string& transport, const TransportOptions& options, absl::Duration step_timeout) {
  std::unique_ptr<DaemonDataPlane> d(new DaemonDataPlane());
  d->transport_name_ = transport;
  d->step_timeout_ = step_timeout;
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
    return absl::InvalidArgumentError(absl::StrCat("daemon rank ", rank, " outside [0, ", n, ")"));
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
  peer_addresses_ = addresses;
  endpoint_.reset();
  std::vector<int> group(n);
  std::iota(group.begin(), group.end(), 0);
  Transport* t = transport_.get();
  const absl::Duration timeout = step_timeout_;
  return AllReduceMaxFn([t, group, timeout](absl::Span<float> values) {
    return t->AllReduceMax(group, values, absl::Now() + timeout);
  });
}

absl::Status DaemonDataPlane::AwaitPeers(absl::Time deadline) {
  if (transport_ == nullptr) return absl::OkStatus();  // one daemon, or not connected
  constexpr absl::Duration kRetry = absl::Milliseconds(50);
  for (int peer = 0; peer < transport_->world_size(); ++peer) {
    if (peer == transport_->rank()) continue;
    for (;;) {
      absl::Status s =
          transport_->CanConnect(peer, std::min(deadline, absl::Now() + absl::Seconds(1)));
      if (s.ok()) break;
      if (!absl::IsUnavailable(s) && !absl::IsDeadlineExceeded(s)) return s;
      if (absl::Now() + kRetry >= deadline) {
        return absl::UnavailableError(
            absl::StrCat("data-plane peer rank ", peer, " at ", peer_addresses_[peer],
                         " did not answer before the deadline: ", s.message()));
      }
      absl::SleepFor(kRetry);
    }
  }
  return absl::OkStatus();
}

}  // namespace paramd
