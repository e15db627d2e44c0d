// File: server/daemon/traffic_counters.h
//
// What one daemon has served and taken since it started (DaemonStats):
// bytes fetched per direction, bytes pushed, device fetches that streamed a
// version in flight or were sent beside a running step.
//
// Threading: lock-free; any thread adds, GetStats reads.
#ifndef PARAMD_SERVER_DAEMON_TRAFFIC_COUNTERS_H_
#define PARAMD_SERVER_DAEMON_TRAFFIC_COUNTERS_H_

#include <atomic>
#include <cstdint>

#include "kernels/format.h"
#include "proto/paramd.pb.h"

namespace paramd {

struct TrafficCounters {
  void AddServed(Direction d, int64_t bytes) {
    served[d == Direction::kRowwise ? 0 : 1].fetch_add(bytes);
  }

  void Fill(rpc::DaemonStats* stats) const {
    stats->set_bytes_served_rowwise(served[0].load());
    stats->set_bytes_served_columnwise(served[1].load());
    stats->set_device_fetches_streamed(device_fetches_streamed.load());
    stats->set_device_fetches_beside_step(device_fetches_beside_step.load());
    stats->set_bytes_pushed(pushed.load());
  }

  std::atomic<int64_t> served[2] = {0, 0};  // rowwise, columnwise
  std::atomic<int64_t> pushed{0};
  std::atomic<int64_t> device_fetches_streamed{0};
  std::atomic<int64_t> device_fetches_beside_step{0};
};

}  // namespace paramd

#endif  // PARAMD_SERVER_DAEMON_TRAFFIC_COUNTERS_H_
