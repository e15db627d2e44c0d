#include "checkpoint/export_dir.h"

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace paramd {
namespace checkpoint {
namespace {

namespace fs = std::filesystem;

bool AllDigits(absl::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), absl::ascii_isdigit);
}

// "model-00001-of-00003.safetensors".
bool IsShardName(absl::string_view name) {
  if (!absl::ConsumePrefix(&name, "model-") || !absl::ConsumeSuffix(&name, ".safetensors")) {
    return false;
  }
  const size_t of = name.find("-of-");
  return of != absl::string_view::npos && AllDigits(name.substr(0, of)) &&
         AllDigits(name.substr(of + 4));
}

}  // namespace

bool IsExportFile(absl::string_view name) {
  // Temporary files of the atomic writer (safetensors/atomic_file.cc):
  // "<name>.tmp-XXXXXX"; a leading '.' is accepted too.
  absl::string_view base = name;
  absl::ConsumePrefix(&base, ".");
  const size_t tmp = base.find(".tmp");
  if (tmp != absl::string_view::npos) base = base.substr(0, tmp);
  return base == "model.safetensors.index.json" || base == "model.safetensors" || IsShardName(base);
}

absl::StatusOr<std::vector<std::string>> PrepareExportDir(const std::string& dir, bool overwrite) {
  std::error_code ec;
  const fs::file_status st = fs::status(dir, ec);
  if (ec || st.type() == fs::file_type::not_found) return std::vector<std::string>{};
  if (st.type() != fs::file_type::directory) {
    return absl::InvalidArgumentError(absl::StrCat(dir, " exists and is not a directory"));
  }
  std::vector<std::string> entries;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    entries.push_back(e.path().filename().string());
  }
  if (ec) return absl::PermissionDeniedError(absl::StrCat("cannot list ", dir, ": ", ec.message()));
  std::sort(entries.begin(), entries.end());
  if (entries.empty()) return entries;
  if (!overwrite) {
    constexpr size_t kShown = 5;
    std::vector<std::string> shown(entries.begin(),
                                   entries.begin() + std::min(kShown, entries.size()));
    return absl::FailedPreconditionError(absl::StrCat(
        dir, " is not empty (", absl::StrJoin(shown, ", "), entries.size() > kShown ? ", ..." : "",
        "); pass --overwrite to replace an older export there (its shards and index are "
        "removed first, other files are kept), or choose another --out"));
  }
  std::vector<std::string> removed;
  for (const std::string& name : entries) {
    const fs::path path = fs::path(dir) / name;
    if (!IsExportFile(name) || !fs::is_regular_file(fs::symlink_status(path, ec))) continue;
    if (!fs::remove(path, ec) || ec) {
      return absl::PermissionDeniedError(
          absl::StrCat("cannot remove ", path.string(), ": ", ec.message()));
    }
    removed.push_back(name);
  }
  return removed;
}

}  // namespace checkpoint
}  // namespace paramd
