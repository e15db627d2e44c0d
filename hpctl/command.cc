#include "hpctl/command.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cli.h"

namespace paramd {
namespace hpctl {
namespace {

// Function-local static: safe to use from other translation units' static
// initialisers, whatever the link order.
std::map<std::string, Command>& Registry() {
  static auto* registry = new std::map<std::string, Command>();
  return *registry;
}

void PrintCommandList(std::ostream& out) {
  out << "Usage: hpctl <command> [options]\n\n"
      << "Operator tool for hybrid-paramd.\n\nCommands:\n";
  size_t width = 4;
  for (const auto& [name, command] : Registry()) width = std::max(width, name.size());
  for (const auto& [name, command] : Registry()) {
    out << absl::StrFormat("  %-*s  %s\n", static_cast<int>(width), name, command.help);
  }
  out << "\nRun 'hpctl <command> --help' for the options of one command;\n"
         "'hpctl --version' prints the version and commit.\n";
}

}  // namespace

CommandRegistration::CommandRegistration(const char* name, const char* help, CommandFn run) {
  auto [it, inserted] = Registry().emplace(name, Command{name, help, run});
  if (!inserted) {
    std::fprintf(stderr, "hpctl: command '%s' registered twice\n", name);
    std::abort();
  }
}

std::vector<Command> RegisteredCommands() {
  std::vector<Command> commands;
  for (const auto& [name, command] : Registry()) commands.push_back(command);
  return commands;
}

const Command* FindCommand(absl::string_view name) {
  auto it = Registry().find(std::string(name));
  return it == Registry().end() ? nullptr : &it->second;
}

int HpctlMain(int argc, char** argv, std::ostream& out, std::ostream& err) {
  if (argc < 2) {
    PrintCommandList(err);
    return kExitUsage;
  }
  const std::string first = argv[1];
  if (IsVersionRequest(first)) {
    PrintVersion("hpctl", out);
    return kExitOk;
  }
  if (first == "--help" || first == "-h" || first == "help") {
    if (first == "help" && argc >= 3) {
      const Command* command = FindCommand(argv[2]);
      if (command == nullptr) {
        err << "hpctl: unknown command '" << argv[2] << "'. Run 'hpctl --help' for the list.\n";
        return kExitUsage;
      }
      char help_flag[] = "--help";
      char* sub_argv[] = {argv[2], help_flag, nullptr};
      return command->run(2, sub_argv);
    }
    PrintCommandList(out);
    return kExitOk;
  }
  const Command* command = FindCommand(first);
  if (command == nullptr) {
    err << "hpctl: unknown command '" << first << "'. Run 'hpctl --help' for the list.\n";
    return kExitUsage;
  }
  return command->run(argc - 1, argv + 1);
}

// ---------------------------------------------------------------------------
// OptionParser

namespace {

bool ParseValue(absl::string_view text, int64_t* value) { return absl::SimpleAtoi(text, value); }
bool ParseValue(absl::string_view text, double* value) { return absl::SimpleAtod(text, value); }
bool ParseValue(absl::string_view text, bool* value) { return absl::SimpleAtob(text, value); }

// The check of a T option's values, run by CLI11 on every value given
// (CLI::Validator: "" accepts the value, other text is the error, which
// CLI11 prefixes with the option's name). absl's parsers, so an integer is
// decimal and range-checked: CLI11's own conversion reads "010" as octal
// and saturates out-of-range values.
template <typename T>
CLI::Validator ValueCheck(const char* wants) {
  return CLI::Validator(
      [wants](std::string& text) -> std::string {
        T parsed;
        if (ParseValue(text, &parsed)) return "";
        return absl::StrCat("wants ", wants, ", got '", text, "'");
      },
      "");
}

// An option with one value; `assign` stores the last one given (already
// checked, so it does not fail; if it did, CLI11 would report the option).
CLI::Option* AddValueOption(CLI::App& app, const std::string& name, std::string help,
                            const char* type_name, std::function<bool(const std::string&)> assign) {
  return app
      .add_option(
          "--" + name,
          [assign = std::move(assign)](const CLI::results_t& results) {
            return assign(results.back());
          },
          std::move(help))
      ->type_name(type_name)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
}

template <typename T>
void AddNumberOption(CLI::App& app, const std::string& name, T* value, std::string help,
                     const char* type_name, const char* wants) {
  AddValueOption(app, name, std::move(help), type_name,
                 [value](const std::string& text) { return ParseValue(text, value); })
      ->check(ValueCheck<T>(wants))
      ->default_str(absl::StrCat(*value));
}

}  // namespace

OptionParser::OptionParser(std::string synopsis, std::string description)
    : synopsis_(std::move(synopsis)),
      description_(std::move(description)),
      app_(std::make_unique<CLI::App>(description_)) {
  app_->set_help_flag("-h,--help", "this text");
  // Everything that is not an option, exactly as typed: CLI11's usual
  // list positional (allow_extra_args) would read "[a,b]" as two values, so
  // this one instead expects as many single values as CLI11 allows.
  app_->add_option("POSITIONAL",
                   [this](const CLI::results_t& results) {
                     positional_ = results;
                     return true;
                   })
      ->expected(CLI::detail::expected_max_vector_size, CLI::detail::expected_max_vector_size)
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
}

OptionParser::~OptionParser() = default;

void OptionParser::AddString(const std::string& name, std::string* value, std::string help) {
  AddValueOption(*app_, name, std::move(help), "TEXT", [value](const std::string& text) {
    *value = text;
    return true;
  })->default_str(*value);
}

void OptionParser::AddInt(const std::string& name, int64_t* value, std::string help) {
  AddNumberOption(*app_, name, value, std::move(help), "INT", "a 64-bit integer");
}

void OptionParser::AddDouble(const std::string& name, double* value, std::string help) {
  AddNumberOption(*app_, name, value, std::move(help), "NUMBER", "a number");
}

void OptionParser::AddBool(const std::string& name, bool* value, std::string help) {
  // "!--noNAME" is CLI11's negated flag. CLI11 converts the value (its
  // boolean words include every one SimpleAtob accepts).
  app_->add_flag(absl::StrCat("--", name, ",!--no", name), *value, std::move(help))
      ->check(ValueCheck<bool>("true or false"))
      ->default_str(*value ? "true" : "false");
}

absl::Status OptionParser::Parse(int argc, char** argv) {
  positional_.clear();
  help_requested_ = false;
  // CLI::App::parse takes the arguments in reverse order. Two adjustments
  // on the way, for CLI11 2.1: it reads `--name=` as `--name` and takes the
  // *next* argument as the value, so an empty value given with `=` is passed
  // as `--name ""`; and it would read `--noflag=false` as false (the value
  // replaces the negation), so a value after --noflag is refused. Scanning
  // stops at `--`, and skips the argument after an option that takes a
  // value (that argument is the value, whatever it looks like).
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") {
      args.insert(args.end(), argv + i, argv + argc);
      break;
    }
    args.emplace_back(arg);
    if (!absl::StartsWith(arg, "--")) continue;
    const size_t eq = arg.find('=');
    const std::string name(arg.substr(2, eq == absl::string_view::npos ? eq : eq - 2));
    const CLI::Option* option = app_->get_option_no_throw("--" + name);
    if (option == nullptr) continue;        // CLI11 reports it
    if (option->get_expected_min() == 0) {  // a flag
      if (eq != absl::string_view::npos && option->check_fname(name)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, " takes no value (use ", option->get_name(), "=true|false)"));
      }
      continue;
    }
    if (eq == arg.size() - 1) {
      args.back().pop_back();
      args.emplace_back();
    } else if (eq == absl::string_view::npos && i + 1 < argc) {
      args.emplace_back(argv[++i]);
    }
  }
  std::reverse(args.begin(), args.end());
  try {
    app_->parse(args);
  } catch (const CLI::CallForHelp&) {
    help_requested_ = true;
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(e.what());
  }
  return absl::OkStatus();
}

int OptionParser::ParseOrExit(int argc, char** argv) {
  absl::Status status = Parse(argc, argv);
  const std::string command = argc > 0 ? argv[0] : "?";
  if (!status.ok()) {
    std::cerr << "hpctl " << command << ": " << status.message() << "\n\n" << Usage();
    return kExitUsage;
  }
  if (help_requested_) {
    std::cout << Usage();
    return kExitOk;
  }
  return -1;
}

// The option table from CLI11's record of the options, in the layout hpctl
// has always printed: `  --name  help (default: value)`, --help last.
std::string OptionParser::Usage() const {
  std::string usage = absl::StrCat("Usage: ", synopsis_, "\n");
  if (!description_.empty()) absl::StrAppend(&usage, "\n", description_, "\n");
  const CLI::App& app = *app_;
  const CLI::Option* help = app.get_help_ptr();
  std::vector<const CLI::Option*> options = app.get_options(
      [help](const CLI::Option* option) { return option->nonpositional() && option != help; });
  if (options.empty()) return usage;
  absl::StrAppend(&usage, "\nOptions:\n");
  size_t width = 4;  // "help"
  for (const CLI::Option* option : options) {
    width = std::max(width, option->get_lnames().front().size());
  }
  for (const CLI::Option* option : options) {
    absl::StrAppend(&usage,
                    absl::StrFormat("  --%-*s  %s", static_cast<int>(width),
                                    option->get_lnames().front(), option->get_description()));
    const std::string& default_value = option->get_default_str();
    if (!default_value.empty()) {
      const bool text = option->get_type_name() == "TEXT";
      absl::StrAppend(&usage, " (default: ", text ? "\"" : "", default_value, text ? "\"" : "",
                      ")");
    }
    absl::StrAppend(&usage, "\n");
  }
  absl::StrAppend(&usage, absl::StrFormat("  --%-*s  %s\n", static_cast<int>(width), "help",
                                          help->get_description()));
  return usage;
}

void TensorNameLimit::AddTo(OptionParser& opts) {
  opts.AddInt("max_tensor_name_bytes", &bytes_,
              "longest tensor name accepted in a model file, in bytes (set it as on the "
              "cluster's hybrid-paramd --max_tensor_name_bytes)");
}

absl::Status TensorNameLimit::Check() const {
  if (bytes_ >= 1) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--max_tensor_name_bytes must be at least 1, got ", bytes_));
}

}  // namespace hpctl
}  // namespace paramd
