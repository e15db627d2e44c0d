#include "common/names.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace paramd {

namespace {

// OK, or InvalidArgument "<what> <quoted> holds control character 0xNN at
// byte I (...)" for the first byte 0x00-0x1f or 0x7f of `value`.
absl::Status CheckNoControlCharacter(absl::string_view what, absl::string_view value,
                                     absl::string_view quoted) {
  for (size_t i = 0; i < value.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(value[i]);
    if (c < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " ", quoted, " holds control character 0x", absl::Hex(c, absl::kZeroPad2),
          " at byte ", i, " (NUL and control characters are refused)"));
    }
  }
  return absl::OkStatus();
}

// OK, or InvalidArgument "<what> of N bytes ("..."): longer than the limit
// of M bytes".
absl::Status CheckSize(absl::string_view what, absl::string_view value, size_t max_bytes) {
  if (value.size() <= max_bytes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, " of ", value.size(), " bytes (", QuoteForError(value),
                   "): longer than the limit of ", max_bytes, " bytes"));
}

}  // namespace

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
  return CheckSize(what, id, kMaxClientStringBytes);
}

absl::Status CheckClientIds(
    std::initializer_list<std::pair<absl::string_view, absl::string_view>> ids) {
  for (const auto& [what, id] : ids) RETURN_IF_ERROR(CheckClientId(what, id));
  return absl::OkStatus();
}

absl::Status CheckTensorName(absl::string_view name, int64_t max_bytes) {
  if (name.empty()) return absl::InvalidArgumentError("empty tensor name");
  if (static_cast<int64_t>(name.size()) > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor name of ", name.size(), " bytes (", QuoteForError(name),
        "): longer than the limit of ", max_bytes, " bytes (--max_tensor_name_bytes)"));
  }
  return CheckNoControlCharacter("tensor name", name, QuoteForError(name));
}

absl::Status CheckClientPath(absl::string_view what, absl::string_view path, size_t max_bytes) {
  RETURN_IF_ERROR(CheckSize(what, path, max_bytes));
  return CheckNoControlCharacter(what, path, QuoteForMessage(path));
}

}  // namespace paramd
