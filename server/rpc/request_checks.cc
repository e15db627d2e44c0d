#include "server/rpc/request_checks.h"

#include <limits>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "safetensors/safetensors.h"

namespace paramd {
namespace {

absl::Status CheckCount(int64_t n, const RequestLimits& limits) {
  if (n > limits.max_tensors) {
    return absl::ResourceExhaustedError(absl::StrCat(n, " tensors: more than the limit of ",
                                                     limits.max_tensors, " (--max_tensors)"));
  }
  return absl::OkStatus();
}

absl::Status CheckName(absl::string_view name, const RequestLimits& limits) {
  return CheckTensorName(name, limits.max_tensor_name_bytes);
}

}  // namespace

absl::Status CheckTensorDecls(const std::vector<rpc::TensorDecl>& tensors,
                              const RequestLimits& limits) {
  RETURN_IF_ERROR(CheckCount(static_cast<int64_t>(tensors.size()), limits));
  std::set<absl::string_view> names;
  for (const rpc::TensorDecl& d : tensors) {
    RETURN_IF_ERROR(CheckName(d.name(), limits));
    if (!names.insert(d.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", QuoteForError(d.name(), 256), " declared twice"));
    }
    if (d.shape_size() > limits.max_tensor_dims) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", QuoteForError(d.name(), 256), " has ", d.shape_size(),
                       " dimensions; at most ", limits.max_tensor_dims, " are accepted"));
    }
    int64_t elements = 1;
    for (int64_t s : d.shape()) {
      if (s < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", QuoteForError(d.name(), 256), " has an empty dimension"));
      }
      if (elements > std::numeric_limits<int64_t>::max() / 8 / s) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", QuoteForError(d.name(), 256), ": shape overflows"));
      }
      elements *= s;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> FrozenTensorBytes(const FrozenTensor& frozen) {
  const std::string what = absl::StrCat("frozen buffer ", QuoteForError(frozen.name(), 256));
  absl::StatusOr<safetensors::Dtype> dtype = safetensors::ParseDtype(frozen.dtype());
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", dtype.status().message()));
  }
  int64_t bytes = safetensors::DtypeSize(*dtype);
  for (int64_t s : frozen.shape()) {
    if (s < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": negative dimension"));
    if (s > 0 && bytes > std::numeric_limits<int64_t>::max() / s) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": shape overflows"));
    }
    bytes *= s;
  }
  return bytes;
}

absl::Status CheckFrozenTensors(const google::protobuf::RepeatedPtrField<FrozenTensor>& frozen,
                                const std::vector<rpc::TensorDecl>& tensors,
                                const RequestLimits& limits, bool check_data) {
  RETURN_IF_ERROR(CheckCount(static_cast<int64_t>(tensors.size()) + frozen.size(), limits));
  std::set<absl::string_view> names;
  for (const rpc::TensorDecl& d : tensors) names.insert(d.name());
  int64_t total = 0;
  for (const FrozenTensor& f : frozen) {
    RETURN_IF_ERROR(CheckName(f.name(), limits));
    const std::string what = absl::StrCat("frozen buffer ", QuoteForError(f.name(), 256));
    if (!names.insert(f.name()).second) {
      return absl::InvalidArgumentError(absl::StrCat(what, " is named twice in the model"));
    }
    if (f.shape_size() > limits.max_tensor_dims) {
      return absl::InvalidArgumentError(absl::StrCat(what, " has ", f.shape_size(),
                                                     " dimensions; at most ",
                                                     limits.max_tensor_dims, " are accepted"));
    }
    ASSIGN_OR_RETURN(const int64_t bytes, FrozenTensorBytes(f));
    if (check_data && static_cast<int64_t>(f.data().size()) != bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " has ", f.data().size(), " bytes of data; its dtype and shape need ", bytes));
    }
    total = bytes > std::numeric_limits<int64_t>::max() - total
                ? std::numeric_limits<int64_t>::max()
                : total + bytes;
  }
  if (total > limits.max_frozen_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the model's ", frozen.size(), " frozen buffers (non-floating tensors such as ",
        QuoteForError(frozen.begin()->name(), 64), ") hold ", total,
        " bytes: more than the coordinator's --max_frozen_bytes=", limits.max_frozen_bytes));
  }
  return absl::OkStatus();
}

absl::Status CheckSourcePaths(absl::string_view safetensors_path,
                              absl::string_view checkpoint_path) {
  RETURN_IF_ERROR(CheckClientPath("safetensors_path", safetensors_path));
  return CheckClientPath("checkpoint_path", checkpoint_path);
}

absl::Status CheckLoadRequest(const rpc::LoadRequest& request, const RequestLimits& limits) {
  const int sources = !request.safetensors_path().empty() + (request.tensors_size() > 0) +
                      !request.checkpoint_path().empty();
  if (sources == 0) {
    return absl::InvalidArgumentError(
        "Load: give a safetensors path, declared tensors or a checkpoint path");
  }
  if (sources > 1) {
    return absl::InvalidArgumentError(
        "Load: give exactly one of a safetensors path, declared tensors or a checkpoint path");
  }
  if (request.checkpoint_version() < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Load: checkpoint_version ", request.checkpoint_version(), " (-1 = newest, else >= 0)"));
  }
  if (request.frozen_size() > 0 && request.tensors_size() == 0) {
    return absl::InvalidArgumentError(
        request.checkpoint_path().empty()
            ? "Load: frozen buffers go with declared tensors (a safetensors file's non-floating "
              "tensors are its frozen buffers)"
            : "Load: a checkpoint restore takes its frozen buffers from the checkpoint");
  }
  if (request.tensors_size() > 0) {
    const std::vector<rpc::TensorDecl> decls(request.tensors().begin(), request.tensors().end());
    RETURN_IF_ERROR(CheckTensorDecls(decls, limits));
    RETURN_IF_ERROR(CheckFrozenTensors(request.frozen(), decls, limits));
  }
  return absl::OkStatus();
}

absl::Status CheckLoadShardsRequest(const rpc::LoadShardsRequest& request,
                                    const RequestLimits& limits) {
  const rpc::Manifest& m = request.manifest();
  if (m.tensors_size() == 0) {
    return absl::InvalidArgumentError("LoadShards: the manifest has no tensors");
  }
  RETURN_IF_ERROR(CheckCount(m.tensors_size(), limits));
  if (request.daemon_rank() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoadShards: daemon_rank ", request.daemon_rank()));
  }
  if (request.expected_pushers() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoadShards: expected_pushers ", request.expected_pushers()));
  }
  if (!request.safetensors_path().empty() && !request.checkpoint_path().empty()) {
    return absl::InvalidArgumentError("LoadShards: a safetensors path or a checkpoint, not both");
  }
  RETURN_IF_ERROR(CheckSourcePaths(request.safetensors_path(), request.checkpoint_path()));
  std::set<absl::string_view> names;
  for (const rpc::TensorInfo& t : m.tensors()) {
    RETURN_IF_ERROR(CheckName(t.name(), limits));
    if (!names.insert(t.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("LoadShards: tensor ", QuoteForError(t.name(), 256), " listed twice"));
    }
    if (t.rows() < 1 || t.cols() < 1 ||
        t.rows() > std::numeric_limits<int64_t>::max() / 8 / t.cols()) {
      return absl::InvalidArgumentError(
          absl::StrCat("LoadShards: tensor ", QuoteForError(t.name(), 256), " has a bad shape"));
    }
  }
  if (limits.memory_budget_bytes > 0) {
    const int64_t need = EstimateDaemonBytes(m, request.daemon_rank());
    if (need > limits.memory_budget_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("LoadShards: the shards need about ", need,
                                                       " bytes, more than this daemon's memory "
                                                       "budget of ",
                                                       limits.memory_budget_bytes,
                                                       " bytes (--memory_budget_bytes)"));
    }
  }
  return absl::OkStatus();
}

namespace {

// Published bytes per element of one direction (rounded up, scales in).
int64_t PublishedBytesPerElement(const rpc::QuantSpec& q) {
  switch (q.format()) {
    case rpc::FORMAT_IDENTITY_FP32:
      return 4;
    case rpc::FORMAT_IDENTITY_BF16:
      return 2;
    default:  // FP8 formats, MXFP8, NVFP4 (with their scales): at most ~1.07
      return 2;
  }
}

int64_t SaturatingAdd(int64_t a, int64_t b) {
  return a > std::numeric_limits<int64_t>::max() - b ? std::numeric_limits<int64_t>::max() : a + b;
}

}  // namespace

int64_t EstimateDaemonBytes(const rpc::Manifest& manifest, int rank) {
  int64_t total = 0;
  for (const rpc::ShardPiece& p : manifest.pieces()) {
    if (p.daemon_rank() != rank || p.tensor_index() < 0 ||
        p.tensor_index() >= manifest.tensors_size()) {
      continue;
    }
    const rpc::TensorInfo& t = manifest.tensors(p.tensor_index());
    const rpc::HybridSpec& spec = t.spec();
    int64_t per_element = 16;  // master + gradient + two AdamW moments
    if (!spec.has_rowwise_usage() || spec.rowwise_usage()) {
      per_element += 2 * PublishedBytesPerElement(spec.rowwise());
    }
    if (!spec.has_columnwise_usage() || spec.columnwise_usage()) {
      per_element += 2 * PublishedBytesPerElement(spec.columnwise());
    }
    const int64_t rows = p.row_end() - p.row_begin();
    if (rows <= 0 || t.cols() <= 0) continue;
    const int64_t limit = std::numeric_limits<int64_t>::max() / per_element;
    const int64_t elements = rows > limit / t.cols() ? limit : rows * t.cols();
    total = SaturatingAdd(
        total, elements >= limit ? std::numeric_limits<int64_t>::max() : elements * per_element);
  }
  return total;
}

absl::Status CheckMemoryBudget(const rpc::Manifest& manifest, const RequestLimits& limits) {
  if (limits.memory_budget_bytes <= 0) return absl::OkStatus();
  std::set<int> ranks;
  for (const rpc::ShardPiece& p : manifest.pieces()) ranks.insert(p.daemon_rank());
  for (int rank : ranks) {
    const int64_t need = EstimateDaemonBytes(manifest, rank);
    if (need > limits.memory_budget_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the model needs about ", need, " bytes on daemon rank ", rank,
                       ", more than its memory budget of ", limits.memory_budget_bytes,
                       " bytes (--memory_budget_bytes)"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckFetchRequest(const rpc::FetchRequest& request, const RequestLimits& limits) {
  if (request.version() < -1) {
    return absl::InvalidArgumentError(absl::StrCat("Fetch: version ", request.version(),
                                                   " (-1 = the latest published, else >= 0)"));
  }
  if (request.max_chunk_bytes() < 0 ||
      (request.max_chunk_bytes() > 0 && request.max_chunk_bytes() < limits.min_chunk_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("Fetch: max_chunk_bytes ",
                                                   request.max_chunk_bytes(),
                                                   " (0 = the server's default, else at least ",
                                                   limits.min_chunk_bytes, ": --min_chunk_bytes)"));
  }
  for (const rpc::TensorDirections& t : request.tensors()) {
    for (int d : t.directions()) {
      if (!rpc::Direction_IsValid(d)) {
        return absl::InvalidArgumentError(absl::StrCat("Fetch: unknown direction ", d));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckDaemonStepRequest(const rpc::DaemonStepRequest& request) {
  if (request.version() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Step: version ", request.version(), " (the version to step from, >= 0)"));
  }
  return absl::OkStatus();
}

}  // namespace paramd
