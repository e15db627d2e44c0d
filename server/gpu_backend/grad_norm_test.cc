// GPU only (tag gpu). The device gradient norm (grad_norm.h) against
// server/step/grad_norm.h's definition, bit for bit: the add + row sums for both
// load paths (16-byte loads: cols % 4 == 0 and aligned rows, one or several
// 1024-element rounds and a partial one; scalar loads: odd cols or a
// misaligned add), FP32 and BF16 adds and no add; the block slots, their
// float64 sum and the clip factor through the two launches (several
// daemons) and through the one launch of a single daemon, with slots of
// other daemons (0) and a non-finite sum.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <cuda_runtime.h>  // the typed cudaMalloc

#include "gtest/gtest.h"
#include "server/gpu_backend/grad_norm.h"
#include "server/step/grad_norm.h"
#include "server/step/optimizer.h"

namespace paramd {
namespace gpu_backend {
namespace {

std::vector<float> Random(int64_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

uint16_t Bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>(b >> 16);
}
float FromBf16(uint16_t h) {
  const uint32_t b = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

uint64_t Bits(double d) {
  uint64_t b;
  std::memcpy(&b, &d, 8);
  return b;
}

template <typename T>
T* ToDevice(const std::vector<T>& v, size_t pad_elements = 0) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, (v.size() + pad_elements + 1) * sizeof(T)), cudaSuccess);
  T* d = static_cast<T*>(p) + pad_elements;
  EXPECT_EQ(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

template <typename T>
std::vector<T> ToHost(const T* d, size_t n) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

enum Add { kNone, kFp32, kBf16 };

// (rows, cols, add kind, misaligned add)
struct RowCase {
  int64_t rows, cols;
  Add add;
  bool misaligned;
};

class RowSumTest : public ::testing::TestWithParam<RowCase> {};

TEST_P(RowSumTest, AddAndRowSumsEqualTheDefinition) {
  const RowCase c = GetParam();
  const int64_t n = c.rows * c.cols;
  std::vector<float> acc = Random(n, 1, 1.0f);
  std::vector<float> add = Random(n, 2, 0.5f);
  std::vector<uint16_t> half(n);
  for (int64_t i = 0; i < n; ++i) half[i] = Bf16(add[i]);
  // Odd values too: -0, a denormal, a huge value (its square still fits).
  acc[0] = -0.0f;
  acc[n / 2] = 1e-40f;
  acc[n - 1] = 3e38f;
  std::vector<float> want = acc;
  for (int64_t i = 0; i < n; ++i) {
    if (c.add == kFp32) want[i] = acc[i] + add[i];
    if (c.add == kBf16) want[i] = acc[i] + FromBf16(half[i]);
  }
  float* d_acc = ToDevice(acc);
  // One element of padding in front: a misaligned source.
  const size_t pad = c.misaligned ? 1 : 0;
  const void* d_add = nullptr;
  if (c.add == kFp32) d_add = ToDevice(add, pad);
  if (c.add == kBf16) d_add = ToDevice(half, pad);
  double* d_sums = nullptr;
  ASSERT_EQ(cudaMalloc(&d_sums, c.rows * sizeof(double)), cudaSuccess);
  ASSERT_EQ(LaunchRowSumSq(d_acc, d_add, c.add == kBf16, c.rows, c.cols, d_sums, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> got = ToHost(d_acc, n);
  ASSERT_EQ(std::memcmp(got.data(), want.data(), n * 4), 0);
  const std::vector<double> sums = ToHost(d_sums, c.rows);
  for (int64_t r = 0; r < c.rows; ++r) {
    EXPECT_EQ(Bits(sums[r]), Bits(RowSumSq(want.data() + r * c.cols, c.cols))) << "row " << r;
  }
  cudaFree(d_acc);
  if (d_add != nullptr) {
    cudaFree(const_cast<char*>(static_cast<const char*>(d_add)) - pad * (c.add == kBf16 ? 2 : 4));
  }
  cudaFree(d_sums);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RowSumTest,
    ::testing::Values(RowCase{3, 8192, kFp32, false}, RowCase{3, 8192, kBf16, false},
                      RowCase{3, 8192, kNone, false}, RowCase{2, 2052, kFp32, false},
                      RowCase{2, 2052, kBf16, false}, RowCase{4, 40, kFp32, false},
                      RowCase{2, 300, kBf16, false}, RowCase{5, 1030, kFp32, false},
                      RowCase{5, 1030, kBf16, false}, RowCase{5, 1030, kNone, false},
                      RowCase{3, 2048, kFp32, true}, RowCase{3, 2048, kBf16, true},
                      RowCase{1, 3, kFp32, false}));

// Slots of a manifest of three tensors (300, 128 and 5 rows: 3 + 1 + 1
// slots) of which this daemon holds tensors 0 and 2; tensor 1's slot
// belongs to another daemon (0 here).
TEST(NormSlotsTest, SlotsSumAndFactorEqualTheDefinitionInOneOrTwoLaunches) {
  const std::vector<int64_t> rows = {300, 128, 5};
  for (bool non_finite : {false, true}) {
    SCOPED_TRACE(non_finite ? "non-finite" : "finite");
    std::vector<std::vector<double>> row_sums;
    std::vector<double*> d_row_sums;
    for (size_t t = 0; t < rows.size(); ++t) {
      std::vector<double> s(rows[t]);
      std::mt19937_64 rng(7 + t);
      std::uniform_real_distribution<double> u(0.0, 50.0);
      for (double& x : s) x = u(rng);
      if (non_finite && t == 2) s[3] = INFINITY;
      row_sums.push_back(s);
      d_row_sums.push_back(ToDevice(s));
    }
    std::vector<NormSlotSource> table;
    std::vector<float> want(4 * 5, 0.0f);
    int64_t slot = 0;
    for (size_t t = 0; t < rows.size(); ++t) {
      for (int64_t b = 0; b * 128 < rows[t]; ++b, ++slot) {
        const int32_t n = static_cast<int32_t>(std::min<int64_t>(128, rows[t] - 128 * b));
        if (t == 1) {
          table.push_back({nullptr, 0});
          continue;
        }
        table.push_back({d_row_sums[t] + 128 * b, n});
        double sum = 0.0;
        for (int32_t r = 0; r < n; ++r) sum += row_sums[t][128 * b + r];
        EncodeGradNormSlot(sum, want.data() + 4 * slot);
      }
    }
    ASSERT_EQ(slot, 5);
    const double want_sum = SumGradNormSlots(want);
    NormSlotSource* d_table = ToDevice(table);
    float* d_slots = nullptr;
    float* d_factor = nullptr;
    double* d_sum = nullptr;
    unsigned int* d_counter = nullptr;
    ASSERT_EQ(cudaMalloc(&d_slots, want.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_factor, 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_sum, 8), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_counter, 4), cudaSuccess);
    ASSERT_EQ(cudaMemset(d_counter, 0, 4), cudaSuccess);
    for (float bound : {0.0f, 1.0f, 1e9f}) {
      for (bool skip : {false, true}) {
        OptimizerOptions o;
        o.max_grad_norm = bound;
        float want_factor = ClipFactor(o, want_sum);
        if (skip && !std::isfinite(want_sum)) want_factor = NAN;
        for (int fused = 0; fused < 2; ++fused) {
          SCOPED_TRACE(::testing::Message() << "bound " << bound << " skip " << skip
                                            << (fused ? " one launch" : " two launches"));
          ASSERT_EQ(cudaMemset(d_slots, 0xFF, want.size() * 4), cudaSuccess);  // overwritten
          if (fused) {
            // Twice: the counter is left at 0 for the next launch.
            for (int k = 0; k < 2; ++k) {
              ASSERT_EQ(LaunchNormSlotsAndClipFactor(d_table, 5, d_slots, d_counter, bound, skip,
                                                     d_sum, d_factor, nullptr),
                        cudaSuccess);
            }
          } else {
            ASSERT_EQ(LaunchEncodeNormSlots(d_table, 5, d_slots, nullptr), cudaSuccess);
            ASSERT_EQ(LaunchClipFactor(d_slots, 5, bound, skip, d_sum, d_factor, nullptr),
                      cudaSuccess);
          }
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          EXPECT_EQ(ToHost(d_slots, want.size()), want);
          EXPECT_EQ(Bits(ToHost(d_sum, 1)[0]), Bits(want_sum));
          const float f = ToHost(d_factor, 1)[0];
          if (std::isnan(want_factor)) {
            EXPECT_TRUE(std::isnan(f)) << f;
          } else {
            EXPECT_EQ(f, want_factor);
          }
          EXPECT_EQ(ToHost(d_counter, 1)[0], 0u);
        }
      }
    }
    cudaFree(d_table);
    cudaFree(d_slots);
    cudaFree(d_factor);
    cudaFree(d_sum);
    cudaFree(d_counter);
    for (double* p : d_row_sums) cudaFree(p);
  }
}

// Many slots (more blocks than one, a final sum over several decode
// rounds): the 1.07 B benchmark model's 1,024 slots and 5,000.
TEST(NormSlotsTest, ManySlotsInOneLaunchEqualTwoLaunches) {
  for (int64_t slots : {1024, 5000}) {
    std::vector<double> sums(slots * 128);
    std::mt19937_64 rng(11);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (double& x : sums) x = u(rng);
    double* d_sums = ToDevice(sums);
    std::vector<NormSlotSource> table;
    for (int64_t s = 0; s < slots; ++s) table.push_back({d_sums + 128 * s, 128});
    NormSlotSource* d_table = ToDevice(table);
    float *d_slots = nullptr, *d_factor = nullptr;
    double* d_sum = nullptr;
    unsigned int* d_counter = nullptr;
    ASSERT_EQ(cudaMalloc(&d_slots, slots * 16), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_factor, 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_sum, 8), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_counter, 4), cudaSuccess);
    ASSERT_EQ(cudaMemset(d_counter, 0, 4), cudaSuccess);
    std::vector<float> want(4 * slots);
    for (int64_t s = 0; s < slots; ++s) {
      double sum = 0.0;
      for (int r = 0; r < 128; ++r) sum += sums[128 * s + r];
      EncodeGradNormSlot(sum, want.data() + 4 * s);
    }
    const double want_sum = SumGradNormSlots(want);
    ASSERT_EQ(LaunchNormSlotsAndClipFactor(d_table, slots, d_slots, d_counter, 1.0f, true, d_sum,
                                           d_factor, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(ToHost(d_slots, want.size()), want) << slots;
    EXPECT_EQ(Bits(ToHost(d_sum, 1)[0]), Bits(want_sum)) << slots;
    OptimizerOptions o;
    o.max_grad_norm = 1.0f;
    EXPECT_EQ(ToHost(d_factor, 1)[0], ClipFactor(o, want_sum)) << slots;
    cudaFree(d_sums);
    cudaFree(d_table);
    cudaFree(d_slots);
    cudaFree(d_factor);
    cudaFree(d_sum);
    cudaFree(d_counter);
  }
}

}  // namespace
}  // namespace gpu_backend
}  // namespace paramd
