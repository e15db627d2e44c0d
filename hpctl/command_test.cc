#include "hpctl/command.h"

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

namespace paramd::hpctl {
namespace {

std::vector<std::string> g_seen_args;

int RecordArgs(int argc, char** argv) {
  g_seen_args.assign(argv, argv + argc);
  return 7;
}

int HelpOnly(int argc, char** argv) {
  std::string name;
  OptionParser opts("hpctl zz_help", "test command");
  opts.AddString("name", &name, "a name");
  int rc = opts.ParseOrExit(argc, argv);
  return rc >= 0 ? rc + 40 : 3;
}

HPCTL_REGISTER_COMMAND(zz_record, "records its arguments", RecordArgs);
HPCTL_REGISTER_COMMAND(zz_help, "parses options", HelpOnly);

// Runs HpctlMain on a list of words.
int RunHpctl(std::vector<std::string> words, std::string* out, std::string* err) {
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  std::ostringstream o, e;
  int rc = HpctlMain(static_cast<int>(words.size()), argv.data(), o, e);
  *out = o.str();
  *err = e.str();
  return rc;
}

TEST(Registry, ListsRegisteredCommandsSorted) {
  std::vector<Command> commands = RegisteredCommands();
  ASSERT_GE(commands.size(), 2u);
  for (size_t i = 1; i < commands.size(); ++i) EXPECT_LT(commands[i - 1].name, commands[i].name);
  ASSERT_NE(FindCommand("zz_record"), nullptr);
  EXPECT_EQ(FindCommand("zz_record")->help, "records its arguments");
  EXPECT_EQ(FindCommand("nope"), nullptr);
}

TEST(HpctlMain, HelpListsCommandsWithTheirHelpLine) {
  std::string out, err;
  EXPECT_EQ(RunHpctl({"hpctl", "--help"}, &out, &err), kExitOk);
  EXPECT_NE(out.find("zz_record"), std::string::npos);
  EXPECT_NE(out.find("records its arguments"), std::string::npos);
  EXPECT_EQ(RunHpctl({"hpctl", "help"}, &out, &err), kExitOk);
  EXPECT_NE(out.find("zz_help"), std::string::npos);
}

TEST(HpctlMain, NoCommandIsAUsageError) {
  std::string out, err;
  EXPECT_EQ(RunHpctl({"hpctl"}, &out, &err), kExitUsage);
  EXPECT_NE(err.find("Commands:"), std::string::npos);
}

TEST(HpctlMain, UnknownCommandExitsTwoWithMessage) {
  std::string out, err;
  EXPECT_EQ(RunHpctl({"hpctl", "frobnicate"}, &out, &err), kExitUsage);
  EXPECT_NE(err.find("unknown command 'frobnicate'"), std::string::npos) << err;
  EXPECT_EQ(RunHpctl({"hpctl", "help", "frobnicate"}, &out, &err), kExitUsage);
}

TEST(HpctlMain, DispatchesWithCommandNameAsArgvZero) {
  std::string out, err;
  EXPECT_EQ(RunHpctl({"hpctl", "zz_record", "a", "--b=c"}, &out, &err), 7);
  EXPECT_EQ(g_seen_args, (std::vector<std::string>{"zz_record", "a", "--b=c"}));
}

TEST(HpctlMain, HelpCommandRunsCommandWithHelp) {
  std::string out, err;
  // ParseOrExit returns kExitOk for --help; HelpOnly adds 40.
  EXPECT_EQ(RunHpctl({"hpctl", "help", "zz_help"}, &out, &err), 40);
  EXPECT_EQ(RunHpctl({"hpctl", "zz_help", "--help"}, &out, &err), 40);
  EXPECT_EQ(RunHpctl({"hpctl", "zz_help", "--bogus"}, &out, &err), 40 + kExitUsage);
  EXPECT_EQ(RunHpctl({"hpctl", "zz_help", "--name", "x"}, &out, &err), 3);
}

std::vector<char*> Argv(std::vector<std::string>& words) {
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  return argv;
}

TEST(OptionParser, ParsesAllKindsAndPositionals) {
  std::string out = "default.safetensors";
  int64_t seed = 1;
  double ratio = 0.5;
  bool all = false, verbose = true;
  OptionParser p("hpctl x", "");
  p.AddString("out", &out, "output");
  p.AddInt("seed", &seed, "seed");
  p.AddDouble("ratio", &ratio, "ratio");
  p.AddBool("all", &all, "all");
  p.AddBool("verbose", &verbose, "verbose");
  std::vector<std::string> words = {"x",    "model", "--out=a.st",  "--seed", "42",       "--ratio",
                                    "0.25", "--all", "--noverbose", "--",     "--literal"};
  std::vector<char*> argv = Argv(words);
  ASSERT_TRUE(p.Parse(static_cast<int>(argv.size()), argv.data()).ok());
  EXPECT_EQ(out, "a.st");
  EXPECT_EQ(seed, 42);
  EXPECT_DOUBLE_EQ(ratio, 0.25);
  EXPECT_TRUE(all);
  EXPECT_FALSE(verbose);
  EXPECT_EQ(p.positional(), (std::vector<std::string>{"model", "--literal"}));
  EXPECT_FALSE(p.help_requested());
}

TEST(OptionParser, ErrorsNameTheOption) {
  int64_t seed = 1;
  bool all = false;
  OptionParser p("hpctl x", "");
  p.AddInt("seed", &seed, "seed");
  p.AddBool("all", &all, "all");
  struct Case {
    std::vector<std::string> words;
    std::string expected;
  };
  std::vector<Case> cases = {
      {{"x", "--seed=abc"}, "--seed wants an integer, got 'abc'"},
      {{"x", "--seed"}, "option '--seed' needs a value"},
      {{"x", "--what"}, "unknown option '--what'"},
      {{"x", "-q"}, "unknown option '-q'"},
      {{"x", "--all=maybe"}, "--all wants true or false"},
  };
  for (Case& c : cases) {
    std::vector<char*> argv = Argv(c.words);
    absl::Status status = p.Parse(static_cast<int>(argv.size()), argv.data());
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(status.message()).find(c.expected), std::string::npos)
        << status.message();
  }
}

TEST(OptionParser, UsageShowsDefaultsAndHelp) {
  std::string out = "m.safetensors";
  int64_t seed = 3;
  OptionParser p("hpctl gen --out FILE", "Writes a model.");
  p.AddString("out", &out, "output file");
  p.AddInt("seed", &seed, "random seed");
  std::string usage = p.Usage();
  EXPECT_NE(usage.find("Usage: hpctl gen --out FILE"), std::string::npos);
  EXPECT_NE(usage.find("--out   output file (default: \"m.safetensors\")"), std::string::npos)
      << usage;
  EXPECT_NE(usage.find("--seed  random seed (default: 3)"), std::string::npos) << usage;
  EXPECT_NE(usage.find("--help  this text"), std::string::npos) << usage;
}

}  // namespace
}  // namespace paramd::hpctl
