// File: safetensors/test_util.h (testonly)
//
// Helpers for tests that write and corrupt safetensors files.
#ifndef PARAMD_SAFETENSORS_TEST_UTIL_H_
#define PARAMD_SAFETENSORS_TEST_UTIL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace paramd {
namespace safetensors {
namespace testing {

// A fresh empty directory under TEST_TMPDIR.
std::string MakeTempDir();
// Writes `bytes` to `path` (overwriting); aborts the test on failure.
void WriteFile(const std::string& path, absl::string_view bytes);
std::string ReadFile(const std::string& path);
// 8-byte little-endian `header_len` + `header` + `data`.
std::string RawSafetensors(absl::string_view header, absl::string_view data, uint64_t header_len);
inline std::string RawSafetensors(absl::string_view header, absl::string_view data) {
  return RawSafetensors(header, data, header.size());
}
// Deterministic pseudo-random bytes.
std::vector<uint8_t> PatternBytes(size_t n, uint32_t seed);
// Names of the entries of `dir` (no "." / ".."), sorted.
std::vector<std::string> ListDir(const std::string& dir);

}  // namespace testing
}  // namespace safetensors
}  // namespace paramd

#endif  // PARAMD_SAFETENSORS_TEST_UTIL_H_
