#include "server/snapshot/shard_set_adapter.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "checkpoint/daemon_io.h"
#include "checkpoint/store.h"
#include "checkpoint/test_util.h"
#include "gtest/gtest.h"
#include "kernels/format.h"
#include "kernels/reference.h"

namespace paramd {
namespace checkpoint {
namespace {

bool SameBytes(absl::Span<const float> a, absl::Span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// One daemon holding rows [64, 200) of "w" (FP8 delayed rowwise, MXFP8
// columnwise) and all of "b" (BF16), after two AdamW steps.
std::unique_ptr<ShardSet> SteppedShardSet(OptimizerKind kind) {
  TensorDef w{"w", 200, 48, {}};
  w.spec.rowwise = DefaultQuantSpec(Format::kFp8Delayed);
  w.spec.rowwise.amax_history_len = 8;
  w.spec.columnwise = DefaultQuantSpec(Format::kMxfp8);
  TensorDef b{"b", 1, 33, {}};
  OptimizerOptions opt;
  opt.kind = kind;
  opt.momentum = 0.9f;
  auto set = ShardSet::Create({w, b}, {{0, 64, 200}, {1, 0, 1}}, opt);
  EXPECT_TRUE(set.ok()) << set.status();
  std::mt19937 rng(7);
  std::normal_distribution<float> dist;
  for (int s = 0; s < 2; ++s) {
    for (float& x : (*set)->master(s)) x = dist(rng);
  }
  auto no_reduce = [](absl::Span<float>) { return absl::OkStatus(); };
  EXPECT_TRUE((*set)->Step(0, false, no_reduce).ok());
  for (int64_t v = 1; v <= 2; ++v) {
    for (int s = 0; s < 2; ++s) {
      for (float& g : (*set)->gradient(s)) g = dist(rng) * 0.1f;
    }
    EXPECT_TRUE((*set)->Step(v, true, no_reduce).ok());
  }
  return *std::move(set);
}

TEST(ShardSetAdapterTest, CheckpointHoldsTheShardSetExactly) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kSgd}) {
    auto set = SteppedShardSet(kind);
    auto no_reduce = [](absl::Span<float>) { return absl::OkStatus(); };
    auto published = set->Step(3, false, no_reduce);  // republish, state as is
    ASSERT_TRUE(published.ok()) << published.status();
    DaemonStateView view = MakeDaemonStateView(*set, **published);
    EXPECT_EQ(view.version, 3);
    ASSERT_EQ(view.pieces.size(), 2u);

    auto store = CheckpointStore::Open(testing::MakeTestDir("adapter"), true);
    auto info = WriteDaemonShard(*store, 0, 1, view);
    ASSERT_TRUE(info.ok()) << info.status();
    // Rows 0..64 of "w" belong to another daemon (a manifest of this file
    // alone would be refused): read the shard file directly.
    auto file = ShardFileReader::Open(store->VersionDir(3) + "/" + info->name());
    ASSERT_TRUE(file.ok()) << file.status();
    const std::vector<std::string> moments = MomentNames(kind);
    int rows_sections = 0;
    for (const Section& section : file->get()->index().sections()) {
      if (section.kind() != Section::ROWS) continue;
      ++rows_sections;
      const int s = section.tensor() == "w" ? 0 : 1;
      std::vector<float> got((section.row_end() - section.row_begin()) * section.cols());
      ASSERT_TRUE(
          file->get()
              ->ReadRows(section, section.row_begin(), section.row_end(), absl::MakeSpan(got))
              .ok());
      absl::Span<const float> want;
      if (section.name() == "master") want = set->master(s);
      if (section.name() == moments[0]) want = set->optimizer_state(s).m;
      if (moments.size() > 1 && section.name() == moments[1]) want = set->optimizer_state(s).v;
      EXPECT_TRUE(SameBytes(got, want)) << section.tensor() << "/" << section.name();
    }
    EXPECT_EQ(rows_sections, 2 * (1 + static_cast<int>(moments.size())));

    const TensorState& w_state = view.tensor_states.at("w");
    EXPECT_EQ(w_state.optimizer_step(), 2);
    const DelayedScalingState& delayed = set->delayed_state(0, Direction::kRowwise);
    ASSERT_EQ(w_state.rowwise().amax_history_size(), 8);
    EXPECT_TRUE(SameBytes(w_state.rowwise().amax_history(), delayed.amax_history));
    EXPECT_EQ(w_state.rowwise().scale(), delayed.scale);
    // The exact multiplier version 3 was cast with, beside its rcp.
    const TensorScalingInfo& cast = (*published)->tensors[0];
    EXPECT_EQ(w_state.rowwise().cast_scale(), cast.rowwise_scale);
    EXPECT_EQ(w_state.rowwise().scale_inv(), 1.0f / cast.rowwise_scale);
    // The steps recorded amaxes (the history is not all zeros).
    EXPECT_TRUE(std::any_of(delayed.amax_history.begin(), delayed.amax_history.end(),
                            [](float a) { return a != 0.0f; }));

    OptimizerOptions decoded;
    ASSERT_TRUE(DecodeOptimizerOptions(view.daemon_blob, &decoded).ok()) << view.daemon_blob;
    EXPECT_EQ(decoded.kind, kind);
    EXPECT_EQ(decoded.momentum, 0.9f);
    EXPECT_EQ(EncodeOptimizerOptions(decoded), view.daemon_blob);
  }
  OptimizerOptions ignored;
  EXPECT_FALSE(DecodeOptimizerOptions("kind=adamw lr=zz", &ignored).ok());
}

TEST(ShardSetAdapterTest, ReadPublishedRowsDequantizesTheDirection) {
  auto set = SteppedShardSet(OptimizerKind::kAdamW);
  auto no_reduce = [](absl::Span<float>) { return absl::OkStatus(); };
  auto published = set->Step(3, false, no_reduce);
  ASSERT_TRUE(published.ok());
  std::vector<float> out((150 - 100) * 48);
  ASSERT_TRUE(ReadPublishedRows(*set, **published, ExportValuesKind::kMaster, "w", 100, 150,
                                absl::MakeSpan(out))
                  .ok());
  EXPECT_TRUE(SameBytes(out, set->master(0).subspan((100 - 64) * 48, out.size())));
  for (ExportValuesKind kind : {ExportValuesKind::kRowwise, ExportValuesKind::kColumnwise}) {
    ASSERT_TRUE(
        ReadPublishedRows(*set, **published, kind, "w", 100, 150, absl::MakeSpan(out)).ok());
    const Direction d =
        kind == ExportValuesKind::kRowwise ? Direction::kRowwise : Direction::kColumnwise;
    const PublishedPiece* piece = nullptr;
    for (const PublishedPiece& p : (*published)->pieces) {
      if (p.shard == 0 && p.direction == d) piece = &p;
    }
    ASSERT_NE(piece, nullptr);
    const TensorDef& def = set->tensors()[0];
    auto all = ref::Dequantize(piece->q,
                               d == Direction::kRowwise ? def.spec.rowwise : def.spec.columnwise);
    ASSERT_TRUE(all.ok());
    EXPECT_TRUE(SameBytes(out, absl::MakeConstSpan(*all).subspan((100 - 64) * 48, out.size())));
    EXPECT_FALSE(SameBytes(out, set->master(0).subspan((100 - 64) * 48, out.size())));
  }
  EXPECT_TRUE(absl::IsNotFound(ReadPublishedRows(*set, **published, ExportValuesKind::kMaster, "w",
                                                 0, 10, absl::MakeSpan(out))));
  EXPECT_TRUE(absl::IsNotFound(ReadPublishedRows(*set, **published, ExportValuesKind::kMaster,
                                                 "nope", 0, 1, absl::MakeSpan(out))));
}

}  // namespace
}  // namespace checkpoint
}  // namespace paramd
