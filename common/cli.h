// File: common/cli.h
//
// The command-line conventions hybrid-paramd and hpctl share:
//   --help, -h   usage on stdout, exit 0
//   --version    "<program> <version> (commit <commit>, -c <mode>)" on
//                stdout (common/build_info.h), exit 0
//   a bad flag   the reason on stderr, a non-zero exit
// hybrid-paramd's flags are Abseil flags (ParseAbslFlagsOrExit); hpctl's
// subcommands each parse their own options (hpctl/command.h) and call
// IsVersionRequest for the top level.
//
// Not thread-safe: call from main() before other threads start.
#ifndef PARAMD_COMMON_CLI_H_
#define PARAMD_COMMON_CLI_H_

#include <iosfwd>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace paramd {

struct AbslCliOptions {
  std::string program;  // "hybrid-paramd"
  std::string usage;    // absl::SetProgramUsageMessage
  // --help lists the flags defined in files whose path ends with this
  // (e.g. "server/main.cc"); absl's default looks for the binary's name.
  std::string flags_file;
  // The name of the flag that selects JSON logs ("log_format"; empty: none).
  // When argv sets it to "json", a bad flag is reported as JSON log lines
  // (common/log.h, tag "flags") like every later line of the process.
  std::string log_format_flag;
};

// absl::ParseCommandLine with the shared --help/--version behaviour; exits
// the process for --help, --version and bad flags (their reason on stderr:
// text, or JSON lines when options.log_format_flag says json). Returns the
// positional
// arguments (argv[0] first).
std::vector<char*> ParseAbslFlagsOrExit(int argc, char** argv, const AbslCliOptions& options);

// True if `arg` asks for the version ("--version").
bool IsVersionRequest(absl::string_view arg);
// Writes VersionLine(program) and a newline.
void PrintVersion(absl::string_view program, std::ostream& out);

}  // namespace paramd

#endif  // PARAMD_COMMON_CLI_H_
