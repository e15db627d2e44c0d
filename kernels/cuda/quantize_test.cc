// GPU quantization against the CPU reference, byte for byte (tag gpu).
//
// For every pair of (rowwise spec, columnwise spec) x columnwise source x
// source dtype x input type x value distribution, one QuantizeHybrid call
// quantizes a batch of tensors of many shapes (1x1, 1xN, Nx1, primes,
// non-multiples of 16/32/128) into poisoned buffers; data, scales (padding
// included), scale_inv and amax must equal ref::QuantizeHybrid exactly.
// Also: ColumnwiseSourceAmax, dequantization, device amax and scaling updates,
// and one 8192 x 16384 tensor per format.
#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/gpu_status.h"
#include "kernels/cuda/amax.h"
#include "kernels/cuda/dequantize.h"
#include "kernels/cuda/misc_launch.h"
#include "kernels/cuda/quantize.h"
#include "kernels/cuda/scaling.h"
#include "kernels/cuda/test_util.h"
#include "kernels/format.h"
#include "kernels/reference.h"

namespace paramd {
namespace gpu {
namespace {

using testing::Bits;
using testing::CompareBytes;
using testing::DeviceArena;
using testing::Dist;
using testing::Download;

struct NamedSpec {
  std::string name;
  QuantSpec spec;
};

std::vector<NamedSpec> CoreSpecs() {
  std::vector<NamedSpec> v;
  for (Format f :
       {Format::kIdentityBf16, Format::kIdentityFp32, Format::kFp8Delayed, Format::kFp8Current,
        Format::kMxfp8, Format::kNvfp4, Format::kFp8Block128x128, Format::kFp8Block1x128}) {
    v.push_back({std::string(FormatName(f)), DefaultQuantSpec(f)});
  }
  return v;
}

std::vector<NamedSpec> VariantSpecs() {
  std::vector<NamedSpec> v;
  QuantSpec s = DefaultQuantSpec(Format::kFp8Current);
  s.pow2_scales = true;
  v.push_back({"fp8_current_pow2", s});
  s = DefaultQuantSpec(Format::kFp8Current);
  s.fp8_type = Fp8Type::kE5M2;
  v.push_back({"fp8_current_e5m2", s});
  s = DefaultQuantSpec(Format::kFp8Delayed);
  s.fp8_type = Fp8Type::kE5M2;
  v.push_back({"fp8_delayed_e5m2", s});
  s = DefaultQuantSpec(Format::kMxfp8);
  s.two_d = true;
  v.push_back({"mxfp8_2d", s});
  s = DefaultQuantSpec(Format::kMxfp8);
  s.fp8_type = Fp8Type::kE5M2;
  v.push_back({"mxfp8_e5m2", s});
  s = DefaultQuantSpec(Format::kNvfp4);
  s.two_d = false;
  v.push_back({"nvfp4_1d", s});
  s = DefaultQuantSpec(Format::kFp8Block128x128);
  s.pow2_scales = false;
  v.push_back({"block128_fp32scale", s});
  s = DefaultQuantSpec(Format::kFp8Block1x128);
  s.pow2_scales = false;
  s.eps = 1e-3f;
  v.push_back({"block1x128_fp32scale_eps", s});
  return v;
}

struct Shape {
  int64_t rows, cols;
};
const std::vector<Shape>& Shapes() {
  static const auto* shapes =
      new std::vector<Shape>{{1, 1},   {1, 7},     {1, 128},   {1, 300},   {5, 1},     {129, 1},
                             {17, 33}, {31, 257},  {127, 129}, {128, 128}, {130, 250}, {200, 64},
                             {48, 80}, {256, 384}, {33, 1000}, {7, 16},    {64, 4}};
  return *shapes;
}

bool IsFp8PerTensor(Format f) { return f == Format::kFp8Delayed || f == Format::kFp8Current; }

// A delayed-scaling scale: what the history would give, off by a random power of 2.
float RandomDelayedScale(float amax, const QuantSpec& spec, std::mt19937_64& rng) {
  const float fmax = ref::Fp8Max(spec.fp8_type);
  float s = (std::isfinite(amax) && amax > 0) ? fmax / amax : 1.0f;
  if (!std::isfinite(s) || s == 0.0f) s = 1.0f;
  return s * std::ldexp(1.0f, static_cast<int>(rng() % 7) - 3);
}

ref::HybridScaling MakeScaling(const std::vector<float>& master, int64_t rows, int64_t cols,
                               const HybridSpec& h, std::mt19937_64& rng) {
  ref::HybridScaling sc;
  const std::vector<float> source = ref::RoundToSource(master, h.source_dtype);
  const float row_amax = ref::Amax(source);
  sc.rowwise = ref::ScalingFromAmax(h.rowwise, row_amax);
  if (h.rowwise.format == Format::kFp8Delayed)
    sc.rowwise.scale = RandomDelayedScale(row_amax, h.rowwise, rng);
  float col_amax = row_amax;
  if (h.columnwise_source == ColumnwiseSource::kRowwiseDequantized) {
    auto cs = ref::ColumnwiseSourceValues(master, rows, cols, h, sc.rowwise);
    col_amax = ref::Amax(*cs);
  }
  sc.columnwise = ref::ScalingFromAmax(h.columnwise, col_amax);
  if (h.columnwise.format == Format::kFp8Delayed) {
    sc.columnwise.scale = RandomDelayedScale(col_amax, h.columnwise, rng);
  }
  return sc;
}

struct DeviceOut {
  void* data = nullptr;
  void* scales = nullptr;
  float* scale_inv = nullptr;
  float* amax = nullptr;
  Layout layout;
};

// Everything one tensor of a batch needs on both sides.
struct TensorCase {
  Shape shape;
  std::vector<float> master;  // what the reference reads (BF16-exact for BF16 input)
  ref::HybridScaling scaling;
  QuantizeTensorArgs args;
  DeviceOut out[2];
  float* col_amax_dev = nullptr;
};

std::string CheckDirection(const TensorCase& tc, const HybridSpec& h, Direction dir,
                           const QuantizedTensor& want) {
  const int d = dir == Direction::kRowwise ? 0 : 1;
  const DeviceOut& o = tc.out[d];
  const QuantSpec& spec = d == 0 ? h.rowwise : h.columnwise;
  const std::string where = absl::StrCat(DirectionName(dir), " ", FormatName(spec.format), " [",
                                         tc.shape.rows, "x", tc.shape.cols, "]");
  std::vector<uint8_t> got = Download<uint8_t>(o.data, o.layout.data_bytes());
  if (spec.format == Format::kIdentityFp32) {
    // FORMATS.md D14 defines no canonical FP32 NaN, and the reference's NaN
    // payloads come from x86 arithmetic (e.g. 0 * Inf in a dequantized
    // rowwise copy): a NaN matches any NaN here; every other value must be
    // bit-identical.
    for (size_t i = 0; i + 4 <= got.size(); i += 4) {
      float g, w;
      std::memcpy(&g, &got[i], 4);
      std::memcpy(&w, &want.data[i], 4);
      if (std::isnan(g) && std::isnan(w)) std::memcpy(&got[i], &want.data[i], 4);
    }
  }
  std::string e = CompareBytes(where + " data", got, want.data, o.layout.data_row_bytes);
  if (!e.empty()) return e;
  e = CompareBytes(where + " scales", Download<uint8_t>(o.scales, o.layout.scale_bytes()),
                   want.scales, o.layout.scale_cols * o.layout.scale_elem_bytes);
  if (!e.empty()) return e;
  if (IsFp8PerTensor(spec.format)) {
    const float si = Download<float>(o.scale_inv, 1)[0];
    if (Bits(si) != Bits(want.scale_inv)) {
      return absl::StrCat(where, " scale_inv ", si, " != ", want.scale_inv);
    }
    const float am = Download<float>(o.amax, 1)[0];
    if (Bits(am) != Bits(want.amax)) return absl::StrCat(where, " amax ", am, " != ", want.amax);
  }
  return "";
}

// Runs one batch (all shapes) for one configuration; returns failures.
std::vector<std::string> RunBatch(DeviceArena& arena, const HybridSpec& h, InputType input,
                                  Dist dist, std::mt19937_64& rng,
                                  const std::vector<Shape>& shapes) {
  arena.Reset();
  std::vector<TensorCase> cases(shapes.size());
  std::vector<QuantizeTensorArgs> args;
  for (size_t n = 0; n < shapes.size(); ++n) {
    TensorCase& tc = cases[n];
    tc.shape = shapes[n];
    const int64_t M = tc.shape.rows, K = tc.shape.cols;
    tc.master = testing::RandomMatrix(M, K, dist, rng);
    QuantizeTensorArgs& a = tc.args;
    a.rows = M;
    a.cols = K;
    a.spec = h;
    a.input_type = input;
    const size_t src_mis = rng() % 3 == 0 ? (input == InputType::kBf16 ? 2 : 4) : 0;
    if (input == InputType::kBf16) {
      std::vector<uint16_t> bits(tc.master.size());
      for (size_t i = 0; i < bits.size(); ++i) {
        bits[i] = ref::EncodeBf16(tc.master[i]);
        tc.master[i] = ref::DecodeBf16(bits[i]);
      }
      a.source = arena.Upload(bits, src_mis);
    } else {
      a.source = arena.Upload(tc.master, src_mis);
    }
    tc.scaling = MakeScaling(tc.master, M, K, h, rng);
    a.rowwise_scaling.scale = arena.Scalar(tc.scaling.rowwise.scale);
    a.rowwise_scaling.global_amax = arena.Scalar(tc.scaling.rowwise.global_amax);
    a.columnwise_scaling.scale = arena.Scalar(tc.scaling.columnwise.scale);
    a.columnwise_scaling.global_amax = arena.Scalar(tc.scaling.columnwise.global_amax);
    for (int d = 0; d < 2; ++d) {
      const Direction dir = d == 0 ? Direction::kRowwise : Direction::kColumnwise;
      DeviceOut& o = tc.out[d];
      o.layout = *ComputeLayout(d == 0 ? h.rowwise : h.columnwise, dir, M, K);
      // Misaligned by one element now and then: exercises the scalar store paths.
      const Format f = (d == 0 ? h.rowwise : h.columnwise).format;
      const size_t elem = f == Format::kIdentityBf16 ? 2 : f == Format::kIdentityFp32 ? 4 : 1;
      const bool mis = rng() % 4 == 0;
      o.data = arena.Alloc(o.layout.data_bytes(), mis ? elem : 0);
      o.scales =
          arena.Alloc(o.layout.scale_bytes(), mis ? std::max(1, o.layout.scale_elem_bytes) : 0);
      o.scale_inv = static_cast<float*>(arena.Alloc(4));
      o.amax = arena.Scalar(0.0f);
      DirectionBuffers& b = d == 0 ? a.rowwise : a.columnwise;
      b.data = o.data;
      b.scales = o.layout.scale_bytes() > 0 ? o.scales : nullptr;
      b.scale_inv = o.scale_inv;
      b.amax = o.amax;
    }
    tc.col_amax_dev = arena.Scalar(0.0f);
    args.push_back(a);
  }
  std::vector<std::string> failures;
  absl::Status st = QuantizeHybrid(args, nullptr);
  if (st.ok()) st = GPU_STATUS(cudaDeviceSynchronize());
  if (!st.ok()) {
    failures.push_back(std::string(st.message()));
    return failures;
  }
  std::vector<float*> col_amax;
  for (TensorCase& tc : cases) col_amax.push_back(tc.col_amax_dev);
  st = ColumnwiseSourceAmax(args, col_amax, nullptr);
  if (!st.ok()) failures.push_back(absl::StrCat("ColumnwiseSourceAmax: ", st.message()));
  for (TensorCase& tc : cases) {
    auto want = ref::QuantizeHybrid(tc.master, tc.shape.rows, tc.shape.cols, h, tc.scaling);
    if (!want.ok()) {
      failures.push_back(absl::StrCat("reference failed: ", want.status().message()));
      continue;
    }
    if (h.rowwise_usage) {
      std::string e = CheckDirection(tc, h, Direction::kRowwise, *want->rowwise);
      if (!e.empty()) failures.push_back(e);
    }
    if (h.columnwise_usage) {
      std::string e = CheckDirection(tc, h, Direction::kColumnwise, *want->columnwise);
      if (!e.empty()) failures.push_back(e);
    }
    auto cs =
        ref::ColumnwiseSourceValues(tc.master, tc.shape.rows, tc.shape.cols, h, tc.scaling.rowwise);
    const float want_amax = ref::Amax(*cs);
    const float got_amax = Download<float>(tc.col_amax_dev, 1)[0];
    if (Bits(got_amax) != Bits(want_amax)) {
      failures.push_back(absl::StrCat("ColumnwiseSourceAmax [", tc.shape.rows, "x", tc.shape.cols,
                                      "]: ", got_amax, " != ", want_amax));
    }
  }
  return failures;
}

std::string ConfigName(const NamedSpec& r, const NamedSpec& c, const HybridSpec& h, InputType in,
                       Dist d) {
  return absl::StrCat(
      r.name, "+", c.name,
      h.columnwise_source == ColumnwiseSource::kOriginal ? " original" : " rowwise_dequantized",
      h.source_dtype == SourceDtype::kBf16 ? " src=bf16" : " src=fp32",
      in == InputType::kBf16 ? " in=bf16" : " in=fp32", h.rowwise_usage ? "" : " (no rowwise)",
      h.columnwise_usage ? "" : " (no columnwise)", " ", testing::DistName(d));
}

DeviceArena& Arena() { return testing::SharedArena(size_t{256} << 20); }

// Runs all configurations of one (row spec, col spec) pair.
void RunPair(const NamedSpec& r, const NamedSpec& c, bool all_configs, uint64_t seed) {
  std::mt19937_64 rng(seed);
  int configs = 0, failed = 0;
  for (ColumnwiseSource cs : {ColumnwiseSource::kOriginal, ColumnwiseSource::kRowwiseDequantized}) {
    for (SourceDtype sd : {SourceDtype::kBf16, SourceDtype::kFp32}) {
      for (InputType in : {InputType::kFp32, InputType::kBf16}) {
        if (!all_configs && in == InputType::kBf16 && sd == SourceDtype::kFp32) continue;
        for (Dist dist : testing::kAllDists) {
          for (int usage = 0; usage < (all_configs ? 3 : 1); ++usage) {
            HybridSpec h;
            h.rowwise = r.spec;
            h.columnwise = c.spec;
            h.columnwise_source = cs;
            h.source_dtype = sd;
            h.rowwise_usage = usage != 2;     // usage 2: columnwise only
            h.columnwise_usage = usage != 1;  // usage 1: rowwise only
            if (usage == 1 && cs == ColumnwiseSource::kRowwiseDequantized) continue;
            ++configs;
            auto failures = RunBatch(Arena(), h, in, dist, rng, Shapes());
            if (!failures.empty()) {
              ++failed;
              ADD_FAILURE() << ConfigName(r, c, h, in, dist) << ": " << failures.size()
                            << " failures; first: " << failures[0]
                            << (failures.size() > 1 ? "; second: " + failures[1] : "");
            }
          }
        }
      }
    }
  }
  printf("%s + %s: %d configurations, %d failed\n", r.name.c_str(), c.name.c_str(), configs,
         failed);
}

class CorePairTest : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(CorePairTest, BytesEqualReference) {
  const auto specs = CoreSpecs();
  const auto [ri, ci] = GetParam();
  RunPair(specs[ri], specs[ci], /*all_configs=*/ri == ci, 1000 + ri * 16 + ci);
}

std::vector<std::pair<int, int>> AllCorePairs() {
  std::vector<std::pair<int, int>> v;
  for (int r = 0; r < 8; ++r) {
    for (int c = 0; c < 8; ++c) v.push_back({r, c});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(AllPairs, CorePairTest, ::testing::ValuesIn(AllCorePairs()),
                         [](const ::testing::TestParamInfo<std::pair<int, int>>& info) {
                           const auto specs = CoreSpecs();
                           return specs[info.param.first].name + "_" +
                                  specs[info.param.second].name;
                         });

class VariantTest : public ::testing::TestWithParam<int> {};

TEST_P(VariantTest, BytesEqualReference) {
  const auto variants = VariantSpecs();
  const auto core = CoreSpecs();
  const NamedSpec& v = variants[GetParam()];
  RunPair(v, v, /*all_configs=*/true, 5000 + GetParam());
  // With a different format on the other side, both ways round.
  RunPair(v, core[4 + GetParam() % 4], false, 6000 + GetParam());
  RunPair(core[2 + GetParam() % 6], v, false, 7000 + GetParam());
}

INSTANTIATE_TEST_SUITE_P(Variants, VariantTest, ::testing::Range(0, 8),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return VariantSpecs()[info.param].name;
                         });

// More tensors than one launch holds, all in one call.
TEST(QuantizeBatching, ManyTensorsInOneCall) {
  std::vector<Shape> shapes;
  for (int i = 0; i < 97; ++i) shapes.push_back({1 + i * 7 % 150, 1 + i * 13 % 200});
  std::mt19937_64 rng(77);
  HybridSpec h;
  h.rowwise = DefaultQuantSpec(Format::kMxfp8);
  h.columnwise = DefaultQuantSpec(Format::kNvfp4);
  auto failures = RunBatch(Arena(), h, InputType::kFp32, Dist::kNormal, rng, shapes);
  EXPECT_TRUE(failures.empty()) << failures.size() << " failures; first: " << failures[0];
}

TEST(QuantizeValidation, RefusesBadArguments) {
  QuantizeTensorArgs a;
  a.rows = 4;
  a.cols = 4;
  EXPECT_EQ(QuantizeHybrid({a}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);  // null source
  float* src = Arena().Scalar(1.0f);
  a.source = src;
  a.spec.rowwise = DefaultQuantSpec(Format::kFp8Current);
  a.spec.columnwise_usage = false;
  a.rowwise.data = Arena().Alloc(16);
  EXPECT_EQ(QuantizeHybrid({a}, nullptr).code(), absl::StatusCode::kInvalidArgument);  // no scale
  a.rowwise_scaling.scale = Arena().Scalar(1.0f);
  EXPECT_TRUE(QuantizeHybrid({a}, nullptr).ok());
  a.spec.rowwise = DefaultQuantSpec(Format::kIdentityFp32);
  a.rowwise.data = static_cast<char*>(Arena().Alloc(80)) + 2;  // FP32 output, 2-byte aligned
  EXPECT_EQ(QuantizeHybrid({a}, nullptr).code(), absl::StatusCode::kInvalidArgument);
  a.rows = 0;
  EXPECT_EQ(QuantizeHybrid({a}, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

// ---- Element codecs, exhaustively on the device ----

TEST(CodecTest, ExhaustiveDeviceCodecsMatchReferenceRules) {
  Arena().Reset();
  constexpr int kN = detail::kCodecChecks;
  auto* counts = static_cast<unsigned long long*>(Arena().Alloc(8 * kN));
  auto* first = static_cast<unsigned*>(Arena().Alloc(4 * kN));
  PARAMD_CUDA_CHECK(cudaMemset(counts, 0, 8 * kN));
  PARAMD_CUDA_CHECK(cudaMemset(first, 0xFF, 4 * kN));
  ASSERT_EQ(detail::LaunchCodecCheck(counts, first, nullptr), cudaSuccess);
  PARAMD_CUDA_CHECK(cudaDeviceSynchronize());
  const auto c = Download<unsigned long long>(counts, kN);
  const auto f = Download<unsigned>(first, kN);
  const char* names[kN] = {
      "E4M3 cvt.rn.satfinite vs reference rule", "E5M2 cvt.rn.satfinite vs reference rule",
      "BF16 cvt.rn.bf16x2 vs reference rule",    "E2M1 FMA encoder vs compare encoder",
      "E2M1 compare encoder vs reference rule",  "E8M0 branch-free vs reference rule",
      "E2M1 v4 fast encoder vs compare encoder", "E2M1 packed x4 encoder vs compare encoder"};
  for (int k = 0; k < kN; ++k) {
    EXPECT_EQ(c[k], 0u) << names[k] << ": " << c[k] << " of 2^32 inputs differ, first 0x"
                        << std::hex << f[k];
    printf("codec check %-42s: %llu mismatches over 2^32 inputs\n", names[k], c[k]);
  }
}

// ---- Dequantize ----

TEST(DequantizeTest, EqualsReference) {
  std::mt19937_64 rng(99);
  std::vector<NamedSpec> specs = CoreSpecs();
  for (const NamedSpec& v : VariantSpecs()) specs.push_back(v);
  int checked = 0;
  for (const NamedSpec& ns : specs) {
    for (Direction dir : {Direction::kRowwise, Direction::kColumnwise}) {
      for (const Shape& shape : Shapes()) {
        for (Dist dist : testing::kAllDists) {
          Arena().Reset();
          const int64_t M = shape.rows, K = shape.cols;
          const auto source =
              ref::RoundToSource(testing::RandomMatrix(M, K, dist, rng), SourceDtype::kBf16);
          TensorScaling sc = ref::ScalingFromAmax(ns.spec, ref::Amax(source));
          if (ns.spec.format == Format::kFp8Delayed)
            sc.scale = RandomDelayedScale(ref::Amax(source), ns.spec, rng);
          auto q = ref::Quantize(source, M, K, ns.spec, dir, sc);
          ASSERT_TRUE(q.ok()) << q.status();
          auto want = ref::Dequantize(*q, ns.spec);
          ASSERT_TRUE(want.ok()) << want.status();
          DequantizeArgs a;
          a.spec = ns.spec;
          a.direction = dir;
          a.rows = M;
          a.cols = K;
          a.data = Arena().Upload(q->data);
          a.scales = q->scales.empty() ? nullptr : Arena().Upload(q->scales);
          a.scale_inv = Arena().Scalar(q->scale_inv);
          a.global_amax = Arena().Scalar(q->amax);
          float* out32 = static_cast<float*>(Arena().Alloc(4 * M * K));
          uint16_t* out16 = static_cast<uint16_t*>(Arena().Alloc(2 * M * K));
          a.out = out32;
          DequantizeArgs b = a;
          b.out = out16;
          b.output_type = OutputType::kBf16;
          ASSERT_TRUE(Dequantize({a, b}, nullptr).ok());
          const auto got32 = Download<float>(out32, M * K);
          const auto got16 = Download<uint16_t>(out16, M * K);
          for (int64_t i = 0; i < M * K; ++i) {
            const float w = (*want)[i];
            const bool same = std::isnan(w) ? std::isnan(got32[i]) : Bits(w) == Bits(got32[i]);
            ASSERT_TRUE(same) << ns.name << " " << DirectionName(dir) << " [" << M << "x" << K
                              << "] element " << i << ": " << got32[i] << " != " << w;
            ASSERT_EQ(got16[i], ref::EncodeBf16(w)) << ns.name << " bf16 element " << i;
          }
          ++checked;
        }
      }
    }
  }
  printf("dequantize: %d tensors checked\n", checked);
}

// ---- amax and scaling on the device ----

TEST(AmaxTest, MultiTensorExact) {
  std::mt19937_64 rng(5);
  for (int round = 0; round < 6; ++round) {
    Arena().Reset();
    std::vector<AmaxArgs> args;
    std::vector<float> want;
    for (int i = 0; i < 300; ++i) {
      const int64_t n = i % 50 == 0 ? 1000003 : 1 + static_cast<int64_t>(rng() % 5000);
      const auto v = testing::RandomMatrix(1, n, testing::kAllDists[rng() % 3], rng);
      AmaxArgs a;
      a.count = n;
      a.source_dtype = rng() % 2 ? SourceDtype::kBf16 : SourceDtype::kFp32;
      a.input_type = round % 2 ? InputType::kBf16 : InputType::kFp32;
      std::vector<float> vals = v;
      if (a.input_type == InputType::kBf16) {
        std::vector<uint16_t> bits(n);
        for (int64_t k = 0; k < n; ++k) {
          bits[k] = ref::EncodeBf16(v[k]);
          vals[k] = ref::DecodeBf16(bits[k]);
        }
        a.source = Arena().Upload(bits, rng() % 2 ? 2 : 0);
      } else {
        a.source = Arena().Upload(v, rng() % 2 ? 4 : 0);
      }
      a.amax = static_cast<float*>(Arena().Alloc(4));
      args.push_back(a);
      want.push_back(ref::Amax(ref::RoundToSource(vals, a.source_dtype)));
    }
    ASSERT_TRUE(ComputeAmax(args, nullptr, /*zero_first=*/true).ok());
    for (size_t i = 0; i < args.size(); ++i) {
      const float got = Download<float>(args[i].amax, 1)[0];
      ASSERT_EQ(Bits(got), Bits(want[i])) << "tensor " << i << ": " << got << " != " << want[i];
    }
  }
}

TEST(ScalingTest, CurrentScalingMatchesComputeScale) {
  std::mt19937_64 rng(6);
  std::vector<float> amaxes = {0.0f,         1e-45f,  1e-40f,
                               1e-38f,       1.0f,    448.0f,
                               3e38f,        FLT_MAX, std::numeric_limits<float>::infinity(),
                               std::nanf("")};
  for (int i = 0; i < 200; ++i)
    amaxes.push_back(testing::FromBits(static_cast<uint32_t>(rng()) & 0x7FFFFFFFu));
  for (const NamedSpec& ns : {NamedSpec{"e4m3", DefaultQuantSpec(Format::kFp8Current)},
                              VariantSpecs()[0], VariantSpecs()[1]}) {
    for (float eps : {0.0f, 1e-3f}) {
      Arena().Reset();
      QuantSpec spec = ns.spec;
      spec.eps = eps;
      std::vector<CurrentScalingArgs> args;
      for (float a : amaxes) {
        CurrentScalingArgs c;
        c.amax = Arena().Scalar(a);
        c.scale = static_cast<float*>(Arena().Alloc(4));
        c.scale_inv = static_cast<float*>(Arena().Alloc(4));
        c.spec = spec;
        args.push_back(c);
      }
      ASSERT_TRUE(CurrentScalingUpdate(args, nullptr).ok());
      for (size_t i = 0; i < amaxes.size(); ++i) {
        const TensorScaling want = ref::ScalingFromAmax(spec, amaxes[i]);
        ASSERT_EQ(Bits(Download<float>(args[i].scale, 1)[0]), Bits(want.scale))
            << ns.name << " amax " << amaxes[i];
        ASSERT_EQ(Bits(Download<float>(args[i].scale_inv, 1)[0]), Bits(1.0f / want.scale));
      }
    }
  }
}

// 20 steps of delayed scaling: amax recorded by the quantize kernel into
// history[0], then the device update; history and scale against the reference.
TEST(ScalingTest, DelayedScalingTwentySteps) {
  std::mt19937_64 rng(7);
  struct Cfg {
    int len;
    AmaxAlgo algo;
    int margin;
    Fp8Type type;
  };
  const std::vector<Cfg> cfgs = {{1024, AmaxAlgo::kMax, 0, Fp8Type::kE4M3},
                                 {7, AmaxAlgo::kMax, 1, Fp8Type::kE4M3},
                                 {1, AmaxAlgo::kMax, 0, Fp8Type::kE4M3},
                                 {16, AmaxAlgo::kMostRecent, 2, Fp8Type::kE5M2},
                                 {3000, AmaxAlgo::kMax, -1, Fp8Type::kE4M3}};
  Arena().Reset();
  std::vector<DelayedScalingState> states;
  std::vector<DelayedScalingArgs> args;
  std::vector<QuantSpec> specs;
  for (const Cfg& c : cfgs) {
    QuantSpec spec = DefaultQuantSpec(Format::kFp8Delayed);
    spec.amax_history_len = c.len;
    spec.amax_algo = c.algo;
    spec.margin = c.margin;
    spec.fp8_type = c.type;
    specs.push_back(spec);
    states.push_back(ref::InitialDelayedState(spec));
    DelayedScalingArgs a;
    a.history = Arena().Upload(states.back().amax_history);
    a.scale = Arena().Scalar(1.0f);
    a.scale_inv = static_cast<float*>(Arena().Alloc(4));
    a.spec = spec;
    args.push_back(a);
  }
  for (int step = 0; step < 20; ++step) {
    // Each tensor: quantize a random tensor with the current scale, recording
    // its amax into history[0] (step 5 records nothing: amax 0, D9).
    for (size_t i = 0; i < cfgs.size(); ++i) {
      const int64_t M = 40 + rng() % 100, K = 30 + rng() % 200;
      std::vector<float> master = testing::RandomMatrix(
          M, K, step == 5 ? Dist::kNormal : testing::kAllDists[rng() % 2], rng);
      if (step == 5) std::fill(master.begin(), master.end(), 0.0f);
      QuantizeTensorArgs q;
      q.source = Arena().Upload(master);
      q.rows = M;
      q.cols = K;
      q.spec.rowwise = specs[i];
      q.spec.columnwise = specs[i];
      q.rowwise_scaling.scale = args[i].scale;
      q.columnwise_scaling.scale = args[i].scale;
      q.rowwise.data = Arena().Alloc(M * K);
      q.columnwise.data = Arena().Alloc(M * K);
      q.rowwise.amax = args[i].history;  // history[0]
      ASSERT_TRUE(QuantizeHybrid({q}, nullptr).ok());
      ref::DelayedRecordAmax(states[i], ref::Amax(ref::RoundToSource(master, SourceDtype::kBf16)));
    }
    ASSERT_TRUE(DelayedScalingUpdate(args, nullptr).ok());
    for (size_t i = 0; i < cfgs.size(); ++i) {
      ref::DelayedUpdate(states[i], states[i].amax_history[0], specs[i]);
      const auto hist = Download<float>(args[i].history, states[i].amax_history.size());
      for (size_t k = 0; k < hist.size(); ++k) {
        ASSERT_EQ(Bits(hist[k]), Bits(states[i].amax_history[k]))
            << "cfg " << i << " step " << step << " slot " << k;
      }
      ASSERT_EQ(Bits(Download<float>(args[i].scale, 1)[0]), Bits(states[i].scale))
          << "cfg " << i << " step " << step;
      ASSERT_EQ(Bits(Download<float>(args[i].scale_inv, 1)[0]), Bits(1.0f / states[i].scale));
    }
  }
}

// The daemon's step on the device for current scaling / NVFP4: amax ->
// scaling -> quantize, no host round trip; bytes equal the reference.
TEST(PipelineTest, DeviceAmaxScalingQuantize) {
  std::mt19937_64 rng(8);
  for (Format f : {Format::kFp8Current, Format::kNvfp4}) {
    Arena().Reset();
    const int64_t M = 300, K = 520;
    const auto master = testing::RandomMatrix(M, K, Dist::kWide, rng);
    HybridSpec h;
    h.rowwise = DefaultQuantSpec(f);
    h.columnwise = DefaultQuantSpec(f);
    QuantizeTensorArgs q;
    q.source = Arena().Upload(master);
    q.rows = M;
    q.cols = K;
    q.spec = h;
    float* amax = static_cast<float*>(Arena().Alloc(4));
    float* scale = static_cast<float*>(Arena().Alloc(4));
    AmaxArgs aa;
    aa.source = q.source;
    aa.count = M * K;
    aa.amax = amax;
    ASSERT_TRUE(ComputeAmax({aa}, nullptr, true).ok());
    CurrentScalingArgs ca;
    ca.amax = amax;
    ca.scale = scale;
    ca.spec = h.rowwise;
    ASSERT_TRUE(CurrentScalingUpdate({ca}, nullptr).ok());
    q.rowwise_scaling = {scale, amax};
    q.columnwise_scaling = {scale, amax};
    const Layout lr = *ComputeLayout(h.rowwise, Direction::kRowwise, M, K);
    const Layout lc = *ComputeLayout(h.columnwise, Direction::kColumnwise, M, K);
    q.rowwise.data = Arena().Alloc(lr.data_bytes());
    q.rowwise.scales = lr.scale_bytes() ? Arena().Alloc(lr.scale_bytes()) : nullptr;
    q.columnwise.data = Arena().Alloc(lc.data_bytes());
    q.columnwise.scales = lc.scale_bytes() ? Arena().Alloc(lc.scale_bytes()) : nullptr;
    ASSERT_TRUE(QuantizeHybrid({q}, nullptr).ok());
    const float a = ref::Amax(ref::RoundToSource(master, SourceDtype::kBf16));
    auto want = ref::QuantizeHybrid(
        master, M, K, h,
        {ref::ScalingFromAmax(h.rowwise, a), ref::ScalingFromAmax(h.columnwise, a)});
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(CompareBytes("row", Download<uint8_t>(q.rowwise.data, lr.data_bytes()),
                           want->rowwise->data, 0),
              "");
    EXPECT_EQ(CompareBytes("col", Download<uint8_t>(q.columnwise.data, lc.data_bytes()),
                           want->columnwise->data, 0),
              "");
  }
}

// One 8192 x 16384 tensor per format (both directions), references in parallel.
TEST(LargeTest, Full8192x16384) {
  constexpr int64_t M = 8192, K = 16384;
  std::mt19937_64 rng(9);
  std::vector<float> master(M * K);
  {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    uint64_t s = rng();
    for (int64_t i = 0; i < M * K; ++i) {  // fast xorshift normals-ish with a spread of scales
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      const float u = static_cast<float>(s >> 40) * (1.0f / 16777216.0f) - 0.5f;
      master[i] = u * std::ldexp(1.0f, static_cast<int>((s >> 20) & 15) - 8);
    }
    for (int k = 0; k < 1000; ++k) master[rng() % (M * K)] = std::nanf("");
    for (int64_t r = 0; r < 256; ++r) {
      for (int64_t c = 512; c < 768; ++c) master[r * K + c] = 0.0f;  // zero blocks
    }
  }
  const auto source = ref::RoundToSource(master, SourceDtype::kBf16);
  const float amax = ref::Amax(source);
  DeviceArena arena(size_t{3} << 30);
  const float* d_src = arena.Upload(master);
  const std::vector<Format> formats = {Format::kIdentityBf16,    Format::kFp8Current,
                                       Format::kMxfp8,           Format::kNvfp4,
                                       Format::kFp8Block128x128, Format::kFp8Block1x128};
  std::vector<std::future<absl::StatusOr<ref::HybridResult>>> refs;
  for (Format f : formats) {  // all references in parallel (the GPU machine has 16 cores)
    refs.push_back(std::async(std::launch::async, [&master, amax, f] {
      HybridSpec h;
      h.rowwise = DefaultQuantSpec(f);
      h.columnwise = DefaultQuantSpec(f);
      const TensorScaling sc = ref::ScalingFromAmax(h.rowwise, amax);
      return ref::QuantizeHybrid(master, M, K, h, {sc, sc});
    }));
  }
  for (size_t n = 0; n < formats.size(); ++n) {
    const Format f = formats[n];
    HybridSpec h;
    h.rowwise = DefaultQuantSpec(f);
    h.columnwise = DefaultQuantSpec(f);
    const TensorScaling sc = ref::ScalingFromAmax(h.rowwise, amax);
    QuantizeTensorArgs q;
    q.source = d_src;
    q.rows = M;
    q.cols = K;
    q.spec = h;
    q.rowwise_scaling = {arena.Scalar(sc.scale), arena.Scalar(sc.global_amax)};
    q.columnwise_scaling = q.rowwise_scaling;
    const Layout lr = *ComputeLayout(h.rowwise, Direction::kRowwise, M, K);
    const Layout lc = *ComputeLayout(h.columnwise, Direction::kColumnwise, M, K);
    void* rd = arena.Alloc(lr.data_bytes());
    void* rs = arena.Alloc(lr.scale_bytes());
    void* cd = arena.Alloc(lc.data_bytes());
    void* cs = arena.Alloc(lc.scale_bytes());
    q.rowwise = {rd, lr.scale_bytes() ? rs : nullptr, nullptr, nullptr};
    q.columnwise = {cd, lc.scale_bytes() ? cs : nullptr, nullptr, nullptr};
    ASSERT_TRUE(QuantizeHybrid({q}, nullptr).ok());
    auto want = refs[n].get();
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(CompareBytes(absl::StrCat(FormatName(f), " row data"),
                           Download<uint8_t>(rd, lr.data_bytes()), want->rowwise->data,
                           lr.data_row_bytes),
              "");
    EXPECT_EQ(CompareBytes(absl::StrCat(FormatName(f), " row scales"),
                           Download<uint8_t>(rs, lr.scale_bytes()), want->rowwise->scales, 0),
              "");
    EXPECT_EQ(CompareBytes(absl::StrCat(FormatName(f), " col data"),
                           Download<uint8_t>(cd, lc.data_bytes()), want->columnwise->data,
                           lc.data_row_bytes),
              "");
    EXPECT_EQ(CompareBytes(absl::StrCat(FormatName(f), " col scales"),
                           Download<uint8_t>(cs, lc.scale_bytes()), want->columnwise->scales, 0),
              "");
  }
}

}  // namespace
}  // namespace gpu
}  // namespace paramd
