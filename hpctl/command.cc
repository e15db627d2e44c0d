#include "hpctl/command.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <vector>

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

OptionParser::OptionParser(std::string synopsis, std::string description)
    : synopsis_(std::move(synopsis)), description_(std::move(description)) {}

void OptionParser::AddString(const std::string& name, std::string* value, std::string help) {
  options_.push_back({name, Kind::kString, value, std::move(help),
                      value->empty() ? "" : absl::StrCat("\"", *value, "\"")});
}

void OptionParser::AddInt(const std::string& name, int64_t* value, std::string help) {
  options_.push_back({name, Kind::kInt, value, std::move(help), absl::StrCat(*value)});
}

void OptionParser::AddDouble(const std::string& name, double* value, std::string help) {
  options_.push_back({name, Kind::kDouble, value, std::move(help), absl::StrCat(*value)});
}

void OptionParser::AddBool(const std::string& name, bool* value, std::string help) {
  options_.push_back({name, Kind::kBool, value, std::move(help), *value ? "true" : "false"});
}

const OptionParser::Option* OptionParser::Find(absl::string_view name) const {
  for (const Option& option : options_) {
    if (option.name == name) return &option;
  }
  return nullptr;
}

absl::Status OptionParser::Assign(const Option& option, absl::string_view text) {
  switch (option.kind) {
    case Kind::kString:
      *static_cast<std::string*>(option.value) = std::string(text);
      return absl::OkStatus();
    case Kind::kInt:
      if (!absl::SimpleAtoi(text, static_cast<int64_t*>(option.value))) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", option.name, " wants an integer, got '", text, "'"));
      }
      return absl::OkStatus();
    case Kind::kDouble:
      if (!absl::SimpleAtod(text, static_cast<double*>(option.value))) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", option.name, " wants a number, got '", text, "'"));
      }
      return absl::OkStatus();
    case Kind::kBool:
      if (!absl::SimpleAtob(text, static_cast<bool*>(option.value))) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", option.name, " wants true or false, got '", text, "'"));
      }
      return absl::OkStatus();
  }
  return absl::InternalError("unreachable option kind");
}

absl::Status OptionParser::Parse(int argc, char** argv) {
  positional_.clear();
  help_requested_ = false;
  bool options_ended = false;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (options_ended || arg.size() < 2 || arg[0] != '-') {
      positional_.emplace_back(arg);
      continue;
    }
    if (arg == "--") {
      options_ended = true;
      continue;
    }
    if (arg == "--help" || arg == "-h") {
      help_requested_ = true;
      continue;
    }
    if (arg.substr(0, 2) != "--") {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown option '", arg, "' (options are spelled --name)"));
    }
    absl::string_view body = arg.substr(2);
    absl::string_view name = body;
    absl::string_view value;
    bool has_value = false;
    if (size_t eq = body.find('='); eq != absl::string_view::npos) {
      name = body.substr(0, eq);
      value = body.substr(eq + 1);
      has_value = true;
    }
    const Option* option = Find(name);
    if (option == nullptr && !has_value && name.substr(0, 2) == "no") {
      const Option* negated = Find(name.substr(2));
      if (negated != nullptr && negated->kind == Kind::kBool) {
        *static_cast<bool*>(negated->value) = false;
        continue;
      }
    }
    if (option == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown option '--", name, "'"));
    }
    if (!has_value) {
      if (option->kind == Kind::kBool) {
        *static_cast<bool*>(option->value) = true;
        continue;
      }
      if (i + 1 >= argc) {
        return absl::InvalidArgumentError(absl::StrCat("option '--", name, "' needs a value"));
      }
      value = argv[++i];
    }
    if (absl::Status status = Assign(*option, value); !status.ok()) return status;
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

std::string OptionParser::Usage() const {
  std::string usage = absl::StrCat("Usage: ", synopsis_, "\n");
  if (!description_.empty()) absl::StrAppend(&usage, "\n", description_, "\n");
  if (options_.empty()) return usage;
  absl::StrAppend(&usage, "\nOptions:\n");
  size_t width = 4;  // "help"
  for (const Option& option : options_) width = std::max(width, option.name.size());
  for (const Option& option : options_) {
    absl::StrAppend(
        &usage, absl::StrFormat("  --%-*s  %s", static_cast<int>(width), option.name, option.help));
    if (!option.default_text.empty()) {
      absl::StrAppend(&usage, " (default: ", option.default_text, ")");
    }
    absl::StrAppend(&usage, "\n");
  }
  absl::StrAppend(&usage,
                  absl::StrFormat("  --%-*s  this text\n", static_cast<int>(width), "help"));
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
