// GPU optimizer steps against a float64 CPU reference (tag gpu): AdamW and
// SGD with momentum within float32 rounding, amax of the updated weights
// exact, and the fused AdamW + quantize pass byte-equal to the reference
// quantization of the weights it produced.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "kernels/cuda/optimizer.h"
#include "kernels/cuda/quantize.h"
#include "kernels/cuda/test_util.h"
#include "kernels/format.h"
#include "kernels/reference.h"

namespace paramd {
namespace gpu {
namespace {

using testing::Bits;
using testing::CompareBytes;
using testing::DeviceArena;
using testing::Download;

DeviceArena& Arena() { return testing::SharedArena(size_t{512} << 20); }

struct HostTensor {
  std::vector<float> p, m, v, g;
};

HostTensor RandomTensor(int64_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  HostTensor t;
  const float pscale = std::ldexp(1.0f, static_cast<int>(rng() % 9) - 4);
  for (int64_t i = 0; i < n; ++i) {
    t.p.push_back(nd(rng) * pscale);
    t.m.push_back(nd(rng) * 0.01f);
    t.v.push_back(std::fabs(nd(rng)) * 1e-4f);
    t.g.push_back(nd(rng) * 0.1f);
  }
  return t;
}

// |got - want| within a few float32 roundings of the terms that made it.
bool Close(float got, double want, double magnitude) {
  const double tol = 8.0 * std::ldexp(1.0, -24) * magnitude + 1e-38;
  return std::fabs(static_cast<double>(got) - want) <= tol;
}

float AmaxOf(const std::vector<float>& p, SourceDtype sd) {
  return ref::Amax(ref::RoundToSource(p, sd));
}

std::vector<int64_t> Sizes() { return {1, 3, 4, 17, 1000, 4099, 16384, 16385, 100003, 1 << 20}; }

TEST(AdamWTest, MatchesFloat64ReferenceAndAmaxExact) {
  std::mt19937_64 rng(11);
  for (int64_t step : {1, 2, 10, 1000}) {
    Arena().Reset();
    AdamWHyper h;
    h.lr = 1e-3 * (1 + rng() % 5);
    h.weight_decay = step % 2 ? 0.01 : 0.0;
    h.step = step;
    std::vector<HostTensor> host;
    std::vector<OptimizerTensor> ts;
    for (int64_t n : Sizes()) {
      host.push_back(RandomTensor(n, rng));
      const HostTensor& H = host.back();
      OptimizerTensor t;
      const size_t mis = rng() % 3 == 0 ? 4 : 0;  // unaligned: scalar path
      t.param = Arena().Upload(H.p, mis);
      t.exp_avg = Arena().Upload(H.m);
      t.exp_avg_sq = Arena().Upload(H.v);
      t.grad = Arena().Upload(H.g);
      t.count = n;
      t.amax = Arena().Scalar(0.0f);
      t.amax_source = rng() % 2 ? SourceDtype::kBf16 : SourceDtype::kFp32;
      ts.push_back(t);
    }
    ASSERT_TRUE(AdamWStep(ts, h, nullptr).ok());
    const double bc1 = 1.0 - std::pow(h.beta1, step), bc2 = 1.0 - std::pow(h.beta2, step);
    for (size_t k = 0; k < ts.size(); ++k) {
      const HostTensor& H = host[k];
      const int64_t n = ts[k].count;
      const auto p = Download<float>(ts[k].param, n), m = Download<float>(ts[k].exp_avg, n),
                 v = Download<float>(ts[k].exp_avg_sq, n);
      for (int64_t i = 0; i < n; ++i) {
        const double g = H.g[i];
        const double m1 = h.beta1 * H.m[i] + (1 - h.beta1) * g;
        const double v1 = h.beta2 * H.v[i] + (1 - h.beta2) * g * g;
        const double denom = std::sqrt(v1) / std::sqrt(bc2) + h.eps;
        const double upd = (h.lr / bc1) * m1 / denom;
        const double p1 = H.p[i] * (1 - h.lr * h.weight_decay) - upd;
        ASSERT_TRUE(Close(m[i], m1, std::fabs(h.beta1 * H.m[i]) + std::fabs((1 - h.beta1) * g)))
            << "m tensor " << k << " i " << i << ": " << m[i] << " vs " << m1;
        ASSERT_TRUE(Close(v[i], v1, std::fabs(v1))) << "v tensor " << k << " i " << i;
        ASSERT_TRUE(Close(p[i], p1, std::fabs(H.p[i]) + 4 * std::fabs(upd)))
            << "p tensor " << k << " i " << i << ": " << p[i] << " vs " << p1;
      }
      const float amax = Download<float>(ts[k].amax, 1)[0];
      ASSERT_EQ(Bits(amax), Bits(AmaxOf(p, ts[k].amax_source))) << "amax tensor " << k;
    }
  }
}

TEST(SgdTest, MatchesFloat64ReferenceAndAmaxExact) {
  std::mt19937_64 rng(12);
  for (int variant = 0; variant < 6; ++variant) {
    Arena().Reset();
    SgdHyper h;
    h.lr = 0.01;
    h.momentum = variant == 5 ? 0.0 : 0.9;
    h.dampening = variant == 2 ? 0.1 : 0.0;
    h.weight_decay = variant % 2 ? 1e-4 : 0.0;
    h.nesterov = variant == 3;
    h.first_step = variant == 4;
    std::vector<HostTensor> host;
    std::vector<OptimizerTensor> ts;
    for (int64_t n : Sizes()) {
      host.push_back(RandomTensor(n, rng));
      OptimizerTensor t;
      t.param = Arena().Upload(host.back().p, rng() % 3 == 0 ? 4 : 0);
      t.exp_avg = h.momentum != 0.0 ? Arena().Upload(host.back().m) : nullptr;
      t.grad = Arena().Upload(host.back().g);
      t.count = n;
      t.amax = Arena().Scalar(0.0f);
      t.amax_source = SourceDtype::kFp32;
      ts.push_back(t);
    }
    ASSERT_TRUE(SgdStep(ts, h, nullptr).ok());
    for (size_t k = 0; k < ts.size(); ++k) {
      const HostTensor& H = host[k];
      const int64_t n = ts[k].count;
      const auto p = Download<float>(ts[k].param, n);
      const auto buf = h.momentum != 0.0 ? Download<float>(ts[k].exp_avg, n) : std::vector<float>();
      for (int64_t i = 0; i < n; ++i) {
        double d = H.g[i] + h.weight_decay * H.p[i];
        double b = 0, mag = std::fabs(d);
        if (h.momentum != 0.0) {
          b = h.first_step ? d : h.momentum * H.m[i] + (1 - h.dampening) * d;
          const double bmag =
              h.first_step ? std::fabs(d) : std::fabs(h.momentum * H.m[i]) + std::fabs(d);
          ASSERT_TRUE(Close(buf[i], b, bmag)) << "buf " << k << " " << i;
          d = h.nesterov ? d + h.momentum * b : b;
          mag = bmag * 2 + std::fabs(d);
        }
        const double p1 = H.p[i] - h.lr * d;
        ASSERT_TRUE(Close(p[i], p1, std::fabs(H.p[i]) + 2 * h.lr * mag))
            << "p variant " << variant << " tensor " << k << " i " << i << ": " << p[i] << " vs "
            << p1;
      }
      ASSERT_EQ(Bits(Download<float>(ts[k].amax, 1)[0]), Bits(AmaxOf(p, SourceDtype::kFp32)));
    }
  }
}

// Fused AdamW + quantize: p/m/v equal to the plain AdamW kernel's (same
// arithmetic), quantized bytes equal the reference quantization of that p.
TEST(AdamWQuantizeTest, FusedEqualsStepThenReference) {
  std::mt19937_64 rng(13);
  struct Pair {
    Format row, col;
    ColumnwiseSource cs;
  };
  const std::vector<Pair> pairs = {
      {Format::kFp8Delayed, Format::kFp8Delayed, ColumnwiseSource::kOriginal},
      {Format::kMxfp8, Format::kMxfp8, ColumnwiseSource::kOriginal},
      {Format::kFp8Block128x128, Format::kFp8Block1x128, ColumnwiseSource::kRowwiseDequantized},
      {Format::kIdentityBf16, Format::kFp8Delayed, ColumnwiseSource::kRowwiseDequantized}};
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 1}, {33, 257}, {128, 128}, {300, 1024}, {7, 12}};
  for (const Pair& pr : pairs) {
    for (const auto& [M, K] : shapes) {
      Arena().Reset();
      const int64_t n = M * K;
      const HostTensor H = RandomTensor(n, rng);
      AdamWHyper h;
      h.step = 3;
      // Plain step on a copy, for the expected p/m/v.
      OptimizerTensor plain;
      plain.param = Arena().Upload(H.p);
      plain.exp_avg = Arena().Upload(H.m);
      plain.exp_avg_sq = Arena().Upload(H.v);
      plain.grad = Arena().Upload(H.g);
      plain.count = n;
      ASSERT_TRUE(AdamWStep({plain}, h, nullptr).ok());
      AdamWQuantizeArgs a;
      a.opt = plain;
      a.opt.param = Arena().Upload(H.p);
      a.opt.exp_avg = Arena().Upload(H.m);
      a.opt.exp_avg_sq = Arena().Upload(H.v);
      a.opt.grad = Arena().Upload(H.g);
      HybridSpec hs;
      hs.rowwise = DefaultQuantSpec(pr.row);
      hs.columnwise = DefaultQuantSpec(pr.col);
      hs.columnwise_source = pr.cs;
      a.quant.rows = M;
      a.quant.cols = K;
      a.quant.spec = hs;
      const float s_row = 0.75f * std::ldexp(1.0f, static_cast<int>(rng() % 8));
      const float s_col = 1.25f * std::ldexp(1.0f, static_cast<int>(rng() % 8));
      a.quant.rowwise_scaling.scale = Arena().Scalar(s_row);
      a.quant.columnwise_scaling.scale = Arena().Scalar(s_col);
      const Layout lr = *ComputeLayout(hs.rowwise, Direction::kRowwise, M, K);
      const Layout lc = *ComputeLayout(hs.columnwise, Direction::kColumnwise, M, K);
      a.quant.rowwise.data = Arena().Alloc(lr.data_bytes());
      a.quant.rowwise.scales = lr.scale_bytes() ? Arena().Alloc(lr.scale_bytes()) : nullptr;
      a.quant.rowwise.amax = Arena().Scalar(0.0f);
      a.quant.columnwise.data = Arena().Alloc(lc.data_bytes());
      a.quant.columnwise.scales = lc.scale_bytes() ? Arena().Alloc(lc.scale_bytes()) : nullptr;
      ASSERT_TRUE(AdamWStepAndQuantize({a}, h, nullptr).ok());
      const auto p_plain = Download<float>(plain.param, n);
      const auto p_fused = Download<float>(a.opt.param, n);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(Bits(p_plain[i]), Bits(p_fused[i])) << "p " << i;
      const auto m_plain = Download<float>(plain.exp_avg, n),
                 m_fused = Download<float>(a.opt.exp_avg, n);
      const auto v_plain = Download<float>(plain.exp_avg_sq, n),
                 v_fused = Download<float>(a.opt.exp_avg_sq, n);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(Bits(m_plain[i]), Bits(m_fused[i])) << "m " << i;
        ASSERT_EQ(Bits(v_plain[i]), Bits(v_fused[i])) << "v " << i;
      }
      TensorScaling sr, sc;
      sr.scale = s_row;
      sc.scale = s_col;
      auto want = ref::QuantizeHybrid(p_fused, M, K, hs, {sr, sc});
      ASSERT_TRUE(want.ok()) << want.status();
      const std::string what =
          absl::StrCat(FormatName(pr.row), "+", FormatName(pr.col), " [", M, "x", K, "]");
      EXPECT_EQ(
          CompareBytes(what + " row data", Download<uint8_t>(a.quant.rowwise.data, lr.data_bytes()),
                       want->rowwise->data, lr.data_row_bytes),
          "");
      EXPECT_EQ(CompareBytes(what + " row scales",
                             Download<uint8_t>(a.quant.rowwise.scales, lr.scale_bytes()),
                             want->rowwise->scales, 0),
                "");
      EXPECT_EQ(CompareBytes(what + " col data",
                             Download<uint8_t>(a.quant.columnwise.data, lc.data_bytes()),
                             want->columnwise->data, lc.data_row_bytes),
                "");
      EXPECT_EQ(CompareBytes(what + " col scales",
                             Download<uint8_t>(a.quant.columnwise.scales, lc.scale_bytes()),
                             want->columnwise->scales, 0),
                "");
      const float amax = Download<float>(a.quant.rowwise.amax, 1)[0];
      EXPECT_EQ(Bits(amax), Bits(AmaxOf(p_fused, SourceDtype::kBf16))) << what;
    }
  }
}

TEST(AdamWQuantizeTest, RefusesFormatsNeedingThisStepsAmax) {
  AdamWQuantizeArgs a;
  float* p = Arena().Scalar(1.0f);
  a.opt = {p, p, p, p, 1, nullptr, SourceDtype::kBf16};
  a.quant.rows = 1;
  a.quant.cols = 1;
  a.quant.spec.rowwise = DefaultQuantSpec(Format::kNvfp4);
  a.quant.spec.columnwise_usage = false;
  EXPECT_EQ(AdamWStepAndQuantize({a}, AdamWHyper{}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace gpu
}  // namespace paramd
