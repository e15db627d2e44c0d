// The "nccl" backend: the shared conformance suite (ranks round-robin over
// the visible GPUs, one thread per rank) plus what only this backend has:
// device-memory messages, the NCCL amax all-reduce, and recovery of a
// direction after a transfer whose peer never came (abort on deadline).
// Tag gpu: runs on the GPU machine; most tests need 2 GPUs.
#include "transport/nccl_transport.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "transport/conformance_test_lib.h"
#include "transport/nccl_amax_keys.h"
#include "transport/transport.h"

namespace paramd {
namespace {

int GpuCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

// Rank r on GPU r % GpuCount().
absl::StatusOr<std::vector<std::unique_ptr<Transport>>> MakeWorld(int world_size) {
  const int gpus = GpuCount();
  if (gpus == 0) return absl::UnavailableError("no GPU");
  std::vector<std::unique_ptr<TransportEndpoint>> endpoints;
  std::vector<std::string> addresses;
  for (int r = 0; r < world_size; ++r) {
    if (cudaSetDevice(r % gpus) != cudaSuccess) return absl::InternalError("cudaSetDevice");
    absl::StatusOr<std::unique_ptr<TransportEndpoint>> e = OpenNcclEndpoint();
    if (!e.ok()) return e.status();
    addresses.push_back((*e)->address());
    endpoints.push_back(*std::move(e));
  }
  std::vector<absl::StatusOr<std::unique_ptr<Transport>>> results;
  for (int r = 0; r < world_size; ++r) results.emplace_back(absl::UnknownError("not connected"));
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] { results[r] = endpoints[r]->Connect(r, addresses); });
  }
  for (std::thread& t : threads) t.join();
  std::vector<std::unique_ptr<Transport>> world;
  for (auto& result : results) {
    if (!result.ok()) return result.status();
    world.push_back(*std::move(result));
  }
  return world;
}

TransportConformanceParam NcclParam() {
  TransportConformanceParam param;
  param.name = "nccl";
  param.make_world = MakeWorld;
  param.detects_size_mismatch = true;
  param.buffered_sends = false;
  return param;
}

INSTANTIATE_TEST_SUITE_P(Nccl, TransportConformanceTest, ::testing::Values(NcclParam()),
                         ConformanceParamName);

absl::Time In(absl::Duration d) { return absl::Now() + d; }

std::vector<uint8_t> Pattern(size_t size, uint32_t seed) {
  std::vector<uint8_t> v(size);
  uint32_t x = seed * 2654435761u + 7;
  for (size_t i = 0; i < size; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = static_cast<uint8_t>(x >> 24);
  }
  return v;
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Device memory on `device`, freed at scope exit.
struct DeviceBuffer {
  DeviceBuffer(int device, size_t size) : device(device), size(size) {
    cudaSetDevice(device);
    EXPECT_EQ(cudaMalloc(&data, size > 0 ? size : 1), cudaSuccess);
  }
  ~DeviceBuffer() {
    cudaSetDevice(device);
    cudaFree(data);
  }
  void Upload(const std::vector<uint8_t>& bytes) {
    cudaSetDevice(device);
    EXPECT_EQ(cudaMemcpy(data, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<uint8_t> Download() {
    cudaSetDevice(device);
    std::vector<uint8_t> out(size);
    EXPECT_EQ(cudaMemcpy(out.data(), data, size, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  int device;
  size_t size;
  void* data = nullptr;
};

TEST(NcclAmaxKeysTest, OrderMatchesMaxIgnoringNan) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> v = {nan,  -nan,   -inf, -3.5f, -1e-45f, -0.0f,
                                0.0f, 1e-45f, 1.0f, 448.f, 3.4e38f, inf};
  for (float a : v) {
    for (float b : v) {
      const unsigned ka = nccl_internal::EncodeAmaxKeyHost(a);
      const unsigned kb = nccl_internal::EncodeAmaxKeyHost(b);
      const float got = nccl_internal::DecodeAmaxKeyHost(ka > kb ? ka : kb);
      const float want = MaxIgnoringNan(a, b);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << a << " " << b;
      } else {
        EXPECT_EQ(Bits(got), Bits(want)) << a << " " << b;
      }
    }
  }
}

class NcclTwoGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (GpuCount() < 2) GTEST_SKIP() << "needs 2 GPUs";
    absl::StatusOr<std::vector<std::unique_ptr<Transport>>> world = MakeWorld(2);
    ASSERT_TRUE(world.ok()) << world.status();
    world_ = *std::move(world);
    for (auto& t : world_) {
      nccl_.push_back(AsNcclTransport(t.get()));
      ASSERT_NE(nccl_.back(), nullptr);
    }
    ASSERT_TRUE(nccl_[0]->UsesNccl(1));
    ASSERT_FALSE(nccl_[0]->UsesNccl(0));
  }
  std::vector<std::unique_ptr<Transport>> world_;
  std::vector<NcclTransport*> nccl_;
};

TEST_F(NcclTwoGpuTest, DeviceMessagesInPieces) {
  const std::vector<size_t> sizes = {1, 0, 4096, (size_t{5} << 20) + 3, 77};
  std::vector<std::unique_ptr<DeviceBuffer>> src, dst;
  std::vector<DeviceBytes> send;
  std::vector<MutableDeviceBytes> recv;
  for (size_t i = 0; i < sizes.size(); ++i) {
    src.push_back(std::make_unique<DeviceBuffer>(0, sizes[i]));
    src.back()->Upload(Pattern(sizes[i], i));
    dst.push_back(std::make_unique<DeviceBuffer>(1, sizes[i]));
    send.push_back({src.back()->data, sizes[i]});
    recv.push_back({dst.back()->data, sizes[i]});
  }
  for (int round = 0; round < 3; ++round) {
    absl::Status sent;
    std::thread sender(
        [&] { sent = nccl_[0]->SendDevice(1, 42, send, nullptr, In(absl::Seconds(30))); });
    absl::Status got = nccl_[1]->RecvDevice(0, 42, recv, In(absl::Seconds(30)));
    sender.join();
    ASSERT_TRUE(sent.ok()) << sent;
    ASSERT_TRUE(got.ok()) << got;
    for (size_t i = 0; i < sizes.size(); ++i) {
      EXPECT_TRUE(dst[i]->Download() == Pattern(sizes[i], i)) << "piece " << i;
    }
  }
  // Mismatched pieces: refused at the receiver, consumed, sender succeeds.
  absl::Status sent;
  std::thread sender(
      [&] { sent = nccl_[0]->SendDevice(1, 43, send, nullptr, In(absl::Seconds(30))); });
  EXPECT_EQ(nccl_[1]
                ->RecvDevice(0, 43, absl::MakeConstSpan(recv).subspan(0, 3), In(absl::Seconds(30)))
                .code(),
            absl::StatusCode::kInvalidArgument);
  sender.join();
  EXPECT_TRUE(sent.ok()) << sent;
  // Device to host Recv of a one-piece message works too.
  std::vector<uint8_t> host(4096);
  std::thread sender2(
      [&] { sent = nccl_[0]->SendDevice(1, 44, {send[2]}, nullptr, In(absl::Seconds(30))); });
  absl::StatusOr<size_t> n = world_[1]->Recv(0, 44, absl::MakeSpan(host), In(absl::Seconds(30)));
  sender2.join();
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 4096u);
  EXPECT_TRUE(host == Pattern(4096, 2));
}

TEST_F(NcclTwoGpuTest, PipelinedSendInPartsBehindEvents) {
  // Pieces 0-1 behind e0, 2-3 behind e1, 4 behind nothing; e1 is recorded
  // after its pieces' upload on a side stream, so the bytes exist only then.
  const std::vector<size_t> sizes = {(size_t{1} << 20) + 5, 77, size_t{3} << 20, 0, 4096};
  std::vector<std::unique_ptr<DeviceBuffer>> src, dst;
  std::vector<DeviceBytes> send;
  std::vector<MutableDeviceBytes> recv;
  for (size_t i = 0; i < sizes.size(); ++i) {
    src.push_back(std::make_unique<DeviceBuffer>(0, sizes[i]));
    dst.push_back(std::make_unique<DeviceBuffer>(1, sizes[i]));
    send.push_back({src.back()->data, sizes[i]});
    recv.push_back({dst.back()->data, sizes[i]});
  }
  cudaSetDevice(0);
  cudaStream_t side;
  ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
  cudaEvent_t e0, e1;
  ASSERT_EQ(cudaEventCreateWithFlags(&e0, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&e1, cudaEventDisableTiming), cudaSuccess);
  for (int round = 0; round < 2; ++round) {
    std::vector<std::vector<uint8_t>> host;
    for (size_t i = 0; i < sizes.size(); ++i) host.push_back(Pattern(sizes[i], 100 * round + i));
    src[0]->Upload(host[0]);
    src[1]->Upload(host[1]);
    src[4]->Upload(host[4]);
    cudaSetDevice(0);
    ASSERT_EQ(cudaEventRecord(e0, side), cudaSuccess);
    // Pinned, so the copy really is asynchronous behind the event.
    void* pinned = nullptr;
    ASSERT_EQ(cudaHostAlloc(&pinned, sizes[2], cudaHostAllocDefault), cudaSuccess);
    std::memcpy(pinned, host[2].data(), sizes[2]);
    ASSERT_EQ(cudaMemcpyAsync(src[2]->data, pinned, sizes[2], cudaMemcpyHostToDevice, side),
              cudaSuccess);
    ASSERT_EQ(cudaEventRecord(e1, side), cudaSuccess);
    const std::vector<cudaEvent_t> ready = {e0, e0, e1, e1, nullptr};
    absl::Status sent;
    std::thread sender([&] {
      sent = nccl_[0]->SendDevicePipelined(1, 50 + round, send, ready, In(absl::Seconds(30)));
    });
    absl::Status got = nccl_[1]->RecvDevice(0, 50 + round, recv, In(absl::Seconds(30)));
    sender.join();
    cudaSetDevice(0);
    cudaStreamSynchronize(side);
    cudaFreeHost(pinned);
    ASSERT_TRUE(sent.ok()) << sent;
    ASSERT_TRUE(got.ok()) << got;
    for (size_t i = 0; i < sizes.size(); ++i) {
      EXPECT_TRUE(dst[i]->Download() == host[i]) << "round " << round << " piece " << i;
    }
  }
  // One event per piece is required.
  EXPECT_EQ(nccl_[0]->SendDevicePipelined(1, 60, send, {e0}, In(absl::Seconds(30))).code(),
            absl::StatusCode::kInvalidArgument);
  // A pipelined message to a host Recv: one piece, one part.
  std::vector<uint8_t> buffer(4096);
  absl::Status sent;
  std::thread sender(
      [&] { sent = nccl_[0]->SendDevicePipelined(1, 61, {send[4]}, {e1}, In(absl::Seconds(30))); });
  absl::StatusOr<size_t> n = world_[1]->Recv(0, 61, absl::MakeSpan(buffer), In(absl::Seconds(30)));
  sender.join();
  ASSERT_TRUE(sent.ok()) << sent;
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_TRUE(buffer == Pattern(4096, 104));
  cudaSetDevice(0);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(side);
}

// More parts than the transport enqueues ahead of their completion (64):
// each piece behind its own event, so each is its own NCCL group on both
// sides; the later groups wait for earlier ones (WaitForGroupSlot). Two
// rounds on one communicator reuse the group events.
TEST_F(NcclTwoGpuTest, PipelinedSendWithMorePartsThanGroupsInFlight) {
  constexpr size_t kPieces = 150;
  std::vector<std::unique_ptr<DeviceBuffer>> src, dst;
  std::vector<DeviceBytes> send;
  std::vector<MutableDeviceBytes> recv;
  std::vector<cudaEvent_t> ready(kPieces);
  cudaSetDevice(0);
  for (size_t i = 0; i < kPieces; ++i) {
    const size_t size = 1000 + 37 * i;
    src.push_back(std::make_unique<DeviceBuffer>(0, size));
    dst.push_back(std::make_unique<DeviceBuffer>(1, size));
    send.push_back({src.back()->data, size});
    recv.push_back({dst.back()->data, size});
    cudaSetDevice(0);
    ASSERT_EQ(cudaEventCreateWithFlags(&ready[i], cudaEventDisableTiming), cudaSuccess);
  }
  cudaStream_t side;
  ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
  for (int round = 0; round < 2; ++round) {
    std::vector<std::vector<uint8_t>> host;
    for (size_t i = 0; i < kPieces; ++i) {
      host.push_back(Pattern(send[i].size, 1000 * round + i));
      src[i]->Upload(host[i]);
      cudaSetDevice(0);
      ASSERT_EQ(cudaEventRecord(ready[i], side), cudaSuccess);
    }
    absl::Status sent;
    std::thread sender([&] {
      sent = nccl_[0]->SendDevicePipelined(1, 70 + round, send, ready, In(absl::Seconds(30)));
    });
    absl::Status got = nccl_[1]->RecvDevice(0, 70 + round, recv, In(absl::Seconds(30)));
    sender.join();
    ASSERT_TRUE(sent.ok()) << sent;
    ASSERT_TRUE(got.ok()) << got;
    for (size_t i = 0; i < kPieces; ++i) {
      ASSERT_TRUE(dst[i]->Download() == host[i]) << "round " << round << " piece " << i;
    }
  }
  cudaSetDevice(0);
  for (cudaEvent_t e : ready) cudaEventDestroy(e);
  cudaStreamDestroy(side);
}

TEST_F(NcclTwoGpuTest, AllReduceMaxOverNccl) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const float denorm = std::numeric_limits<float>::denorm_min();
  const std::vector<std::vector<float>> inputs = {
      {nan, 1.5f}, {nan, -nan},     {-0.0f, 0.0f}, {-0.0f, -0.0f},   {-inf, -5.0f},
      {1.0f, inf}, {denorm, -1.0f}, {-3.0f, nan},  {448.0f, 3.4e38f}};
  const std::vector<float> expected = {1.5f, nan, 0.0f, -0.0f, -5.0f, inf, denorm, -3.0f, 3.4e38f};
  for (bool device : {false, true}) {
    SCOPED_TRACE(device ? "device" : "host");
    std::vector<std::vector<float>> results(2);
    std::vector<absl::Status> status(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        for (const auto& e : inputs) results[r].push_back(e[r]);
        if (!device) {
          status[r] =
              world_[r]->AllReduceMax({0, 1}, absl::MakeSpan(results[r]), In(absl::Seconds(30)));
          return;
        }
        cudaSetDevice(r);
        float* d = nullptr;
        cudaStream_t stream;
        cudaStreamCreate(&stream);
        cudaMalloc(reinterpret_cast<void**>(&d), results[r].size() * 4);
        cudaMemcpy(d, results[r].data(), results[r].size() * 4, cudaMemcpyHostToDevice);
        status[r] = nccl_[r]->AllReduceMaxDevice({0, 1}, d, results[r].size(), stream,
                                                 In(absl::Seconds(30)));
        if (status[r].ok()) status[r] = nccl_[r]->WaitStream(stream, In(absl::Seconds(30)));
        cudaMemcpy(results[r].data(), d, results[r].size() * 4, cudaMemcpyDeviceToHost);
        cudaFree(d);
        cudaStreamDestroy(stream);
      });
    }
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(status[r].ok()) << status[r];
      for (size_t e = 0; e < expected.size(); ++e) {
        if (std::isnan(expected[e])) {
          EXPECT_TRUE(std::isnan(results[r][e])) << "rank " << r << " element " << e;
        } else {
          EXPECT_EQ(Bits(results[r][e]), Bits(expected[e])) << "rank " << r << " element " << e;
        }
      }
    }
  }
}

TEST_F(NcclTwoGpuTest, AbandonedTransferTimesOutAndTheDirectionRecovers) {
  const std::vector<uint8_t> big = Pattern(1 << 20, 9);
  // The sender gives up waiting for the clear-to-send...
  const absl::Time start = absl::Now();
  EXPECT_EQ(world_[0]->Send(1, 7, big, In(absl::Milliseconds(300))).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // ...so the receiver that takes its header waits on an ncclRecv nobody
  // serves: it must return at its deadline (abort), not hang.
  std::vector<uint8_t> buffer(1 << 20);
  const absl::Time start2 = absl::Now();
  absl::StatusOr<size_t> got =
      world_[1]->Recv(0, 7, absl::MakeSpan(buffer), In(absl::Milliseconds(1500)));
  EXPECT_FALSE(got.ok());
  EXPECT_LT(absl::Now() - start2, absl::Seconds(6));
  // The next message on the same direction uses a new communicator. The
  // first attempt may meet the stale state on one side (UNAVAILABLE); a
  // retry must work.
  bool delivered = false;
  for (int attempt = 0; attempt < 3 && !delivered; ++attempt) {
    absl::Status sent;
    std::thread sender([&] { sent = world_[0]->Send(1, 8, big, In(absl::Seconds(30))); });
    absl::StatusOr<size_t> n = world_[1]->Recv(0, 8, absl::MakeSpan(buffer), In(absl::Seconds(30)));
    sender.join();
    if (sent.ok() && n.ok()) {
      delivered = *n == big.size() && buffer == big;
    } else {
      EXPECT_EQ(sent.code(), absl::StatusCode::kUnavailable) << sent;
    }
  }
  EXPECT_TRUE(delivered);
}

}  // namespace
}  // namespace paramd
