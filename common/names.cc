#include "common/names.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace paramd {

std::string QuoteForError(absl::string_view name, size_t max_bytes) {
  const bool cut = name.size() > max_bytes;
  if (!cut) return absl::StrCat("\"", absl::CHexEscape(name), "\"");
  return absl::StrCat("\"", absl::CHexEscape(name.substr(0, max_bytes)), "...\" (", name.size(),
                      " bytes)");
}

absl::Status UnknownTensorError(absl::string_view name, int64_t max_bytes) {
  if (absl::Status bad = CheckTensorName(name, max_bytes); !bad.ok()) return bad;
  return absl::NotFoundError(absl::StrCat("unknown tensor ", QuoteForMessage(name)));
}

absl::Status CheckClientId(absl::string_view what, absl::string_view id) {
  if (id.size() <= kMaxClientStringBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, " of ", id.size(), " bytes (",
                                                 QuoteForError(id), "): longer than the limit of ",
                                                 kMaxClientStringBytes, " bytes"));
}

absl::Status CheckTensorName(absl::string_view name, int64_t max_bytes) {
  if (name.empty()) return absl::InvalidArgumentError("empty tensor name");
  if (static_cast<int64_t>(name.size()) > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor name of ", name.size(), " bytes (", QuoteForError(name),
                     "): longer than the limit of ", max_bytes,
                     " bytes (--max_tensor_name_bytes)"));
  }
  for (size_t i = 0; i < name.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    if (c < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor name ", QuoteForError(name), " holds control character 0x",
                       absl::Hex(c, absl::kZeroPad2), " at byte ", i,
                       " (NUL and control characters are refused)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace paramd
