// CPU (no GPU; CI): the daemon's side of the issue-5 overlap
// (server/daemon/daemon.cc) through its real RPCs, in one process: a coordinator
// and a daemon with --backend=gpu where the "gpu" backend is a fake (the cpu
// backend's steps under the gpu name; a step can be held after it reported
// its work enqueued, or made to fail) and the device channel is a fake too
// (Send records its version and whether it was in flight, and can be held).
// What it pins down:
//   - a fetch of the latest version is sent while a step runs (no
//     whole-step lock);
//   - a step waits for a send of the version whose slot it rewrites, and a
//     new fetch of that version is refused (NOT_FOUND) once the step started;
//   - with reply_after_send, a fetch of the version being stepped is sent
//     in flight right after the step's enqueue and answered only once the
//     version is published; a failed step fails it with ABORTED.
// Only without --config=cuda: there the real gpu backend and channel are
// linked and registered instead of the fakes.
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "proto/paramd.grpc.pb.h"
#include "server/backend/device_channel.h"
#include "server/backend/shard_backend.h"
#include "server/server.h"
#include "tests/server_test_util.h"
#include "transport/transport.h"

namespace paramd {
namespace testing {
namespace {

// What the fakes do, set by the test (one daemon per process).
struct Control {
  absl::Mutex mu;
  bool hold_steps ABSL_GUARDED_BY(mu) = false;  // optimizer steps wait after the enqueue
  int steps_entered ABSL_GUARDED_BY(mu) = 0;    // optimizer steps that reported the enqueue
  int steps_released ABSL_GUARDED_BY(mu) = 0;
  int64_t fail_version ABSL_GUARDED_BY(mu) = -1;
  bool hold_sends ABSL_GUARDED_BY(mu) = false;
  int sends_released ABSL_GUARDED_BY(mu) = 0;
  struct Send {
    int64_t version;
    bool in_flight;
  };
  std::vector<Send> sends ABSL_GUARDED_BY(mu);
  std::vector<std::string> opened_secrets ABSL_GUARDED_BY(mu);  // given to the opener
};
Control& Ctl() {
  static Control* c = new Control;
  return *c;
}

// Waits (bounded) until `pred` holds under Ctl().mu.
bool WaitFor(const std::function<bool()>& pred, absl::Duration timeout = absl::Seconds(10)) {
  Control& c = Ctl();
  absl::MutexLock lock(&c.mu);
  return c.mu.AwaitWithTimeout(absl::Condition(&pred), timeout);
}

class FakeGpuBackend : public ShardBackend {
 public:
  explicit FakeGpuBackend(std::unique_ptr<ShardBackend> inner) : inner_(std::move(inner)) {}
  absl::string_view name() const override { return "gpu"; }
  const std::vector<TensorDef>& tensors() const override { return inner_->tensors(); }
  const std::vector<ShardDef>& shards() const override { return inner_->shards(); }
  absl::Span<float> load_master(int i) override { return inner_->load_master(i); }
  absl::Span<float> gradient(int i) override { return inner_->gradient(i); }
  absl::Status AccumulateGradient(int i, int64_t offset, absl::Span<const float> v,
                                  bool last_pusher) override {
    return inner_->AccumulateGradient(i, offset, v, last_pusher);
  }
  absl::Status SetOptimizer(const OptimizerOptions& o) override { return inner_->SetOptimizer(o); }
  ShardSet* host_state() override { return inner_->host_state(); }
  void set_step_enqueued(StepEnqueuedFn fn) override { enqueued_ = std::move(fn); }
  absl::StatusOr<std::shared_ptr<const PublishedVersion>> Step(int64_t new_version,
                                                               bool apply_optimizer,
                                                               const AllReduceMaxFn& all_reduce,
                                                               bool update_delayed) override {
    Control& c = Ctl();
    int index = 0;
    if (apply_optimizer) {
      absl::MutexLock lock(&c.mu);
      index = ++c.steps_entered;
    }
    if (enqueued_) enqueued_(new_version);
    bool fail = false;
    if (apply_optimizer) {
      absl::MutexLock lock(&c.mu);
      auto released = [&c, index]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) {
        return !c.hold_steps || c.steps_released >= index;
      };
      c.mu.Await(absl::Condition(&released));
      fail = c.fail_version == new_version;
    }
    if (fail) return absl::InternalError("fake step failure");
    return inner_->Step(new_version, apply_optimizer, all_reduce, update_delayed);
  }

 private:
  std::unique_ptr<ShardBackend> inner_;
  StepEnqueuedFn enqueued_;
};

class FakeChannel : public DeviceChannel {
 public:
  std::string address() const override { return "fake"; }
  int device() const override { return 0; }
  absl::Status Connect(const std::string&) override { return absl::OkStatus(); }
  absl::Status Send(ShardBackend&, int64_t version, absl::Span<const DeviceFetchItem>, uint64_t,
                    absl::Time deadline, bool in_flight) override {
    Control& c = Ctl();
    absl::MutexLock lock(&c.mu);
    c.sends.push_back({version, in_flight});
    const int index = static_cast<int>(c.sends.size());
    auto released = [this, &c, index]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) {
      return shut_down_ || !c.hold_sends || c.sends_released >= index;
    };
    if (!c.mu.AwaitWithDeadline(absl::Condition(&released), deadline)) {
      return absl::DeadlineExceededError("fake send held past its deadline");
    }
    return shut_down_ ? absl::CancelledError("closed") : absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<StagedDevicePush>> ReceivePush(absl::Span<const DevicePushPiece>,
                                                                uint64_t, absl::Time,
                                                                bool) override {
    return absl::UnimplementedError("fake channel");
  }
  absl::Status ApplyPush(ShardBackend&, StagedDevicePush&, bool) override {
    return absl::UnimplementedError("fake channel");
  }
  void Shutdown() override {
    absl::MutexLock lock(&Ctl().mu);
    shut_down_ = true;
  }

 private:
  bool shut_down_ = false;  // guarded by Ctl().mu
};

const bool kFakeGpu = RegisterGpuShardBackend(
    [](std::vector<TensorDef> tensors, std::vector<ShardDef> shards,
       const ShardBackendOptions& options) -> absl::StatusOr<std::unique_ptr<ShardBackend>> {
      absl::StatusOr<std::unique_ptr<ShardBackend>> inner =
          CreateShardBackend(DaemonBackend::kCpu, std::move(tensors), std::move(shards), options);
      if (!inner.ok()) return inner.status();
      return std::unique_ptr<ShardBackend>(new FakeGpuBackend(*std::move(inner)));
    });
const bool kFakeChannel = RegisterDeviceChannelOpener(
    [](const std::string&, const std::string&,
       const std::string& secret) -> absl::StatusOr<std::unique_ptr<DeviceChannel>> {
      absl::MutexLock lock(&Ctl().mu);
      Ctl().opened_secrets.push_back(secret);
      return std::unique_ptr<DeviceChannel>(new FakeChannel);
    });
// --backend=gpu asks whether an "nccl" transport can run (select.cc).
const TransportRegistration kFakeNccl(
    "nccl", [](const TransportOptions&) -> absl::StatusOr<std::unique_ptr<TransportEndpoint>> {
      return absl::UnimplementedError("fake nccl");
    });

class DaemonOverlapCpu : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kFakeGpu && kFakeChannel);
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    options.coordinator.expected_daemons = 1;
    options.coordinator.expected_pushers = 1;
    options.daemon.backend = "gpu";
    absl::StatusOr<std::unique_ptr<ParamdServer>> s = ParamdServer::Start(options);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    address_ = absl::StrCat("127.0.0.1:", server_->port());
    stub_ = rpc::Daemon::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
    const std::vector<TestTensor> tensors = {{"w", {64, 32}, RandomValues(64 * 32, 1)}};
    model_ = absl::StrCat(::testing::TempDir(), "/daemon_overlap_cpu.safetensors");
    ASSERT_TRUE(WriteModel(model_, tensors).ok());
    client::ClientOptions copts;
    copts.coordinator_address = address_;
    copts.name = "overlap_cpu";
    absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(copts);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
    // The in-process daemon joins its coordinator asynchronously, and a Load
    // before it has joined is refused UNAVAILABLE: retry until it is in.
    absl::StatusOr<int64_t> v0 = absl::UnavailableError("not tried");
    for (absl::Time end = absl::Now() + absl::Seconds(20);
         absl::IsUnavailable(v0.status()) && absl::Now() < end;) {
      v0 = client_->Load(model_, "", absl::Seconds(20));
      if (absl::IsUnavailable(v0.status())) absl::SleepFor(absl::Milliseconds(20));
    }
    ASSERT_TRUE(v0.ok()) << v0.status();
  }
  void TearDown() override {
    {
      Control& c = Ctl();
      absl::MutexLock lock(&c.mu);
      c.hold_steps = false;
      c.hold_sends = false;
    }
    for (auto& ch : channels_) ch.context->TryCancel();
    channels_.clear();
    client_.reset();
    server_.reset();
  }

  // Opens a device channel (its stream stays open); returns its id.
  uint64_t OpenChannel() {
    channels_.emplace_back();
    Channel& ch = channels_.back();
    ch.context = std::make_unique<grpc::ClientContext>();
    rpc::OpenDeviceChannelRequest request;
    request.set_trainer_address("fake-trainer");
    request.set_name("overlap_cpu");
    ch.reader = stub_->OpenDeviceChannel(ch.context.get(), request);
    rpc::DeviceChannelEvent event;
    EXPECT_TRUE(ch.reader->Read(&event));
    secrets_[event.channel()] = event.channel_secret();
    return event.channel();
  }

  // FetchDevice of "w" rowwise at `version`, answered in the future, with
  // the channel's secret (or `secret` when given).
  std::future<grpc::Status> Fetch(uint64_t channel, int64_t version, bool reply_after_send = true,
                                  std::optional<std::string> secret = std::nullopt) {
    if (!secret) secret = secrets_[channel];
    return std::async(std::launch::async, [this, channel, version, reply_after_send, secret] {
      grpc::ClientContext context;
      SetDeadline(context, absl::Seconds(10));
      rpc::FetchDeviceRequest request;
      request.set_channel(channel);
      request.set_channel_secret(*secret);
      request.set_version(version);
      request.set_tag(static_cast<uint64_t>(version) + 1);
      request.set_reply_after_send(reply_after_send);
      rpc::TensorDirections* td = request.add_tensors();
      td->set_tensor("w");
      td->add_directions(rpc::DIRECTION_ROWWISE);
      rpc::FetchDeviceResponse response;
      return stub_->FetchDevice(&context, request, &response);
    });
  }

  void Push(int64_t version) {
    const std::vector<float> g = RandomValues(64 * 32, 100 + version, 0.1f);
    absl::StatusOr<client::PushResult> r =
        client_->PushGradients(version, {client::Gradient::Fp32("w", g)});
    ASSERT_TRUE(r.ok()) << r.status();
  }

  static void Release(int step) {
    absl::MutexLock lock(&Ctl().mu);
    Ctl().steps_released = step;
  }

  struct Channel {
    std::unique_ptr<grpc::ClientContext> context;
    std::unique_ptr<grpc::ClientReader<rpc::DeviceChannelEvent>> reader;
  };
  std::unique_ptr<ParamdServer> server_;
  std::string address_;
  std::string model_;
  std::unique_ptr<rpc::Daemon::Stub> stub_;
  std::unique_ptr<client::Client> client_;
  std::vector<Channel> channels_;
  std::map<uint64_t, std::string> secrets_;  // by channel id, from the first event
};

bool Pending(std::future<grpc::Status>& f, absl::Duration d = absl::Milliseconds(300)) {
  return f.wait_for(absl::ToChronoMilliseconds(d)) == std::future_status::timeout;
}

TEST_F(DaemonOverlapCpu, FetchesBesideStepsPinsAndInFlightVersions) {
  Control& c = Ctl();
  const uint64_t ch = OpenChannel();
  const uint64_t other = OpenChannel();
  {
    absl::MutexLock lock(&c.mu);
    c.hold_steps = true;
  }
  // 1. The step to v1 is held after its enqueue: a fetch of v0 is sent and
  //    answered meanwhile.
  Push(0);
  ASSERT_TRUE(WaitFor([&c] { return c.steps_entered == 1; }));
  std::future<grpc::Status> latest = Fetch(ch, 0);
  ASSERT_EQ(latest.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  grpc::Status s = latest.get();
  EXPECT_TRUE(s.ok()) << s.error_message();
  {
    absl::MutexLock lock(&c.mu);
    ASSERT_EQ(c.sends.size(), 1u);
    EXPECT_EQ(c.sends[0].version, 0);
    EXPECT_FALSE(c.sends[0].in_flight);
  }
  Release(1);
  ASSERT_TRUE(client_->WaitForVersion(1, absl::Seconds(10)).ok());

  // 2. v0 and v1 held. A send of v0 in progress (held) pins it: the step to
  //    v2, which rewrites v0's slot, waits; a new fetch of v0 is refused.
  {
    absl::MutexLock lock(&c.mu);
    c.hold_sends = true;
    c.sends_released = 1;
  }
  std::future<grpc::Status> pinned = Fetch(ch, 0);
  ASSERT_TRUE(WaitFor([&c] { return c.sends.size() == 2; }));
  Push(1);
  absl::SleepFor(absl::Milliseconds(300));
  {
    absl::MutexLock lock(&c.mu);
    EXPECT_EQ(c.steps_entered, 1) << "the step rewrote a slot a send was reading";
  }
  std::future<grpc::Status> refused = Fetch(other, 0);
  ASSERT_EQ(refused.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  s = refused.get();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_TRUE(Pending(pinned));
  {
    absl::MutexLock lock(&c.mu);
    c.hold_sends = false;
  }
  s = pinned.get();
  EXPECT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(WaitFor([&c] { return c.steps_entered == 2; }));
  Release(2);
  ASSERT_TRUE(client_->WaitForVersion(2, absl::Seconds(10)).ok());

  // 3. A fetch of v3 asked before its step: sent in flight right after the
  //    step's enqueue, answered only once v3 is published.
  std::future<grpc::Status> next = Fetch(ch, 3);
  EXPECT_TRUE(Pending(next));
  const size_t before = [&c] {
    absl::MutexLock lock(&c.mu);
    return c.sends.size();
  }();
  Push(2);
  ASSERT_TRUE(WaitFor([&c, before] { return c.sends.size() == before + 1; }));
  {
    absl::MutexLock lock(&c.mu);
    EXPECT_EQ(c.sends.back().version, 3);
    EXPECT_TRUE(c.sends.back().in_flight);
    EXPECT_EQ(c.steps_entered, 3);
  }
  EXPECT_TRUE(Pending(next)) << "answered before the version was published";
  Release(3);
  ASSERT_EQ(next.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  s = next.get();
  EXPECT_TRUE(s.ok()) << s.error_message();

  // Without reply_after_send (the older exchange) the fetch of the version
  // being stepped waits for its publish: its send is not in flight.
  {
    absl::MutexLock lock(&c.mu);
    c.fail_version = -1;
  }
  ASSERT_TRUE(client_->WaitForVersion(3, absl::Seconds(10)).ok());
  std::future<grpc::Status> legacy = Fetch(ch, 4, /*reply_after_send=*/false);
  Push(3);
  ASSERT_TRUE(WaitFor([&c] { return c.steps_entered == 4; }));
  absl::SleepFor(absl::Milliseconds(200));
  {
    absl::MutexLock lock(&c.mu);
    EXPECT_NE(c.sends.back().version, 4) << "sent before its publish without reply_after_send";
  }
  Release(4);
  s = legacy.get();
  EXPECT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(WaitFor([&c] { return c.sends.back().version == 4; }));
  {
    absl::MutexLock lock(&c.mu);
    EXPECT_FALSE(c.sends.back().in_flight);
  }

  // 4. The step to v5 fails after its enqueue: the fetch sent in flight
  //    fails with ABORTED, never OK.
  ASSERT_TRUE(client_->WaitForVersion(4, absl::Seconds(10)).ok());
  {
    absl::MutexLock lock(&c.mu);
    c.fail_version = 5;
  }
  std::future<grpc::Status> failing = Fetch(ch, 5);
  EXPECT_TRUE(Pending(failing));
  Push(4);
  ASSERT_TRUE(WaitFor([&c] { return c.sends.back().version == 5; }));
  Release(5);
  ASSERT_EQ(failing.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  s = failing.get();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();

  rpc::GetStatsRequest request;
  rpc::GetStatsResponse stats;
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(5));
  ASSERT_TRUE(stub_->GetStats(&context, request, &stats).ok());
  EXPECT_EQ(stats.stats().device_fetches_streamed(), 1);     // v3 (v5 failed)
  EXPECT_GE(stats.stats().device_fetches_beside_step(), 1);  // v0 in phase 1
}

// Each device channel gets a fresh secret (the one its NCCL endpoint was
// opened with), handed out only in the channel's first event; FetchDevice
// and PushGradientsDevice on a channel without its secret -- none,
// another channel's, a near miss -- are PERMISSION_DENIED, send nothing,
// and do not echo the secret.
TEST_F(DaemonOverlapCpu, DeviceChannelsServeOnlyTheirOpener) {
  Control& c = Ctl();
  {
    absl::MutexLock lock(&c.mu);
    c.sends.clear();
    c.opened_secrets.clear();
  }
  const uint64_t ch = OpenChannel();
  const uint64_t other = OpenChannel();
  const std::string mine = secrets_[ch], theirs = secrets_[other];
  EXPECT_EQ(mine.size(), 64u);
  EXPECT_NE(mine, theirs);
  {
    absl::MutexLock lock(&c.mu);
    EXPECT_EQ(c.opened_secrets, (std::vector<std::string>{mine, theirs}));
  }
  std::string near_miss = mine;
  near_miss.back() = near_miss.back() == '0' ? '1' : '0';
  for (const std::string& wrong : {std::string(), theirs, near_miss}) {
    const grpc::Status s = Fetch(ch, 0, /*reply_after_send=*/true, wrong).get();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_EQ(s.error_message().find(mine), std::string::npos);

    rpc::PushGradientsDeviceRequest push;
    push.set_channel(ch);
    push.set_channel_secret(wrong);
    push.set_version(0);
    push.set_pusher_id(client_->member_id());
    push.set_tag(77);
    rpc::DevicePushTensor* t = push.add_tensors();
    t->set_tensor("w");
    t->set_row_begin(0);
    t->set_row_end(64);
    t->set_dtype(rpc::DTYPE_FP32);
    rpc::PushGradientsResponse response;
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(10));
    const grpc::Status p = stub_->PushGradientsDevice(&context, push, &response);
    EXPECT_EQ(p.error_code(), grpc::StatusCode::PERMISSION_DENIED) << p.error_message();
  }
  {
    absl::MutexLock lock(&c.mu);
    EXPECT_TRUE(c.sends.empty()) << "a refused FetchDevice sent";
  }
  // Its own secret works; the other channel's opener uses its own.
  grpc::Status s = Fetch(ch, 0).get();
  EXPECT_TRUE(s.ok()) << s.error_message();
  s = Fetch(other, 0).get();
  EXPECT_TRUE(s.ok()) << s.error_message();
  absl::MutexLock lock(&c.mu);
  EXPECT_EQ(c.sends.size(), 2u);
}

}  // namespace
}  // namespace testing
}  // namespace paramd
