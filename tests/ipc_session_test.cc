// Same-GPU sessions (proto/ipc.proto) against a real coordinator + daemon
// in this process (cpu backend), with a fake exporter standing in for the
// CUDA one: the daemon's pin and lease rules, the descriptor socket and the
// in-place push rules, without a GPU. The fake's "trainer buffers" are
// memfds mapped into the daemon (as CUDA shareable handles would be).
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "client/ipc/ipc_session.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "ipc/pin_page.h"
#include "server/ipc/ipc_service.h"
#include "server/server.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace {

constexpr int64_t kRows = 8;
constexpr int64_t kCols = 16;
constexpr float kLr = 0.5f;

// Host memory regions and memfd-backed trainer buffers.
class FakeExporter : public ipc::IpcExporter {
 public:
  absl::StatusOr<std::string> DeviceUuid() override { return std::string(16, 'u'); }
  absl::Status Export(ShardBackend& backend, std::vector<int>* fds,
                      std::vector<uint64_t>* sizes) override {
    int fd = memfd_create("fake_region", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, 4096) != 0) return absl::InternalError("memfd");
    fds->push_back(fd);
    sizes->push_back(4096);
    return absl::OkStatus();
  }
  absl::StatusOr<ipc::IpcDirectionRefs> Describe(ShardBackend& backend, int64_t version, int shard,
                                                 Direction direction) override {
    ipc::IpcDirectionRefs r;
    r.data = {0, static_cast<uint64_t>(shard * 2 + static_cast<int>(direction)) * 256};
    r.data_bytes = kRows * kCols * 4;
    return r;
  }
  absl::Status ImportBuffer(uint64_t session, uint64_t id, int fd, uint64_t bytes) override {
    void* p = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return absl::InvalidArgumentError("mmap");
    absl::MutexLock lock(&mu_);
    buffers_[{session, id}] = {static_cast<const float*>(p), bytes};
    return absl::OkStatus();
  }
  void DropSession(uint64_t session) override {
    absl::MutexLock lock(&mu_);
    for (auto it = buffers_.begin(); it != buffers_.end();) {
      if (it->first.first == session) {
        munmap(const_cast<float*>(it->second.first), it->second.second);
        it = buffers_.erase(it);
      } else {
        ++it;
      }
    }
    ++dropped_;
  }
  absl::Status CheckPush(uint64_t session, ShardBackend&,
                         absl::Span<const ipc::IpcPushPiece> pieces) override {
    for (const ipc::IpcPushPiece& p : pieces) {
      ASSIGN_OR_RETURN(const float* v, Values(session, p));
      for (int64_t i = 0; i < p.count; ++i) {
        if (!std::isfinite(v[i])) return absl::InvalidArgumentError("non-finite gradient value");
      }
    }
    return absl::OkStatus();
  }
  absl::Status ApplyPush(uint64_t session, ShardBackend& backend,
                         absl::Span<const ipc::IpcPushPiece> pieces) override {
    for (const ipc::IpcPushPiece& p : pieces) {
      ASSIGN_OR_RETURN(const float* v, Values(session, p));
      RETURN_IF_ERROR(
          backend.AccumulateGradient(p.shard, p.offset, absl::MakeConstSpan(v, p.count), false));
    }
    return absl::OkStatus();
  }
  absl::StatusOr<int> SlotOf(ShardBackend&, int64_t version) override {
    return static_cast<int>(version % 2);  // the two slots alternate
  }
  int dropped() {
    absl::MutexLock lock(&mu_);
    return dropped_;
  }

 private:
  absl::StatusOr<const float*> Values(uint64_t session, const ipc::IpcPushPiece& p) {
    absl::MutexLock lock(&mu_);
    auto it = buffers_.find({session, p.buffer});
    if (it == buffers_.end()) return absl::InvalidArgumentError("unknown buffer");
    if (p.bf16 || p.buffer_offset + p.count * 4 > it->second.second) {
      return absl::InvalidArgumentError("piece outside the buffer");
    }
    return it->second.first + p.buffer_offset / 4;
  }
  absl::Mutex mu_;
  std::map<std::pair<uint64_t, uint64_t>, std::pair<const float*, uint64_t>> buffers_;
  int dropped_ = 0;
};

FakeExporter* g_exporter = nullptr;
const bool kRegistered =
    ipc::RegisterIpcExporterFactory([]() -> absl::StatusOr<std::unique_ptr<ipc::IpcExporter>> {
      auto e = std::make_unique<FakeExporter>();
      g_exporter = e.get();
      return std::unique_ptr<ipc::IpcExporter>(std::move(e));
    });

// A memfd of FP32 values, its descriptor.
int GradientFd(const std::vector<float>& values) {
  int fd = memfd_create("grad", MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(write(fd, values.data(), values.size() * 4), static_cast<ssize_t>(values.size() * 4));
  return fd;
}

class IpcSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/ipc_session_test_" + std::to_string(getpid());
    mkdir(dir_.c_str(), 0700);
    initial_ = testing::RandomValues(kRows * kCols, 7);
    ASSERT_TRUE(
        testing::WriteModel(dir_ + "/m.safetensors", {{"w", {kRows, kCols}, initial_}}).ok());
    ServerOptions o;
    o.listen = "127.0.0.1:0";
    o.coordinator.expected_pushers = 1;
    o.coordinator.model_path = dir_ + "/m.safetensors";
    o.coordinator.optimizer.kind = OptimizerKind::kSgd;
    o.coordinator.optimizer.lr = kLr;
    o.coordinator.optimizer_explicit = true;
    o.coordinator.resolver = [](const std::string&,
                                absl::Span<const int64_t>) -> absl::StatusOr<HybridSpec> {
      HybridSpec s;
      s.rowwise = DefaultQuantSpec(Format::kIdentityFp32);
      s.columnwise = DefaultQuantSpec(Format::kIdentityFp32);
      s.source_dtype = SourceDtype::kFp32;
      return s;
    };
    o.daemon.optimizer = o.coordinator.optimizer;
    absl::StatusOr<std::unique_ptr<ParamdServer>> server = ParamdServer::Start(o);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    client::ClientOptions co;
    co.coordinator_address = server_->address();
    absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(co);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
    ASSERT_TRUE(client_->WaitForVersion(0, absl::Seconds(20)).ok());
  }
  void TearDown() override {
    client_.reset();
    server_.reset();
  }

  std::unique_ptr<ipc::IpcSession> Session(absl::Duration lease, bool keep_alive = true) {
    ipc::IpcSessionOptions o;
    o.lease = lease;
    o.keep_alive = keep_alive;
    o.name = "ipc_session_test";
    absl::StatusOr<std::unique_ptr<ipc::IpcSession>> s =
        ipc::IpcSession::Open(client_->DaemonChannel(server_->address()), o);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  absl::StatusOr<rpc::PushGradientsResponse> PushIpc(ipc::IpcSession& s, int64_t version,
                                                     uint64_t buffer) {
    rpc::PushGradientsIpcRequest r;
    r.set_version(version);
    r.set_pusher_id(client_->member_id());
    rpc::IpcPushTensor* t = r.add_tensors();
    t->set_tensor("w");
    t->set_row_begin(0);
    t->set_row_end(kRows);
    t->set_dtype(rpc::DTYPE_FP32);
    t->set_buffer(buffer);
    return s.Push(r);
  }

  std::vector<float> FetchRowwise(int64_t version) {
    absl::StatusOr<client::FetchResult> r = client_->Fetch(version, {{"w", Direction::kRowwise}});
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    const std::vector<uint8_t>& bytes = r->tensors[0].value.data;
    std::vector<float> out(bytes.size() / 4);
    std::memcpy(out.data(), bytes.data(), bytes.size());
    return out;
  }

  std::string dir_;
  std::vector<float> initial_;
  std::unique_ptr<ParamdServer> server_;
  std::unique_ptr<client::Client> client_;
};

TEST_F(IpcSessionTest, PinDescribesBuffersAndHoldsBackTheStepThatWouldRewriteThem) {
  std::unique_ptr<ipc::IpcSession> s = Session(absl::Seconds(5));
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->device_uuid(), std::string(16, 'u'));
  absl::StatusOr<rpc::PinIpcResponse> pin0 = s->Pin(-1, {});
  ASSERT_TRUE(pin0.ok()) << pin0.status();
  EXPECT_EQ(pin0->version(), 0);
  ASSERT_EQ(pin0->pieces_size(), 2);  // w rowwise + columnwise
  EXPECT_EQ(pin0->pieces(0).tensor(), "w");
  EXPECT_EQ(pin0->pieces(0).row_end(), kRows);
  EXPECT_EQ(pin0->pieces(1).data().offset(), 256u);
  absl::StatusOr<ipc::FdReply> regions = s->GetRegions();
  ASSERT_TRUE(regions.ok()) << regions.status();
  EXPECT_EQ(regions->fds.size(), 1u);
  EXPECT_EQ(regions->epoch, pin0->regions_epoch());
  for (int fd : regions->fds) close(fd);
  // Unknown tensor, direction not published, future version: refused.
  rpc::TensorDirections bad;
  bad.set_tensor("nope");
  EXPECT_EQ(s->Pin(0, {bad}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s->Pin(7, {}).status().code(), absl::StatusCode::kNotFound);

  const std::vector<float> ones(kRows * kCols, 1.0f);
  int fd = GradientFd(ones);
  ASSERT_TRUE(s->RegisterBuffer(1, fd, ones.size() * 4).ok());
  close(fd);
  // v0 -> v1: nothing to retire yet (no previous version).
  ASSERT_TRUE(PushIpc(*s, 0, 1).ok());
  ASSERT_TRUE(client_->WaitForVersion(1, absl::Seconds(10)).ok());
  // v1 -> v2 rewrites v0's buffers, which the session pins: the step waits.
  ASSERT_TRUE(PushIpc(*s, 1, 1).ok());
  absl::StatusOr<int64_t> early = client_->WaitForVersion(2, absl::Milliseconds(700));
  EXPECT_FALSE(early.ok()) << "the step rewrote a pinned version";
  // v0 is still published (held) and readable meanwhile.
  EXPECT_EQ(FetchRowwise(0), initial_);
  // Pinning v1 and releasing v0 in one call lets the step go on.
  absl::StatusOr<rpc::PinIpcResponse> pin1 = s->Pin(1, {}, /*unpin_version=*/0);
  ASSERT_TRUE(pin1.ok()) << pin1.status();
  ASSERT_TRUE(client_->WaitForVersion(2, absl::Seconds(10)).ok());
  // v0 is gone now: a pin of it is NOT_FOUND.
  EXPECT_EQ(s->Pin(0, {}).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(IpcSessionTest, AStoppedTrainersPinsExpireWithItsLease) {
  std::unique_ptr<ipc::IpcSession> live = Session(absl::Seconds(5));
  std::unique_ptr<ipc::IpcSession> killed = Session(absl::Milliseconds(400), /*keep_alive=*/false);
  ASSERT_NE(live, nullptr);
  ASSERT_NE(killed, nullptr);
  const std::vector<float> g(kRows * kCols, 0.25f);
  int fd = GradientFd(g);
  ASSERT_TRUE(live->RegisterBuffer(9, fd, g.size() * 4).ok());
  close(fd);
  ASSERT_TRUE(killed->Pin(0, {}).ok());  // then it never calls again
  ASSERT_TRUE(PushIpc(*live, 0, 9).ok());
  ASSERT_TRUE(client_->WaitForVersion(1, absl::Seconds(10)).ok());
  const absl::Time start = absl::Now();
  ASSERT_TRUE(PushIpc(*live, 1, 9).ok());  // v2 rewrites v0: waits for the lease
  ASSERT_TRUE(client_->WaitForVersion(2, absl::Seconds(10)).ok());
  const absl::Duration waited = absl::Now() - start;
  EXPECT_GE(waited, absl::Milliseconds(250)) << "the step did not wait for the pin";
  EXPECT_LT(waited, absl::Seconds(5));
  EXPECT_GE(g_exporter->dropped(), 1);  // the expired session's buffers were dropped
  // The expired session is told so, stickily.
  absl::Status gone = killed->Pin(-1, {}).status();
  EXPECT_EQ(gone.code(), absl::StatusCode::kUnavailable) << gone;
  EXPECT_FALSE(killed->Healthy().ok());
  EXPECT_TRUE(live->Healthy().ok());
}

TEST_F(IpcSessionTest, InPlacePushFollowsThePushRules) {
  std::unique_ptr<ipc::IpcSession> s = Session(absl::Seconds(5));
  ASSERT_NE(s, nullptr);
  std::vector<float> g = testing::RandomValues(kRows * kCols, 11);
  std::vector<float> bad = g;
  bad[17] = std::nanf("");
  int fd = GradientFd(g), bad_fd = GradientFd(bad);
  ASSERT_TRUE(s->RegisterBuffer(1, fd, g.size() * 4).ok());
  ASSERT_TRUE(s->RegisterBuffer(2, bad_fd, g.size() * 4).ok());
  close(fd);
  close(bad_fd);
  EXPECT_EQ(PushIpc(*s, 0, 2).status().code(), absl::StatusCode::kInvalidArgument);  // NaN
  EXPECT_EQ(PushIpc(*s, 0, 3).status().code(), absl::StatusCode::kInvalidArgument);  // no buffer
  EXPECT_EQ(PushIpc(*s, 5, 1).status().code(), absl::StatusCode::kOutOfRange);       // early
  absl::StatusOr<rpc::PushGradientsResponse> ok = PushIpc(*s, 0, 1);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->bytes_received(), kRows * kCols * 4);
  ASSERT_TRUE(client_->WaitForVersion(1, absl::Seconds(10)).ok());
  EXPECT_EQ(PushIpc(*s, 0, 1).status().code(), absl::StatusCode::kFailedPrecondition);  // stale
  // The refused pushes added nothing: v1 = v0 - lr * g exactly.
  const std::vector<float> v1 = FetchRowwise(1);
  ASSERT_EQ(v1.size(), g.size());
  for (size_t i = 0; i < g.size(); ++i) {
    ASSERT_EQ(v1[i], initial_[i] - kLr * g[i]) << i;
  }
  // The same push over the host stream gives the same bytes.
  ASSERT_TRUE(client_->PushGradients(1, {client::Gradient::Fp32("w", g)}).ok());
  ASSERT_TRUE(client_->WaitForVersion(2, absl::Seconds(10)).ok());
  const std::vector<float> v2 = FetchRowwise(2);
  for (size_t i = 0; i < g.size(); ++i) ASSERT_EQ(v2[i], v1[i] - kLr * g[i]) << i;
}

// The session's pin page (ipc/pin_page.h): the daemon offers each
// published version in its slot; a pin written into the page (no RPC)
// holds back the step that would rewrite that version like a PinIpc pin;
// the step withdraws the version first, so a page pin of it fails after.
TEST_F(IpcSessionTest, PagePinsHandOverVersionsWithoutAnRpc) {
  std::unique_ptr<ipc::IpcSession> s = Session(absl::Seconds(5));
  ASSERT_NE(s, nullptr);
  absl::StatusOr<std::unique_ptr<ipc::PinPage>> page = s->GetPinPage();
  ASSERT_TRUE(page.ok()) << page.status();
  absl::StatusOr<rpc::PinIpcResponse> pin0 = s->Pin(-1, {});  // the model's generation
  ASSERT_TRUE(pin0.ok()) << pin0.status();
  const int64_t gen = static_cast<int64_t>(pin0->regions_epoch());
  ASSERT_TRUE(s->Unpin(0).ok());
  const uint64_t v0 = ipc::PackPin(gen, 0), v1 = ipc::PackPin(gen, 1), v2 = ipc::PackPin(gen, 2);
  EXPECT_EQ((*page)->SlotOf(v0), 0);  // the fake exporter's slot: version % 2
  const int held = (*page)->TryPin(0, v0);
  ASSERT_GE(held, 0);

  const std::vector<float> ones(kRows * kCols, 1.0f);
  int fd = GradientFd(ones);
  ASSERT_TRUE(s->RegisterBuffer(1, fd, ones.size() * 4).ok());
  close(fd);
  ASSERT_TRUE(PushIpc(*s, 0, 1).ok());
  ASSERT_TRUE(client_->WaitForVersion(1, absl::Seconds(10)).ok());
  // Offered before the version's waiters are answered.
  EXPECT_EQ((*page)->SlotOf(v1), 1);
  EXPECT_EQ((*page)->SlotOf(v0), 0);
  // v1 -> v2 rewrites v0's buffers: the page pin holds the step.
  ASSERT_TRUE(PushIpc(*s, 1, 1).ok());
  EXPECT_FALSE(client_->WaitForVersion(2, absl::Milliseconds(700)).ok())
      << "the step rewrote a page-pinned version";
  EXPECT_EQ((*page)->SlotOf(v0), -1);       // withdrawn by the waiting step
  EXPECT_EQ((*page)->TryPin(0, v0), -1);    // so a second pin of it fails
  EXPECT_EQ(FetchRowwise(0), initial_);     // still intact
  const int next = (*page)->TryPin(1, v1);  // the hand-over: pin v1, release v0
  ASSERT_GE(next, 0);
  (*page)->Unpin(held);
  ASSERT_TRUE(client_->WaitForVersion(2, absl::Seconds(10)).ok());
  EXPECT_EQ((*page)->SlotOf(v2), 0);
  EXPECT_EQ((*page)->SlotOf(v1), 1);
  (*page)->Unpin(next);
}

TEST_F(IpcSessionTest, ADeadDaemonIsAClearErrorAtTheNextCall) {
  std::unique_ptr<ipc::IpcSession> s = Session(absl::Seconds(2));
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(s->Pin(-1, {}).ok());
  client_.reset();
  server_.reset();  // the daemon is gone
  absl::Status st = s->Pin(-1, {}).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_NE(st.message().find("no longer valid"), std::string::npos) << st;
  EXPECT_FALSE(s->Healthy().ok());
  EXPECT_EQ(s->GetRegions().status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace paramd
