// Restore of delayed scaling must republish version V with the exact scale V
// was cast with. A checkpoint that kept only scale_inv = rcp(scale) would
// give rcp(rcp(scale)), which differs from scale by one ulp for some
// scales; this test picks such a scale (through the tensor's amax) and
// values whose FP8 codes differ between the two scales, checkpoints V = 1
// on two daemon processes and restores it on fresh processes started with
// --restore_from: the republished V must be byte-identical (data, scale_inv)
// in both directions, and equal the CPU reference cast with the exact scale.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/format.h"
#include "kernels/reference.h"
#include "proto/checkpoint_service.grpc.pb.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {
namespace {

constexpr int64_t kRows = 256;
constexpr int64_t kCols = 64;
constexpr char kRecipe[] = R"txt(
  default_spec {
    rowwise { format: FP8_DELAYED amax_history_len: 4 }
    columnwise { format: FP8_DELAYED amax_history_len: 4 }
    source_dtype: FP32
  })txt";

uint32_t Bits(float f) { return absl::bit_cast<uint32_t>(f); }
float FromBits(uint32_t b) { return absl::bit_cast<float>(b); }

// What the server's delayed update computes from amax `a` (E4M3, margin 0).
float DelayedScaleFor(float a) { return 448.0f / a; }
// What a checkpoint holding only scale_inv gives back.
float RoundTripped(float scale) {
  volatile float inv = 1.0f / scale;
  return 1.0f / inv;
}

struct Model {
  float amax = 0;
  float scale = 0;  // the exact cast scale of every version after v0
  std::vector<float> values;
  int sensitive = 0;  // values whose E4M3 code differs between the two scales
};

// An amax whose delayed scale does not survive rcp(rcp(.)), element 0 = amax,
// then values x near x * scale = an E4M3 rounding midpoint that round
// differently with the round-tripped scale, then small filler.
Model MakeModel() {
  Model m;
  for (uint32_t k = 1; k < 100000; ++k) {
    const float a = FromBits(Bits(1.75f) + k * 7919u);
    if (RoundTripped(DelayedScaleFor(a)) != DelayedScaleFor(a)) {
      m.amax = a;
      break;
    }
  }
  m.scale = DelayedScaleFor(m.amax);
  const float other = RoundTripped(m.scale);
  m.values.assign(kRows * kCols, 0.0f);
  m.values[0] = m.amax;
  size_t next = 1;
  // E4M3 midpoints between consecutive normal codes in [16, 448).
  for (int e = 4; e <= 8 && next < m.values.size() / 2; ++e) {
    for (int q = 0; q < 8; ++q) {
      const float mid = std::ldexp(1.0f + (q + 0.5f) / 8.0f, e);
      if (mid >= 448.0f) break;
      for (float sign : {1.0f, -1.0f}) {
        const float x0 = sign * mid / m.scale;
        for (int d = -3; d <= 3; ++d) {
          const float x = FromBits(Bits(x0) + d);
          if (std::fabs(x) >= m.amax) continue;
          if (ref::EncodeFp8(x * m.scale, Fp8Type::kE4M3) !=
              ref::EncodeFp8(x * other, Fp8Type::kE4M3)) {
            m.values[next++] = x;
            ++m.sensitive;
          }
        }
      }
    }
  }
  const std::vector<float> filler = RandomValues(m.values.size(), 5, 0.02f);
  for (size_t i = next; i < m.values.size(); ++i) m.values[i] = filler[i];
  return m;
}

TestClusterOptions Options(const std::string& checkpoint_dir, const std::string& restore_from) {
  TestClusterOptions o;
  o.daemons = 2;
  o.expected_pushers = 1;
  o.optimizer = "sgd";
  o.lr = 0.5;
  o.coordinator_flags = {"--checkpoint_dir=" + checkpoint_dir};
  o.daemon_flags = {"--checkpoint_dir=" + checkpoint_dir};
  if (!restore_from.empty()) o.coordinator_flags.push_back("--restore_from=" + restore_from);
  return o;
}

TEST(CheckpointDelayedScaleTest, RestoreRepublishesWithTheExactCastScale) {
  const Model model = MakeModel();
  std::printf(
      "amax %.9g (0x%08x): scale %.9g (0x%08x), rcp(rcp(scale)) 0x%08x; %d sensitive "
      "values\n",
      model.amax, Bits(model.amax), model.scale, Bits(model.scale), Bits(RoundTripped(model.scale)),
      model.sensitive);
  ASSERT_NE(Bits(RoundTripped(model.scale)), Bits(model.scale));
  ASSERT_GT(model.sensitive, 4);
  // The reference casts with the two scales differ (else this test could
  // not see a one-ulp difference).
  HybridSpec spec;
  spec.rowwise = DefaultQuantSpec(Format::kFp8Delayed);
  spec.rowwise.source_dtype = SourceDtype::kFp32;
  for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
    auto exact = ref::Quantize(model.values, kRows, kCols, spec.rowwise, d, {model.scale, 0});
    auto off =
        ref::Quantize(model.values, kRows, kCols, spec.rowwise, d, {RoundTripped(model.scale), 0});
    ASSERT_TRUE(exact.ok() && off.ok());
    ASSERT_NE(exact->data, off->data) << DirectionName(d);
  }

  absl::StatusOr<demo::TempDir> ckpt = demo::TempDir::Create("paramd_delayed_ckpt");
  ASSERT_TRUE(ckpt.ok());
  std::vector<QuantizedTensor> v1(2);
  {
    absl::StatusOr<std::unique_ptr<RawCluster>> c = RawCluster::Start(Options(ckpt->path(), ""));
    ASSERT_TRUE(c.ok()) << c.status();
    RawCluster& a = **c;
    const std::string path = a.cluster().dir() + "/model.safetensors";
    ASSERT_TRUE(WriteModel(path, {{"w", {kRows, kCols}, model.values}}).ok());
    ASSERT_TRUE(a.Load(path, kRecipe).ok()) << a.cluster().Logs();
    ASSERT_EQ(a.manifest().daemons_size(), 2);
    // v0 is cast with scale 1 and records the amax; a zero gradient keeps
    // the masters, so v1 is cast with 448 / amax.
    ASSERT_TRUE(a.PushAll(0, "trainer", {}).ok());
    ASSERT_TRUE(a.WaitForVersion(1).ok());
    for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
      absl::StatusOr<QuantizedTensor> q = a.FetchAssembled(1, "w", d);
      ASSERT_TRUE(q.ok()) << q.status();
      auto want = ref::Quantize(model.values, kRows, kCols, spec.rowwise, d, {model.scale, 0});
      ASSERT_TRUE(want.ok());
      ASSERT_TRUE(q->data == want->data) << "v1 before the checkpoint, " << DirectionName(d);
      v1[static_cast<int>(d)] = *std::move(q);
    }
    auto stub = checkpoint::CheckpointCoordinator::NewStub(
        grpc::CreateChannel(a.cluster().coordinator_address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    SetDeadline(context, absl::Seconds(30));
    checkpoint::CheckpointRequest request;
    request.set_version(1);
    checkpoint::CheckpointResponse response;
    const grpc::Status s = stub->Checkpoint(&context, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message() << a.cluster().Logs();
  }
  // Fresh processes restore v1 at startup.
  absl::StatusOr<std::unique_ptr<RawCluster>> c =
      RawCluster::Start(Options(ckpt->path(), ckpt->path()));
  ASSERT_TRUE(c.ok()) << c.status();
  RawCluster& b = **c;
  absl::StatusOr<int64_t> restored = b.WaitForVersion(1);
  ASSERT_TRUE(restored.ok()) << restored.status() << b.cluster().Logs();
  ASSERT_EQ(*restored, 1);
  ASSERT_TRUE(b.RefreshManifest().ok());
  for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
    SCOPED_TRACE(DirectionName(d));
    absl::StatusOr<QuantizedTensor> q = b.FetchAssembled(1, "w", d);
    ASSERT_TRUE(q.ok()) << q.status();
    const QuantizedTensor& want = v1[static_cast<int>(d)];
    int differ = 0;
    for (size_t i = 0; i < want.data.size() && i < q->data.size(); ++i) {
      differ += want.data[i] != q->data[i];
    }
    EXPECT_EQ(q->data.size(), want.data.size());
    EXPECT_EQ(differ, 0) << "bytes of the republished v1 differ from the original";
    EXPECT_EQ(Bits(q->scale_inv), Bits(want.scale_inv));
    EXPECT_EQ(Bits(q->scale_inv), Bits(1.0f / model.scale));
  }
  // The run continues as it would have: v2 from a zero gradient is cast
  // with the same scale.
  ASSERT_TRUE(b.PushAll(1, "trainer", {}).ok());
  ASSERT_TRUE(b.WaitForVersion(2).ok());
  for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
    absl::StatusOr<QuantizedTensor> q = b.FetchAssembled(2, "w", d);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_TRUE(q->data == v1[static_cast<int>(d)].data) << "v2, " << DirectionName(d);
  }
}

}  // namespace
}  // namespace testing
}  // namespace paramd
