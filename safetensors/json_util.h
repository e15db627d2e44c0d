// File: safetensors/json_util.h (package-internal)
//
// JSON parsing for untrusted headers: no exceptions escape, and duplicate
// object keys (which nlohmann::json silently collapses, last one winning)
// are reported instead of hidden.
#ifndef PARAMD_SAFETENSORS_JSON_UTIL_H_
#define PARAMD_SAFETENSORS_JSON_UTIL_H_

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace paramd {
namespace safetensors {
namespace internal {

struct StrictJson {
  nlohmann::json value;
  // Empty if every object's keys are unique; else the keys leading to the
  // first repeated key, ending with it ({"a"} = a repeated top-level key).
  std::vector<std::string> duplicate_key_path;
};

// InvalidArgument "<what> is not valid JSON: <parser message>" on a syntax
// error (including invalid UTF-8).
absl::StatusOr<StrictJson> ParseStrictJson(absl::string_view text, absl::string_view what);

}  // namespace internal
}  // namespace safetensors
}  // namespace paramd

#endif  // PARAMD_SAFETENSORS_JSON_UTIL_H_
