// A trainer process on the daemon's GPU that acquires the latest version
// in place (IpcFetcher) and then does nothing, keeping its session alive
// until it is killed: ipc_test SIGKILLs it and checks that its pin lapses
// with its lease. Prints "PINNED <version>" once pinned.
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/gpu_fetch/ipc_import.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:7070", "coordinator host:port");
ABSL_FLAG(int, lease_ms, 1000, "IPC session lease");
ABSL_FLAG(int, device, 0, "CUDA device (the daemon's GPU)");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  paramd::client::ClientOptions o;
  o.coordinator_address = absl::GetFlag(FLAGS_coordinator);
  o.role = paramd::client::ClientOptions::Role::kObserver;
  o.name = "ipc_pin_loop";
  auto client = paramd::client::Client::Connect(o);
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  paramd::gpu_fetch::IpcFetcherOptions fo;
  fo.device = absl::GetFlag(FLAGS_device);
  fo.lease = absl::Milliseconds(absl::GetFlag(FLAGS_lease_ms));
  fo.name = "ipc_pin_loop";
  auto fetcher = paramd::gpu_fetch::IpcFetcher::Open(client->get(), 0, fo);
  if (!fetcher.ok()) {
    std::fprintf(stderr, "open: %s\n", fetcher.status().ToString().c_str());
    return 1;
  }
  auto v = (*fetcher)->Acquire(-1, {});
  if (!v.ok()) {
    std::fprintf(stderr, "acquire: %s\n", v.status().ToString().c_str());
    return 1;
  }
  std::printf("PINNED %lld\n", static_cast<long long>((*v)->version));
  std::fflush(stdout);
  for (;;) absl::SleepFor(absl::Seconds(1));
}
