#include "common/cli.h"

#include <iostream>

#include "absl/flags/internal/program_name.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "common/build_info.h"

namespace paramd {

bool IsVersionRequest(absl::string_view arg) { return arg == "--version" || arg == "-version"; }

void PrintVersion(absl::string_view program, std::ostream& out) {
  out << VersionLine(program) << "\n";
}

std::vector<char*> ParseAbslFlagsOrExit(int argc, char** argv, const AbslCliOptions& options) {
  absl::SetProgramUsageMessage(options.usage);
  // Static: absl keeps the callbacks.
  static std::string* const flags_file = new std::string();
  static std::string* const program = new std::string();
  *flags_file = options.flags_file;
  *program = options.program;
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, *flags_file);
  };
  // absl's own --version text is "Debug build (NDEBUG not #defined)".
  usage.version_string = [] { return VersionLine(*program) + "\n"; };
  absl::SetFlagsUsageConfig(usage);
  // This Abseil exits with status 1 after --help; a requested help is a
  // success, so print it here and exit 0. --version likewise, before any
  // flag is parsed.
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg == "--help" || arg == "-h" || arg == "-help") {
      absl::flags_internal::SetProgramInvocationName(argv[0]);
      const std::string prefix = options.flags_file.substr(0, options.flags_file.rfind('.') + 1);
      absl::flags_internal::FlagsHelp(std::cout, prefix,
                                      absl::flags_internal::HelpFormat::kHumanReadable,
                                      absl::ProgramUsageMessage());
      std::exit(0);
    }
    if (IsVersionRequest(arg)) {
      PrintVersion(options.program, std::cout);
      std::exit(0);
    }
  }
  return absl::ParseCommandLine(argc, argv);
}

}  // namespace paramd
