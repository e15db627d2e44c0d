// libFuzzer target: Recipe::Parse on arbitrary text, then Resolve of names
// taken from the same input (RE2 matching must stay linear: libFuzzer's
// -timeout catches a hang). Built and run by tools/fuzz.sh.
#include <cstddef>
#include <cstdint>
#include <string>

#include "recipe/recipe.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  // "<recipe text>\0<name>\0<name>...": the part after the first NUL names
  // tensors to resolve.
  const size_t nul = input.find('\0');
  const std::string text = input.substr(0, nul);
  absl::StatusOr<paramd::Recipe> recipe = paramd::Recipe::Parse(text, "fuzz");
  const paramd::Recipe& r = recipe.ok() ? *recipe : paramd::Recipe::Builtin();
  (void)r.Resolve(text);
  if (nul != std::string::npos) {
    size_t begin = nul + 1;
    while (begin <= input.size()) {
      size_t end = input.find('\0', begin);
      if (end == std::string::npos) end = input.size();
      const paramd::Recipe::Match m = r.Resolve(input.substr(begin, end - begin));
      (void)r.DescribeMatch(m);
      begin = end + 1;
    }
  }
  return 0;
}
