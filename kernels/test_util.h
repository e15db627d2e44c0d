// File: kernels/test_util.h
//
// Helpers for the kernels tests (testonly): status assertions, bit
// patterns, and byte-buffer builders for hand-written expectations.
#ifndef PARAMD_KERNELS_TEST_UTIL_H_
#define PARAMD_KERNELS_TEST_UTIL_H_

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/format.h"
#include "kernels/reference.h"

#define PARAMD_TEST_CONCAT_INNER(a, b) a##b
#define PARAMD_TEST_CONCAT(a, b) PARAMD_TEST_CONCAT_INNER(a, b)
// `ASSERT_OK_AND_ASSIGN(auto q, Quantize(...));`
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ASSERT_OK_AND_ASSIGN_IMPL(PARAMD_TEST_CONCAT(statusor_, __LINE__), lhs, expr)
#define ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  ASSERT_TRUE(tmp.ok()) << tmp.status();          \
  lhs = std::move(tmp).value()

namespace paramd::ref::testing {

inline float F(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}
inline uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

// A zero buffer of n bytes with the given (offset, byte) pairs set.
inline std::vector<uint8_t> BytesAt(size_t n,
                                    std::initializer_list<std::pair<size_t, uint8_t>> set) {
  std::vector<uint8_t> b(n, 0);
  for (const auto& [offset, value] : set) b.at(offset) = value;
  return b;
}

// A zero buffer of n fp32 entries (little-endian) with (entry, value) set.
inline std::vector<uint8_t> Fp32At(size_t n, std::initializer_list<std::pair<size_t, float>> set) {
  std::vector<uint8_t> b(4 * n, 0);
  for (const auto& [entry, value] : set) {
    const uint32_t v = Bits(value);
    for (int i = 0; i < 4; ++i) b.at(4 * entry + i) = static_cast<uint8_t>(v >> (8 * i));
  }
  return b;
}

// Spec with one field changed, for terse test tables.
inline QuantSpec Spec(Format f, bool two_d) {
  QuantSpec s = DefaultQuantSpec(f);
  s.two_d = two_d;
  return s;
}

}  // namespace paramd::ref::testing

#endif  // PARAMD_KERNELS_TEST_UTIL_H_
