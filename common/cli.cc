#include "common/cli.h"

#include <iostream>
#include <streambuf>
#include <string>

#include "absl/flags/internal/program_name.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "common/build_info.h"
#include "common/log.h"

namespace paramd {

bool IsVersionRequest(absl::string_view arg) { return arg == "--version" || arg == "-version"; }

void PrintVersion(absl::string_view program, std::ostream& out) {
  out << VersionLine(program) << "\n";
}

namespace {

// The value argv gives flag `name` ("--name=v", "-name=v", "--name v"), or
// "" when it is absent. The last one wins, as in Abseil.
std::string FlagValueInArgv(int argc, char** argv, const std::string& name) {
  std::string value;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "--")) absl::ConsumePrefix(&arg, "-");
    if (!absl::ConsumePrefix(&arg, name)) continue;
    if (absl::ConsumePrefix(&arg, "=")) {
      value = std::string(arg);
    } else if (arg.empty() && i + 1 < argc) {
      value = argv[++i];
    }
  }
  return value;
}

// A stream buffer that hands each complete line written to it to LogError
// (tag "flags"): Abseil reports flag errors on std::cerr and then exits, so
// each line must be logged as soon as its newline arrives.
class LogLineBuf : public std::streambuf {
 protected:
  int_type overflow(int_type c) override {
    if (c == traits_type::eof()) return traits_type::not_eof(c);
    if (c == '\n') {
      Emit();
    } else {
      line_.push_back(static_cast<char>(c));
    }
    return c;
  }
  int sync() override {
    Emit();
    return 0;
  }

 private:
  void Emit() {
    absl::string_view text = line_;
    absl::ConsumePrefix(&text, "ERROR: ");
    if (!text.empty()) LogError("flags", text);
    line_.clear();
  }
  std::string line_;
};

}  // namespace

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
  if (options.log_format_flag.empty() ||
      FlagValueInArgv(argc, argv, options.log_format_flag) != "json") {
    return absl::ParseCommandLine(argc, argv);
  }
  // JSON mode: Abseil's error lines go through the JSON log (the caller sets
  // its role and level later, once the flags are known).
  (void)InitLogging({"json", "info", 0, "-"});
  static LogLineBuf* const json_lines = new LogLineBuf();  // outlives exit()
  std::streambuf* const previous = std::cerr.rdbuf(json_lines);
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  std::cerr.rdbuf(previous);
  return positional;
}

}  // namespace paramd
