// `hpctl generate`: writes a synthetic model (see hpctl/generate.h).
#include <iostream>
#include <string>

#include "hpctl/command.h"
#include "hpctl/generate.h"

namespace paramd {
namespace hpctl {
namespace {

int RunGenerate(int argc, char** argv) {
  std::string out;
  std::string preset = "small";
  std::string dtype = "f32";
  int64_t seed = 1;
  OptionParser opts(
      "hpctl generate --out FILE.safetensors [--seed N] [--preset small|demo] [--dtype f32|bf16]",
      "Writes a synthetic model (transformer-like names, odd shapes, realistic magnitudes,\n"
      "a few outlier columns; 'demo' includes a 4096x4096 weight) so that every command\n"
      "runs without downloading anything.");
  opts.AddString("out", &out, "output .safetensors file (required)");
  opts.AddInt("seed", &seed, "random seed");
  opts.AddString("preset", &preset, "small (~0.4 MB) or demo (~90 MB as f32)");
  opts.AddString("dtype", &dtype, "element type on disk: f32 or bf16");
  if (int rc = opts.ParseOrExit(argc, argv); rc >= 0) return rc;
  if (out.empty() || !opts.positional().empty() || (dtype != "f32" && dtype != "bf16") ||
      seed < 0) {
    std::cerr << "hpctl generate: need --out FILE, --dtype f32|bf16 and --seed >= 0, and no "
                 "positional arguments\n\n"
              << opts.Usage();
    return kExitUsage;
  }
  GenerateOptions options;
  options.preset = preset;
  options.seed = static_cast<uint64_t>(seed);
  options.dtype = dtype == "bf16" ? safetensors::Dtype::kBF16 : safetensors::Dtype::kF32;
  if (absl::Status status = GenerateModel(out, options); !status.ok()) {
    std::cerr << "hpctl generate: " << status.message() << "\n";
    return status.code() == absl::StatusCode::kInvalidArgument ? kExitUsage : kExitFailure;
  }
  std::cout << "wrote " << out << " (preset " << preset << ", seed " << seed << ", " << dtype
            << ")\n";
  return kExitOk;
}

}  // namespace

HPCTL_REGISTER_COMMAND(generate, "write a synthetic model (.safetensors) for demos and tests",
                       RunGenerate);

}  // namespace hpctl
}  // namespace paramd
