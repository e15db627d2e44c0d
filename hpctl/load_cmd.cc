// hpctl load: loads a model into the daemons (through the coordinator) with
// an optional recipe, and prints the resulting manifest. A single
// safetensors file is read by the daemons at its path; a directory, a
// sharded Hugging Face checkpoint (model.safetensors.index.json) or
// --stream sends the values from this machine instead (client/weight_stream.h).
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/weight_stream.h"
#include "hpctl/cluster.h"
#include "hpctl/command.h"
#include "hpctl/progress.h"
#include "kernels/format.h"
#include "nlohmann/json.hpp"
#include "safetensors/safetensors.h"

namespace paramd {
namespace hpctl {
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

// The safetensors files of MODEL: the file itself, the shards named by a
// *.index.json (or a directory's model.safetensors.index.json), or every
// *.safetensors of a directory.
absl::StatusOr<std::vector<std::string>> ModelFiles(const std::string& model) {
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
    return absl::InvalidArgumentError(absl::StrCat(index, ": not a safetensors index (no "
                                                   "'weight_map' object)"));
  }
  std::set<std::string> shards;
  for (const auto& [tensor, file] : j["weight_map"].items()) {
    if (!file.is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(index, ": weight_map['", tensor,
                                                     "'] is not a file name"));
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

// Weight sources over the tensors of `files` (kept open by the sources).
absl::StatusOr<std::vector<client::WeightSource>> Sources(const std::vector<std::string>& files) {
  std::vector<client::WeightSource> out;
  std::set<std::string> seen;
  for (const std::string& path : files) {
    auto opened = safetensors::SafetensorsFile::Open(path);
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
      client::WeightSource s;
      s.name = t.name;
      s.shape = t.shape;
      const safetensors::TensorInfo info = t;
      switch (t.dtype) {
        case safetensors::Dtype::kF32:
        case safetensors::Dtype::kBF16:
          s.dtype = t.dtype == safetensors::Dtype::kF32 ? client::Gradient::DType::kFp32
                                                        : client::Gradient::DType::kBf16;
          s.read = [file, info](int64_t offset, absl::Span<uint8_t> dst) {
            return file->ReadTensorBytes(info, offset, dst);
          };
          break;
        case safetensors::Dtype::kF16:
          // Sent as FP32 (exact): the daemons take FP32 or BF16.
          s.dtype = client::Gradient::DType::kFp32;
          s.read = [file, info](int64_t offset, absl::Span<uint8_t> dst) -> absl::Status {
            std::vector<uint8_t> half(dst.size() / 2);
            if (absl::Status st = file->ReadTensorBytes(info, offset / 2, absl::MakeSpan(half));
                !st.ok()) {
              return st;
            }
            for (size_t i = 0; i < half.size() / 2; ++i) {
              const float f = HalfToFloat(static_cast<uint16_t>(half[2 * i] | half[2 * i + 1] << 8));
              std::memcpy(dst.data() + 4 * i, &f, 4);
            }
            return absl::OkStatus();
          };
          break;
        default:
          return absl::InvalidArgumentError(absl::StrCat(
              path, ": tensor '", t.name, "' is ", safetensors::DtypeName(t.dtype),
              "; hpctl load takes F32, BF16 or F16 tensors"));
      }
      out.push_back(std::move(s));
    }
  }
  return out;
}

int RunLoad(int argc, char** argv) {
  ClusterOptions cluster;
  std::string recipe_path;
  bool stream = false;
  bool progress = true;
  bool force = false;
  double load_timeout = 3600;
  OptionParser opts(
      "hpctl load MODEL [--recipe RECIPE.textproto] [--stream] [--force] [--address HOST:PORT]",
      "Loads a model (FP32, BF16 or F16 tensors) into the daemons and publishes it as version "
      "0. MODEL is a .safetensors file, a directory (its model.safetensors.index.json if there "
      "is one, else every *.safetensors in it) or a Hugging Face index file "
      "(model.safetensors.index.json of a sharded checkpoint). A single file is read by the "
      "daemons at its path (it must be readable by every daemon there; it is made absolute "
      "here) unless --stream; directories and indexes are always streamed: this machine reads "
      "the files and sends the values to the daemons (no shared path needed; F16 is sent as "
      "FP32). --recipe overrides the coordinator's recipe for this model. A cluster that already "
      "holds a model refuses unless --force: the load replaces the model and discards its "
      "training state (the committed version goes back to 0).");
  cluster.AddTo(opts);
  opts.AddString("recipe", &recipe_path, "recipe file (protobuf text format)");
  opts.AddBool("stream", &stream, "send a single file's values from this machine");
  opts.AddBool("progress", &progress,
               "progress on stderr: in place on a terminal, else whole lines");
  opts.AddBool("force", &force, "replace the model the cluster holds");
  opts.AddDouble("load_timeout", &load_timeout, "seconds to wait for the daemons to load");
  if (int rc = opts.ParseOrExit(argc, argv); rc >= 0) return rc;
  if (opts.positional().size() != 1) {
    std::cerr << "hpctl load: expected exactly one MODEL\n" << opts.Usage();
    return kExitUsage;
  }
  std::error_code ec;
  const std::string model = fs::absolute(opts.positional()[0], ec).string();
  auto files = ModelFiles(model);
  if (!files.ok()) return ReportFailure("load", files.status());
  const bool single = files->size() == 1 && *files->begin() == model;
  std::string recipe;
  if (!recipe_path.empty()) {
    std::ifstream in(recipe_path);
    if (!in) return ReportFailure("load", absl::NotFoundError("cannot read " + recipe_path));
    std::stringstream text;
    text << in.rdbuf();
    recipe = text.str();
  }
  auto client = cluster.Connect();
  if (!client.ok()) return ReportFailure("load", client.status());
  const bool terminal = StderrIsTerminal();
  const client::Manifest before = (*client)->manifest();
  std::string replacing;
  if (before.committed_version >= 0 && force) {
    replacing = absl::StrFormat(", replacing the model at version %d", before.committed_version);
  }
  absl::StatusOr<int64_t> version;
  if (single && !stream) {
    std::string label = absl::StrFormat("loading %s (%.1f MB)", model,
                                        fs::file_size(model, ec) / 1e6);
    if (before.num_daemons > 0) {
      absl::StrAppendFormat(&label, " on %d daemon(s)", before.num_daemons);
    }
    Spinner spinner(label + replacing, progress && terminal);
    version = (*client)->Load(model, recipe, absl::Seconds(load_timeout), force);
  } else {
    auto sources = Sources(*files);
    if (!sources.ok()) return ReportFailure("load", sources.status());
    std::cerr << "streaming " << sources->size() << " tensors from " << files->size()
              << " file(s)" << replacing << " ...\n";
    ProgressBar bar(progress && terminal);
    int last_decile = -1;
    const bool lines = progress && !terminal;
    version = client::StreamLoad(
        **client, *sources, recipe,
        [&](const client::StreamProgress& p) {
          bar.Update(p.bytes_sent, p.bytes_total);
          const int decile = p.bytes_total == 0 ? 10 : static_cast<int>(10 * p.bytes_sent /
                                                                         p.bytes_total);
          if (lines && decile != last_decile) {
            last_decile = decile;
            std::cerr << absl::StrFormat("streamed %.1f of %.1f MB\n", p.bytes_sent / 1e6,
                                         p.bytes_total / 1e6);
          }
        },
        std::max(cluster.timeout(), absl::Seconds(load_timeout)), force);
  }
  if (!version.ok()) return ReportFailure("load", version.status());
  const client::Manifest m = (*client)->manifest();
  std::cout << absl::StrFormat("loaded %d tensors on %d daemons; committed version %d\n",
                               m.tensors.size(), m.num_daemons, *version);
  for (const client::TensorMeta& t : m.tensors) {
    std::string placement;
    for (const client::PieceLocation& p : t.pieces) {
      absl::StrAppendFormat(&placement, " [%d,%d)->d%d", p.row_begin, p.row_end, p.daemon_rank);
    }
    std::cout << absl::StrFormat("  %-28s %6dx%-6d %-18s %-18s%s\n", t.name, t.rows, t.cols,
                                 t.spec.rowwise_usage ? FormatName(t.spec.rowwise.format) : "-",
                                 t.spec.columnwise_usage ? FormatName(t.spec.columnwise.format)
                                                         : "-",
                                 placement);
  }
  return kExitOk;
}

}  // namespace

HPCTL_REGISTER_COMMAND(load, "load a safetensors model (file, directory, sharded index)",
                       RunLoad);

}  // namespace hpctl
}  // namespace paramd
