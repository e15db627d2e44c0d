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

absl::Status ParseWords(OptionParser& p, std::vector<std::string> words) {
  std::vector<char*> argv = Argv(words);
  return p.Parse(static_cast<int>(argv.size()), argv.data());
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
      {{"x", "--seed=abc"}, "--seed: wants a 64-bit integer, got 'abc'"},
      {{"x", "--seed="}, "--seed: wants a 64-bit integer, got ''"},
      {{"x", "--seed", "0x10"}, "--seed: wants a 64-bit integer, got '0x10'"},
      {{"x", "--seed=99999999999999999999"},
       "--seed: wants a 64-bit integer, got '99999999999999999999'"},
      {{"x", "--seed=abc", "--seed=2"}, "--seed: wants a 64-bit integer, got 'abc'"},
      {{"x", "--seed"}, "--seed: 1 required INT missing"},
      {{"x", "--what"}, "The following argument was not expected: --what"},
      {{"x", "--what=1"}, "The following argument was not expected: --what=1"},
      {{"x", "-q"}, "The following argument was not expected: -q"},
      {{"x", "--all=maybe"}, "--all: wants true or false, got 'maybe'"},
      {{"x", "--noall=false"}, "--noall takes no value (use --all=true|false)"},
  };
  for (Case& c : cases) {
    absl::Status status = ParseWords(p, c.words);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(status.message()).find(c.expected), std::string::npos)
        << status.message();
  }
}

TEST(OptionParser, EmptyValueWithEqualsIsAValue) {
  std::string ca = "from-environment.pem", out = "x";
  OptionParser p("hpctl x", "");
  p.AddString("tls_ca", &ca, "ca");
  p.AddString("out", &out, "out");
  ASSERT_TRUE(ParseWords(p, {"x", "--tls_ca=", "--out", "o", "model"}).ok());
  EXPECT_EQ(ca, "");  // not "--out": the next argument is not taken as the value
  EXPECT_EQ(out, "o");
  EXPECT_EQ(p.positional(), (std::vector<std::string>{"model"}));

  ca = "again.pem";
  ASSERT_TRUE(ParseWords(p, {"x", "--tls_ca", ""}).ok());
  EXPECT_EQ(ca, "");
  EXPECT_TRUE(p.positional().empty());
}

TEST(OptionParser, ValuesAreTakenAsTyped) {
  std::string out, filter;
  int64_t seed = 1, version = 0;
  OptionParser p("hpctl x", "");
  p.AddString("out", &out, "output");
  p.AddString("filter", &filter, "regex");
  p.AddInt("seed", &seed, "seed");
  p.AddInt("version", &version, "version");
  // The argument after an option that takes a value is its value, whatever
  // it looks like; "010" is ten (decimal, not octal).
  ASSERT_TRUE(ParseWords(p, {"x", "--out", "--", "--filter", "--seed=", "--seed", "010", "[a,b]",
                             "-", "-5", "{}", "--version", "-1"})
                  .ok());
  EXPECT_EQ(out, "--");
  EXPECT_EQ(filter, "--seed=");
  EXPECT_EQ(seed, 10);
  EXPECT_EQ(version, -1);
  EXPECT_EQ(p.positional(), (std::vector<std::string>{"[a,b]", "-", "-5", "{}"}));
}

TEST(OptionParser, LastValueWinsAndFlagsTakeWords) {
  int64_t seed = 1;
  bool all = false, wait = true;
  OptionParser p("hpctl x", "");
  p.AddInt("seed", &seed, "seed");
  p.AddBool("all", &all, "all");
  p.AddBool("wait", &wait, "wait");
  struct Case {
    std::vector<std::string> words;
    int64_t seed;
    bool all, wait;
  };
  std::vector<Case> cases = {
      {{"x", "--seed=2", "--seed", "3", "--all", "--noall"}, 3, false, true},
      {{"x", "--noall", "--all", "--nowait"}, 1, true, false},
      {{"x", "--all", "--all=false", "--wait=no"}, 1, false, false},
      {{"x", "--all=T", "--wait=0"}, 1, true, false},
      {{"x", "--all=y", "--nowait", "--wait=YES"}, 1, true, true},
  };
  for (Case& c : cases) {
    seed = 1;
    all = false;
    wait = true;
    ASSERT_TRUE(ParseWords(p, c.words).ok()) << c.words[1];
    EXPECT_EQ(seed, c.seed) << c.words[1];
    EXPECT_EQ(all, c.all) << c.words[1];
    EXPECT_EQ(wait, c.wait) << c.words[1];
  }
}

TEST(OptionParser, HelpIsRequestedAndPositionalsReset) {
  std::string name;
  OptionParser p("hpctl x", "");
  p.AddString("name", &name, "a name");
  ASSERT_TRUE(ParseWords(p, {"x", "a", "-h"}).ok());
  EXPECT_TRUE(p.help_requested());
  ASSERT_TRUE(ParseWords(p, {"x", "--name=n"}).ok());
  EXPECT_FALSE(p.help_requested());
  EXPECT_TRUE(p.positional().empty());
  EXPECT_EQ(name, "n");
}

TEST(OptionParser, ParseOrExitReportsTheErrorAndUsageOnStderr) {
  int64_t seed = 1;
  OptionParser p("hpctl x [--seed N]", "");
  p.AddInt("seed", &seed, "seed");
  std::vector<std::string> words = {"x", "--seed=abc"};
  std::vector<char*> argv = Argv(words);
  testing::internal::CaptureStderr();
  EXPECT_EQ(p.ParseOrExit(static_cast<int>(argv.size()), argv.data()), kExitUsage);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(
      err.find("hpctl x: --seed: wants a 64-bit integer, got 'abc'\n\nUsage: hpctl x [--seed N]"),
      0u)
      << err;
  words = {"x", "--seed=4"};
  argv = Argv(words);
  EXPECT_EQ(p.ParseOrExit(static_cast<int>(argv.size()), argv.data()), -1);
  EXPECT_EQ(seed, 4);
}

TEST(OptionParser, UsageShowsDefaultsAndHelp) {
  std::string out = "m.safetensors";
  int64_t seed = 3;
  OptionParser p("hpctl gen --out FILE", "Writes a model.");
  p.AddString("out", &out, "output file");
  p.AddInt("seed", &seed, "random seed");
  std::string empty;
  double ratio = 0.5;
  bool wait = true;
  p.AddString("tag", &empty, "tag");
  p.AddDouble("ratio", &ratio, "ratio");
  p.AddBool("wait", &wait, "wait");
  std::string usage = p.Usage();
  EXPECT_NE(usage.find("Usage: hpctl gen --out FILE"), std::string::npos);
  EXPECT_NE(usage.find("--out    output file (default: \"m.safetensors\")"), std::string::npos)
      << usage;
  EXPECT_NE(usage.find("--seed   random seed (default: 3)"), std::string::npos) << usage;
  EXPECT_NE(usage.find("--tag    tag\n"), std::string::npos) << usage;
  EXPECT_NE(usage.find("--ratio  ratio (default: 0.5)"), std::string::npos) << usage;
  EXPECT_NE(usage.find("--wait   wait (default: true)\n  --help   this text\n"), std::string::npos)
      << usage;
}

}  // namespace
}  // namespace paramd::hpctl
