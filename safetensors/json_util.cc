#include "safetensors/json_util.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"

namespace paramd {
namespace safetensors {
namespace internal {

absl::StatusOr<StrictJson> ParseStrictJson(absl::string_view text, absl::string_view what) {
  using Json = nlohmann::json;
  struct Frame {
    std::string name;  // key under which this object sits in its parent
    std::string last_key;
    std::set<std::string> keys;
  };
  std::vector<Frame> frames;
  StrictJson result;
  auto on_event = [&](int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        frames.push_back({frames.empty() ? "" : frames.back().last_key, "", {}});
        break;
      case Json::parse_event_t::object_end:
        if (!frames.empty()) frames.pop_back();
        break;
      case Json::parse_event_t::key: {
        Frame& frame = frames.back();
        frame.last_key = parsed.get<std::string>();
        if (!frame.keys.insert(frame.last_key).second && result.duplicate_key_path.empty()) {
          for (size_t i = 1; i < frames.size(); ++i) {
            result.duplicate_key_path.push_back(frames[i].name);
          }
          result.duplicate_key_path.push_back(frame.last_key);
        }
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    result.value = Json::parse(text.begin(), text.end(), on_event);
  } catch (const Json::parse_error& e) {
    // Only the position: nlohmann's message quotes the text around it
    // ("last read: ..."), which may be a file the caller must not see.
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is not valid JSON (syntax error at byte ", e.byte, ")"));
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is not valid JSON (error ", e.id, ")"));
  }
  return result;
}

}  // namespace internal
}  // namespace safetensors
}  // namespace paramd
