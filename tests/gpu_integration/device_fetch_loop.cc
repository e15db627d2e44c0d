// A trainer process for the kill tests of daemon_fetch_test and
// daemon_push_test. --mode=fetch (default): joins as an observer, then
// fetches both directions of one tensor to the device in a loop, printing
// "fetch N ok" after each. --mode=push: joins as the
// pusher, then for version v = 0, 1, ... pushes the same deterministic BF16
// gradient of the whole tensor from its GPU over the device channels
// (DeviceFetcher::Push), printing "push N ok", and waits for v + 1. Loops
// until --seconds pass or a call fails (exit 1).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/gpu_fetch/device_fetcher.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:7070", "coordinator address");
ABSL_FLAG(int32_t, device, 1, "CUDA device");
ABSL_FLAG(std::string, tensor, "big", "tensor to fetch (both directions) or push (whole)");
ABSL_FLAG(int32_t, seconds, 60, "how long to loop");
ABSL_FLAG(std::string, mode, "fetch", "fetch or push");
ABSL_FLAG(bool, same_gpu_ipc, true,
          "read a daemon on this GPU in place (DeviceFetcherOptions::same_gpu_ipc); false: NCCL");

namespace {

using namespace paramd;

// The gradient --mode=push sends: BF16 bits of a deterministic pattern
// (daemon_push_test's PushLoopGradient recomputes it: keep in sync).
std::vector<uint16_t> PushGradient(int64_t n) {
  std::vector<uint16_t> g(n);
  for (int64_t i = 0; i < n; ++i) g[i] = static_cast<uint16_t>(0x3c00 + (i * 7919) % 1024);
  return g;
}

int FetchLoop(gpu_fetch::DeviceFetcher& f, const std::string& tensor, absl::Time until) {
  for (int i = 1; absl::Now() < until; ++i) {
    absl::StatusOr<gpu_fetch::DeviceFetchResult> r =
        f.Fetch(client::Client::kLatest,
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

int PushLoop(client::Client& c, gpu_fetch::DeviceFetcher& f, const std::string& tensor,
             absl::Time until) {
  const client::TensorMeta* meta = c.manifest().Find(tensor);
  if (meta == nullptr) {
    std::fprintf(stderr, "no tensor %s\n", tensor.c_str());
    return 1;
  }
  const std::vector<uint16_t> host = PushGradient(meta->rows * meta->cols);
  void* grad = nullptr;
  if (cudaSetDevice(f.device()) != cudaSuccess ||
      cudaMalloc(&grad, host.size() * 2) != cudaSuccess ||
      cudaMemcpy(grad, host.data(), host.size() * 2, cudaMemcpyHostToDevice) != cudaSuccess) {
    std::fprintf(stderr, "cuda alloc/copy failed\n");
    return 1;
  }
  absl::StatusOr<int64_t> v = c.WaitForVersion(0, absl::Seconds(30));
  for (int i = 1; v.ok() && absl::Now() < until; ++i) {
    absl::StatusOr<client::PushResult> r =
        f.Push(*v, {{tensor, client::Gradient::DType::kBf16, grad, host.size() * 2}});
    if (!r.ok()) {
      std::fprintf(stderr, "push %d: %s\n", i, r.status().ToString().c_str());
      return 1;
    }
    std::printf("push %d ok (version %lld)\n", i, static_cast<long long>(*v));
    std::fflush(stdout);
    v = c.WaitForVersion(*v + 1, absl::Seconds(30));
  }
  if (!v.ok()) {
    std::fprintf(stderr, "wait: %s\n", v.status().ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const bool push = absl::GetFlag(FLAGS_mode) == "push";
  client::ClientOptions options;
  options.coordinator_address = absl::GetFlag(FLAGS_coordinator);
  options.role =
      push ? client::ClientOptions::Role::kTrainer : client::ClientOptions::Role::kObserver;
  options.pusher = push;
  options.name = push ? "device_push_loop" : "device_fetch_loop";
  absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(options);
  if (!c.ok()) {
    std::fprintf(stderr, "connect: %s\n", c.status().ToString().c_str());
    return 1;
  }
  gpu_fetch::DeviceFetcherOptions fo;
  fo.device = absl::GetFlag(FLAGS_device);
  fo.name = options.name;
  fo.same_gpu_ipc = absl::GetFlag(FLAGS_same_gpu_ipc);
  absl::StatusOr<std::unique_ptr<gpu_fetch::DeviceFetcher>> f =
      gpu_fetch::DeviceFetcher::Create(c->get(), fo);
  if (!f.ok()) {
    std::fprintf(stderr, "fetcher: %s\n", f.status().ToString().c_str());
    return 1;
  }
  const std::string tensor = absl::GetFlag(FLAGS_tensor);
  const absl::Time until = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_seconds));
  return push ? PushLoop(**c, **f, tensor, until) : FetchLoop(**f, tensor, until);
}
