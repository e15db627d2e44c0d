#include "sharding/balance.h"

#include "gtest/gtest.h"
#include "kernels/format.h"

namespace paramd {
namespace sharding {
namespace {

HybridSpec Hybrid(Format row, Format col) {
  HybridSpec spec;
  spec.rowwise = DefaultQuantSpec(row);
  spec.columnwise = DefaultQuantSpec(col);
  return spec;
}

TEST(BalanceTest, CountsStatePlusBothVersionsOfEachDirection) {
  // 256 x 256 BF16 both ways: 16 + 2 * (2 + 2) = 24 bytes per element.
  absl::StatusOr<ManifestTensor> bf16 =
      ManifestEntry("w", 256, 256, Hybrid(Format::kIdentityBf16, Format::kIdentityBf16));
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ(bf16->name, "w");
  EXPECT_DOUBLE_EQ(bf16->bytes_per_element, 24.0);

  // MXFP8 rowwise: 1 byte + scales [256][8] = 1/32 per element; columnwise
  // FP8 per-tensor: 1 byte. 16 + 2 * (1 + 1/32 + 1).
  absl::StatusOr<ManifestTensor> mixed =
      ManifestEntry("m", 256, 256, Hybrid(Format::kMxfp8, Format::kFp8Current));
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  EXPECT_DOUBLE_EQ(mixed->bytes_per_element, 16.0 + 2 * (2.0 + 1.0 / 32));

  // A direction that is not published costs nothing.
  HybridSpec row_only = Hybrid(Format::kNvfp4, Format::kIdentityFp32);
  row_only.columnwise_usage = false;
  DaemonMemoryModel model;
  model.state_bytes_per_element = 0;
  model.published_versions = 1;
  absl::StatusOr<ManifestTensor> nvfp4 = ManifestEntry("n", 128, 128, row_only, model);
  ASSERT_TRUE(nvfp4.ok()) << nvfp4.status();
  // 0.5 byte data + [128][8] UE4M3 scales = 1/16 per element.
  EXPECT_DOUBLE_EQ(nvfp4->bytes_per_element, 0.5 + 1.0 / 16);
}

TEST(BalanceTest, RejectsBadShapesAndFreeTensors) {
  EXPECT_FALSE(ManifestEntry("w", 0, 4, HybridSpec()).ok());
  HybridSpec none;
  none.rowwise_usage = none.columnwise_usage = false;
  DaemonMemoryModel zero;
  zero.state_bytes_per_element = 0;
  EXPECT_FALSE(ManifestEntry("w", 4, 4, none, zero).ok());
  zero.published_versions = -1;
  EXPECT_FALSE(ManifestEntry("w", 4, 4, HybridSpec(), zero).ok());
}

}  // namespace
}  // namespace sharding
}  // namespace paramd
