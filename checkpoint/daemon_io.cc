#include "checkpoint/daemon_io.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace paramd {
namespace checkpoint {

absl::StatusOr<ShardFileInfo> WriteDaemonShard(const CheckpointStore& store, int rank, int world,
                                               const DaemonStateView& state,
                                               std::vector<std::string>* created) {
  if (state.version < 0) return absl::FailedPreconditionError("no version published yet");
  ASSIGN_OR_RETURN(
      std::unique_ptr<ShardWriter> writer,
      store.NewShardWriter(static_cast<uint64_t>(state.version), rank, world, created));
  std::vector<float> zeros;
  for (const PieceView& piece : state.pieces) {
    const size_t elements = static_cast<size_t>((piece.row_end - piece.row_begin) * piece.cols);
    if (piece.master.size() != elements) {
      return absl::InternalError(absl::StrCat("piece of ", piece.tensor, ": master holds ",
                                              piece.master.size(), " values, not ", elements));
    }
    RETURN_IF_ERROR(writer->AddRows(piece.tensor, kMasterSection, piece.row_begin, piece.row_end,
                                    piece.cols, piece.master));
    for (const auto& [name, values] : piece.moments) {
      absl::Span<const float> data = values;
      if (data.empty()) {
        zeros.assign(elements, 0.0f);
        data = zeros;
      } else if (data.size() != elements) {
        return absl::InternalError(absl::StrCat("piece of ", piece.tensor, ": ", name, " holds ",
                                                data.size(), " values, not ", elements));
      }
      RETURN_IF_ERROR(
          writer->AddRows(piece.tensor, name, piece.row_begin, piece.row_end, piece.cols, data));
    }
  }
  for (const auto& [tensor, tensor_state] : state.tensor_states) {
    RETURN_IF_ERROR(writer->AddBlob(tensor, kTensorStateSection, tensor_state.SerializeAsString()));
  }
  RETURN_IF_ERROR(writer->AddBlob("", kDaemonBlobSection, state.daemon_blob));
  return writer->Finish();
}

Manifest BuildManifest(uint64_t version, const std::vector<TensorInfo>& tensors,
                       std::vector<ShardFileInfo> shards,
                       const std::map<std::string, std::string>& metadata) {
  std::sort(shards.begin(), shards.end(), [](const ShardFileInfo& a, const ShardFileInfo& b) {
    return a.daemon_rank() < b.daemon_rank();
  });
  Manifest manifest;
  manifest.set_version(version);
  manifest.set_world_size(static_cast<int>(shards.size()));
  for (const TensorInfo& tensor : tensors) *manifest.add_tensors() = tensor;
  for (ShardFileInfo& shard : shards) *manifest.add_shards() = std::move(shard);
  for (const auto& [key, value] : metadata) (*manifest.mutable_metadata())[key] = value;
  return manifest;
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenForRestore(const CheckpointStore& store,
                                                                 int64_t version, bool verify) {
  uint64_t chosen;
  if (version < 0) {
    ASSIGN_OR_RETURN(chosen, store.LatestVersion());
  } else {
    chosen = static_cast<uint64_t>(version);
  }
  if (verify) RETURN_IF_ERROR(store.Verify(chosen));
  return CheckpointReader::Open(store, chosen);
}

absl::StatusOr<RestoredDaemonState> ReadDaemonState(const CheckpointReader& reader,
                                                    const std::vector<PieceInfo>& pieces) {
  RestoredDaemonState state;
  state.version = reader.manifest().version();
  for (const auto& [key, value] : reader.manifest().metadata()) state.metadata[key] = value;
  for (const PieceInfo& info : pieces) {
    const TensorInfo* tensor = reader.FindTensor(info.tensor());
    if (tensor == nullptr) {
      return absl::NotFoundError(absl::StrCat("checkpoint v", state.version, " has no tensor ",
                                              QuoteForMessage(info.tensor())));
    }
    RestoredPiece piece;
    piece.tensor = info.tensor();
    piece.row_begin = info.row_begin();
    piece.row_end = info.row_end();
    piece.cols = tensor->cols();
    for (const std::string& name : reader.RowSectionNames(info.tensor())) {
      ASSIGN_OR_RETURN(std::vector<float> rows,
                       reader.ReadRows(info.tensor(), name, info.row_begin(), info.row_end()));
      if (name == kMasterSection) {
        piece.master = std::move(rows);
      } else {
        piece.moments[name] = std::move(rows);
      }
    }
    if (state.tensor_states.count(info.tensor()) == 0) {
      absl::StatusOr<TensorState> tensor_state = reader.ReadTensorState(info.tensor());
      if (tensor_state.ok()) {
        state.tensor_states[info.tensor()] = *std::move(tensor_state);
      } else if (!absl::IsNotFound(tensor_state.status())) {
        return tensor_state.status();
      }
    }
    state.pieces.push_back(std::move(piece));
  }
  absl::StatusOr<std::string> blob = reader.ReadBlob("", kDaemonBlobSection);
  if (blob.ok()) {
    state.daemon_blob = *std::move(blob);
  } else if (!absl::IsNotFound(blob.status())) {
    return blob.status();
  }
  return state;
}

}  // namespace checkpoint
}  // namespace paramd
