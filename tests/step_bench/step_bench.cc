// //tests/step_bench:step_bench — the GPU step and NCCL data plane benchmark.
// One process, two GPUs: the daemon (GPU 0, server/gpu_backend
// GpuShardStore) and one trainer (GPU 1), joined by the "nccl" transport.
//
// Model: --tensors x [--rows, --cols] FP32 masters (default 8 x 8192 x 16384
// = 1.07 B parameters), AdamW. Two configurations, one after the other:
//   fp8:  FP8 E4M3 current scaling, rowwise + columnwise (transposed)
//   bf16: BF16 identity, rowwise only (what a trainer fetches without FP8)
// Per step: push (trainer -> daemon BF16 gradients, tensor by tensor, into
// two staging buffers, accumulated in FP32 on the daemon), the GPU step
// (optimizer+amax, all-reduce (one daemon: none), scaling, quantize; one
// wait), then the fetch of every published direction. Also timed: the fetch
// of the rowwise direction alone through the transport, and raw
// ncclSend/ncclRecv of exactly the same pieces on a plain communicator in
// the same run (the ratio target is >= 0.90), and the same rowwise fetch
// through a second world whose control messages (header, clear-to-send) go
// over gRPC instead of the socket control channel (PARAMD_NCCL_CONTROL=grpc;
// the A/B of that channel), and through a third world whose direction
// communicators are of the other kind (the A/B of blocking vs non-blocking
// communicators: blocking by default, so the third world is non-blocking
// unless the run sets PARAMD_NCCL_BLOCKING=0, which swaps the two); a
// pipelined step where the fetch of tensor i waits only for tensor i's
// quantization (one message per tensor, and as one SendDevicePipelined
// message); and a double-buffered one where the fetch of version v runs
// during the step that produces v+1.
//
// Medians over --steps timed steps after --warmup. Prints a table;
// --json=PATH writes the numbers.
#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/gpu_fetch/fetch.h"
#include "common/gpu_status.h"
#include "kernels/format.h"
#include "server/gpu_backend/fetch_server.h"
#include "server/gpu_backend/shard_store.h"
#include "transport/nccl_transport.h"

ABSL_FLAG(int, tensors, 8, "number of tensors");
ABSL_FLAG(int64_t, rows, 8192, "rows per tensor");
ABSL_FLAG(int64_t, cols, 16384, "cols per tensor");
ABSL_FLAG(int, steps, 5, "timed steps (medians reported)");
ABSL_FLAG(int, warmup, 2, "untimed steps first");
ABSL_FLAG(std::string, configs, "fp8,bf16", "which configurations to run");
ABSL_FLAG(std::string, json, "", "write the results as JSON here");

namespace paramd {
namespace {

using gpu_backend::FetchItem;
using gpu_backend::GpuShardStore;

#define CHECK_OK(expr)                                                           \
  do {                                                                           \
    absl::Status s_ = (expr);                                                    \
    if (!s_.ok()) {                                                              \
      fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, s_.ToString().c_str()); \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)

absl::Time In(absl::Duration d) { return absl::Now() + d; }

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Two threads meet here.
class Rendezvous {
 public:
  void Meet() {
    std::unique_lock<std::mutex> lock(mu_);
    const int gen = gen_;
    if (++count_ == 2) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen_ != gen; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int count_ = 0;
  int gen_ = 0;
};

struct Config {
  std::string name;
  HybridSpec spec;
};

Config MakeConfig(const std::string& name) {
  Config c;
  c.name = name;
  if (name == "fp8") {
    c.spec.rowwise = DefaultQuantSpec(Format::kFp8Current);
    c.spec.columnwise = DefaultQuantSpec(Format::kFp8Current);
  } else {
    c.spec.rowwise = DefaultQuantSpec(Format::kIdentityBf16);
    c.spec.columnwise_usage = false;
  }
  return c;
}

struct Result {
  std::string config;
  double push_ms = 0, optimizer_ms = 0, all_reduce_ms = 0, scaling_ms = 0, quantize_ms = 0;
  double step_ms = 0, fetch_all_ms = 0, fetch_all_bytes = 0;
  double fetch_row_ms = 0, raw_row_ms = 0, row_bytes = 0, fetch_row_grpc_ms = 0;
  double fetch_row_alt_ms = 0;  // the world with the other communicator kind
  double pipelined_ms = 0, sequential_ms = 0, double_buffered_ms = 0, prefetch_exposed_ms = 0;
  double pipelined_one_ms = 0;
  bool pipelined_one_verified = false;
  double bytes_per_param = 0;
  bool verified = false;
};

// Whether this process's worlds use blocking direction communicators: the
// transport's default, unless PARAMD_NCCL_BLOCKING=0 (the same rule as
// transport/nccl_comm.h's BlockingPairsFromEnv).
bool DefaultBlocking() {
  const char* v = std::getenv("PARAMD_NCCL_BLOCKING");
  return v == nullptr || std::string(v) != "0";
}

// `grpc_control`: the world's control messages go over gRPC (the socket
// control channel off), for the A/B. `flip_blocking`: its direction
// communicators are of the other kind than DefaultBlocking().
std::vector<std::unique_ptr<Transport>> MakeWorld(bool grpc_control, bool flip_blocking = false) {
  std::vector<std::unique_ptr<TransportEndpoint>> endpoints;
  std::vector<std::string> addresses;
  const bool blocking = DefaultBlocking();
  if (grpc_control) setenv("PARAMD_NCCL_CONTROL", "grpc", 1);
  if (flip_blocking) setenv("PARAMD_NCCL_BLOCKING", blocking ? "0" : "1", 1);
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    absl::StatusOr<std::unique_ptr<TransportEndpoint>> e = OpenNcclEndpoint();
    CHECK_OK(e.status());
    addresses.push_back((*e)->address());
    endpoints.push_back(*std::move(e));
  }
  if (grpc_control) unsetenv("PARAMD_NCCL_CONTROL");
  if (flip_blocking) setenv("PARAMD_NCCL_BLOCKING", blocking ? "1" : "0", 1);
  std::vector<std::unique_ptr<Transport>> world(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<Transport>> t = endpoints[r]->Connect(r, addresses);
      CHECK_OK(t.status());
      world[r] = *std::move(t);
    });
  }
  for (auto& t : threads) t.join();
  return world;
}

Result RunConfig(const Config& config, NcclTransport& daemon_t, NcclTransport& trainer_t,
                 NcclTransport& daemon_g, NcclTransport& trainer_g, NcclTransport& daemon_a,
                 NcclTransport& trainer_a, ncclComm_t raw[2]) {
  const int n = absl::GetFlag(FLAGS_tensors);
  const int64_t rows = absl::GetFlag(FLAGS_rows), cols = absl::GetFlag(FLAGS_cols);
  const int64_t count = rows * cols;
  Result result;
  result.config = config.name;

  // ---- daemon state on GPU 0 ----
  std::vector<gpu_backend::GpuShardDef> shards;
  for (int i = 0; i < n; ++i) {
    gpu_backend::GpuShardDef def;
    def.name = absl::StrCat("w", i);
    def.rows = rows;
    def.cols = cols;
    def.spec = config.spec;
    shards.push_back(def);
  }
  gpu_backend::GpuStoreOptions options;
  options.device = 0;
  options.adamw.lr = 1e-3;
  absl::StatusOr<std::unique_ptr<GpuShardStore>> store_or = GpuShardStore::Create(shards, options);
  CHECK_OK(store_or.status());
  GpuShardStore& store = **store_or;
  result.bytes_per_param = store.bytes_per_parameter();
  // Masters: a deterministic non-zero pattern (never time on zeros).
  cudaSetDevice(0);
  {
    std::vector<float> host(count);
    for (int i = 0; i < n; ++i) {
      uint32_t x = 12345u + i;
      for (int64_t j = 0; j < count; ++j) {
        x = x * 1664525u + 1013904223u;
        host[j] = (static_cast<int32_t>(x >> 8) - (1 << 23)) * (1.0f / (1 << 23)) * 0.05f;
      }
      CHECK_OK(
          GPU_STATUS(cudaMemcpy(store.master(i), host.data(), count * 4, cudaMemcpyHostToDevice)));
    }
  }

  // ---- trainer state on GPU 1 ----
  cudaSetDevice(1);
  std::vector<void*> grads(n);
  {
    std::vector<uint16_t> host(count);
    uint32_t x = 777;
    for (int64_t j = 0; j < count; ++j) {
      x = x * 1664525u + 1013904223u;
      host[j] = static_cast<uint16_t>(0x3C00 | ((x >> 16) & 0x80FF));  // small +-values
    }
    for (int i = 0; i < n; ++i) {
      CHECK_OK(GPU_STATUS(cudaMalloc(&grads[i], count * 2)));
      CHECK_OK(GPU_STATUS(cudaMemcpy(grads[i], host.data(), count * 2, cudaMemcpyHostToDevice)));
    }
  }
  gpu_fetch::DevicePool pool(1);
  std::vector<FetchItem> all_items, row_items;
  std::vector<gpu_fetch::DeviceDirection> all_dst, row_dst;
  for (int i = 0; i < n; ++i) {
    for (int dir = 0; dir < 2; ++dir) {
      if (dir == 1 && !config.spec.columnwise_usage) continue;
      const QuantSpec& q = dir == 0 ? config.spec.rowwise : config.spec.columnwise;
      absl::StatusOr<Layout> layout = ComputeLayout(q, static_cast<Direction>(dir), rows, cols);
      CHECK_OK(layout.status());
      absl::StatusOr<gpu_fetch::DeviceDirection> d = pool.Allocate(*layout);
      CHECK_OK(d.status());
      all_items.push_back({i, static_cast<Direction>(dir)});
      all_dst.push_back(*d);
      if (dir == 0) {
        row_items.push_back({i, Direction::kRowwise});
        row_dst.push_back(*d);
      }
    }
  }
  for (const auto& d : all_dst)
    result.fetch_all_bytes += d.layout.data_bytes() + d.layout.scale_bytes() + 8;
  for (const auto& d : row_dst)
    result.row_bytes += d.layout.data_bytes() + d.layout.scale_bytes() + 8;

  Rendezvous meet;
  std::vector<double> push_ms, opt_ms, ar_ms, sc_ms, q_ms, step_ms, fetch_all_ms, fetch_row_ms,
      raw_ms, seq_ms, pipe_ms, dbuf_ms, pre_ms, row_grpc_ms, pipe1_ms, row_alt_ms;
  const int total_steps = absl::GetFlag(FLAGS_warmup) + absl::GetFlag(FLAGS_steps);
  const absl::Duration kDeadline = absl::Seconds(60);
  int64_t version = 0;
  std::vector<cudaEvent_t> acc_done(2);
  cudaSetDevice(0);
  for (auto& e : acc_done) cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  cudaStream_t raw_stream[2];
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    cudaStreamCreateWithFlags(&raw_stream[r], cudaStreamNonBlocking);
  }
  uint64_t tag = 1000;

  // First publish (no optimizer) so version 1 exists.
  CHECK_OK(store.Step(++version, false, nullptr, In(kDeadline)));

  for (int step = 0; step < total_steps; ++step) {
    const bool timed = step >= absl::GetFlag(FLAGS_warmup);
    const uint64_t base = (tag += 100);
    // ---- 1. push ----
    absl::Time t0;
    std::thread trainer([&] {
      cudaSetDevice(1);
      meet.Meet();
      for (int i = 0; i < n; ++i) {
        CHECK_OK(trainer_t.SendDevice(0, base + i, {{grads[i], static_cast<size_t>(count * 2)}},
                                      nullptr, In(kDeadline)));
      }
    });
    cudaSetDevice(0);
    meet.Meet();
    t0 = absl::Now();
    for (int i = 0; i < n; ++i) {
      const int k = i % 2;
      CHECK_OK(GPU_STATUS(cudaEventSynchronize(acc_done[k])));
      CHECK_OK(daemon_t.RecvDevice(
          1, base + i, {{store.push_staging(k), static_cast<size_t>(count * 2)}}, In(kDeadline)));
      CHECK_OK(store.Accumulate(i, store.push_staging(k), /*bf16=*/true));
      CHECK_OK(GPU_STATUS(cudaEventRecord(acc_done[k], store.stream())));
    }
    CHECK_OK(GPU_STATUS(cudaStreamSynchronize(store.stream())));
    const double push = absl::ToDoubleMilliseconds(absl::Now() - t0);
    trainer.join();

    // ---- 2. step, then 3. fetch everything (sequential) ----
    const absl::Time s0 = absl::Now();
    CHECK_OK(store.Step(++version, true, nullptr, In(kDeadline)));
    const double stepped = absl::ToDoubleMilliseconds(absl::Now() - s0);
    double fetch_all = 0;
    std::thread fetcher([&] {
      cudaSetDevice(1);
      meet.Meet();
      const absl::Time f0 = absl::Now();
      CHECK_OK(gpu_fetch::FetchDirections(trainer_t, 0, base + 50, all_dst, In(kDeadline)));
      fetch_all = absl::ToDoubleMilliseconds(absl::Now() - f0);
    });
    meet.Meet();
    CHECK_OK(gpu_backend::ServeFetch(daemon_t, 1, base + 50, store, version, all_items, false,
                                     In(kDeadline)));
    fetcher.join();
    const double sequential = absl::ToDoubleMilliseconds(absl::Now() - s0);

    // ---- rowwise only: transport vs raw NCCL, same pieces ----
    // One cold rowwise fetch through a world (ms from the trainer's call).
    auto row_fetch = [&](NcclTransport& daemon, NcclTransport& trainer, uint64_t t) {
      double ms = 0;
      std::thread fetch([&] {
        cudaSetDevice(1);
        meet.Meet();
        const absl::Time f0 = absl::Now();
        CHECK_OK(gpu_fetch::FetchDirections(trainer, 0, t, row_dst, In(kDeadline)));
        ms = absl::ToDoubleMilliseconds(absl::Now() - f0);
      });
      meet.Meet();
      CHECK_OK(
          gpu_backend::ServeFetch(daemon, 1, t, store, version, row_items, false, In(kDeadline)));
      fetch.join();
      return ms;
    };
    const double fetch_row = row_fetch(daemon_t, trainer_t, base + 60);
    // The same through the world with gRPC control messages, and through
    // the world with the other communicator kind.
    const double fetch_row_grpc = row_fetch(daemon_g, trainer_g, base + 65);
    const double fetch_row_alt = row_fetch(daemon_a, trainer_a, base + 67);
    absl::StatusOr<std::vector<DeviceBytes>> send_pieces =
        gpu_backend::FetchPieces(store, version, row_items);
    CHECK_OK(send_pieces.status());
    std::vector<MutableDeviceBytes> recv_pieces = gpu_fetch::PlanPieces(row_dst);
    const absl::Time r0 = absl::Now();
    ncclGroupStart();
    for (size_t p = 0; p < send_pieces->size(); ++p) {
      ncclSend((*send_pieces)[p].data, (*send_pieces)[p].size, ncclUint8, 1, raw[0], raw_stream[0]);
      ncclRecv(recv_pieces[p].data, recv_pieces[p].size, ncclUint8, 0, raw[1], raw_stream[1]);
    }
    CHECK_OK(GPU_STATUS(ncclGroupEnd()));
    for (int r = 0; r < 2; ++r) {
      cudaSetDevice(r);
      CHECK_OK(GPU_STATUS(cudaStreamSynchronize(raw_stream[r])));
    }
    const double raw_row = absl::ToDoubleMilliseconds(absl::Now() - r0);
    cudaSetDevice(0);

    // ---- pipelined: a second push-free step (apply_optimizer with zero
    // grads keeps the bytes moving) where tensor i's fetch waits only for
    // tensor i's quantization. ----
    std::thread pipe_fetcher([&] {
      cudaSetDevice(1);
      meet.Meet();
      for (int i = 0; i < n; ++i) {
        std::vector<gpu_fetch::DeviceDirection> dst;
        for (size_t k = 0; k < all_items.size(); ++k) {
          if (all_items[k].shard == i) dst.push_back(all_dst[k]);
        }
        CHECK_OK(gpu_fetch::FetchDirections(trainer_t, 0, base + 70 + i, dst, In(kDeadline)));
      }
    });
    meet.Meet();
    const absl::Time p0 = absl::Now();
    CHECK_OK(store.EnqueueStep(++version, true, nullptr));
    CHECK_OK(gpu_backend::ServeFetch(daemon_t, 1, base + 70, store, version, all_items, true,
                                     In(kDeadline)));
    CHECK_OK(store.FinishStep(In(kDeadline)));
    pipe_fetcher.join();
    const double pipelined = absl::ToDoubleMilliseconds(absl::Now() - p0);

    // ---- pipelined as ONE message: SendDevicePipelined, each tensor's
    // pieces behind its TensorReady event, one control exchange ----
    std::thread pipe1_fetcher([&] {
      cudaSetDevice(1);
      meet.Meet();
      CHECK_OK(gpu_fetch::FetchDirections(trainer_t, 0, base + 68, all_dst, In(kDeadline)));
    });
    meet.Meet();
    const absl::Time q0 = absl::Now();
    CHECK_OK(store.EnqueueStep(++version, true, nullptr));
    {
      std::vector<DeviceBytes> pieces;
      std::vector<cudaEvent_t> ready;
      for (const FetchItem& item : all_items) {
        absl::StatusOr<std::vector<DeviceBytes>> p =
            gpu_backend::FetchPieces(store, version, {item});
        CHECK_OK(p.status());
        pieces.insert(pieces.end(), p->begin(), p->end());
        ready.insert(ready.end(), p->size(), store.TensorReady(item.shard));
      }
      CHECK_OK(daemon_t.SendDevicePipelined(1, base + 68, pieces, ready, In(kDeadline)));
    }
    CHECK_OK(store.FinishStep(In(kDeadline)));
    pipe1_fetcher.join();
    const double pipelined_one = absl::ToDoubleMilliseconds(absl::Now() - q0);
    if (step == total_steps - 1) {
      // The last tensor's last direction (the last part) equals the daemon's.
      const FetchItem& last = all_items.back();
      absl::StatusOr<gpu_backend::GpuPublishedDirection> pub =
          store.Published(version, last.shard, last.direction);
      CHECK_OK(pub.status());
      const size_t bytes = pub->layout.data_bytes();
      std::vector<uint8_t> a(bytes), b(bytes);
      cudaSetDevice(0);
      cudaMemcpy(a.data(), pub->data, bytes, cudaMemcpyDeviceToHost);
      cudaSetDevice(1);
      cudaMemcpy(b.data(), all_dst.back().data, bytes, cudaMemcpyDeviceToHost);
      result.pipelined_one_verified = a == b;
      cudaSetDevice(0);
    }

    // ---- prefetch: the trainer's request for v+1 (and so the control
    // round trip) happens while the step runs; the rowwise bytes leave as
    // soon as the step's last kernel is done. Exposed fetch time = wall -
    // the step's GPU time. ----
    double prefetch_total = 0;
    std::thread pre_fetcher([&] {
      cudaSetDevice(1);
      meet.Meet();
      const absl::Time f0 = absl::Now();
      CHECK_OK(gpu_fetch::FetchDirections(trainer_t, 0, base + 80, row_dst, In(kDeadline)));
      prefetch_total = absl::ToDoubleMilliseconds(absl::Now() - f0);
    });
    meet.Meet();
    CHECK_OK(store.EnqueueStep(++version, true, nullptr));
    CHECK_OK(gpu_backend::ServeFetch(daemon_t, 1, base + 80, store, version, row_items, false,
                                     In(kDeadline), store.StepDone()));
    CHECK_OK(store.FinishStep(In(kDeadline)));
    pre_fetcher.join();
    const gpu_backend::GpuStepTimings& pt = store.last_timings();
    const double prefetch_exposed =
        prefetch_total - (pt.optimizer_ms + pt.all_reduce_ms + pt.scaling_ms + pt.quantize_ms);

    // ---- double buffering: the fetch of version v runs while the step
    // producing v+1 writes the other slot ----
    std::thread db_fetcher([&] {
      cudaSetDevice(1);
      meet.Meet();
      CHECK_OK(gpu_fetch::FetchDirections(trainer_t, 0, base + 90, all_dst, In(kDeadline)));
    });
    meet.Meet();
    const absl::Time d0 = absl::Now();
    const int64_t fetched_version = version;
    CHECK_OK(store.EnqueueStep(++version, true, nullptr));
    CHECK_OK(gpu_backend::ServeFetch(daemon_t, 1, base + 90, store, fetched_version, all_items,
                                     false, In(kDeadline)));
    CHECK_OK(store.FinishStep(In(kDeadline)));
    db_fetcher.join();
    const double double_buffered = absl::ToDoubleMilliseconds(absl::Now() - d0);

    // Sanity: the last fetched rowwise bytes of tensor 0 equal the daemon's.
    if (step == total_steps - 1) {
      absl::StatusOr<gpu_backend::GpuPublishedDirection> pub =
          store.Published(fetched_version, 0, Direction::kRowwise);
      CHECK_OK(pub.status());
      const size_t bytes = pub->layout.data_bytes();
      std::vector<uint8_t> a(bytes), b(bytes);
      cudaSetDevice(0);
      cudaMemcpy(a.data(), pub->data, bytes, cudaMemcpyDeviceToHost);
      cudaSetDevice(1);
      cudaMemcpy(b.data(), row_dst[0].data, bytes, cudaMemcpyDeviceToHost);
      result.verified = a == b;
      cudaSetDevice(0);
    }
    const gpu_backend::GpuStepTimings& t = store.last_timings();
    std::printf(
        "[%s] step %d%s: push %.2f  step %.2f (opt %.2f ar %.3f sc %.3f q %.2f)  "
        "fetch-all %.2f  row %.2f (grpc control %.2f, other comm kind %.2f) raw %.2f "
        "prefetch-exposed %.2f  seq %.2f pipe %.2f pipe1 %.2f dbuf %.2f ms\n",
        config.name.c_str(), step, timed ? "" : " (warm-up)", push, stepped, t.optimizer_ms,
        t.all_reduce_ms, t.scaling_ms, t.quantize_ms, fetch_all, fetch_row, fetch_row_grpc,
        fetch_row_alt, raw_row, prefetch_exposed, sequential, pipelined, pipelined_one,
        double_buffered);
    std::fflush(stdout);
    if (!timed) continue;
    push_ms.push_back(push);
    step_ms.push_back(stepped);
    fetch_all_ms.push_back(fetch_all);
    fetch_row_ms.push_back(fetch_row);
    row_grpc_ms.push_back(fetch_row_grpc);
    row_alt_ms.push_back(fetch_row_alt);
    raw_ms.push_back(raw_row);
    seq_ms.push_back(sequential);
    pipe_ms.push_back(pipelined);
    pipe1_ms.push_back(pipelined_one);
    dbuf_ms.push_back(double_buffered);
    pre_ms.push_back(prefetch_exposed);
    // Phase timings of the (non-pipelined) step are overwritten by the
    // pipelined one; both are the same kernels, so either is fine.
    opt_ms.push_back(t.optimizer_ms);
    ar_ms.push_back(t.all_reduce_ms);
    sc_ms.push_back(t.scaling_ms);
    q_ms.push_back(t.quantize_ms);
  }
  result.push_ms = Median(push_ms);
  result.optimizer_ms = Median(opt_ms);
  result.all_reduce_ms = Median(ar_ms);
  result.scaling_ms = Median(sc_ms);
  result.quantize_ms = Median(q_ms);
  result.step_ms = Median(step_ms);
  result.fetch_all_ms = Median(fetch_all_ms);
  result.fetch_row_ms = Median(fetch_row_ms);
  result.fetch_row_grpc_ms = Median(row_grpc_ms);
  result.fetch_row_alt_ms = Median(row_alt_ms);
  result.raw_row_ms = Median(raw_ms);
  result.sequential_ms = Median(seq_ms);
  result.pipelined_ms = Median(pipe_ms);
  result.pipelined_one_ms = Median(pipe1_ms);
  result.double_buffered_ms = Median(dbuf_ms);
  result.prefetch_exposed_ms = Median(pre_ms);
  cudaSetDevice(1);
  for (void* g : grads) cudaFree(g);
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    cudaStreamDestroy(raw_stream[r]);
  }
  cudaSetDevice(0);
  for (auto& e : acc_done) cudaEventDestroy(e);
  return result;
}

int Main() {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  int gpus = 0;
  cudaGetDeviceCount(&gpus);
  if (gpus < 2) {
    std::fprintf(stderr, "needs 2 GPUs, found %d\n", gpus);
    return 1;
  }
  std::vector<std::unique_ptr<Transport>> world = MakeWorld(false);
  std::vector<std::unique_ptr<Transport>> world_grpc = MakeWorld(true);
  std::vector<std::unique_ptr<Transport>> world_alt = MakeWorld(false, /*flip_blocking=*/true);
  NcclTransport* daemon_a = AsNcclTransport(world_alt[0].get());
  NcclTransport* trainer_a = AsNcclTransport(world_alt[1].get());
  NcclTransport* daemon_t = AsNcclTransport(world[0].get());
  NcclTransport* trainer_t = AsNcclTransport(world[1].get());
  NcclTransport* daemon_g = AsNcclTransport(world_grpc[0].get());
  NcclTransport* trainer_g = AsNcclTransport(world_grpc[1].get());
  ncclComm_t raw[2];
  int devs[2] = {0, 1};
  CHECK_OK(GPU_STATUS(ncclCommInitAll(raw, 2, devs)));

  std::vector<Result> results;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_configs), ',')) {
    results.push_back(RunConfig(MakeConfig(std::string(name)), *daemon_t, *trainer_t, *daemon_g,
                                *trainer_g, *daemon_a, *trainer_a, raw));
  }
  const double params = static_cast<double>(absl::GetFlag(FLAGS_tensors)) *
                        absl::GetFlag(FLAGS_rows) * absl::GetFlag(FLAGS_cols);
  std::printf("\n%.3f B parameters, 1 daemon (GPU 0) + 1 trainer (GPU 1); medians of %d steps\n",
              params / 1e9, absl::GetFlag(FLAGS_steps));
  std::printf("direction communicators: %s (PARAMD_NCCL_BLOCKING); 'other kind' = %s\n",
              DefaultBlocking() ? "blocking" : "non-blocking",
              DefaultBlocking() ? "non-blocking" : "blocking");
  std::printf(
      "%-5s %8s %8s %8s %8s %8s %8s | %9s %9s | %8s %8s %6s %8s | %8s %6s | %8s %8s %8s | %5s %s\n",
      "cfg", "push", "optim", "allred", "scaling", "quant", "step", "fetchall", "GB/s", "row",
      "raw", "ratio", "rowGB/s", "pre-exp", "ratio2", "seq", "pipe", "dbuf", "B/par", "ok");
  std::printf(
      "(row = the socket control channel; the same fetch with gRPC control follows "
      "each row as 'grpc-control row, ratio')\n");
  std::string json = "[";
  for (const Result& r : results) {
    const double ratio = r.fetch_row_ms > 0 ? r.raw_row_ms / r.fetch_row_ms : 0;
    const double ratio2 = r.prefetch_exposed_ms > 0 ? r.raw_row_ms / r.prefetch_exposed_ms : 0;
    std::printf(
        "%-5s %8.2f %8.2f %8.3f %8.3f %8.2f %8.2f | %9.2f %9.1f | %8.2f %8.2f %6.3f %8.1f | "
        "%8.2f %6.3f | %8.2f %8.2f %8.2f | %5.2f %s\n",
        r.config.c_str(), r.push_ms, r.optimizer_ms, r.all_reduce_ms, r.scaling_ms, r.quantize_ms,
        r.step_ms, r.fetch_all_ms, r.fetch_all_bytes / r.fetch_all_ms / 1e6, r.fetch_row_ms,
        r.raw_row_ms, ratio, r.row_bytes / r.fetch_row_ms / 1e6, r.prefetch_exposed_ms, ratio2,
        r.sequential_ms, r.pipelined_ms, r.double_buffered_ms, r.bytes_per_param,
        r.verified ? "yes" : "NO");
    std::printf(
        "%-5s grpc-control row %.2f ms, ratio %.3f; pipelined as one message %.2f ms (%s)\n",
        r.config.c_str(), r.fetch_row_grpc_ms,
        r.fetch_row_grpc_ms > 0 ? r.raw_row_ms / r.fetch_row_grpc_ms : 0, r.pipelined_one_ms,
        r.pipelined_one_verified ? "verified" : "NOT VERIFIED");
    std::printf("%-5s RATIO %s %.3f (row %.2f ms) | %s %.3f (row %.2f ms) | raw %.2f ms\n",
                r.config.c_str(), DefaultBlocking() ? "blocking" : "non-blocking", ratio,
                r.fetch_row_ms, DefaultBlocking() ? "non-blocking" : "blocking",
                r.fetch_row_alt_ms > 0 ? r.raw_row_ms / r.fetch_row_alt_ms : 0, r.fetch_row_alt_ms,
                r.raw_row_ms);
    absl::StrAppend(
        &json, json.size() > 1 ? "," : "",
        absl::StrFormat(
            "{\"config\":\"%s\",\"push_ms\":%.3f,\"optimizer_ms\":%.3f,\"all_reduce_ms\":%.4f,"
            "\"scaling_ms\":%.4f,\"quantize_ms\":%.3f,\"step_ms\":%.3f,\"fetch_all_ms\":%.3f,"
            "\"fetch_all_bytes\":%.0f,\"fetch_row_ms\":%.3f,\"raw_row_ms\":%.3f,"
            "\"row_bytes\":%.0f,\"ratio\":%.4f,\"fetch_row_grpc_ms\":%.3f,"
            "\"blocking\":%s,\"fetch_row_other_kind_ms\":%.3f,"
            "\"sequential_ms\":%.3f,\"pipelined_ms\":%.3f,\"pipelined_one_ms\":%.3f,"
            "\"double_buffered_ms\":%.3f,\"prefetch_exposed_ms\":%.3f,\"prefetch_ratio\":%.4f,"
            "\"bytes_per_param\":%.3f,\"verified\":%s}",
            r.config, r.push_ms, r.optimizer_ms, r.all_reduce_ms, r.scaling_ms, r.quantize_ms,
            r.step_ms, r.fetch_all_ms, r.fetch_all_bytes, r.fetch_row_ms, r.raw_row_ms, r.row_bytes,
            ratio, r.fetch_row_grpc_ms, DefaultBlocking() ? "true" : "false", r.fetch_row_alt_ms,
            r.sequential_ms, r.pipelined_ms, r.pipelined_one_ms, r.double_buffered_ms,
            r.prefetch_exposed_ms, ratio2, r.bytes_per_param, r.verified ? "true" : "false"));
  }
  json += "]\n";
  if (!absl::GetFlag(FLAGS_json).empty()) {
    std::ofstream(absl::GetFlag(FLAGS_json)) << json;
  }
  for (int r = 0; r < 2; ++r) ncclCommDestroy(raw[r]);
  world.clear();
  world_grpc.clear();
  world_alt.clear();
  return 0;
}

}  // namespace
}  // namespace paramd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return paramd::Main();
}
