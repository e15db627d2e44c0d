#include "common/log.h"

#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "spdlog/logger.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_sinks.h"

namespace paramd {
namespace {

std::atomic<int> g_rank{-1};
std::atomic<int> g_verbosity{0};

spdlog::level::level_enum ToSpd(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return spdlog::level::debug;
    case LogLevel::kInfo:
      return spdlog::level::info;
    case LogLevel::kWarning:
      return spdlog::level::warn;
    case LogLevel::kError:
      break;
  }
  return spdlog::level::err;
}

const char* LevelName(spdlog::level::level_enum level) {
  switch (level) {
    case spdlog::level::trace:
    case spdlog::level::debug:
      return "DEBUG";
    case spdlog::level::info:
      return "INFO";
    case spdlog::level::warn:
      return "WARN";
    default:
      return "ERROR";
  }
}

std::string TimeText(spdlog::log_clock::time_point t) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E3S%Ez", absl::FromChrono(t), absl::LocalTimeZone());
}

// The process's role, shared by both formatters (set by InitLogging).
class RoleHolder {
 public:
  void Set(std::string role) {
    absl::MutexLock lock(&mu_);
    role_ = std::move(role);
  }
  std::string Get() const {
    absl::MutexLock lock(&mu_);
    return role_;
  }

 private:
  mutable absl::Mutex mu_;
  std::string role_ = "-";
};

RoleHolder& Role() {
  static RoleHolder* const role = new RoleHolder();
  return *role;
}

void Append(spdlog::memory_buf_t& dest, absl::string_view text) {
  dest.append(text.data(), text.data() + text.size());
}

// Custom pattern flags of the text format: %q role, %k rank ("-" for
// none), %V the level in capitals, padded to 5.
class RoleFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    Append(dest, Role().Get());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<RoleFlag>();
  }
};

class RankFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    const int rank = g_rank.load();
    Append(dest, rank < 0 ? std::string("-") : absl::StrCat(rank));
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<RankFlag>();
  }
};

class LevelFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    // Padded here: spdlog leaves a custom flag's padding to the flag.
    const absl::string_view name = LevelName(msg.level);
    Append(dest, name);
    for (size_t i = name.size(); i < 5; ++i) dest.push_back(' ');
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<LevelFlag>();
  }
};

std::unique_ptr<spdlog::formatter> TextFormatter() {
  auto f = std::make_unique<spdlog::pattern_formatter>();
  f->add_flag<RoleFlag>('q').add_flag<RankFlag>('k').add_flag<LevelFlag>('V');
  // Time with the zone offset, as TimeText.
  f->set_pattern("%Y-%m-%dT%H:%M:%S.%e%z %V %q rank=%k pid=%P %n: %v");
  return f;
}

// One JSON object per line: ts, level, role, rank, pid, tag, msg, written
// by nlohmann-json (bytes that are not UTF-8 become U+FFFD, so every line
// parses).
class JsonFormatter : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    nlohmann::ordered_json line;
    line["ts"] = TimeText(msg.time);
    line["level"] = absl::AsciiStrToLower(LevelName(msg.level));
    line["role"] = Role().Get();
    line["rank"] = g_rank.load();
    line["pid"] = getpid();
    line["tag"] = std::string(msg.logger_name.data(), msg.logger_name.size());
    line["msg"] = std::string(msg.payload.data(), msg.payload.size());
    Append(dest, line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    dest.push_back('\n');
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>();
  }
};

// One spdlog logger per tag (its name is the tag), all writing to one
// stderr sink: the sink's mutex keeps lines whole.
class Loggers {
 public:
  Loggers() : sink_(std::make_shared<spdlog::sinks::stderr_sink_mt>()) {
    sink_->set_formatter(TextFormatter());
  }

  std::shared_ptr<spdlog::logger> Get(absl::string_view tag) {
    {
      absl::ReaderMutexLock lock(&mu_);
      auto it = loggers_.find(tag);
      if (it != loggers_.end()) return it->second;
    }
    absl::MutexLock lock(&mu_);
    auto& logger = loggers_[tag];
    if (logger == nullptr) {
      logger = std::make_shared<spdlog::logger>(std::string(tag), sink_);
      logger->set_level(spdlog::level::trace);  // filtered by LogEnabled
      logger->flush_on(spdlog::level::trace);
    }
    return logger;
  }

  void SetFormatter(std::unique_ptr<spdlog::formatter> f) { sink_->set_formatter(std::move(f)); }

  std::atomic<int> level{spdlog::level::info};

 private:
  std::shared_ptr<spdlog::sinks::stderr_sink_mt> sink_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<spdlog::logger>> loggers_ ABSL_GUARDED_BY(mu_);
};

Loggers& All() {
  static Loggers* const loggers = new Loggers();
  return *loggers;
}

}  // namespace

absl::Status InitLogging(const LogOptions& options) {
  spdlog::level::level_enum level;
  if (options.level == "debug") {
    level = spdlog::level::debug;
  } else if (options.level == "info") {
    level = spdlog::level::info;
  } else if (options.level == "warning" || options.level == "warn") {
    level = spdlog::level::warn;
  } else if (options.level == "error") {
    level = spdlog::level::err;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--log_level must be debug, info, warning or error, got \"", options.level, "\""));
  }
  if (options.format != "text" && options.format != "json") {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_format must be text or json, got \"", options.format, "\""));
  }
  if (options.verbosity < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--v must be >= 0, got ", options.verbosity));
  }
  if (options.verbosity > 0) level = spdlog::level::debug;
  Loggers& all = All();
  all.SetFormatter(options.format == "json"
                       ? std::unique_ptr<spdlog::formatter>(std::make_unique<JsonFormatter>())
                       : TextFormatter());
  all.level.store(level);
  g_verbosity.store(options.verbosity);
  Role().Set(options.role.empty() ? "-" : options.role);
  return absl::OkStatus();
}

void SetLogRank(int rank) { g_rank.store(rank); }

bool LogEnabled(LogLevel level) { return ToSpd(level) >= All().level.load(); }

bool VLogEnabled(int verbosity) { return verbosity <= g_verbosity.load(); }

void LogAt(LogLevel level, absl::string_view tag, absl::string_view message) {
  if (!LogEnabled(level)) return;
  All().Get(tag)->log(ToSpd(level), spdlog::string_view_t(message.data(), message.size()));
}

void VLog(int verbosity, absl::string_view tag, absl::string_view message) {
  if (!VLogEnabled(verbosity)) return;
  LogAt(LogLevel::kDebug, tag, message);
}

}  // namespace paramd
