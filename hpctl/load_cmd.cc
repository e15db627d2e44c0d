// hpctl load: loads a safetensors model into the daemons (through the
// coordinator) with an optional recipe, and prints the resulting manifest.
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "absl/strings/str_format.h"
#include "hpctl/cluster.h"
#include "hpctl/command.h"
#include "kernels/format.h"

namespace paramd {
namespace hpctl {
namespace {

int RunLoad(int argc, char** argv) {
  ClusterOptions cluster;
  std::string recipe_path;
  OptionParser opts("hpctl load MODEL.safetensors [--recipe RECIPE.textproto] [--address HOST:PORT]",
                    "Loads a safetensors model (FP32, BF16 or F16 tensors) into the daemons and "
                    "publishes it as version 0. The file must be readable by every daemon at the "
                    "same path (it is made absolute here). --recipe overrides the coordinator's "
                    "recipe for this model.");
  cluster.AddTo(opts);
  opts.AddString("recipe", &recipe_path, "recipe file (protobuf text format)");
  if (int rc = opts.ParseOrExit(argc, argv); rc >= 0) return rc;
  if (opts.positional().size() != 1) {
    std::cerr << "hpctl load: expected exactly one MODEL.safetensors\n" << opts.Usage();
    return kExitUsage;
  }
  std::error_code ec;
  const std::string model = std::filesystem::absolute(opts.positional()[0], ec).string();
  if (ec || !std::filesystem::is_regular_file(model)) {
    return ReportFailure("load", absl::NotFoundError("no file " + opts.positional()[0]));
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
  std::cerr << "loading " << model << " ...\n";
  auto version = (*client)->Load(model, recipe);
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

HPCTL_REGISTER_COMMAND(load, "load a safetensors model into the daemons", RunLoad);

}  // namespace hpctl
}  // namespace paramd
