// Test fixture for tests/export_safetensors_test.sh: exports a synthetic
// model (special values included) with ExportSafetensors and writes its FP32
// masters beside it, raw, so that an independent reader can recompute the
// expected BF16 values:
//
//   <masters>/masters.json   {"<name>": [shape...], ...}
//   <masters>/<name>.f32     little-endian float32, row-major
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/export.h"
#include "checkpoint/test_util.h"

ABSL_FLAG(std::string, out, "", "export directory");
ABSL_FLAG(std::string, masters, "", "directory for the raw FP32 masters");
ABSL_FLAG(std::string, dtype, "bf16", "bf16 or fp32");
ABSL_FLAG(std::string, max_shard_size, "20000", "maximum shard size (e.g. 5GB)");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Writes a synthetic export and its FP32 masters (test fixture).");
  absl::ParseCommandLine(argc, argv);
  using namespace paramd::checkpoint;
  auto dtype = ParseExportDtype(absl::GetFlag(FLAGS_dtype));
  auto max_shard = ParseByteSize(absl::GetFlag(FLAGS_max_shard_size));
  if (!dtype.ok() || !max_shard.ok() || absl::GetFlag(FLAGS_out).empty() ||
      absl::GetFlag(FLAGS_masters).empty()) {
    std::cerr << "export_fixture: bad flags (see --help)\n";
    return 2;
  }
  // Names as a Hugging Face model has them; shapes 1-D to 3-D, odd sizes.
  std::vector<ExportTensor> tensors = {
      {"model.embed_tokens.weight", {97, 64}, 97, 64},
      {"model.layers.0.self_attn.q_proj.weight", {64, 64}, 64, 64},
      {"model.layers.0.mlp.up_proj.weight", {130, 33}, 130, 33},
      {"model.layers.0.input_layernorm.weight", {257}, 1, 257},
      {"model.layers.0.conv.weight", {4, 3, 5}, 4, 15},
      {"lm_head.weight", {1, 1}, 1, 1},
  };
  std::map<std::string, std::vector<float>> values;
  std::vector<std::string> json_entries;
  for (const ExportTensor& tensor : tensors) {
    TensorInfo info;
    info.set_name(tensor.name);
    info.set_rows(tensor.rows);
    info.set_cols(tensor.cols);
    std::vector<float>& v = values[tensor.name];
    v = testing::FakeRows(17, info, "master", 0, tensor.rows);
    // Exact BF16 ties (even and odd) and the largest finite float.
    const uint32_t specials[] = {0x3F808000u, 0x3F818000u, 0xC0C18000u, 0x7F7FFFFFu};
    for (size_t i = 0; i < 4 && i < v.size(); ++i)
      std::memcpy(&v[i * 7 % v.size()], &specials[i], 4);
    std::ofstream raw(absl::StrCat(absl::GetFlag(FLAGS_masters), "/", tensor.name, ".f32"),
                      std::ios::binary);
    raw.write(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
    if (!raw) {
      std::cerr << "export_fixture: cannot write masters\n";
      return 1;
    }
    json_entries.push_back(
        absl::StrCat("\"", tensor.name, "\": [", absl::StrJoin(tensor.shape, ", "), "]"));
  }
  std::ofstream json(absl::StrCat(absl::GetFlag(FLAGS_masters), "/masters.json"));
  json << "{" << absl::StrJoin(json_entries, ", ") << "}\n";

  FloatRowSource source(
      [&](const ExportTensor& tensor, int64_t row_begin, int64_t row_end, absl::Span<float> out) {
        std::memcpy(out.data(), values[tensor.name].data() + row_begin * tensor.cols,
                    out.size() * sizeof(float));
        return absl::OkStatus();
      },
      /*chunk_bytes=*/777);
  ExportOptions options;
  options.out_dir = absl::GetFlag(FLAGS_out);
  options.dtype = *dtype;
  options.max_shard_bytes = *max_shard;
  auto result = ExportSafetensors(tensors, source, options);
  if (!result.ok()) {
    std::cerr << "export_fixture: " << result.status() << "\n";
    return 1;
  }
  std::cout << "wrote " << absl::StrJoin(result->files, " ") << "\n";
  return 0;
}
