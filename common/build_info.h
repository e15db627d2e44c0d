// File: common/build_info.h
//
// What a binary was built from: the version (VERSION at the repository
// root), the git commit (tools/workspace_status.sh through Bazel's
// stamping; "unknown" outside a git checkout, "-dirty" for uncommitted
// changes) and Bazel's compilation mode (opt for release builds:
// `bazel build --config=release`). Shown by `--version` and the
// paramd_build_info metric.
//
// Thread-safe (immutable).
#ifndef PARAMD_COMMON_BUILD_INFO_H_
#define PARAMD_COMMON_BUILD_INFO_H_

#include <string>

#include "absl/strings/string_view.h"

namespace paramd {

struct BuildInfo {
  const char* version;  // "0.1.0"
  const char* commit;   // "3f2a9c1d0b7e", "3f2a9c1d0b7e-dirty" or "unknown"
  const char* mode;     // "opt", "fastbuild" or "dbg"
};

const BuildInfo& GetBuildInfo();

// "<program> <version> (commit <commit>, -c <mode>)".
std::string VersionLine(absl::string_view program);

}  // namespace paramd

#endif  // PARAMD_COMMON_BUILD_INFO_H_
