// The push routing DeviceFetcher::Push shares with Client::PushGradients
// (client::CheckPushGradients / client::PushRoutesTo), on a hand-made
// manifest: which rows, byte offsets and sizes each daemon gets, and the
// refusals. CPU only (no device memory is read: only sizes).
#include <cstdint>
#include <vector>

#include "client/client.h"
#include "gtest/gtest.h"

namespace paramd {
namespace client {
namespace {

Manifest TwoDaemons() {
  Manifest m;
  m.num_daemons = 2;
  m.daemon_addresses = {"d0:1", "d1:1"};
  TensorMeta w;
  w.name = "w";
  w.rows = 10;
  w.cols = 3;
  w.pieces = {{0, 6, 0, "d0:1"}, {6, 10, 1, "d1:1"}};
  TensorMeta b;
  b.name = "b";
  b.rows = 1;
  b.cols = 5;
  b.pieces = {{0, 1, 1, "d1:1"}};
  m.tensors = {w, b};
  return m;
}

// `n` bytes (routing reads only the size).
absl::Span<const uint8_t> Bytes(size_t n) {
  static const std::vector<uint8_t>* bytes = new std::vector<uint8_t>(256);
  return absl::MakeConstSpan(bytes->data(), n);
}

TEST(PushRoutes, RowsOffsetsAndSizesPerDaemon) {
  const Manifest m = TwoDaemons();
  const std::vector<Gradient> g = {{"b", Gradient::DType::kFp32, Bytes(5 * 4)},
                                   {"w", Gradient::DType::kBf16, Bytes(30 * 2)}};
  ASSERT_TRUE(CheckPushGradients(m, g, PushCoverage::kEveryTensor).ok());
  const std::vector<PushRoute> r0 = PushRoutesTo(m, 0, g);
  ASSERT_EQ(r0.size(), 1u);
  EXPECT_EQ(r0[0].gradient, 1);
  EXPECT_EQ(r0[0].row_begin, 0);
  EXPECT_EQ(r0[0].row_end, 6);
  EXPECT_EQ(r0[0].byte_offset, 0);
  EXPECT_EQ(r0[0].bytes, 6 * 3 * 2);
  const std::vector<PushRoute> r1 = PushRoutesTo(m, 1, g);
  // Manifest order (w, then b) whatever the gradients' order: a pipelined
  // daemon steps a tensor once the push has moved past it.
  ASSERT_EQ(r1.size(), 2u);
  EXPECT_EQ(r1[0].gradient, 1);
  EXPECT_EQ(r1[0].row_begin, 6);
  EXPECT_EQ(r1[0].row_end, 10);
  EXPECT_EQ(r1[0].byte_offset, 6 * 3 * 2);
  EXPECT_EQ(r1[0].bytes, 4 * 3 * 2);
  EXPECT_EQ(r1[1].gradient, 0);
  EXPECT_EQ(r1[1].byte_offset, 0);
  EXPECT_EQ(r1[1].bytes, 5 * 4);
  EXPECT_TRUE(PushRoutesTo(m, 2, g).empty());
}

TEST(PushRoutes, Refusals) {
  const Manifest m = TwoDaemons();
  auto check = [&](const std::vector<Gradient>& g) {
    return CheckPushGradients(m, g, PushCoverage::kPartial);
  };
  auto code = [&](const std::vector<Gradient>& g) { return check(g).code(); };
  EXPECT_EQ(code({{"nope", Gradient::DType::kFp32, Bytes(4)}}), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{"b", Gradient::DType::kBf16, Bytes(5 * 4)}}),  // BF16: 10 bytes
            absl::StatusCode::kInvalidArgument);
  // The message counts values and names the shape, not only bytes.
  EXPECT_EQ(check({{"b", Gradient::DType::kBf16, Bytes(5 * 4)}}).message(),
            "gradient of b has 10 values; expected 5 (1 x 5, BF16: 10 bytes)");
  EXPECT_EQ(check({{"b", Gradient::DType::kFp32, Bytes(7)}}).message(),
            "gradient of b has 7 bytes; expected 5 (1 x 5, FP32: 20 bytes)");
  EXPECT_EQ(
      code({{"b", Gradient::DType::kFp32, Bytes(20)}, {"b", Gradient::DType::kFp32, Bytes(20)}}),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckPushGradients(Manifest(), {}, PushCoverage::kPartial).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(check({}).ok());
}

// A push that leaves out tensors is refused, naming them, unless it says
// it is partial (the tensors left out then count as zero).
TEST(PushRoutes, MissingTensorsAreRefusedUnlessThePushIsPartial) {
  const Manifest m = TwoDaemons();
  const std::vector<Gradient> only_b = {{"b", Gradient::DType::kFp32, Bytes(5 * 4)}};
  const absl::Status missing = CheckPushGradients(m, only_b, PushCoverage::kEveryTensor);
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(missing.message(),
            "the push misses 1 of the model's 2 tensors: w; give every gradient of the step, or "
            "push as partial (the tensors left out then count as zero)");
  EXPECT_EQ(CheckPushGradients(m, {}, PushCoverage::kEveryTensor).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckPushGradients(m, only_b, PushCoverage::kPartial).ok());
}

}  // namespace
}  // namespace client
}  // namespace paramd
