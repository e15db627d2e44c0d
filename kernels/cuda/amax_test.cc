// Per-block partial amax on the GPU (ComputeBlockAmax) against the CPU
// reference's amax rule (ref::Amax over each block of ref::RoundToSource),
// bit for bit: every block shape a format uses, shapes that are not multiples
// of the blocks, FP32 and BF16 inputs (aligned and not), both source dtypes,
// NaN / Inf / -0 blocks, many tensors per call (more than one launch), with
// the output poisoned first and the gaps between tensors checked untouched.
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cuda/amax.h"
#include "kernels/cuda/test_util.h"
#include "kernels/format.h"
#include "kernels/reference.h"

namespace paramd {
namespace gpu {
namespace {

using testing::Bits;
using testing::Download;
using testing::FromBits;

testing::DeviceArena& Arena() { return testing::SharedArena(); }

constexpr uint32_t kPoison = 0xA5A5A5A5u;  // DeviceArena::Alloc's fill

// ref::Amax of every block of `source` (already rounded to the source dtype).
std::vector<float> RefBlockAmaxes(const std::vector<float>& source, int64_t M, int64_t K,
                                  AmaxBlockShape b) {
  if (b.per_tensor()) return {ref::Amax(source)};
  const int64_t gr = (M + b.block_rows - 1) / b.block_rows,
                gc = (K + b.block_cols - 1) / b.block_cols;
  std::vector<float> out;
  for (int64_t bi = 0; bi < gr; ++bi) {
    for (int64_t bj = 0; bj < gc; ++bj) {
      std::vector<float> vals;
      for (int64_t i = bi * b.block_rows; i < std::min(M, (bi + 1) * b.block_rows); ++i) {
        for (int64_t j = bj * b.block_cols; j < std::min(K, (bj + 1) * b.block_cols); ++j) {
          vals.push_back(source[i * K + j]);
        }
      }
      out.push_back(ref::Amax(vals));
    }
  }
  return out;
}

struct Case {
  std::string name;
  BlockAmaxArgs args;
  std::vector<float> want;
};

// Adds a tensor (uploaded with the input type / alignment given) to `cases`.
void AddCase(std::vector<Case>& cases, const std::vector<float>& master, int64_t M, int64_t K,
             AmaxBlockShape b, InputType in, SourceDtype sd, bool misalign,
             const std::string& what) {
  Case c;
  BlockAmaxArgs& a = c.args;
  a.rows = M;
  a.cols = K;
  a.blocks = b;
  a.input_type = in;
  a.source_dtype = sd;
  std::vector<float> values = master;
  if (in == InputType::kBf16) {
    std::vector<uint16_t> bits(master.size());
    for (size_t k = 0; k < master.size(); ++k) {
      bits[k] = ref::EncodeBf16(master[k]);
      values[k] = ref::DecodeBf16(bits[k]);
    }
    a.source = Arena().Upload(bits, misalign ? 2 : 0);
  } else {
    a.source = Arena().Upload(master, misalign ? 4 : 0);
  }
  c.want = RefBlockAmaxes(ref::RoundToSource(values, sd), M, K, b);
  c.name = absl::StrCat(what, " [", M, "x", K, "] blocks ", b.block_rows, "x", b.block_cols,
                        in == InputType::kBf16 ? " bf16-in" : " fp32-in",
                        sd == SourceDtype::kBf16 ? " src-bf16" : " src-fp32",
                        misalign ? " misaligned" : "");
  cases.push_back(std::move(c));
}

// Runs all cases in one ComputeBlockAmax call with a poisoned float between
// consecutive tensors' ranges, and checks every block and every gap.
void RunAndCheck(std::vector<Case>& cases) {
  int64_t next = 0;
  for (Case& c : cases) {
    c.args.offset = next;
    next += NumBlockAmaxes(c.args.rows, c.args.cols, c.args.blocks) + 1;  // + 1 gap float
  }
  float* out = static_cast<float*>(Arena().Alloc(4 * next));  // poisoned with 0xA5
  std::vector<BlockAmaxArgs> args;
  for (const Case& c : cases) args.push_back(c.args);
  ASSERT_TRUE(ComputeBlockAmax(args, out, next, nullptr).ok());
  PARAMD_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got = Download<float>(out, next);
  int64_t blocks = 0;
  for (const Case& c : cases) {
    const int64_t n = static_cast<int64_t>(c.want.size());
    ASSERT_EQ(n, NumBlockAmaxes(c.args.rows, c.args.cols, c.args.blocks)) << c.name;
    for (int64_t k = 0; k < n; ++k) {
      const float g = got[c.args.offset + k];
      ASSERT_EQ(Bits(g), Bits(c.want[k])) << c.name << " block " << k << ": got " << g << " (0x"
                                          << std::hex << Bits(g) << ") want " << c.want[k];
    }
    ASSERT_EQ(Bits(got[c.args.offset + n]), kPoison) << c.name << ": wrote past its range";
    blocks += n;
  }
  printf("block amax: %zu tensors, %lld blocks exact\n", cases.size(),
         static_cast<long long>(blocks));
}

const AmaxBlockShape kShapes[] = {{1, 16}, {16, 16}, {16, 1},  {1, 32},    {32, 32},
                                  {32, 1}, {1, 128}, {128, 1}, {128, 128}, {0, 0}};

TEST(BlockAmaxTest, FormatsBlockShapes) {
  struct Want {
    Format f;
    bool two_d;
    AmaxBlockShape row, col;
  };
  const Want wants[] = {
      {Format::kNvfp4, true, {16, 16}, {16, 16}},
      {Format::kNvfp4, false, {1, 16}, {16, 1}},
      {Format::kMxfp8, false, {1, 32}, {32, 1}},
      {Format::kMxfp8, true, {32, 32}, {32, 32}},
      {Format::kFp8Block128x128, false, {128, 128}, {128, 128}},
      {Format::kFp8Block1x128, false, {1, 128}, {128, 1}},
      {Format::kFp8Current, false, {0, 0}, {0, 0}},
      {Format::kFp8Delayed, false, {0, 0}, {0, 0}},
      {Format::kIdentityBf16, false, {0, 0}, {0, 0}},
  };
  for (const Want& w : wants) {
    QuantSpec s = DefaultQuantSpec(w.f);
    s.two_d = w.two_d;
    const AmaxBlockShape r = AmaxBlockShapeOf(s, Direction::kRowwise);
    const AmaxBlockShape c = AmaxBlockShapeOf(s, Direction::kColumnwise);
    EXPECT_EQ(r.block_rows, w.row.block_rows) << FormatName(w.f);
    EXPECT_EQ(r.block_cols, w.row.block_cols) << FormatName(w.f);
    EXPECT_EQ(c.block_rows, w.col.block_rows) << FormatName(w.f);
    EXPECT_EQ(c.block_cols, w.col.block_cols) << FormatName(w.f);
  }
  EXPECT_EQ(NumBlockAmaxes(130, 257, {16, 16}), 9 * 17);
  EXPECT_EQ(NumBlockAmaxes(130, 257, {0, 0}), 1);
  EXPECT_EQ(NumBlockAmaxes(1, 1, {128, 1}), 1);
}

// Every block shape x many shapes x input variants x value distributions
// (incl. NaN, +-Inf, -0, subnormals, near FLT_MAX), all in one call.
TEST(BlockAmaxTest, MatchesReferenceAllShapes) {
  Arena().Reset();
  std::mt19937_64 rng(17);
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1},     {1, 200},   {17, 33}, {128, 128},
                                                {130, 257}, {256, 384}, {300, 5}, {33, 130},
                                                {1000, 17}, {129, 1000}};
  std::vector<Case> cases;
  int v = 0;
  for (const auto& [M, K] : shapes) {
    for (const AmaxBlockShape& b : kShapes) {
      for (int variant = 0; variant < 3; ++variant, ++v) {
        const auto dist = testing::kAllDists[v % 3];
        const std::vector<float> master = testing::RandomMatrix(M, K, dist, rng);
        const InputType in = (v / 3) % 2 ? InputType::kBf16 : InputType::kFp32;
        const SourceDtype sd = (v / 6) % 2 ? SourceDtype::kFp32 : SourceDtype::kBf16;
        const bool misalign = (v / 12) % 2 == 1;
        AddCase(cases, master, M, K, b, in, sd, misalign, testing::DistName(dist));
      }
    }
  }
  ASSERT_GT(cases.size(), 256u);  // more than one launch
  RunAndCheck(cases);
}

// Blocks made of special values only: all NaN (-> +0), NaN and -Inf (-> Inf),
// all -0 (-> +0, not -0), one subnormal among NaNs, FLT_MAX that rounds to
// BF16 Inf under source dtype BF16.
TEST(BlockAmaxTest, SpecialBlocks) {
  Arena().Reset();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t M = 160, K = 160;
  std::vector<float> m(M * K, 0.5f);
  auto fill = [&](int64_t r0, int64_t c0, int64_t h, int64_t w, auto fn) {
    for (int64_t i = r0; i < std::min(M, r0 + h); ++i) {
      for (int64_t j = c0; j < std::min(K, c0 + w); ++j) m[i * K + j] = fn(i, j);
    }
  };
  fill(0, 0, 32, 32,
       [&](int64_t i, int64_t j) { return (i + j) % 2 ? nan : FromBits(0xFFC01234u); });
  fill(32, 0, 32, 32, [&](int64_t i, int64_t j) { return i == 40 && j == 3 ? -inf : nan; });
  fill(0, 32, 32, 32, [&](int64_t, int64_t) { return -0.0f; });
  fill(32, 32, 32, 32,
       [&](int64_t i, int64_t j) { return i == 33 && j == 60 ? -FromBits(0x00000003u) : nan; });
  fill(64, 64, 16, 16, [&](int64_t, int64_t) { return -std::numeric_limits<float>::max(); });
  fill(128, 128, 32, 32, [&](int64_t, int64_t) { return nan; });  // edge tile, ragged
  std::vector<Case> cases;
  for (const AmaxBlockShape& b : kShapes) {
    for (InputType in : {InputType::kFp32, InputType::kBf16}) {
      for (SourceDtype sd : {SourceDtype::kBf16, SourceDtype::kFp32}) {
        AddCase(cases, m, M, K, b, in, sd, false, "special");
      }
    }
  }
  RunAndCheck(cases);
  // The all-NaN and all -0 blocks give +0 (bits 0) in the 32x32 grid.
  const std::vector<float> w = RefBlockAmaxes(m, M, K, {32, 32});
  EXPECT_EQ(Bits(w[0]), 0u);
  EXPECT_EQ(Bits(w[1]), 0u);
  EXPECT_EQ(w[5], inf);
}

TEST(BlockAmaxTest, RejectsBadArguments) {
  Arena().Reset();
  float* src = static_cast<float*>(Arena().Alloc(4 * 64));
  float* out = static_cast<float*>(Arena().Alloc(4 * 64));
  BlockAmaxArgs a;
  a.source = src;
  a.rows = 8;
  a.cols = 8;
  a.blocks = {1, 16};
  EXPECT_TRUE(ComputeBlockAmax({a}, out, 8, nullptr).ok());
  BlockAmaxArgs bad = a;
  bad.blocks = {1, 1};
  EXPECT_EQ(ComputeBlockAmax({bad}, out, 64, nullptr).code(), absl::StatusCode::kInvalidArgument);
  bad.blocks = {8, 16};
  EXPECT_EQ(ComputeBlockAmax({bad}, out, 64, nullptr).code(), absl::StatusCode::kInvalidArgument);
  bad = a;
  bad.offset = 60;  // 8 blocks from 60 leave a 64-float vector
  EXPECT_EQ(ComputeBlockAmax({bad}, out, 64, nullptr).code(), absl::StatusCode::kInvalidArgument);
  BlockAmaxArgs b2 = a;
  b2.offset = 7;  // overlaps a's [0, 8)
  EXPECT_EQ(ComputeBlockAmax({a, b2}, out, 64, nullptr).code(), absl::StatusCode::kInvalidArgument);
  bad = a;
  bad.rows = 0;
  EXPECT_EQ(ComputeBlockAmax({bad}, out, 64, nullptr).code(), absl::StatusCode::kInvalidArgument);
  std::vector<BlockAmaxArgs> packed = {a, a, a};
  packed[1].blocks = {0, 0};
  EXPECT_EQ(PackBlockAmaxOffsets(absl::MakeSpan(packed)), 8 + 1 + 8);
  EXPECT_EQ(packed[1].offset, 8);
  EXPECT_EQ(packed[2].offset, 9);
}

}  // namespace
}  // namespace gpu
}  // namespace paramd
