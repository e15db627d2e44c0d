// File: common/names.h
//
// The rule every tensor name must follow, wherever it enters: a Load request
// (declared tensors or the safetensors header the coordinator reads), a
// Daemon.LoadShards manifest, or a safetensors file read by hpctl. A name is
// 1 to `max_bytes` bytes (default kDefaultMaxTensorNameBytes, 1 KiB; the
// `--max_tensor_name_bytes` flag of hybrid-paramd and hpctl) and holds no
// NUL or other control character (bytes 0x00-0x1f and 0x7f). Bytes >= 0x80
// pass (UTF-8 names are the safetensors norm).
//
// Why a limit: names are matched against recipe patterns, logged, put in
// error messages and copied into every manifest; an unbounded name is a
// memory and log amplifier, and control characters forge log lines.
//
// Thread-safe, pure functions.
#ifndef PARAMD_COMMON_NAMES_H_
#define PARAMD_COMMON_NAMES_H_

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace paramd {

inline constexpr int64_t kDefaultMaxTensorNameBytes = 1024;

// OK, or InvalidArgument naming the problem and the limit, e.g.
//   tensor name of 102400 bytes ("aaaa..."): longer than the limit of 1024
//   bytes (--max_tensor_name_bytes)
// The message quotes at most the first 32 bytes of the name, C-escaped.
absl::Status CheckTensorName(absl::string_view name,
                             int64_t max_bytes = kDefaultMaxTensorNameBytes);

// The first `max_bytes` bytes of `name`, C-escaped and quoted; a cut one
// ends in "..." and its full size: "\"abc...\" (1048576 bytes)". For error
// messages and log lines that must not echo a whole untrusted string: the
// result is bounded (4 * max_bytes + 32 characters at most) and holds no
// control character, so a newline cannot forge a log line.
std::string QuoteForError(absl::string_view name, size_t max_bytes = 32);

// How much of a client-supplied string an error message or log line shows,
// and the longest id (pusher, trainer, member, any free string) a server
// accepts from a client.
inline constexpr size_t kMaxClientStringBytes = 256;

// QuoteForError with the kMaxClientStringBytes bound: the one way a server
// echoes a string a client sent (names, ids, paths) into a reply or a log.
inline std::string QuoteForMessage(absl::string_view value) {
  return QuoteForError(value, kMaxClientStringBytes);
}

// The refusal of a request naming a tensor the model does not have:
// NotFound "unknown tensor \"<QuoteForMessage(name)>\"", or CheckTensorName's
// InvalidArgument when `name` could not be any tensor's (too long, control
// characters), so that a megabyte-long name is answered in a short message.
absl::Status UnknownTensorError(absl::string_view name,
                                int64_t max_bytes = kDefaultMaxTensorNameBytes);

// OK, or InvalidArgument ("<what> of 8388608 bytes ("..." ...): longer than
// the limit of 256 bytes") for a client-supplied id longer than
// kMaxClientStringBytes. Checked before the id is stored or compared.
absl::Status CheckClientId(absl::string_view what, absl::string_view id);

// CheckClientId of each {what, id} of a request, in order: the first
// refusal, or OK.
absl::Status CheckClientIds(
    std::initializer_list<std::pair<absl::string_view, absl::string_view>> ids);

// The longest file path a server accepts from a client (Load's
// safetensors_path and checkpoint_path): PATH_MAX.
inline constexpr size_t kMaxClientPathBytes = 4096;

// OK, or InvalidArgument for a client-supplied path longer than `max_bytes`
// or holding a NUL or other control character (no file name the servers
// write or read needs one, and a newline in a path forges log lines):
//   safetensors_path "a\nb" holds control character 0x0a at byte 1
// Checked before the path is opened, stored or logged.
absl::Status CheckClientPath(absl::string_view what, absl::string_view path,
                             size_t max_bytes = kMaxClientPathBytes);

}  // namespace paramd

#endif  // PARAMD_COMMON_NAMES_H_
