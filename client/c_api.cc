// The C API of client/c_api.h over client::Client (and, with --config=cuda,
// gpu_fetch::DeviceFetcher). Every entry point validates its pointers, runs
// inside CApiCall (no exception crosses the C boundary) and reports through
// SetStatus.
#define HPD_BUILDING_LIBRARY 1
#include "client/c_api.h"
#include "client/c_api_internal.h"

#include <cctype>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "auth/security.h"
#include "client/client.h"
#include "client/model_source.h"
#include "client/weight_stream.h"
#include "common/status_macros.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"
#include "kernels/format.h"

#ifdef HPD_WITH_CUDA
#include "client/gpu_fetch/device_fetcher.h"
#endif

namespace paramd {
using capi::LiveClient;
using capi::NullArgument;
using capi::ParseDirection;
using capi::Timeout;

namespace {

// Live handles, so that a NULL, freed or foreign pointer is refused with
// INVALID_ARGUMENT instead of being dereferenced.
class Registry {
 public:
  void Add(const void* p) {
    absl::MutexLock lock(&mu_);
    live_.insert(p);
  }
  bool Remove(const void* p) {
    absl::MutexLock lock(&mu_);
    return live_.erase(p) > 0;
  }
  bool Contains(const void* p) const {
    absl::MutexLock lock(&mu_);
    return live_.contains(p);
  }

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_set<const void*> live_ ABSL_GUARDED_BY(mu_);
};

Registry& Clients() {
  static Registry* r = new Registry;
  return *r;
}
Registry& Manifests() {
  static Registry* r = new Registry;
  return *r;
}

int32_t SetStatus(hpd_status* status, const absl::Status& s) {
  const int32_t code = static_cast<int32_t>(s.code());
  if (status != nullptr) {
    status->code = code;
    const std::string message(s.message());
    const size_t n = std::min(message.size(), sizeof(status->message) - 1);
    std::memcpy(status->message, message.data(), n);
    status->message[n] = '\0';
  }
  return code;
}

// Runs `f` (returning absl::Status) and reports its status; C++ exceptions
// become statuses instead of unwinding into C.
template <typename F>
int32_t CApiCall(hpd_status* status, F&& f) {
  try {
    return SetStatus(status, f());
  } catch (const std::bad_alloc&) {
    return SetStatus(status, absl::ResourceExhaustedError("out of host memory"));
  } catch (const std::exception& e) {
    return SetStatus(status, absl::InternalError(absl::StrCat("exception: ", e.what())));
  } catch (...) {
    return SetStatus(status, absl::InternalError("unknown exception"));
  }
}

bool Set(const char* s) { return s != nullptr && s[0] != '\0'; }

// hpd_connect_options as API version 1000 knew it (up to `token`): callers
// built against that header pass this struct_size.
constexpr size_t kConnectOptionsV1000 = offsetof(hpd_connect_options, tls_server_name);

// A field appended after 1000, or NULL when the caller's struct is older.
const char* Appended(const hpd_connect_options* o, const char* const* field) {
  const size_t end = reinterpret_cast<const char*>(field + 1) - reinterpret_cast<const char*>(o);
  return o->struct_size >= end ? *field : nullptr;
}

absl::Status ToClientOptions(const hpd_connect_options& in, client::ClientOptions* o) {
  if (in.struct_size < kConnectOptionsV1000) {
    return absl::InvalidArgumentError(absl::StrCat("options.struct_size is ", in.struct_size,
                                                   ", expected ", sizeof(hpd_connect_options),
                                                   ": call hpd_connect_options_init first"));
  }
  if (in.expected_pushers < 0) return absl::InvalidArgumentError("expected_pushers < 0");
  if (Set(in.address)) o->coordinator_address = in.address;
  o->role =
      in.observer ? client::ClientOptions::Role::kObserver : client::ClientOptions::Role::kTrainer;
  o->pusher = in.pusher != 0;
  o->expected_pushers = in.expected_pushers;
  if (Set(in.name)) o->name = in.name;
  if (in.connect_timeout_ms > 0) o->connect_timeout = absl::Milliseconds(in.connect_timeout_ms);
  if (in.call_timeout_ms > 0) o->call_timeout = absl::Milliseconds(in.call_timeout_ms);
  o->max_chunk_bytes = in.max_chunk_bytes;
  if (Set(in.tls_root_certs_path)) o->tls.ca = in.tls_root_certs_path;
  if (Set(in.tls_cert_chain_path)) o->tls.cert = in.tls_cert_chain_path;
  if (Set(in.tls_private_key_path)) o->tls.key = in.tls_private_key_path;
  if (const char* name = Appended(&in, &in.tls_server_name); Set(name)) {
    o->tls.server_name = name;
  }
  const char* token_file = Appended(&in, &in.token_file);
  if (Set(in.token) && Set(token_file)) {
    return absl::InvalidArgumentError("give token or token_file, not both");
  }
  // As hpctl: HPCTL_TOKEN_FILE when neither is given.
  if (!Set(in.token) && !Set(token_file)) token_file = std::getenv("HPCTL_TOKEN_FILE");
  if (Set(in.token)) o->token = in.token;
  if (Set(token_file)) {
    ASSIGN_OR_RETURN(o->token,
                     auth::LoadClientToken(
                         token_file, in.observer ? auth::Role::kOperator : auth::Role::kTrainer));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace paramd

struct hpd_manifest {
  paramd::client::Manifest manifest;
  std::vector<hpd_tensor_info> infos;  // names point into manifest
};

namespace paramd {
namespace {

absl::StatusOr<const hpd_manifest*> LiveManifest(const hpd_manifest* m) {
  if (m == nullptr) return NullArgument("manifest");
  if (!Manifests().Contains(m)) {
    return absl::InvalidArgumentError("not a live hpd_manifest handle (freed or foreign)");
  }
  return m;
}

void FillDirection(const client::TensorMeta& t, Direction d, hpd_direction_info* out) {
  *out = hpd_direction_info{};
  if (!t.Publishes(d)) return;
  const QuantSpec& spec = t.SpecOf(d);
  absl::StatusOr<Layout> layout = ComputeLayout(spec, d, t.rows, t.cols);
  if (!layout.ok()) return;  // the daemons could not have published it either
  out->published = 1;
  out->format = static_cast<int32_t>(spec.format);
  out->fp8_type = static_cast<int32_t>(spec.fp8_type);
  out->transposed = layout->transposed ? 1 : 0;
  out->two_d = spec.two_d ? 1 : 0;
  out->scale_elem_bytes = layout->scale_elem_bytes;
  out->data_rows = layout->data_rows;
  out->data_row_bytes = layout->data_row_bytes;
  out->data_bytes = layout->data_bytes();
  out->scale_rows = layout->scale_rows;
  out->scale_cols = layout->scale_cols;
  out->scale_bytes = layout->scale_bytes();
}

std::unique_ptr<hpd_manifest> MakeManifest(client::Manifest manifest) {
  auto m = std::make_unique<hpd_manifest>();
  m->manifest = std::move(manifest);
  m->infos.reserve(m->manifest.tensors.size());
  for (const client::TensorMeta& t : m->manifest.tensors) {
    hpd_tensor_info info{};
    info.name = t.name.c_str();
    info.ndim = static_cast<int32_t>(std::min<size_t>(t.shape.size(), HPD_MAX_RANK));
    for (int i = 0; i < info.ndim; ++i) info.shape[i] = t.shape[i];
    info.rows = t.rows;
    info.cols = t.cols;
    info.num_pieces = static_cast<int32_t>(t.pieces.size());
    FillDirection(t, Direction::kRowwise, &info.dir[HPD_ROWWISE]);
    FillDirection(t, Direction::kColumnwise, &info.dir[HPD_COLUMNWISE]);
    m->infos.push_back(info);
  }
  return m;
}

void FillVersionInfo(const client::VersionInfo& v, hpd_version_info* info) {
  *info = hpd_version_info{};
  info->committed_version = v.committed_version;
  info->rewound = v.rewound_to.has_value() ? 1 : 0;
  info->rewound_to_version = v.rewound_to.value_or(-1);
  info->recovery_epoch = v.recovery_epoch;
}

absl::Status LoadModel(hpd_client* c, const hpd_load_options& o, int64_t* version) {
  ASSIGN_OR_RETURN(const capi::StreamLoadSettings settings, capi::StreamLoadSettingsOf(o));
  if (!Set(o.model)) return absl::InvalidArgumentError("options.model is empty");
  std::error_code ec;
  const std::string model = std::filesystem::absolute(o.model, ec).string();
  ASSIGN_OR_RETURN(std::vector<std::string> files, client::ModelFiles(model));
  int64_t v = 0;
  if (files.size() == 1 && files[0] == model && !o.stream) {
    ASSIGN_OR_RETURN(
        v, c->client->Load(model, settings.recipe, settings.timeout, settings.replace_model));
  } else {
    ASSIGN_OR_RETURN(client::ModelSources sources, client::WeightSources(files));
    ASSIGN_OR_RETURN(
        v, client::StreamLoad(*c->client, sources.weights, settings.recipe, settings.progress,
                              settings.timeout, settings.replace_model, sources.frozen));
  }
  if (version != nullptr) *version = v;
  return absl::OkStatus();
}

absl::StatusOr<std::string> ToJson(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  const auto s = google::protobuf::util::MessageToJsonString(m, &out, options);
  if (!s.ok()) return absl::InternalError(absl::StrCat("to JSON: ", s.ToString()));
  return out;
}

// A malloc'ed copy for hpd_free_string.
absl::Status ReturnString(const std::string& s, char** out) {
  char* copy = static_cast<char*>(std::malloc(s.size() + 1));
  if (copy == nullptr) return absl::ResourceExhaustedError("out of host memory");
  std::memcpy(copy, s.c_str(), s.size() + 1);
  *out = copy;
  return absl::OkStatus();
}

absl::StatusOr<recipe::LrSchedule> ParseSchedule(const char* text) {
  recipe::LrSchedule schedule;
  absl::string_view t(text);
  while (!t.empty() && std::isspace(static_cast<unsigned char>(t.front()))) t.remove_prefix(1);
  if (!t.empty() && t.front() == '{') {
    const auto s = google::protobuf::util::JsonStringToMessage(std::string(t), &schedule);
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("schedule JSON: ", s.ToString()));
    }
    return schedule;
  }
  // Parse errors are collected rather than logged to stderr.
  class Collector : public google::protobuf::io::ErrorCollector {
   public:
    void AddError(int line, int column, const std::string& message) override {
      if (first.empty()) first = absl::StrCat(line + 1, ":", column + 1, ": ", message);
    }
    std::string first;
  } errors;
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(std::string(t), &schedule)) {
    return absl::InvalidArgumentError(
        absl::StrCat("schedule (paramd.recipe.LrSchedule text): ", errors.first));
  }
  return schedule;
}

}  // namespace
}  // namespace paramd

using paramd::CApiCall;
using paramd::LiveManifest;
using paramd::capi::LiveClient;
using paramd::capi::NullArgument;

extern "C" {

int32_t hpd_api_version(void) { return HPD_API_VERSION; }

const char* hpd_code_name(int32_t code) {
  static const char* const kNames[] = {"OK",
                                       "CANCELLED",
                                       "UNKNOWN",
                                       "INVALID_ARGUMENT",
                                       "DEADLINE_EXCEEDED",
                                       "NOT_FOUND",
                                       "ALREADY_EXISTS",
                                       "PERMISSION_DENIED",
                                       "RESOURCE_EXHAUSTED",
                                       "FAILED_PRECONDITION",
                                       "ABORTED",
                                       "OUT_OF_RANGE",
                                       "UNIMPLEMENTED",
                                       "INTERNAL",
                                       "UNAVAILABLE",
                                       "DATA_LOSS",
                                       "UNAUTHENTICATED"};
  if (code < 0 || code > 16) return "UNKNOWN";
  return kNames[code];
}

int32_t hpd_has_cuda(void) {
#ifdef HPD_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

void hpd_connect_options_init(hpd_connect_options* options) {
  if (options == nullptr) return;
  *options = hpd_connect_options{};
  options->struct_size = sizeof(hpd_connect_options);
  options->pusher = 1;
}

int32_t hpd_connect(const hpd_connect_options* options, hpd_client** client, hpd_status* status) {
  return CApiCall(status, [&]() -> absl::Status {
    if (client == nullptr) return NullArgument("client");
    *client = nullptr;
    if (options == nullptr) return NullArgument("options");
    paramd::client::ClientOptions o;
    RETURN_IF_ERROR(paramd::ToClientOptions(*options, &o));
    ASSIGN_OR_RETURN(std::unique_ptr<paramd::client::Client> c, paramd::client::Client::Connect(o));
    auto handle = std::make_unique<hpd_client>();
    handle->client = std::move(c);
    paramd::Clients().Add(handle.get());
    *client = handle.release();
    return absl::OkStatus();
  });
}

int32_t hpd_close(hpd_client* client, hpd_status* status) {
  return CApiCall(status, [&]() -> absl::Status {
    if (client == nullptr) return absl::OkStatus();
    if (!paramd::Clients().Remove(client)) {
      return absl::InvalidArgumentError("not a live hpd_client handle (closed or foreign)");
    }
    delete client;
    return absl::OkStatus();
  });
}

int32_t hpd_member(hpd_client* client, int32_t* rank, char* id, size_t id_bytes,
                   hpd_status* status) {
  return CApiCall(status, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(hpd_client * c, LiveClient(client));
    if (rank != nullptr) *rank = c->client->rank();
    if (id != nullptr && id_bytes > 0) {
      const std::string& m = c->client->member_id();
      if (m.size() + 1 > id_bytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("id buffer of ", id_bytes, " bytes; the id needs ", m.size() + 1));
      }
      std::memcpy(id, m.c_str(), m.size() + 1);
    }
    return absl::OkStatus();
  });
}

int32_t hpd_get_manifest(hpd_client* client, int32_t refresh, hpd_manifest** manifest,
                         hpd_status* status) {
  return CApiCall(status, [&]() -> absl::Status {
    if (manifest == nullptr) return NullArgument("manifest");
    *manifest = nullptr;
    ASSIGN_OR_RETURN(hpd_client * c, LiveClient(client));
    paramd::client::Manifest m;
    if (refresh) {
      ASSIGN_OR_RETURN(m, c->client->RefreshManifest());
    } else {
      m = c->client->manifest();
    }
    std::unique_ptr<hpd_manifest> h = paramd::MakeManifest(std::move(m));
    paramd::Manifests().Add(h.get());
    *manifest = h.release();
    return absl::OkStatus();
  });
}

void hpd_manifest_free(hpd_manifest* manifest) {
  if (manifest != nullptr && paramd::Manifests().Remove(manifest)) delete manifest;
}

int32_t hpd_manifest_num_tensors(const hpd_manifest* manifest, int64_t* count, hpd_status* status) {
  return CApiCall(status, [&]() -> absl::Status {
    if (count == nullptr) return NullArgument("count");
    ASSIGN_OR_RETURN(const hpd_manifest* m, LiveManifest(manifest));
    *count = static_cast<int64_t>(m->infos.size());
    return absl::OkStatus();
  });
}

int32_t hpd_manifest_summary(const hpd_manifest* manifest, int32_t* num_daemons,
                             int32_t* expected_pushers, int64_t* committed_version,
                             hpd_status* status) {
  return CApiCall(status, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(const hpd_manifest* m, LiveManifest(manifest));
    if (num_daemons != nullptr) *num_daemons = m->manifest.num_daemons;
    if (expected_pushers != nullptr) *expected_pushers = m->manifest.expected_pushers;
    if (committed_version != nullptr) *committed_version = m->manifest.committed_version;
    return absl::OkStatus();
  });
}

int32_t hpd_manifest_tensor(const hpd_manifest* manifest, int64_t index, hpd_tensor_info* info,
                            hpd_status* status) {
  return CApiCall(status, [&]() -> absl::Status {
    if (info == nullptr) return NullArgument("info");
    ASSIGN_OR_RETURN(const hpd_manifest* m, LiveManifest(manifest));
    if (index < 0 || index >= static_cast<int64_t>(m->infos.size())) {
      return absl::OutOfRangeError(absl::StrCat("tensor index ", index, " of ", m->infos.size()));
    }
    *info = m->infos[index];
    return absl::OkStatus();
  });
}

int32_t hpd_manifest_find(const hpd_manifest* manifest, const char* name, int64_t* index,
                          hpd_status* status) {
  return CApiCall(status, [&]() -> absl::Status {
    if (name == nullptr) return NullArgument("name");
    if (index == nullptr) return NullArgument("index");
    ASSIGN_OR_RETURN(const hpd_manifest* m, LiveManifest(manifest));
    for (size_t i = 0; i < m->manifest.tensors.size(); ++i) {
      if (m->manifest.tensors[i].name == name) {
        *index = static_cast<int64_t>(i);
        return absl::OkStatus();
      }
    }
    return absl::NotFoundError(absl::StrCat("no tensor '", name, "' in the manifest"));
  });
}

int32_t hpd_wait_for_version(hpd_client* client, int64_t min_version, int64_t timeout_ms,
                             int64_t* version, hpd_status* status) {
  return CApiCall(status, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(hpd_client * c, LiveClient(client));
    absl::Duration timeout = paramd::Timeout(timeout_ms);
    if (timeout == absl::ZeroDuration()) timeout = absl::Seconds(30);
    ASSIGN_OR_RETURN(const int64_t v, c->client->WaitForVersion(min_version, timeout));
    if (version != nullptr) *version = v;
    return absl::OkStatus();
  });
}

int32_t hpd_wait_for_version_info(hpd_client* client, int64_t min_version, int64_t timeout_ms,
                                  hpd_version_info* info, hpd_status* status) {
  return CApiCall(status, [&]() -> absl::Status {
    if (info == nullptr) return NullArgument("info");
    ASSIGN_OR_RETURN(hpd_client * c, LiveClient(client));
    absl::Duration timeout = paramd::Timeout(timeout_ms);
    if (timeout == absl::ZeroDuration()) timeout = absl::Seconds(30);
    ASSIGN_OR_RETURN(const paramd::client::VersionInfo v,
                     c->client->WaitForVersionInfo(min_version, timeout));
    paramd::FillVersionInfo(v, info);
    return absl::OkStatus();
  });
}

int32_t hpd_watch_version(hpd_client* client, int64_t min_version, int64_t timeout_ms,
                          hpd_version_event_fn on_event, void* arg, hpd_status* status) {
  return CApiCall(status, [&]() -> absl::Status {
    if (on_event == nullptr) return NullArgument("on_event");
    ASSIGN_OR_RETURN(hpd_client * c, LiveClient(client));
    absl::Duration timeout = paramd::Timeout(timeout_ms);
    if (timeout == absl::ZeroDuration()) timeout = absl::Seconds(30);
    return c->client->WatchVersion(
        min_version,
        [&](const paramd::client::VersionInfo& v) {
          hpd_version_info info;
          paramd::FillVersionInfo(v, &info);
          return on_event(arg, &info) != 0;
        },
        timeout);
  });
}

int32_t hpd_status_json(hpd_client* client, int32_t include_shards, int64_t timeout_ms, char** json,
                        hpd_status* status) {
  return CApiCall(status, [&]() -> absl::Status {
    if (json == nullptr) return NullArgument("json");
    *json = nullptr;
    ASSIGN_OR_RETURN(hpd_client * c, LiveClient(client));
    ASSIGN_OR_RETURN(paramd::rpc::GetStatusResponse r,
                     c->client->Status(include_shards != 0, paramd::Timeout(timeout_ms)));
    ASSIGN_OR_RETURN(const std::string out, paramd::ToJson(r));
    return paramd::ReturnString(out, json);
  });
}

int32_t hpd_load(hpd_client* client, const char* safetensors_path, const char* recipe_text,
                 int64_t timeout_ms, int64_t* version, hpd_status* status) {
  return CApiCall(status, [&]() -> absl::Status {
    if (safetensors_path == nullptr) return NullArgument("safetensors_path");
    ASSIGN_OR_RETURN(hpd_client * c, LiveClient(client));
    ASSIGN_OR_RETURN(const int64_t v,
                     c->client->Load(safetensors_path, recipe_text ? recipe_text : "",
                                     paramd::Timeout(timeout_ms)));
    if (version != nullptr) *version = v;
    return absl::OkStatus();
  });
}

void hpd_load_options_init(hpd_load_options* options) {
  if (options == nullptr) return;
  *options = hpd_load_options{};
  options->struct_size = sizeof(hpd_load_options);
}

int32_t hpd_load_model(hpd_client* client, const hpd_load_options* options, int64_t* version,
                       hpd_status* status) {
  return CApiCall(status, [&]() -> absl::Status {
    if (options == nullptr) return NullArgument("options");
    ASSIGN_OR_RETURN(hpd_client * c, LiveClient(client));
    return paramd::LoadModel(c, *options, version);
  });
}

int32_t hpd_set_optimizer_schedule(hpd_client* client, const char* schedule, int32_t has_lr,
                                   float lr, int64_t timeout_ms, char** optimizer_json,
                                   hpd_status* status) {
  return CApiCall(status, [&]() -> absl::Status {
    if (optimizer_json != nullptr) *optimizer_json = nullptr;
    if (schedule == nullptr) return NullArgument("schedule");
    ASSIGN_OR_RETURN(hpd_client * c, LiveClient(client));
    ASSIGN_OR_RETURN(const paramd::recipe::LrSchedule s, paramd::ParseSchedule(schedule));
    ASSIGN_OR_RETURN(
        const paramd::recipe::OptimizerConfig config,
        c->client->SetOptimizerSchedule(s, has_lr ? std::optional<float>(lr) : std::nullopt,
                                        paramd::Timeout(timeout_ms)));
    if (optimizer_json == nullptr) return absl::OkStatus();
    ASSIGN_OR_RETURN(const std::string out, paramd::ToJson(config));
    return paramd::ReturnString(out, optimizer_json);
  });
}

int32_t hpd_step(hpd_client* client, int64_t version, int32_t wait, int64_t timeout_ms,
                 int64_t* new_version, hpd_status* status) {
  return CApiCall(status, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(hpd_client * c, LiveClient(client));
    ASSIGN_OR_RETURN(const int64_t v,
                     c->client->Step(version, wait != 0, paramd::Timeout(timeout_ms)));
    if (new_version != nullptr) *new_version = v;
    return absl::OkStatus();
  });
}

void hpd_free_string(char* s) { std::free(s); }

}  // extern "C"

// For the C API's other files (client/c_api_internal.h).
namespace paramd {
namespace capi {

absl::Duration Timeout(int64_t ms) {
  return ms <= 0 ? absl::ZeroDuration() : absl::Milliseconds(ms);
}

absl::Status NullArgument(const char* what) {
  return absl::InvalidArgumentError(absl::StrCat(what, " is NULL"));
}

absl::StatusOr<Direction> ParseDirection(int32_t d) {
  if (d == HPD_ROWWISE) return Direction::kRowwise;
  if (d == HPD_COLUMNWISE) return Direction::kColumnwise;
  return absl::InvalidArgumentError(
      absl::StrCat("bad direction ", d, " (0 rowwise, 1 columnwise)"));
}

absl::StatusOr<hpd_client*> LiveClient(hpd_client* c) {
  if (c == nullptr) return NullArgument("client");
  if (!Clients().Contains(c)) {
    return absl::InvalidArgumentError("not a live hpd_client handle (closed or foreign)");
  }
  return c;
}

absl::StatusOr<client::Client*> ClientOf(hpd_client* handle) {
  ASSIGN_OR_RETURN(hpd_client * c, LiveClient(handle));
  return c->client.get();
}

int32_t Call(hpd_status* status, const std::function<absl::Status()>& f) {
  return CApiCall(status, f);
}

absl::StatusOr<std::string> ToJson(const google::protobuf::Message& m) { return paramd::ToJson(m); }

absl::Status ReturnString(const std::string& s, char** out) { return paramd::ReturnString(s, out); }

absl::StatusOr<StreamLoadSettings> StreamLoadSettingsOf(const hpd_load_options& o) {
  if (o.struct_size < sizeof(hpd_load_options)) {
    return absl::InvalidArgumentError(absl::StrCat("options.struct_size is ", o.struct_size,
                                                   ", expected ", sizeof(hpd_load_options),
                                                   ": call hpd_load_options_init first"));
  }
  StreamLoadSettings settings;
  settings.timeout = o.timeout_ms > 0 ? absl::Milliseconds(o.timeout_ms) : absl::Hours(1);
  settings.recipe = o.recipe_text != nullptr ? o.recipe_text : "";
  settings.replace_model = o.force != 0;
  settings.progress = [](const client::StreamProgress&) {};
  if (o.progress != nullptr) {
    // Copies of the caller's function and argument: the settings may
    // outlive `o`'s reference.
    const hpd_progress_fn fn = o.progress;
    void* const arg = o.progress_arg;
    settings.progress = [fn, arg](const client::StreamProgress& p) {
      fn(arg, p.bytes_sent, p.bytes_total);
    };
  }
  return settings;
}

}  // namespace capi
}  // namespace paramd
