// File: kernels/cuda/test_util.h
//
// testonly helpers for the GPU tests: a device arena with poisoning, random
// inputs of many magnitudes with the special values of FORMATS.md, and byte
// comparison that names the first difference. Not thread-safe.
#ifndef PARAMD_KERNELS_CUDA_TEST_UTIL_H_
#define PARAMD_KERNELS_CUDA_TEST_UTIL_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"

namespace paramd {
namespace gpu {
namespace testing {

#define PARAMD_CUDA_CHECK(expr)                                            \
  do {                                                                     \
    cudaError_t e_ = (expr);                                               \
    if (e_ != cudaSuccess) {                                               \
      fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #expr, \
              cudaGetErrorString(e_));                                     \
      abort();                                                             \
    }                                                                      \
  } while (0)

// One big cudaMalloc, bump-allocated; Reset() frees everything at once.
class DeviceArena {
 public:
  explicit DeviceArena(size_t bytes) : size_(bytes) {
    PARAMD_CUDA_CHECK(cudaMalloc(&base_, bytes));
  }
  ~DeviceArena() { cudaFree(base_); }
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // `misalign` bytes past a 256-byte boundary. Poisons the bytes with 0xA5.
  void* Alloc(size_t bytes, size_t misalign = 0) {
    used_ = (used_ + 255) / 256 * 256 + misalign;
    if (used_ + bytes > size_) {
      fprintf(stderr, "DeviceArena: out of space (%zu + %zu > %zu)\n", used_, bytes, size_);
      abort();
    }
    void* p = static_cast<char*>(base_) + used_;
    used_ += bytes;
    if (bytes > 0) PARAMD_CUDA_CHECK(cudaMemset(p, 0xA5, bytes));
    return p;
  }
  template <typename T>
  T* Upload(const std::vector<T>& v, size_t misalign = 0) {
    void* p = Alloc(v.size() * sizeof(T), misalign);
    if (!v.empty())
      PARAMD_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return static_cast<T*>(p);
  }
  float* Scalar(float v) { return Upload(std::vector<float>{v}); }
  void Reset() { used_ = 0; }

 private:
  void* base_ = nullptr;
  size_t size_ = 0;
  size_t used_ = 0;
};

// A process-wide arena, created on first use with `bytes` (later sizes are ignored).
inline DeviceArena& SharedArena(size_t bytes = size_t{512} << 20) {
  static DeviceArena* arena = new DeviceArena(bytes);
  return *arena;
}

template <typename T>
std::vector<T> Download(const void* p, size_t n) {
  std::vector<T> v(n);
  if (n > 0) PARAMD_CUDA_CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

inline uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}
inline float FromBits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// Value distributions of the tests.
enum class Dist {
  kNormal,   // N(0,1) times one per-tensor scale in [1e-2, 1e2]
  kWide,     // per-tensor scale in {1e-30 ... 1e30}, elements spread over 2^+-8
  kSpecial,  // normal with all-zero regions, a NaN-only region, NaN (any sign/payload), +-Inf
             // (some tensors), -0, subnormals, values near FLT_MAX
};
constexpr Dist kAllDists[] = {Dist::kNormal, Dist::kWide, Dist::kSpecial};
inline const char* DistName(Dist d) {
  return d == Dist::kNormal ? "normal" : d == Dist::kWide ? "wide" : "special";
}

inline std::vector<float> RandomMatrix(int64_t rows, int64_t cols, Dist dist,
                                       std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  std::vector<float> v(rows * cols);
  if (dist == Dist::kNormal) {
    const float scale = std::pow(10.0f, -2.0f + 4.0f * uni(rng));
    for (float& x : v) x = normal(rng) * scale;
    return v;
  }
  if (dist == Dist::kWide) {
    static const float kScales[] = {1e-30f, 1e-20f, 1e-3f, 1.0f, 1e3f, 1e20f, 1e30f};
    const float scale = kScales[rng() % 7];
    for (float& x : v) x = normal(rng) * scale * std::ldexp(1.0f, static_cast<int>(rng() % 17) - 8);
    return v;
  }
  for (float& x : v) x = normal(rng);
  // All-zero regions (blocks of every format become all-zero somewhere).
  const int regions = 1 + static_cast<int>(rng() % 3);
  for (int g = 0; g < regions; ++g) {
    const int64_t r0 = rng() % rows, c0 = rng() % cols;
    const int64_t h = 1 + rng() % 48, w = 1 + rng() % 160;
    for (int64_t r = r0; r < std::min(rows, r0 + h); ++r) {
      for (int64_t c = c0; c < std::min(cols, c0 + w); ++c) v[r * cols + c] = 0.0f;
    }
  }
  // A NaN-only region 128..160 columns wide from a multiple of 128: whole
  // 1x16, 1x32 and 1x128 blocks (and, with enough rows, 16x16 / 32x1 ones)
  // of NaN only, whose amax is 0 (§0).
  {
    const int64_t r0 = rng() % rows, c0 = static_cast<int64_t>(rng() % ((cols + 127) / 128)) * 128;
    const int64_t h = 1 + rng() % 40, w = 128 + rng() % 33;
    for (int64_t r = r0; r < std::min(rows, r0 + h); ++r) {
      for (int64_t c = c0; c < std::min(cols, c0 + w); ++c) {
        v[r * cols + c] = FromBits(0x7FC00000u | static_cast<uint32_t>(rng() % 0x3FFFFF) |
                                   (rng() % 2 ? 0x80000000u : 0u));
      }
    }
  }
  const bool with_inf = rng() % 2 == 0;
  for (float& x : v) {
    const float u = uni(rng);
    if (u < 0.005f) {
      x = FromBits((0x7F800001u + static_cast<uint32_t>(rng() % 0x7FFFFF)) |
                   (rng() % 2 ? 0x80000000u : 0u));
    } else if (u < 0.008f && with_inf) {
      x = rng() % 2 ? std::numeric_limits<float>::infinity()
                    : -std::numeric_limits<float>::infinity();
    } else if (u < 0.013f) {
      x = -0.0f;
    } else if (u < 0.018f) {
      x = FromBits(static_cast<uint32_t>(1 + rng() % 0x7FFFFF) | (rng() % 2 ? 0x80000000u : 0u));
    } else if (u < 0.020f) {
      x = (rng() % 2 ? 1.0f : -1.0f) * 3.0e38f;
    } else if (u < 0.030f) {
      x *= 1e-30f;
    }
  }
  return v;
}

// "" when equal, else a description of the first difference.
inline std::string CompareBytes(const std::string& what, const std::vector<uint8_t>& got,
                                const std::vector<uint8_t>& want, int64_t row_bytes) {
  if (got.size() != want.size()) {
    return absl::StrCat(what, ": size ", got.size(), " != ", want.size());
  }
  int64_t diffs = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++diffs;
    }
  }
  if (diffs == 0) return "";
  const int64_t rb = row_bytes > 0 ? row_bytes : 1;
  return absl::StrCat(what, ": ", diffs, " of ", got.size(), " bytes differ; first at byte ", first,
                      " (row ", first / rb, ", byte ", first % rb, "): got 0x",
                      absl::Hex(got[first]), " want 0x", absl::Hex(want[first]));
}

}  // namespace testing
}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_TEST_UTIL_H_
