// //transport:host_latency_bench — control-message latency of the "host"
// transport on this machine: ping-pong of small messages between two ranks
// of an in-process world (each ping-pong = two Sends), and the Ping RPC.
#include <algorithm>
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "transport/transport.h"

ABSL_FLAG(int, iters, 2000, "ping-pongs");
ABSL_FLAG(int, bytes, 128, "message size");
ABSL_FLAG(std::string, backend, "host", "transport backend");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  auto world = paramd::ConnectInProcessWorld(absl::GetFlag(FLAGS_backend), 2);
  if (!world.ok()) {
    std::fprintf(stderr, "%s\n", world.status().ToString().c_str());
    return 1;
  }
  const int n = absl::GetFlag(FLAGS_iters);
  std::vector<uint8_t> buf(absl::GetFlag(FLAGS_bytes), 7), in(buf.size());
  const absl::Time far = absl::InfiniteFuture();
  std::vector<absl::Time> sent_at(n), arrived_at(n);
  std::vector<double> rtt, one_way, send_call;
  std::thread echo([&] {
    std::vector<uint8_t> b(buf.size());
    for (int i = 0; i < n; ++i) {
      if (!(*world)[1]->Recv(0, 1, absl::MakeSpan(b), far).ok()) std::abort();
      arrived_at[i] = absl::Now();
      if (!(*world)[1]->Send(0, 2, b, far).ok()) std::abort();
    }
  });
  for (int i = 0; i < n; ++i) {
    const absl::Time t0 = absl::Now();
    sent_at[i] = t0;
    if (!(*world)[0]->Send(1, 1, buf, far).ok()) std::abort();
    send_call.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
    if (!(*world)[0]->Recv(1, 2, absl::MakeSpan(in), far).ok()) std::abort();
    rtt.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
  }
  echo.join();
  for (int i = 0; i < n; ++i)
    one_way.push_back(absl::ToDoubleMicroseconds(arrived_at[i] - sent_at[i]));
  std::vector<double> ping;
  for (int i = 0; i < std::min(n, 500); ++i) {
    const absl::Time t0 = absl::Now();
    if (!(*world)[0]->CanConnect(1, absl::Now() + absl::Seconds(5)).ok()) std::abort();
    ping.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
  }
  auto pct = [](std::vector<double> v, double p) {
    std::sort(v.begin(), v.end());
    return v[static_cast<size_t>(p * (v.size() - 1))];
  };
  std::printf("%s ping-pong (2 sends) of %zu B: p10 %.1f  p50 %.1f  p90 %.1f us\n",
              absl::GetFlag(FLAGS_backend).c_str(), buf.size(), pct(rtt, 0.1), pct(rtt, 0.5),
              pct(rtt, 0.9));
  std::printf("one way (Send called -> Recv returned): p10 %.1f  p50 %.1f  p90 %.1f us\n",
              pct(one_way, 0.1), pct(one_way, 0.5), pct(one_way, 0.9));
  std::printf("Send call: p10 %.1f  p50 %.1f  p90 %.1f us\n", pct(send_call, 0.1),
              pct(send_call, 0.5), pct(send_call, 0.9));
  std::printf("Ping RPC: p10 %.1f  p50 %.1f  p90 %.1f us\n", pct(ping, 0.1), pct(ping, 0.5),
              pct(ping, 0.9));
  return 0;
}
