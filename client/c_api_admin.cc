// The C API's models in memory, versions read back, exports and checkpoint
// calls (client/c_api.h, "Models in memory, ..."), over
// client/weight_stream.h and client/cluster_admin.h.
#define HPD_BUILDING_LIBRARY 1
#include "client/c_api.h"
#include "client/c_api_internal.h"

#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/export.h"
#include "client/cluster_admin.h"
#include "client/weight_stream.h"
#include "common/file_util.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "safetensors/safetensors.h"

namespace paramd {
namespace {

// HPD_DTYPE_ codes of frozen buffers and their safetensors names.
constexpr std::pair<int32_t, safetensors::Dtype> kFrozenDtypes[] = {
    {HPD_DTYPE_F64, safetensors::Dtype::kF64},
    {HPD_DTYPE_I64, safetensors::Dtype::kI64},
    {HPD_DTYPE_I32, safetensors::Dtype::kI32},
    {HPD_DTYPE_I16, safetensors::Dtype::kI16},
    {HPD_DTYPE_I8, safetensors::Dtype::kI8},
    {HPD_DTYPE_U8, safetensors::Dtype::kU8},
    {HPD_DTYPE_BOOL, safetensors::Dtype::kBool},
    {HPD_DTYPE_U16, safetensors::Dtype::kU16},
    {HPD_DTYPE_U32, safetensors::Dtype::kU32},
    {HPD_DTYPE_U64, safetensors::Dtype::kU64},
    {HPD_DTYPE_F8_E4M3, safetensors::Dtype::kF8E4M3},
    {HPD_DTYPE_F8_E5M2, safetensors::Dtype::kF8E5M2},
    {HPD_DTYPE_F8_E8M0, safetensors::Dtype::kF8E8M0},
};

const safetensors::Dtype* FrozenDtypeOf(int32_t code) {
  for (const auto& [c, dtype] : kFrozenDtypes) {
    if (c == code) return &dtype;
  }
  return nullptr;
}

// The HPD_DTYPE_ code of a frozen buffer's safetensors dtype name.
absl::StatusOr<int32_t> FrozenCodeOf(const FrozenTensor& f) {
  for (const auto& [c, dtype] : kFrozenDtypes) {
    if (safetensors::DtypeName(dtype) == f.dtype()) return c;
  }
  return absl::UnimplementedError(absl::StrCat("frozen buffer ", QuoteForError(f.name()), " is ",
                                               f.dtype(), ", which this library cannot return"));
}

// The shape of `t` (checked) and its element count.
absl::StatusOr<std::vector<int64_t>> ShapeOf(const hpd_host_tensor& t, const std::string& what,
                                             int64_t* elements) {
  if (t.ndim < 0 || t.ndim > 16 || (t.ndim > 0 && t.shape == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": bad shape (ndim ", t.ndim, ")"));
  }
  std::vector<int64_t> shape;
  *elements = 1;
  for (int32_t d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0 || (t.shape[d] > 0 && *elements > (int64_t{1} << 50) / t.shape[d])) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": bad dimension ", t.shape[d]));
    }
    *elements *= t.shape[d];
    shape.push_back(t.shape[d]);
  }
  return shape;
}

absl::Status CheckDataBytes(const hpd_host_tensor& t, const std::string& what,
                            const std::vector<int64_t>& shape, int64_t bytes) {
  if (t.data_bytes != bytes || (bytes > 0 && t.data == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", t.data_bytes,
                                                   " bytes given, its shape [",
                                                   absl::StrJoin(shape, ", "), "] needs ", bytes));
  }
  return absl::OkStatus();
}

// A caller tensor of a frozen-buffer dtype, copied whole.
absl::StatusOr<FrozenTensor> FrozenOf(const hpd_host_tensor& t, const std::string& name,
                                      safetensors::Dtype dtype) {
  const std::string what = absl::StrCat("tensor ", QuoteForError(name));
  int64_t elements = 0;
  ASSIGN_OR_RETURN(const std::vector<int64_t> shape, ShapeOf(t, what, &elements));
  const int64_t bytes = elements * safetensors::DtypeSize(dtype);
  RETURN_IF_ERROR(CheckDataBytes(t, what, shape, bytes));
  FrozenTensor f;
  f.set_name(name);
  f.set_dtype(std::string(safetensors::DtypeName(dtype)));
  for (int64_t d : shape) f.add_shape(d);
  f.set_data(static_cast<const char*>(t.data), static_cast<size_t>(bytes));
  return f;
}

// One caller tensor as a WeightSource that copies out of the caller's
// buffer (valid for the whole hpd_load_tensors call).
absl::StatusOr<client::WeightSource> SourceOf(const hpd_host_tensor& t, int64_t index) {
  if (t.name == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("tensors[", index, "].name is NULL"));
  }
  const std::string name = t.name;
  RETURN_IF_ERROR(CheckTensorName(name));
  const std::string what = absl::StrCat("tensor ", QuoteForError(name));
  if (t.dtype != HPD_DTYPE_F32 && t.dtype != HPD_DTYPE_BF16) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": dtype ", t.dtype, " is not one of the HPD_DTYPE_ codes"));
  }
  client::WeightSource source;
  source.name = name;
  int64_t elements = 0;
  ASSIGN_OR_RETURN(source.shape, ShapeOf(t, what, &elements));
  const bool bf16 = t.dtype == HPD_DTYPE_BF16;
  const int64_t bytes = elements * (bf16 ? 2 : 4);
  RETURN_IF_ERROR(CheckDataBytes(t, what, source.shape, bytes));
  source.dtype = bf16 ? client::Gradient::DType::kBf16 : client::Gradient::DType::kFp32;
  const auto* data = static_cast<const uint8_t*>(t.data);
  source.read = [data, bytes, what](int64_t offset, absl::Span<uint8_t> out) -> absl::Status {
    if (offset < 0 || offset + static_cast<int64_t>(out.size()) > bytes) {
      return absl::InternalError(absl::StrCat(what, ": read past its end"));
    }
    std::memcpy(out.data(), data + offset, out.size());
    return absl::OkStatus();
  };
  return source;
}

absl::Status CheckReadOptions(const hpd_read_options& o) {
  if (o.struct_size < sizeof(hpd_read_options)) {
    return absl::InvalidArgumentError(absl::StrCat("options.struct_size is ", o.struct_size,
                                                   ", expected ", sizeof(hpd_read_options),
                                                   ": call hpd_read_options_init first"));
  }
  if (o.dtype != HPD_DTYPE_F32 && o.dtype != HPD_DTYPE_BF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.dtype ", o.dtype, " is neither HPD_DTYPE_F32 nor HPD_DTYPE_BF16"));
  }
  if (o.values != HPD_VALUES_MASTER && o.values != HPD_VALUES_ROWWISE &&
      o.values != HPD_VALUES_COLUMNWISE) {
    return absl::InvalidArgumentError(absl::StrCat("options.values ", o.values, " is unknown"));
  }
  return absl::OkStatus();
}

client::OpenVersionOptions OpenOptionsOf(const hpd_read_options& o) {
  client::OpenVersionOptions options;
  options.version = o.version;
  options.values = o.values == HPD_VALUES_ROWWISE      ? checkpoint::ExportValuesKind::kRowwise
                   : o.values == HPD_VALUES_COLUMNWISE ? checkpoint::ExportValuesKind::kColumnwise
                                                       : checkpoint::ExportValuesKind::kMaster;
  if (o.checkpoint_dir != nullptr) options.checkpoint_dir = o.checkpoint_dir;
  return options;
}

checkpoint::ExportDtype ExportDtypeOf(const hpd_read_options& o) {
  return o.dtype == HPD_DTYPE_F32 ? checkpoint::ExportDtype::kFp32 : checkpoint::ExportDtype::kBf16;
}

absl::Status ParseJsonRequest(const char* json, google::protobuf::Message* request) {
  if (json == nullptr || json[0] == '\0') return absl::OkStatus();
  const auto s = google::protobuf::util::JsonStringToMessage(json, request);
  if (!s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_json is not a ", request->GetTypeName(), ": ", s.ToString()));
  }
  return absl::OkStatus();
}

absl::Duration TimeoutOr(int64_t ms, absl::Duration otherwise) {
  return ms > 0 ? absl::Milliseconds(ms) : otherwise;
}

// One checkpoint call with its request parsed from JSON and its response
// returned as JSON.
template <class Request, class Response>
absl::StatusOr<std::string> JsonCall(client::Client& c,
                                     absl::StatusOr<Response> (*call)(client::Client&,
                                                                      const Request&,
                                                                      absl::Duration),
                                     const char* request_json, absl::Duration timeout) {
  Request request;
  RETURN_IF_ERROR(ParseJsonRequest(request_json, &request));
  ASSIGN_OR_RETURN(const Response response, call(c, request, timeout));
  return capi::ToJson(response);
}

}  // namespace
}  // namespace paramd

using paramd::capi::Call;
using paramd::capi::ClientOf;

extern "C" {

int32_t hpd_load_tensors(hpd_client* client, const hpd_host_tensor* tensors, int64_t count,
                         const hpd_load_options* options, int64_t* version, hpd_status* status) {
  return Call(status, [&]() -> absl::Status {
    if (options == nullptr) return absl::InvalidArgumentError("options is NULL");
    if (count < 0 || (count > 0 && tensors == nullptr)) {
      return absl::InvalidArgumentError("tensors is NULL or count is negative");
    }
    if (count == 0) return absl::InvalidArgumentError("no tensors to load");
    ASSIGN_OR_RETURN(paramd::client::Client * c, ClientOf(client));
    ASSIGN_OR_RETURN(const paramd::capi::StreamLoadSettings settings,
                     paramd::capi::StreamLoadSettingsOf(*options));
    std::vector<paramd::client::WeightSource> sources;
    std::vector<paramd::FrozenTensor> frozen;
    std::set<std::string> names;
    for (int64_t i = 0; i < count; ++i) {
      std::string name;
      if (const paramd::safetensors::Dtype* frozen_dtype = paramd::FrozenDtypeOf(tensors[i].dtype);
          frozen_dtype != nullptr && tensors[i].name != nullptr) {
        name = tensors[i].name;
        RETURN_IF_ERROR(paramd::CheckTensorName(name));
        ASSIGN_OR_RETURN(paramd::FrozenTensor f, paramd::FrozenOf(tensors[i], name, *frozen_dtype));
        frozen.push_back(std::move(f));
      } else {
        ASSIGN_OR_RETURN(paramd::client::WeightSource source, paramd::SourceOf(tensors[i], i));
        name = source.name;
        sources.push_back(std::move(source));
      }
      if (!names.insert(name).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", paramd::QuoteForError(name), " is given twice"));
      }
    }
    if (sources.empty()) {
      return absl::InvalidArgumentError(
          "no F32 or BF16 tensors: only frozen buffers, nothing to train");
    }
    ASSIGN_OR_RETURN(const int64_t v,
                     paramd::client::StreamLoad(*c, sources, settings.recipe, settings.progress,
                                                settings.timeout, settings.replace_model, frozen));
    if (version != nullptr) *version = v;
    return absl::OkStatus();
  });
}

void hpd_read_options_init(hpd_read_options* options) {
  if (options == nullptr) return;
  *options = hpd_read_options{};
  options->struct_size = sizeof(hpd_read_options);
  options->version = -1;
  options->dtype = HPD_DTYPE_BF16;
  options->values = HPD_VALUES_MASTER;
}

int32_t hpd_read_version(hpd_client* client, const hpd_read_options* options,
                         hpd_tensor_dest_fn dest, void* dest_arg, int64_t* version,
                         hpd_status* status) {
  return Call(status, [&]() -> absl::Status {
    if (options == nullptr) return absl::InvalidArgumentError("options is NULL");
    if (dest == nullptr) return absl::InvalidArgumentError("dest is NULL");
    RETURN_IF_ERROR(paramd::CheckReadOptions(*options));
    ASSIGN_OR_RETURN(paramd::client::Client * c, ClientOf(client));
    ASSIGN_OR_RETURN(paramd::client::VersionReader reader,
                     paramd::client::OpenVersion(*c, paramd::OpenOptionsOf(*options)));
    const paramd::checkpoint::ExportDtype dtype = paramd::ExportDtypeOf(*options);
    const int64_t element = paramd::checkpoint::ExportDtypeSize(dtype);
    for (const paramd::checkpoint::ExportTensor& t : reader.tensors) {
      const int64_t bytes = t.rows * t.cols * element;
      auto* out =
          static_cast<uint8_t*>(dest(dest_arg, t.name.c_str(), t.shape.data(),
                                     static_cast<int32_t>(t.shape.size()), options->dtype, bytes));
      if (out == nullptr && bytes > 0) {
        return absl::CancelledError(
            absl::StrCat("dest returned no buffer for ", paramd::QuoteForError(t.name)));
      }
      int64_t written = 0;
      RETURN_IF_ERROR(reader.source->StreamTensor(
          t, dtype, [&](absl::Span<const uint8_t> chunk) -> absl::Status {
            if (written + static_cast<int64_t>(chunk.size()) > bytes) {
              return absl::InternalError(
                  absl::StrCat(paramd::QuoteForError(t.name), ": more bytes than its shape holds"));
            }
            std::memcpy(out + written, chunk.data(), chunk.size());
            written += static_cast<int64_t>(chunk.size());
            return absl::OkStatus();
          }));
      if (written != bytes) {
        return absl::InternalError(absl::StrCat(paramd::QuoteForError(t.name), ": ", written,
                                                " of ", bytes, " bytes arrived"));
      }
    }
    for (const paramd::FrozenTensor& f : reader.frozen) {
      ASSIGN_OR_RETURN(const int32_t code, paramd::FrozenCodeOf(f));
      const std::vector<int64_t> shape(f.shape().begin(), f.shape().end());
      const int64_t bytes = static_cast<int64_t>(f.data().size());
      void* out = dest(dest_arg, f.name().c_str(), shape.data(), static_cast<int32_t>(shape.size()),
                       code, bytes);
      if (out == nullptr && bytes > 0) {
        return absl::CancelledError(
            absl::StrCat("dest returned no buffer for ", paramd::QuoteForError(f.name())));
      }
      if (bytes > 0) std::memcpy(out, f.data().data(), static_cast<size_t>(bytes));
    }
    if (version != nullptr) *version = static_cast<int64_t>(reader.version);
    return absl::OkStatus();
  });
}

int32_t hpd_export(hpd_client* client, const char* out_dir, const hpd_read_options* options,
                   int64_t max_shard_bytes, int32_t overwrite, int32_t group_readable,
                   char** result_json, hpd_status* status) {
  return Call(status, [&]() -> absl::Status {
    if (result_json != nullptr) *result_json = nullptr;
    if (out_dir == nullptr || out_dir[0] == '\0') {
      return absl::InvalidArgumentError("out_dir is empty");
    }
    if (options == nullptr) return absl::InvalidArgumentError("options is NULL");
    if (max_shard_bytes < 0) return absl::InvalidArgumentError("max_shard_bytes is negative");
    RETURN_IF_ERROR(paramd::CheckReadOptions(*options));
    ASSIGN_OR_RETURN(paramd::client::Client * c, ClientOf(client));
    paramd::checkpoint::ExportOptions export_options;
    export_options.out_dir = out_dir;
    export_options.dtype = paramd::ExportDtypeOf(*options);
    if (max_shard_bytes > 0)
      export_options.max_shard_bytes = static_cast<uint64_t>(max_shard_bytes);
    export_options.modes = paramd::FileModes::ForGroupReadable(group_readable != 0);
    ASSIGN_OR_RETURN(const paramd::client::ExportVersionResult result,
                     paramd::client::ExportVersion(*c, paramd::OpenOptionsOf(*options),
                                                   export_options, overwrite != 0));
    if (result_json == nullptr) return absl::OkStatus();
    const nlohmann::json out = {{"version", result.version},
                                {"files", result.files.files},
                                {"total_bytes", result.files.total_bytes},
                                {"num_tensors", result.files.num_tensors},
                                {"removed", result.removed}};
    return paramd::capi::ReturnString(out.dump(), result_json);
  });
}

int32_t hpd_checkpoint_call(hpd_client* client, const char* call, const char* request_json,
                            int64_t timeout_ms, char** response_json, hpd_status* status) {
  return Call(status, [&]() -> absl::Status {
    if (response_json != nullptr) *response_json = nullptr;
    const std::string which = call != nullptr ? call : "";
    ASSIGN_OR_RETURN(paramd::client::Client * c, ClientOf(client));
    std::string out;
    if (which == "create") {
      ASSIGN_OR_RETURN(out, paramd::JsonCall<paramd::checkpoint::CheckpointRequest>(
                                *c, &paramd::client::Checkpoint, request_json,
                                paramd::TimeoutOr(timeout_ms, absl::Hours(1))));
    } else if (which == "list") {
      ASSIGN_OR_RETURN(out, paramd::JsonCall<paramd::checkpoint::ListCheckpointsRequest>(
                                *c, &paramd::client::ListCheckpoints, request_json,
                                paramd::TimeoutOr(timeout_ms, absl::Seconds(30))));
    } else if (which == "describe") {
      ASSIGN_OR_RETURN(out, paramd::JsonCall<paramd::checkpoint::DescribeCheckpointRequest>(
                                *c, &paramd::client::DescribeCheckpoint, request_json,
                                paramd::TimeoutOr(timeout_ms, absl::Hours(1))));
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown checkpoint call ",
                                                     paramd::QuoteForError(which),
                                                     ": expected create, list or describe"));
    }
    if (response_json == nullptr) return absl::OkStatus();
    return paramd::capi::ReturnString(out, response_json);
  });
}

}  // extern "C"
