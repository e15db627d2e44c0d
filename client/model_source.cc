// client/model_source.h: the tensors of local safetensors files as
// WeightSources (moved here from hpctl load so the C API shares them).
#include "client/model_source.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "safetensors/safetensors.h"

namespace paramd {
namespace client {
namespace {

namespace fs = std::filesystem;

// IEEE half -> float (exact).
float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ModelFiles(const std::string& model,
                                                    int64_t max_name_bytes) {
  std::error_code ec;
  std::string index;
  if (fs::is_directory(model, ec)) {
    const fs::path i = fs::path(model) / "model.safetensors.index.json";
    if (fs::is_regular_file(i, ec)) {
      index = i.string();
    } else {
      std::vector<std::string> files;
      for (const auto& e : fs::directory_iterator(model, ec)) {
        if (e.is_regular_file() && absl::EndsWith(e.path().string(), ".safetensors")) {
          files.push_back(e.path().string());
        }
      }
      std::sort(files.begin(), files.end());
      if (files.empty()) {
        return absl::NotFoundError(absl::StrCat(model, " has no *.safetensors files"));
      }
      return files;
    }
  } else if (absl::EndsWith(model, ".json")) {
    index = model;
  } else if (fs::is_regular_file(model, ec)) {
    return std::vector<std::string>{model};
  } else {
    return absl::NotFoundError(absl::StrCat("no file or directory ", model));
  }
  std::ifstream in(index);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", index));
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") ||
      !j["weight_map"].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(index,
                                                   ": not a safetensors index (no "
                                                   "'weight_map' object)"));
  }
  std::set<std::string> shards;
  for (const auto& [tensor, file] : j["weight_map"].items()) {
    // Before any message quotes the name.
    if (absl::Status named = CheckTensorName(tensor, max_name_bytes); !named.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(index, ": weight_map: ", named.message()));
    }
    if (!file.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index, ": weight_map['", tensor, "'] is not a file name"));
    }
    const std::string name = file.get<std::string>();
    if (name.find('/') != std::string::npos || name == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat(index, ": shard '", name, "' is not a file beside the index"));
    }
    shards.insert((fs::path(index).parent_path() / name).string());
  }
  if (shards.empty()) return absl::InvalidArgumentError(absl::StrCat(index, ": no tensors"));
  return std::vector<std::string>(shards.begin(), shards.end());
}

absl::StatusOr<ModelSources> WeightSources(const std::vector<std::string>& files,
                                           int64_t max_name_bytes, int64_t max_frozen_bytes) {
  ModelSources sources;
  std::vector<WeightSource>& out = sources.weights;
  std::set<std::string> seen;
  int64_t frozen_bytes = 0;
  for (const std::string& path : files) {
    auto opened = safetensors::SafetensorsFile::Open(path, max_name_bytes);
    if (!opened.ok()) {
      return absl::Status(opened.status().code(),
                          absl::StrCat(path, ": ", opened.status().message()));
    }
    auto file = std::make_shared<safetensors::SafetensorsFile>(std::move(*opened));
    for (const safetensors::TensorInfo& t : file->tensors()) {
      if (!seen.insert(t.name).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", t.name, "' is in two files (", path, ")"));
      }
      WeightSource s;
      s.name = t.name;
      s.shape = t.shape;
      const safetensors::TensorInfo info = t;
      switch (t.dtype) {
        case safetensors::Dtype::kF32:
        case safetensors::Dtype::kBF16:
          s.dtype =
              t.dtype == safetensors::Dtype::kF32 ? Gradient::DType::kFp32 : Gradient::DType::kBf16;
          s.read = [file, info](int64_t offset, absl::Span<uint8_t> dst) {
            return file->ReadTensorBytes(info, offset, dst);
          };
          break;
        case safetensors::Dtype::kF16:
          // Sent as FP32 (exact): the daemons take FP32 or BF16.
          s.dtype = Gradient::DType::kFp32;
          s.read = [file, info](int64_t offset, absl::Span<uint8_t> dst) -> absl::Status {
            std::vector<uint8_t> half(dst.size() / 2);
            if (absl::Status st = file->ReadTensorBytes(info, offset / 2, absl::MakeSpan(half));
                !st.ok()) {
              return st;
            }
            for (size_t i = 0; i < half.size() / 2; ++i) {
              const float f =
                  HalfToFloat(static_cast<uint16_t>(half[2 * i] | half[2 * i + 1] << 8));
              std::memcpy(dst.data() + 4 * i, &f, 4);
            }
            return absl::OkStatus();
          };
          break;
        default: {
          // A frozen buffer: read whole now (they are small; bounded here).
          const int64_t bytes = t.num_elements * safetensors::DtypeSize(t.dtype);
          frozen_bytes += bytes;
          if (frozen_bytes > max_frozen_bytes) {
            return absl::InvalidArgumentError(
                absl::StrCat(path, ": the non-floating tensors (frozen buffers, such as '", t.name,
                             "') hold more than ", max_frozen_bytes, " bytes"));
          }
          FrozenTensor f;
          f.set_name(t.name);
          f.set_dtype(std::string(safetensors::DtypeName(t.dtype)));
          for (int64_t d : t.shape) f.add_shape(d);
          f.mutable_data()->resize(static_cast<size_t>(bytes));
          RETURN_IF_ERROR(file->ReadTensorBytes(
              info, 0,
              absl::MakeSpan(reinterpret_cast<uint8_t*>(f.mutable_data()->data()), bytes)));
          sources.frozen.push_back(std::move(f));
          continue;
        }
      }
      out.push_back(std::move(s));
    }
  }
  return sources;
}

}  // namespace client
}  // namespace paramd
