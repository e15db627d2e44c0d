// File: hpctl/command.h
//
// The subcommand registry of `hpctl`, the operator command-line tool, and
// OptionParser, each command's option parser. OptionParser is a thin layer
// over CLI11 (CLI::App, Debian's libcli11-dev): option syntax, errors and
// the option table come from a maintained, widely used library instead of
// a hand-written parser; the layer keeps hpctl's conventions (below) and
// keeps CLI11 out of the command files.
//
// ---------------------------------------------------------------------------
// Adding a command (e.g. `hpctl status`)
// ---------------------------------------------------------------------------
// 1. Write hpctl/status_cmd.cc:
//
//      #include "hpctl/command.h"
//      namespace paramd::hpctl {
//      namespace {
//      int RunStatus(int argc, char** argv) {
//        std::string address = "localhost:7070";
//        bool json = false;
//        OptionParser opts("hpctl status [--address HOST:PORT] [--json]",
//                          "Shows membership, versions and shard placement.");
//        opts.AddString("address", &address, "coordinator address");
//        opts.AddBool("json", &json, "print JSON instead of a table");
//        if (int rc = opts.ParseOrExit(argc, argv); rc >= 0) return rc;
//        ...  // return kExitOk, kExitFailure (runtime error) or kExitUsage
//      }
//      }  // namespace
//      HPCTL_REGISTER_COMMAND(status, "show cluster membership and versions",
//                             RunStatus);
//      }  // namespace paramd::hpctl
//
// 2. In hpctl/BUILD add
//
//      paramd_cc_library(
//          name = "status_cmd",
//          srcs = ["status_cmd.cc"],
//          alwayslink = 1,          # the registration is a static object
//          deps = [":command", ...],
//      )
//
//    and put ":status_cmd" in the `deps` of cc_binary //hpctl:hpctl (keep the
//    list sorted). Nothing else changes: `hpctl --help` lists the command and
//    `hpctl status --help` prints its OptionParser usage.
//
// Conventions: argv[0] passed to a command is the command name; the rest are
// its arguments. Commands print results to stdout and errors to stderr
// ("hpctl status: <message>") and return one of the kExit* codes. Do not use
// ABSL_FLAG in command libraries: flag names are global to the binary and
// commands would collide (`--out` means different things to different
// commands); use OptionParser.
//
// Threading: registration happens during static initialisation; the
// registry is read-only afterwards. OptionParser is not thread-safe (one per
// invocation).
#ifndef PARAMD_HPCTL_COMMAND_H_
#define PARAMD_HPCTL_COMMAND_H_

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/names.h"

namespace CLI {
class App;
}  // namespace CLI

namespace paramd {
namespace hpctl {

// Exit codes shared by every command.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;  // the command ran and failed
inline constexpr int kExitUsage = 2;    // bad command line

// Entry point of a command. argv[0] is the command name.
using CommandFn = int (*)(int argc, char** argv);

struct Command {
  std::string name;  // as typed after `hpctl`
  std::string help;  // one line, shown by `hpctl --help`
  CommandFn run = nullptr;
};

// Registers a command at static-initialisation time. Prefer the macro.
// Registering the same name twice aborts at startup (a build error in
// disguise, never a runtime condition).
class CommandRegistration {
 public:
  CommandRegistration(const char* name, const char* help, CommandFn run);
};

#define HPCTL_REGISTER_COMMAND(name, help, fn) \
  static ::paramd::hpctl::CommandRegistration hpctl_command_registration_##name(#name, help, fn)

// All registered commands, sorted by name.
std::vector<Command> RegisteredCommands();

// The registered command `name`, or nullptr.
const Command* FindCommand(absl::string_view name);

// The whole of `main`: dispatches argv[1] to a command. `hpctl`,
// `hpctl --help`, `hpctl help` list the commands (exit 0 for the latter two,
// 2 for a bare `hpctl`); `hpctl help CMD` runs `CMD --help`; an unknown
// command prints an error and returns kExitUsage. `out`/`err` receive the
// dispatcher's own messages (commands write to stdout/stderr themselves).
int HpctlMain(int argc, char** argv, std::ostream& out, std::ostream& err);

// ---------------------------------------------------------------------------
// OptionParser (on CLI11): `--name=value`, `--name value`, `--name=` (an
// empty value), `--flag`, `--noflag`, `--flag=true|false` (also t/f, yes/no,
// y/n, 1/0); `--` ends options; everything else is positional, kept exactly
// as typed. A repeated option takes its last value. `--help` / `-h` request
// the usage text. Integers are decimal and must fit 64 bits.
// ---------------------------------------------------------------------------
class OptionParser {
 public:
  // `synopsis` is the first usage line ("hpctl inspect MODEL [--recipe R]"),
  // `description` a paragraph printed under it.
  OptionParser(std::string synopsis, std::string description);
  ~OptionParser();
  OptionParser(const OptionParser&) = delete;
  OptionParser& operator=(const OptionParser&) = delete;

  // Each Add* binds `name` to `*value`, which keeps its current value as
  // the default (shown in the usage). `value` must outlive Parse().
  void AddString(const std::string& name, std::string* value, std::string help);
  void AddInt(const std::string& name, int64_t* value, std::string help);
  void AddDouble(const std::string& name, double* value, std::string help);
  void AddBool(const std::string& name, bool* value, std::string help);

  // Parses argv[1..argc). InvalidArgument names the offending option (unknown
  // option, missing or malformed value).
  absl::Status Parse(int argc, char** argv);

  // Parse plus the usual reporting: returns -1 when the command should go on,
  // kExitOk after printing the usage for --help, kExitUsage after printing
  // the error and usage to stderr.
  int ParseOrExit(int argc, char** argv);

  bool help_requested() const { return help_requested_; }
  const std::vector<std::string>& positional() const { return positional_; }
  std::string Usage() const;

 private:
  std::string synopsis_;
  std::string description_;
  std::unique_ptr<CLI::App> app_;  // owns the options
  std::vector<std::string> positional_;
  bool help_requested_ = false;
};

// `--max_tensor_name_bytes` of the commands that read model files on this
// machine (inspect, load): the same rule and default as hybrid-paramd's
// flag of that name (common/names.h), so hpctl accepts exactly the names a
// server would.
class TensorNameLimit {
 public:
  void AddTo(OptionParser& opts);
  // After Parse: InvalidArgument for a limit below 1.
  absl::Status Check() const;
  int64_t bytes() const { return bytes_; }

 private:
  int64_t bytes_ = kDefaultMaxTensorNameBytes;
};

}  // namespace hpctl
}  // namespace paramd

#endif  // PARAMD_HPCTL_COMMAND_H_
