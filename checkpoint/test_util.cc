#include "checkpoint/test_util.h"

#include <stdlib.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace paramd {
namespace checkpoint {
namespace testing {
namespace {

uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

uint64_t HashName(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return h;
}

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

std::string MakeTestDir(const std::string& prefix) {
  const char* base = getenv("TEST_TMPDIR");
  std::string pattern = absl::StrCat(base != nullptr ? base : "/tmp", "/", prefix, ".XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) return "";
  return pattern;
}

std::vector<TensorInfo> FakeTensors(const std::vector<std::pair<int64_t, int64_t>>& shapes) {
  std::vector<TensorInfo> tensors;
  for (size_t i = 0; i < shapes.size(); ++i) {
    TensorInfo tensor;
    tensor.set_name(absl::StrCat("layers.", i, ".weight"));
    tensor.add_shape(shapes[i].first);
    tensor.add_shape(shapes[i].second);
    tensor.set_rows(shapes[i].first);
    tensor.set_cols(shapes[i].second);
    tensor.set_spec(absl::StrCat("spec of ", tensor.name()));
    tensor.set_spec_type("test.Spec");
    tensors.push_back(std::move(tensor));
  }
  return tensors;
}

float FakeValue(uint64_t seed, const std::string& tensor, const std::string& section, int64_t row,
                int64_t col) {
  const uint64_t h = Mix(seed ^ HashName(tensor) ^ (HashName(section) << 1) ^
                         Mix(static_cast<uint64_t>(row) * 1000003ULL + static_cast<uint64_t>(col)));
  switch (h % 64) {
    case 0:
      return FromBits(0x7FC00000u | static_cast<uint32_t>((h >> 8) & 0x3FFFFF));  // NaN payload
    case 1:
      return FromBits(0xFF800001u);  // negative signalling-pattern NaN
    case 2:
      return std::numeric_limits<float>::infinity();
    case 3:
      return -std::numeric_limits<float>::infinity();
    case 4:
      return -0.0f;
    case 5:
      return FromBits(static_cast<uint32_t>((h >> 16) & 0x7FFFFF));  // subnormal
    default:
      return static_cast<float>(static_cast<int64_t>((h >> 20) % 2000001) - 1000000) * 1e-4f;
  }
}

std::vector<float> FakeRows(uint64_t seed, const TensorInfo& tensor, const std::string& section,
                            int64_t row_begin, int64_t row_end) {
  std::vector<float> rows;
  rows.reserve(static_cast<size_t>((row_end - row_begin) * tensor.cols()));
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t c = 0; c < tensor.cols(); ++c) {
      rows.push_back(FakeValue(seed, tensor.name(), section, r, c));
    }
  }
  return rows;
}

TensorState FakeState(uint64_t seed, const std::string& tensor) {
  TensorState state;
  state.set_optimizer_step(static_cast<int64_t>(seed % 1000) + 7);
  for (DirectionScaling* direction : {state.mutable_rowwise(), state.mutable_columnwise()}) {
    direction->set_scale(FakeValue(seed, tensor, "scale", 0, direction == state.mutable_rowwise()));
    direction->set_scale_inv(1.0f / 3.0f);
    direction->set_global_amax(2.5f);
    for (int i = 0; i < 16; ++i) {
      direction->add_amax_history(std::fabs(FakeValue(seed, tensor, "amax", i, 0)));
    }
  }
  state.set_extra(absl::StrCat("extra-", tensor));
  return state;
}

std::vector<std::vector<PieceInfo>> SimplePlan(const std::vector<TensorInfo>& tensors, int world) {
  std::vector<std::vector<PieceInfo>> plan(world);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorInfo& tensor = tensors[i];
    if (tensor.rows() < world) {
      PieceInfo piece;
      piece.set_tensor(tensor.name());
      piece.set_row_begin(0);
      piece.set_row_end(tensor.rows());
      plan[i % world].push_back(piece);
      continue;
    }
    const int64_t per = (tensor.rows() + world - 1) / world;
    for (int rank = 0; rank < world; ++rank) {
      const int64_t begin = std::min<int64_t>(tensor.rows(), rank * per);
      const int64_t end = std::min<int64_t>(tensor.rows(), begin + per);
      if (end <= begin) continue;
      PieceInfo piece;
      piece.set_tensor(tensor.name());
      piece.set_row_begin(begin);
      piece.set_row_end(end);
      plan[rank].push_back(piece);
    }
  }
  return plan;
}

absl::Status WriteFakeCheckpoint(const CheckpointStore& store, uint64_t version, uint64_t seed,
                                 const std::vector<TensorInfo>& tensors, int world) {
  return WriteFakeCheckpoint(store, version, seed, tensors, SimplePlan(tensors, world));
}

absl::Status WriteFakeCheckpoint(const CheckpointStore& store, uint64_t version, uint64_t seed,
                                 const std::vector<TensorInfo>& tensors, const PiecePlan& plan) {
  const int world = static_cast<int>(plan.size());
  Manifest manifest;
  manifest.set_version(version);
  manifest.set_world_size(world);
  for (const TensorInfo& tensor : tensors) *manifest.add_tensors() = tensor;
  (*manifest.mutable_metadata())["optimizer"] = "adamw";
  for (int rank = 0; rank < world; ++rank) {
    ASSIGN_OR_RETURN(auto writer, store.NewShardWriter(version, rank, world));
    for (const PieceInfo& piece : plan[rank]) {
      const TensorInfo* tensor = nullptr;
      for (const TensorInfo& t : tensors) {
        if (t.name() == piece.tensor()) tensor = &t;
      }
      std::vector<std::string> sections = {kMasterSection};
      for (const std::string& name : FakeMomentNames()) sections.push_back(name);
      for (const std::string& name : sections) {
        // Streamed in chunks of up to 7 rows, as a daemon copying from a GPU would.
        RETURN_IF_ERROR(writer->BeginRows(tensor->name(), name, piece.row_begin(), piece.row_end(),
                                          tensor->cols()));
        for (int64_t r = piece.row_begin(); r < piece.row_end(); r += 7) {
          const int64_t end = std::min(piece.row_end(), r + 7);
          std::vector<float> rows = FakeRows(seed, *tensor, name, r, end);
          RETURN_IF_ERROR(writer->AppendRows(rows));
        }
        RETURN_IF_ERROR(writer->EndSection());
      }
      RETURN_IF_ERROR(writer->AddBlob(tensor->name(), kTensorStateSection,
                                      FakeState(seed, tensor->name()).SerializeAsString()));
    }
    RETURN_IF_ERROR(writer->AddBlob("", "daemon", absl::StrCat("daemon ", rank)));
    ASSIGN_OR_RETURN(ShardFileInfo info, writer->Finish());
    *manifest.add_shards() = std::move(info);
  }
  return store.CommitManifest(std::move(manifest));
}

absl::Status CheckFakeCheckpoint(const CheckpointStore& store, uint64_t version, uint64_t seed,
                                 const std::vector<TensorInfo>& tensors, int restore_world) {
  return CheckFakeCheckpoint(store, version, seed, tensors, SimplePlan(tensors, restore_world));
}

absl::Status CheckFakeCheckpoint(const CheckpointStore& store, uint64_t version, uint64_t seed,
                                 const std::vector<TensorInfo>& tensors, const PiecePlan& plan) {
  ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(store, version));
  if (reader->manifest().tensors_size() != static_cast<int>(tensors.size())) {
    return absl::InternalError("tensor count differs");
  }
  for (size_t rank = 0; rank < plan.size(); ++rank) {
    for (const PieceInfo& piece : plan[rank]) {
      const TensorInfo* tensor = reader->FindTensor(piece.tensor());
      if (tensor == nullptr) return absl::InternalError(absl::StrCat("no ", piece.tensor()));
      std::vector<std::string> sections = {kMasterSection};
      for (const std::string& name : FakeMomentNames()) sections.push_back(name);
      for (const std::string& name : sections) {
        ASSIGN_OR_RETURN(
            std::vector<float> got,
            reader->ReadRows(piece.tensor(), name, piece.row_begin(), piece.row_end()));
        std::vector<float> want = FakeRows(seed, *tensor, name, piece.row_begin(), piece.row_end());
        if (got.size() != want.size() ||
            std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) != 0) {
          return absl::InternalError(absl::StrCat("v", version, " ", piece.tensor(), "/", name,
                                                  " rows [", piece.row_begin(), ", ",
                                                  piece.row_end(), ") differ"));
        }
      }
      ASSIGN_OR_RETURN(TensorState state, reader->ReadTensorState(piece.tensor()));
      if (state.SerializeAsString() != FakeState(seed, piece.tensor()).SerializeAsString()) {
        return absl::InternalError(absl::StrCat(piece.tensor(), ": state differs"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status WriteManifestUnchecked(const std::string& path, const Manifest& manifest) {
  const std::string payload = manifest.SerializeAsString();
  const uint64_t length = payload.size();
  const uint64_t hash = Xxh3(payload);
  std::string bytes = "HPCKMAN1";
  bytes.append(reinterpret_cast<const char*>(&length), 8);
  bytes.append(reinterpret_cast<const char*>(&hash), 8);
  bytes.append(payload);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace testing
}  // namespace checkpoint
}  // namespace paramd
