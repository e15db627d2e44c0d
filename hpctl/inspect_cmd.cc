// `hpctl inspect`: what a recipe does to each tensor of a model (see
// hpctl/inspect.h).
#include <iostream>
#include <string>

#include "hpctl/command.h"
#include "hpctl/inspect.h"
#include "recipe/recipe.h"
#include "safetensors/sharded.h"

namespace paramd {
namespace hpctl {
namespace {

int Fail(const absl::Status& status) {
  std::cerr << "hpctl inspect: " << status.message() << "\n";
  return kExitFailure;
}

int RunInspect(int argc, char** argv) {
  std::string recipe_path;
  std::string filter;
  bool all_formats = false;
  OptionParser opts(
      "hpctl inspect MODEL [--recipe RECIPE.textproto] [--all_formats] [--filter REGEX]",
      "For each tensor of MODEL (a .safetensors file, a directory with\n"
      "model.safetensors.index.json or model.safetensors, or an index file) and each\n"
      "published direction: the format the recipe chooses, the bytes of data and\n"
      "scales, and the round-trip error of quantize -> dequantize with the CPU\n"
      "reference (relative L2, max abs, SQNR in dB), then totals against FP32 and\n"
      "BF16. Without --recipe the built-in recipe is used (hpctl inspect\n"
      "--print_builtin_recipe shows it).");
  opts.AddString("recipe", &recipe_path, "recipe in protobuf text format (proto/recipe.proto)");
  opts.AddBool("all_formats", &all_formats,
               "also the SQNR of every format for every tensor (what each tensor tolerates)");
  opts.AddString("filter", &filter, "only tensors whose name matches this regex (search)");
  bool print_builtin = false;
  opts.AddBool("print_builtin_recipe", &print_builtin, "print the built-in recipe and exit");
  TensorNameLimit name_limit;
  name_limit.AddTo(opts);
  if (int rc = opts.ParseOrExit(argc, argv); rc >= 0) return rc;
  if (absl::Status s = name_limit.Check(); !s.ok()) {
    std::cerr << "hpctl inspect: " << s.message() << "\n";
    return kExitUsage;
  }
  if (print_builtin) {
    std::cout << Recipe::BuiltinRecipeText();
    return kExitOk;
  }
  if (opts.positional().size() != 1) {
    std::cerr << "hpctl inspect: expected exactly one MODEL argument\n\n" << opts.Usage();
    return kExitUsage;
  }
  const Recipe* recipe = &Recipe::Builtin();
  absl::StatusOr<Recipe> loaded;
  if (!recipe_path.empty()) {
    loaded = Recipe::Load(recipe_path);
    if (!loaded.ok()) return Fail(loaded.status());
    recipe = &*loaded;
  }
  absl::StatusOr<safetensors::ShardedSafetensors> model =
      safetensors::ShardedSafetensors::Open(opts.positional()[0], name_limit.bytes());
  if (!model.ok()) return Fail(model.status());
  InspectOptions options;
  options.all_formats = all_formats;
  options.filter = filter;
  absl::StatusOr<InspectReport> report = InspectModel(*model, *recipe, options);
  if (!report.ok()) return Fail(report.status());
  std::cout << "Model: " << opts.positional()[0] << "\n" << RenderReport(*report, options);
  return kExitOk;
}

}  // namespace

HPCTL_REGISTER_COMMAND(inspect,
                       "show formats, bytes and round-trip error of each tensor under a recipe",
                       RunInspect);

}  // namespace hpctl
}  // namespace paramd
