#include "common/log.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/base/internal/raw_logging.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/library_log.h"
#include "google/protobuf/stubs/logging.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace paramd {
namespace {

// Runs `fn` with stderr going to a file; returns what was written.
template <class Fn>
std::string CaptureStderr(Fn fn) {
  const std::string path =
      absl::StrCat(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp", "/log_test_",
                   getpid(), ".txt");
  std::fflush(stderr);
  const int saved = dup(2);
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  dup2(fd, 2);
  close(fd);
  fn();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  std::ifstream in(path);
  std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  unlink(path.c_str());
  return out;
}

std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

TEST(LogTest, TextLinesCarryDateLevelRoleRankPidAndTag) {
  ASSERT_TRUE(InitLogging({"text", "info", 0, "coordinator"}).ok());
  SetLogRank(-1);
  const std::string out = CaptureStderr([] {
    LogInfo("coordinator", "committed version 7");
    SetLogRank(3);
    LogWarning("daemon", "slow step");
    LogDebug("daemon", "hidden at info");
    VLog(1, "daemon", "hidden without --v");
  });
  const std::vector<std::string> lines = Lines(out);
  ASSERT_EQ(lines.size(), 2u) << out;
  // 2026-12-01T20:21:12.345+00:00 INFO  coordinator rank=- pid=N coordinator: ...
  EXPECT_EQ(lines[0][4], '-');
  EXPECT_EQ(lines[0][10], 'T');
  EXPECT_TRUE(
      absl::StrContains(lines[0], " INFO  coordinator rank=- pid=" + std::to_string(getpid()) +
                                      " coordinator: committed version 7"))
      << lines[0];
  EXPECT_TRUE(absl::StrContains(lines[1], " WARN  coordinator rank=3 pid=")) << lines[1];
  EXPECT_TRUE(absl::EndsWith(lines[1], " daemon: slow step")) << lines[1];
}

TEST(LogTest, VerbosityShowsVLogAndDebug) {
  ASSERT_TRUE(InitLogging({"text", "info", 2, "daemon"}).ok());
  const std::string out = CaptureStderr([] {
    VLog(2, "daemon", "v2");
    VLog(3, "daemon", "v3");
    LogDebug("daemon", "debug");
  });
  EXPECT_TRUE(absl::StrContains(out, "DEBUG daemon rank=")) << out;
  EXPECT_TRUE(absl::StrContains(out, "daemon: v2")) << out;
  EXPECT_FALSE(absl::StrContains(out, "v3")) << out;
  EXPECT_TRUE(absl::StrContains(out, "daemon: debug")) << out;
}

TEST(LogTest, ErrorLevelDropsInfoAndWarnings) {
  ASSERT_TRUE(InitLogging({"text", "error", 0, "both"}).ok());
  const std::string out = CaptureStderr([] {
    LogInfo("x", "info");
    LogWarning("x", "warning");
    LogError("x", "error");
  });
  ASSERT_EQ(Lines(out).size(), 1u) << out;
  EXPECT_TRUE(absl::StrContains(out, "ERROR both")) << out;
}

TEST(LogTest, JsonLinesParseWithEveryField) {
  ASSERT_TRUE(InitLogging({"json", "info", 0, "daemon"}).ok());
  SetLogRank(1);
  const std::string out = CaptureStderr([] {
    LogInfo("daemon", "a \"quoted\"\tmessage\nwith a newline \\ and \x01");
    LogError("server", "bad");
  });
  const std::vector<std::string> lines = Lines(out);
  ASSERT_EQ(lines.size(), 2u) << out;
  const nlohmann::json j = nlohmann::json::parse(lines[0]);
  EXPECT_EQ(j["level"], "info");
  EXPECT_EQ(j["role"], "daemon");
  EXPECT_EQ(j["rank"], 1);
  EXPECT_EQ(j["pid"], getpid());
  EXPECT_EQ(j["tag"], "daemon");
  EXPECT_EQ(j["msg"], "a \"quoted\"\tmessage\nwith a newline \\ and \x01");
  EXPECT_EQ(j["ts"].get<std::string>().size(), std::string("2026-12-01T20:21:12.345+00:00").size());
  EXPECT_EQ(nlohmann::json::parse(lines[1])["level"], "error");
  SetLogRank(-1);
  ASSERT_TRUE(InitLogging({}).ok());
}

// A message that is not valid UTF-8 (a client's bytes quoted in a refusal,
// a path) still makes a line that parses: its bad bytes become U+FFFD.
TEST(LogTest, JsonLinesParseWhateverTheBytes) {
  ASSERT_TRUE(InitLogging({"json", "info", 0, "daemon"}).ok());
  const std::string out = CaptureStderr([] {
    LogInfo("daemon", "name \xff\xfe\xc3 end \x7f");
    LogInfo("daemon", "caf\xc3\xa9");
  });
  const std::vector<std::string> lines = Lines(out);
  ASSERT_EQ(lines.size(), 2u) << out;
  const nlohmann::json bad = nlohmann::json::parse(lines[0], nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(bad.is_discarded()) << lines[0];
  EXPECT_EQ(bad["msg"], "name \ufffd\ufffd\ufffd end \x7f");
  EXPECT_EQ(nlohmann::json::parse(lines[1])["msg"], "caf\xc3\xa9");
  ASSERT_TRUE(InitLogging({}).ok());
}

// The libraries' diagnostics in JSON mode: protobuf's and Abseil's
// internal log lines are JSON objects too.
TEST(LogTest, LibraryLinesAreJsonLinesToo) {
  ASSERT_TRUE(InitLogging({"json", "info", 0, "daemon"}).ok());
  RouteLibraryLogging();
  const std::string out = CaptureStderr([] {
    GOOGLE_LOG(WARNING) << "protobuf says\nno";
    ABSL_INTERNAL_LOG(ERROR, "abseil says no");
  });
  const std::vector<std::string> lines = Lines(out);
  ASSERT_EQ(lines.size(), 2u) << out;
  std::vector<std::string> tags;
  for (const std::string& line : lines) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(j.is_object()) << "not a JSON line: " << line;
    tags.push_back(j.value("tag", ""));
    EXPECT_TRUE(absl::StrContains(j.value("msg", ""), "says")) << line;
  }
  EXPECT_EQ(tags, (std::vector<std::string>{"protobuf", "absl"}));
  EXPECT_EQ(nlohmann::json::parse(lines[1])["level"], "error");
  ASSERT_TRUE(InitLogging({}).ok());
}

TEST(LogTest, BadOptionsAreRefused) {
  EXPECT_FALSE(InitLogging({"xml", "info", 0, "x"}).ok());
  EXPECT_FALSE(InitLogging({"text", "loud", 0, "x"}).ok());
  EXPECT_FALSE(InitLogging({"text", "info", -1, "x"}).ok());
}

}  // namespace
}  // namespace paramd
