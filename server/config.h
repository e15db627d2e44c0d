// File: server/config.h
//
// hybrid-paramd's configuration file (`--config=FILE`): a
// paramd.config.ServerConfig (proto/server_config.proto) in protobuf text
// format whose fields are the binary's flags. ApplyConfigFile sets every
// flag the file names unless that flag was given on the command line (or
// in a --flagfile): the command line wins.
//
// Errors are InvalidArgument "FILE:LINE:COLUMN: reason" (1-based), for
// syntax, unknown fields, values of the wrong type, values outside a
// flag's choices (role, data_plane, backend, optimizer, log_format,
// log_level) and unknown names in `flag { name: ... }`; nothing is applied
// then.
//
// Not thread-safe: call from main() after absl::ParseCommandLine, before
// other threads read flags.
#ifndef PARAMD_SERVER_CONFIG_H_
#define PARAMD_SERVER_CONFIG_H_

#include <string>

#include "absl/status/status.h"

namespace paramd {

// Reads `path` and applies it to the binary's Abseil flags (by name).
absl::Status ApplyConfigFile(const std::string& path);
// The same from text (`path` only names it in errors).
absl::Status ApplyConfigText(const std::string& text, const std::string& path);

}  // namespace paramd

#endif  // PARAMD_SERVER_CONFIG_H_
