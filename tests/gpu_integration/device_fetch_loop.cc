// A trainer process for daemon_fetch_test's kill test: joins as an
// observer, then fetches both directions of one tensor to the device in a
// loop, printing "fetch N ok" after each, until --seconds pass or a fetch
// fails (exit 1).
#include <cstdio>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/gpu_fetch/device_fetcher.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:7070", "coordinator address");
ABSL_FLAG(int32_t, device, 1, "CUDA device");
ABSL_FLAG(std::string, tensor, "big", "tensor to fetch (both directions)");
ABSL_FLAG(int32_t, seconds, 60, "how long to loop");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using namespace paramd;
  client::ClientOptions options;
  options.coordinator_address = absl::GetFlag(FLAGS_coordinator);
  options.role = client::ClientOptions::Role::kObserver;
  options.name = "device_fetch_loop";
  absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(options);
  if (!c.ok()) {
    std::fprintf(stderr, "connect: %s\n", c.status().ToString().c_str());
    return 1;
  }
  gpu_fetch::DeviceFetcherOptions fo;
  fo.device = absl::GetFlag(FLAGS_device);
  fo.name = "device_fetch_loop";
  absl::StatusOr<std::unique_ptr<gpu_fetch::DeviceFetcher>> f =
      gpu_fetch::DeviceFetcher::Create(c->get(), fo);
  if (!f.ok()) {
    std::fprintf(stderr, "fetcher: %s\n", f.status().ToString().c_str());
    return 1;
  }
  const std::string tensor = absl::GetFlag(FLAGS_tensor);
  const absl::Time until = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_seconds));
  for (int i = 1; absl::Now() < until; ++i) {
    absl::StatusOr<gpu_fetch::DeviceFetchResult> r = (*f)->Fetch(
        client::Client::kLatest,
        {{tensor, Direction::kRowwise, {}}, {tensor, Direction::kColumnwise, {}}});
    if (!r.ok()) {
      std::fprintf(stderr, "fetch %d: %s\n", i, r.status().ToString().c_str());
      return 1;
    }
    std::printf("fetch %d ok\n", i);
    std::fflush(stdout);
  }
  return 0;
}
