#include "common/build_info.h"

#include "absl/strings/str_cat.h"

namespace paramd {

std::string VersionLine(absl::string_view program) {
  const BuildInfo& info = GetBuildInfo();
  return absl::StrCat(program, " ", info.version, " (commit ", info.commit, ", -c ", info.mode,
                      ")");
}

}  // namespace paramd
