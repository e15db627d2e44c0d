// GPU only (tag gpu): the device optimizer kernels (kernels/cuda/optimizer)
// and the host optimizer (server/step/optimizer.cc, what the cpu backend runs)
// produce identical bits — masters, moments — for AdamW over several steps
// (with and without weight decay) and SGD with and without momentum,
// through both the float4 and the scalar kernel paths. This is what makes a
// gpu daemon publish the same bytes as a cpu daemon.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/optimizer.h"
#include "server/step/optimizer.h"

namespace paramd {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// A device copy of a host vector, `offset` floats into its allocation (1:
// not 16-byte aligned, so the kernel takes its scalar path).
class DeviceVec {
 public:
  DeviceVec(const std::vector<float>& host, int offset) : n_(host.size()), offset_(offset) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&base_), (n_ + 4) * sizeof(float)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr(), host.data(), n_ * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  ~DeviceVec() { cudaFree(base_); }
  float* ptr() { return base_ + offset_; }
  std::vector<float> Download() {
    std::vector<float> out(n_);
    EXPECT_EQ(cudaMemcpy(out.data(), ptr(), n_ * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }

 private:
  float* base_ = nullptr;
  size_t n_;
  int offset_;
};

void ExpectSameBits(const std::vector<float>& got, const std::vector<float>& want,
                    const char* what) {
  ASSERT_EQ(got.size(), want.size());
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (Bits(got[i]) != Bits(want[i]) && !(std::isnan(got[i]) && std::isnan(want[i]))) {
      if (++bad <= 5) {
        ADD_FAILURE() << what << "[" << i << "]: device " << got[i] << " host " << want[i];
      }
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

std::vector<float> Random(size_t n, float scale, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

constexpr int64_t kSizes[] = {1, 5, 4096, 16385, 100003};

TEST(GpuBackendOptimizerTest, AdamWBitsEqualHost) {
  std::mt19937_64 rng(7);
  for (float wd : {0.0f, 0.01f}) {
    for (int64_t n : kSizes) {
      for (int offset : {0, 1}) {
        SCOPED_TRACE(::testing::Message() << "n " << n << " wd " << wd << " offset " << offset);
        OptimizerOptions o;
        o.lr = 0.01f;
        o.weight_decay = wd;
        std::vector<float> w = Random(n, 1.0f, rng);
        OptimizerState state;
        state.m.assign(n, 0.0f);
        state.v.assign(n, 0.0f);
        DeviceVec dw(w, offset), dm(state.m, 0), dv(state.v, 0);
        for (int64_t step = 1; step <= 4; ++step) {
          const std::vector<float> g = Random(n, 0.3f, rng);
          DeviceVec dg(g, 0);
          gpu::OptimizerTensor t;
          t.param = dw.ptr();
          t.exp_avg = dm.ptr();
          t.exp_avg_sq = dv.ptr();
          t.grad = dg.ptr();
          t.count = n;
          gpu::AdamWHyper h;
          h.lr = o.lr;
          h.beta1 = o.beta1;
          h.beta2 = o.beta2;
          h.eps = o.eps;
          h.weight_decay = o.weight_decay;
          h.step = step;
          ASSERT_TRUE(gpu::AdamWStep({t}, h, nullptr).ok());
          ApplyOptimizer(o, step, absl::MakeSpan(w), g, state);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          ExpectSameBits(dw.Download(), w, "master");
          ExpectSameBits(dm.Download(), state.m, "exp_avg");
          ExpectSameBits(dv.Download(), state.v, "exp_avg_sq");
        }
      }
    }
  }
}

TEST(GpuBackendOptimizerTest, SgdBitsEqualHost) {
  std::mt19937_64 rng(8);
  for (float momentum : {0.0f, 0.9f}) {
    for (float wd : {0.0f, 1e-3f}) {
      for (int64_t n : kSizes) {
        SCOPED_TRACE(::testing::Message() << "n " << n << " wd " << wd << " m " << momentum);
        OptimizerOptions o;
        o.kind = OptimizerKind::kSgd;
        o.lr = 0.05f;
        o.momentum = momentum;
        o.weight_decay = wd;
        std::vector<float> w = Random(n, 1.0f, rng);
        if (wd == 0.0f) w[0] = std::numeric_limits<float>::infinity();  // stays Inf
        OptimizerState state;
        state.m.assign(n, 0.0f);
        DeviceVec dw(w, 0), dm(state.m, 0);
        for (int64_t step = 1; step <= 3; ++step) {
          const std::vector<float> g = Random(n, 0.3f, rng);
          DeviceVec dg(g, 0);
          gpu::OptimizerTensor t;
          t.param = dw.ptr();
          t.exp_avg = momentum != 0.0f ? dm.ptr() : nullptr;
          t.grad = dg.ptr();
          t.count = n;
          gpu::SgdHyper h;
          h.lr = o.lr;
          h.momentum = o.momentum;
          h.weight_decay = o.weight_decay;
          h.first_step = step == 1;
          ASSERT_TRUE(gpu::SgdStep({t}, h, nullptr).ok());
          ApplyOptimizer(o, step, absl::MakeSpan(w), g, state);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          ExpectSameBits(dw.Download(), w, "master");
          if (momentum != 0.0f) ExpectSameBits(dm.Download(), state.m, "momentum");
        }
      }
    }
  }
}

}  // namespace
}  // namespace paramd
