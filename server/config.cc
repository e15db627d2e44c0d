#include "server/config.h"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/internal/private_handle_accessor.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "proto/server_config.pb.h"

namespace paramd {
namespace {

namespace pb = google::protobuf;

// The flags whose values are one of a few words.
const std::map<std::string, std::vector<std::string>>& Choices() {
  static const auto* const choices = new std::map<std::string, std::vector<std::string>>{
      {"role", {"coordinator", "daemon", "both"}},
      {"data_plane", {"host", "local", "nccl"}},
      {"backend", {"auto", "cpu", "gpu"}},
      {"optimizer", {"adamw", "sgd"}},
      {"log_format", {"text", "json"}},
      {"log_level", {"debug", "info", "warning", "error"}},
  };
  return *choices;
}

class Collector : public pb::io::ErrorCollector {
 public:
  explicit Collector(std::string path) : path_(std::move(path)) {}
  void AddError(int line, pb::io::ColumnNumber column, const std::string& message) override {
    errors_.push_back(absl::StrCat(path_, ":", line + 1, ":", column + 1, ": ", message));
  }
  void AddWarning(int line, pb::io::ColumnNumber column, const std::string& message) override {
    AddError(line, column, message);
  }
  std::vector<std::string> errors_;

 private:
  const std::string path_;
};

std::string ValueText(const pb::Message& m, const pb::FieldDescriptor* f) {
  const pb::Reflection* r = m.GetReflection();
  switch (f->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_STRING:
      return r->GetString(m, f);
    case pb::FieldDescriptor::CPPTYPE_INT32:
      return absl::StrCat(r->GetInt32(m, f));
    case pb::FieldDescriptor::CPPTYPE_INT64:
      return absl::StrCat(r->GetInt64(m, f));
    case pb::FieldDescriptor::CPPTYPE_DOUBLE:
      return absl::StrCat(r->GetDouble(m, f));
    case pb::FieldDescriptor::CPPTYPE_BOOL:
      return r->GetBool(m, f) ? "true" : "false";
    default:
      return "";
  }
}

}  // namespace

absl::Status ApplyConfigText(const std::string& text, const std::string& path) {
  config::ServerConfig cfg;
  Collector collector(path);
  pb::TextFormat::Parser parser;
  parser.RecordErrorsTo(&collector);
  pb::TextFormat::ParseInfoTree locations;
  parser.WriteLocationsTo(&locations);
  if (!parser.ParseFromString(text, &cfg)) {
    if (collector.errors_.empty()) collector.errors_.push_back(path + ": cannot parse");
    return absl::InvalidArgumentError(absl::StrJoin(collector.errors_, "\n"));
  }
  auto where = [&](const pb::FieldDescriptor* f, int index) {
    const pb::TextFormat::ParseLocation l = locations.GetLocation(f, index);
    return absl::StrCat(path, ":", l.line + 1, ":", l.column + 1, ": ");
  };
  // (flag, value, location) in file order, all checked before any is set.
  struct Setting {
    absl::CommandLineFlag* flag;
    std::string value;
    std::string location;
  };
  std::vector<Setting> settings;
  std::vector<std::string> errors;
  const pb::Descriptor* d = cfg.GetDescriptor();
  const pb::Reflection* r = cfg.GetReflection();
  auto add = [&](const std::string& name, std::string value, std::string location) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr || name == "config") {
      errors.push_back(absl::StrCat(location, "hybrid-paramd has no flag --", name));
      return;
    }
    if (auto it = Choices().find(name);
        it != Choices().end() &&
        std::find(it->second.begin(), it->second.end(), value) == it->second.end()) {
      errors.push_back(absl::StrCat(location, name, " must be one of ",
                                    absl::StrJoin(it->second, ", "), "; got \"", value, "\""));
      return;
    }
    settings.push_back({flag, std::move(value), std::move(location)});
  };
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    if (f->is_repeated() || !r->HasField(cfg, f)) continue;
    add(f->name(), ValueText(cfg, f), where(f, -1));
  }
  const pb::FieldDescriptor* flag_field = d->FindFieldByName("flag");
  for (int i = 0; i < cfg.flag_size(); ++i) {
    add(cfg.flag(i).name(), cfg.flag(i).value(), where(flag_field, i));
  }
  // Typed check of every value against its flag (a throwaway parse: the
  // flags keep their values until everything is known good).
  for (const Setting& s : settings) {
    if (!absl::flags_internal::PrivateHandleAccessor::ValidateInputValue(*s.flag, s.value)) {
      errors.push_back(
          absl::StrCat(s.location, "bad value \"", s.value, "\" for --", s.flag->Name()));
    }
  }
  if (!errors.empty()) return absl::InvalidArgumentError(absl::StrJoin(errors, "\n"));
  for (const Setting& s : settings) {
    if (absl::flags_internal::PrivateHandleAccessor::IsSpecifiedOnCommandLine(*s.flag)) continue;
    std::string error;
    if (!s.flag->ParseFrom(s.value, &error)) {
      return absl::InvalidArgumentError(absl::StrCat(s.location, error));
    }
  }
  return absl::OkStatus();
}

absl::Status ApplyConfigFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return WithContext(text.status(), "--config");
  return ApplyConfigText(*text, path);
}

}  // namespace paramd
