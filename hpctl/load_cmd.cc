// hpctl load: loads a model into the daemons (through the coordinator) with
// an optional recipe, and prints the resulting manifest. A single
// safetensors file is read by the daemons at its path; a directory, a
// sharded Hugging Face checkpoint (model.safetensors.index.json) or
// --stream sends the values from this machine instead (client/weight_stream.h).
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/model_source.h"
#include "client/weight_stream.h"
#include "hpctl/cluster.h"
#include "hpctl/command.h"
#include "hpctl/progress.h"
#include "kernels/format.h"
#include "safetensors/safetensors.h"

namespace paramd {
namespace hpctl {
namespace {

namespace fs = std::filesystem;

int RunLoad(int argc, char** argv) {
  ClusterOptions cluster;
  std::string recipe_path;
  bool stream = false;
  bool progress = true;
  bool force = false;
  double load_timeout = 3600;
  OptionParser opts(
      "hpctl load MODEL [--recipe RECIPE.textproto] [--stream] [--force] [--address HOST:PORT]",
      "Loads a model into the daemons and publishes it as version 0: its FP32, BF16 and F16 "
      "tensors are trained; its integer, bool and F64 tensors are frozen buffers, kept whole by "
      "the coordinator (at most its --max_frozen_bytes), checkpointed and exported, never "
      "stepped. MODEL is a .safetensors file, a directory (its model.safetensors.index.json if "
      "there "
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
  TensorNameLimit name_limit;
  name_limit.AddTo(opts);
  if (int rc = opts.ParseOrExit(argc, argv); rc >= 0) return rc;
  if (absl::Status s = name_limit.Check(); !s.ok()) {
    std::cerr << "hpctl load: " << s.message() << "\n";
    return kExitUsage;
  }
  if (opts.positional().size() != 1) {
    std::cerr << "hpctl load: expected exactly one MODEL\n" << opts.Usage();
    return kExitUsage;
  }
  std::error_code ec;
  const std::string model = fs::absolute(opts.positional()[0], ec).string();
  auto files = client::ModelFiles(model, name_limit.bytes());
  if (!files.ok()) return ReportFailure("load", files.status());
  const bool single = files->size() == 1 && *files->begin() == model;
  if (single) {
    // The daemons read the file themselves (unless --stream), but a file
    // that is not safetensors here is refused before the cluster is asked
    // (and, with --force, before "replacing the model" is said).
    if (auto file = safetensors::SafetensorsFile::Open(model, name_limit.bytes()); !file.ok()) {
      return ReportFailure("load", file.status());
    }
  }
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
    std::string label =
        absl::StrFormat("loading %s (%.1f MB)", model, fs::file_size(model, ec) / 1e6);
    if (before.num_daemons > 0) {
      absl::StrAppendFormat(&label, " on %d daemon(s)", before.num_daemons);
    }
    Spinner spinner(label + replacing, progress && terminal);
    version = (*client)->Load(model, recipe, absl::Seconds(load_timeout), force);
  } else {
    auto sources = client::WeightSources(*files, name_limit.bytes());
    if (!sources.ok()) return ReportFailure("load", sources.status());
    std::cerr << "streaming " << sources->weights.size() << " tensors"
              << (sources->frozen.empty()
                      ? ""
                      : absl::StrCat(" and ", sources->frozen.size(), " frozen buffers"))
              << " from " << files->size() << " file(s)" << replacing << " ...\n";
    ProgressBar bar(progress && terminal);
    int last_decile = -1;
    const bool lines = progress && !terminal;
    version = client::StreamLoad(
        **client, sources->weights, recipe,
        [&](const client::StreamProgress& p) {
          bar.Update(p.bytes_sent, p.bytes_total);
          const int decile =
              p.bytes_total == 0 ? 10 : static_cast<int>(10 * p.bytes_sent / p.bytes_total);
          if (lines && decile != last_decile) {
            last_decile = decile;
            std::cerr << absl::StrFormat("streamed %.1f of %.1f MB\n", p.bytes_sent / 1e6,
                                         p.bytes_total / 1e6);
          }
        },
        std::max(cluster.timeout(), absl::Seconds(load_timeout)), force, sources->frozen);
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
    std::cout << absl::StrFormat(
        "  %-28s %6dx%-6d %-18s %-18s%s\n", t.name, t.rows, t.cols,
        t.spec.rowwise_usage ? FormatName(t.spec.rowwise.format) : "-",
        t.spec.columnwise_usage ? FormatName(t.spec.columnwise.format) : "-", placement);
  }
  return kExitOk;
}

}  // namespace

HPCTL_REGISTER_COMMAND(load, "load a safetensors model (file, directory, sharded index)", RunLoad);

}  // namespace hpctl
}  // namespace paramd
