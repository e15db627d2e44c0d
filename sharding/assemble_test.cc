#include "sharding/assemble.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/format.h"
#include "kernels/reference.h"
#include "sharding/plan.h"

namespace paramd {
namespace sharding {
namespace {

struct Variant {
  std::string name;
  QuantSpec spec;
};

void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

std::vector<Variant> Variants() {
  std::vector<Variant> v;
  for (Format f :
       {Format::kIdentityBf16, Format::kIdentityFp32, Format::kFp8Delayed, Format::kFp8Current,
        Format::kMxfp8, Format::kNvfp4, Format::kFp8Block128x128, Format::kFp8Block1x128}) {
    v.push_back({std::string(FormatName(f)), DefaultQuantSpec(f)});
  }
  Variant mx2d{"mxfp8_2d", DefaultQuantSpec(Format::kMxfp8)};
  mx2d.spec.two_d = true;
  Variant nv1d{"nvfp4_1d", DefaultQuantSpec(Format::kNvfp4)};
  nv1d.spec.two_d = false;
  Variant e5m2{"fp8_current_e5m2_pow2", DefaultQuantSpec(Format::kFp8Current)};
  e5m2.spec.fp8_type = Fp8Type::kE5M2;
  e5m2.spec.pow2_scales = true;
  Variant fp32_block{"fp8_block128x128_fp32_scales", DefaultQuantSpec(Format::kFp8Block128x128)};
  fp32_block.spec.pow2_scales = false;
  v.insert(v.end(), {mx2d, nv1d, e5m2, fp32_block});
  return v;
}

struct Shape {
  int64_t rows;
  int64_t cols;
  bool specials;  // NaN, Inf, -0, subnormals sprinkled in
};

const Shape kShapes[] = {
    {1, 1, false},    {1, 37, false},   {37, 1, false},   {128, 64, false}, {129, 17, false},
    {257, 33, false}, {300, 130, true}, {512, 48, false}, {641, 5, true},   {384, 256, false},
};

// Values whose magnitude changes from one 16-row band to the next, so that
// block scales differ between pieces.
std::vector<float> MakeSource(const Shape& shape, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v(shape.rows * shape.cols);
  for (int64_t i = 0; i < shape.rows; ++i) {
    const float band = std::ldexp(1.0f, static_cast<int>((i / 16) % 9) - 4);
    for (int64_t j = 0; j < shape.cols; ++j) v[i * shape.cols + j] = normal(rng) * band;
  }
  if (shape.specials) {
    const float specials[] = {std::numeric_limits<float>::quiet_NaN(), -0.0f,
                              std::numeric_limits<float>::infinity(), 1e-40f, -3e38f};
    for (size_t k = 0; k < 5; ++k) v[(rng() % v.size())] = specials[k];
  }
  return v;
}

TensorScaling ScalingFor(const QuantSpec& spec, const std::vector<float>& source) {
  if (spec.format == Format::kFp8Delayed) return TensorScaling{2.5f, 0.0f};
  return ref::ScalingFromAmax(spec, ref::Amax(source));
}

// Piece boundaries to try: shard plans for several daemon counts, every 128
// rows, and (where the format allows it) the finest legal split.
std::vector<std::vector<int64_t>> Splits(const Shape& shape, int64_t finest) {
  std::vector<std::vector<int64_t>> out;
  PlanOptions o;
  o.min_split_bytes = 0;
  for (int d : {1, 2, 3, 5}) {
    absl::StatusOr<ShardPlan> plan =
        MakeShardPlan({ManifestTensor{"w", shape.rows, shape.cols, 1.0}}, d, o);
    EXPECT_TRUE(plan.ok()) << plan.status();
    std::vector<int64_t> b;
    for (const Piece& p : plan->pieces) b.push_back(p.row_begin);
    b.push_back(shape.rows);
    out.push_back(b);
  }
  for (int64_t step : {int64_t{128}, finest}) {
    std::vector<int64_t> b;
    for (int64_t r = 0; r < shape.rows; r += step) b.push_back(r);
    b.push_back(shape.rows);
    out.push_back(b);
  }
  return out;
}

std::string Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return absl::StrCat(absl::Hex(u, absl::kZeroPad8));
}

class AssembleTest : public ::testing::TestWithParam<std::tuple<Variant, Direction>> {};

TEST_P(AssembleTest, AssembledPiecesEqualWholeTensorQuantization) {
  const QuantSpec& spec = std::get<0>(GetParam()).spec;
  const Direction dir = std::get<1>(GetParam());
  const int64_t finest = std::max<int64_t>(RequiredRowAlignment(spec, dir), 16);
  uint32_t seed = 1;
  for (const Shape& shape : kShapes) {
    const std::vector<float> source = MakeSource(shape, seed++);
    const TensorScaling scaling = ScalingFor(spec, source);
    absl::StatusOr<QuantizedTensor> whole =
        ref::Quantize(source, shape.rows, shape.cols, spec, dir, scaling);
    ASSERT_TRUE(whole.ok()) << whole.status();
    for (const std::vector<int64_t>& bounds : Splits(shape, finest)) {
      SCOPED_TRACE(absl::StrCat("shape [", shape.rows, ", ", shape.cols, "] pieces at ",
                                absl::StrJoin(bounds, ",")));
      std::vector<QuantizedTensor> pieces;
      for (size_t i = 0; i + 1 < bounds.size(); ++i) {
        const int64_t r0 = bounds[i], r1 = bounds[i + 1];
        absl::StatusOr<QuantizedTensor> piece = ref::Quantize(
            absl::MakeConstSpan(source).subspan(r0 * shape.cols, (r1 - r0) * shape.cols), r1 - r0,
            shape.cols, spec, dir, scaling);
        ASSERT_TRUE(piece.ok()) << piece.status();
        // The inverse: the whole tensor's bytes of these rows are the piece.
        absl::StatusOr<QuantizedTensor> split = Split(spec, *whole, r0, r1);
        ASSERT_TRUE(split.ok()) << split.status();
        EXPECT_EQ(split->rows, r1 - r0);
        EXPECT_EQ(split->data, piece->data) << "split data of rows " << r0;
        EXPECT_EQ(split->scales, piece->scales) << "split scales of rows " << r0;
        EXPECT_EQ(Bits(split->scale_inv), Bits(piece->scale_inv));
        pieces.push_back(*std::move(piece));
      }
      absl::StatusOr<QuantizedTensor> assembled = Assemble(spec, pieces);
      ASSERT_TRUE(assembled.ok()) << assembled.status();
      EXPECT_EQ(assembled->rows, shape.rows);
      EXPECT_EQ(assembled->cols, shape.cols);
      EXPECT_EQ(assembled->format, whole->format);
      EXPECT_EQ(assembled->direction, dir);
      EXPECT_EQ(assembled->data, whole->data);
      EXPECT_EQ(assembled->scales, whole->scales);
      EXPECT_EQ(Bits(assembled->scale_inv), Bits(whole->scale_inv));
      EXPECT_EQ(Bits(assembled->amax), Bits(whole->amax));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllFormats, AssembleTest,
                         ::testing::Combine(::testing::ValuesIn(Variants()),
                                            ::testing::Values(Direction::kRowwise,
                                                              Direction::kColumnwise)),
                         [](const ::testing::TestParamInfo<AssembleTest::ParamType>& info) {
                           return absl::StrCat(std::get<0>(info.param).name, "_",
                                               DirectionName(std::get<1>(info.param)));
                         });

TEST(PlacePieceTest, TransposedFp8IsAColumnBlock) {
  // W[4, 3] per-tensor FP8 columnwise is [3][4]; rows [2, 4) are bytes 2..3
  // of each of the 3 rows.
  absl::StatusOr<PiecePlacement> pl =
      PlacePiece(DefaultQuantSpec(Format::kFp8Current), Direction::kColumnwise, 4, 3, 2, 4);
  ASSERT_TRUE(pl.ok()) << pl.status();
  EXPECT_EQ(pl->data.full_offset, 2);
  EXPECT_EQ(pl->data.full_pitch, 4);
  EXPECT_EQ(pl->data.piece_pitch, 2);
  EXPECT_EQ(pl->data.width, 2);
  EXPECT_EQ(pl->data.height, 3);
  EXPECT_EQ(pl->scales.bytes(), 0);
}

TEST(PlacePieceTest, Nvfp4ColumnwiseScalesAreAColumnBlock) {
  // W[300, 40]: columnwise scales [roundup(40,128)=128][roundup(19,4)=20];
  // rows [256, 300) own scale columns 16..18 (3 valid of the piece's 4).
  absl::StatusOr<PiecePlacement> pl =
      PlacePiece(DefaultQuantSpec(Format::kNvfp4), Direction::kColumnwise, 300, 40, 256, 300);
  ASSERT_TRUE(pl.ok()) << pl.status();
  EXPECT_EQ(pl->scales.full_offset, 16);
  EXPECT_EQ(pl->scales.full_pitch, 20);
  EXPECT_EQ(pl->scales.piece_pitch, 4);
  EXPECT_EQ(pl->scales.width, 3);
  EXPECT_EQ(pl->scales.height, 128);
  // Data [40][150]: the piece's 22 bytes start at byte 128 of each row.
  EXPECT_EQ(pl->data.full_offset, 128);
  EXPECT_EQ(pl->data.width, 22);
  EXPECT_EQ(pl->data.height, 40);
}

TEST(PlacePieceTest, RejectsMisalignedAndOutOfRangePieces) {
  const QuantSpec block = DefaultQuantSpec(Format::kFp8Block128x128);
  EXPECT_EQ(PlacePiece(block, Direction::kRowwise, 300, 8, 100, 300).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlacePiece(block, Direction::kRowwise, 300, 8, 0, 100).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(PlacePiece(block, Direction::kRowwise, 300, 8, 256, 300).ok());
  EXPECT_EQ(PlacePiece(block, Direction::kRowwise, 300, 8, 0, 301).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlacePiece(block, Direction::kRowwise, 300, 8, 128, 128).status().code(),
            absl::StatusCode::kInvalidArgument);
  // 1x128 rowwise blocks run along K: any row boundary is fine.
  EXPECT_TRUE(
      PlacePiece(DefaultQuantSpec(Format::kFp8Block1x128), Direction::kRowwise, 300, 8, 7, 9).ok());
  EXPECT_EQ(RequiredRowAlignment(DefaultQuantSpec(Format::kNvfp4), Direction::kRowwise), 16);
}

TEST(AssembleErrorsTest, RefusesInconsistentPieces) {
  const QuantSpec spec = DefaultQuantSpec(Format::kFp8Current);
  const Shape shape{256, 8, false};
  const std::vector<float> source = MakeSource(shape, 3);
  std::vector<QuantizedTensor> pieces;
  for (int64_t r0 : {0, 128}) {
    absl::StatusOr<QuantizedTensor> q =
        ref::Quantize(absl::MakeConstSpan(source).subspan(r0 * 8, 128 * 8), 128, 8, spec,
                      Direction::kColumnwise, ref::ScalingFromAmax(spec, 1.0f + r0));
    ASSERT_TRUE(q.ok());
    pieces.push_back(*q);
  }
  // Each piece used its own scale: refused, never silently mixed.
  EXPECT_EQ(Assemble(spec, pieces).status().code(), absl::StatusCode::kInvalidArgument);
  pieces[1].scale_inv = pieces[0].scale_inv;
  EXPECT_TRUE(Assemble(spec, pieces).ok());
  pieces[1].data.pop_back();
  EXPECT_EQ(Assemble(spec, pieces).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Assemble(spec, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Assemble(DefaultQuantSpec(Format::kMxfp8), {pieces[0]}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace sharding
}  // namespace paramd
