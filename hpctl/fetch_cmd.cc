// hpctl fetch: one direction of one tensor, as a trainer would receive it,
// written to a safetensors file.
#include <cstring>
#include <iostream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "hpctl/cluster.h"
#include "hpctl/command.h"
#include "kernels/format.h"
#include "kernels/reference.h"
#include "safetensors/safetensors.h"

namespace paramd {
namespace hpctl {
namespace {

absl::Status Write(const std::string& path, const client::FetchedTensor& t, int64_t version,
                   bool dequantize) {
  namespace st = safetensors;
  const QuantizedTensor& q = t.value;
  st::Metadata metadata = {
      {"tensor", t.tensor},
      {"format", std::string(FormatName(q.format))},
      {"direction", std::string(DirectionName(q.direction))},
      {"version", absl::StrCat(version)},
      {"rows", absl::StrCat(q.rows)},
      {"cols", absl::StrCat(q.cols)},
      {"scale_inv", absl::StrFormat("%.9g", q.scale_inv)},
      {"amax", absl::StrFormat("%.9g", q.amax)},
      {"transposed", t.layout.transposed ? "true" : "false"},
  };
  if (dequantize) {
    auto values = ref::Dequantize(q, t.spec);
    if (!values.ok()) return values.status();
    metadata["content"] = "dequantized fp32 [rows][cols]";
    auto writer = st::SafetensorsWriter::Create(
        path, {{t.tensor, st::Dtype::kF32, {q.rows, q.cols}}}, metadata);
    if (!writer.ok()) return writer.status();
    absl::Status s = (*writer)->WriteTensor(
        t.tensor, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(values->data()),
                                      values->size() * sizeof(float)));
    return s.ok() ? (*writer)->Finish() : s;
  }
  metadata["content"] =
      "FORMATS.md buffers: 'scales' (if any) then 'data', shapes of the layout; see hpctl fetch "
      "--help";
  std::vector<st::TensorSpec> specs;
  const Layout& l = t.layout;
  if (l.scale_bytes() > 0) {
    specs.push_back({"scales", l.scale_elem_bytes == 4 ? st::Dtype::kF32 : st::Dtype::kU8,
                     {l.scale_rows, l.scale_cols}});
  }
  specs.push_back({"data", st::Dtype::kU8, {l.data_rows, l.data_row_bytes}});
  auto writer = st::SafetensorsWriter::Create(path, specs, metadata);
  if (!writer.ok()) return writer.status();
  if (l.scale_bytes() > 0) {
    if (absl::Status s = (*writer)->WriteTensor("scales", q.scales); !s.ok()) return s;
  }
  if (absl::Status s = (*writer)->WriteTensor("data", q.data); !s.ok()) return s;
  return (*writer)->Finish();
}

int RunFetch(int argc, char** argv) {
  ClusterOptions cluster;
  std::string direction_name = "rowwise";
  std::string out;
  int64_t version = -1;
  bool dequantize = false;
  OptionParser opts(
      "hpctl fetch TENSOR --out FILE [--direction rowwise|columnwise] [--version V] "
      "[--dequantize]",
      "Fetches one published direction of one tensor (assembled from every daemon holding a "
      "piece of it) and writes a safetensors file: tensors 'data' (U8 [data_rows, "
      "data_row_bytes]) and 'scales' (U8 or F32 [scale_rows, scale_cols], if the format has "
      "them) exactly as in FORMATS.md, with format, direction, version, rows, cols, scale_inv "
      "and amax in the metadata. --dequantize writes the FP32 [rows, cols] values instead.");
  cluster.AddTo(opts);
  opts.AddString("direction", &direction_name, "rowwise or columnwise");
  opts.AddInt("version", &version, "version to fetch; -1 = the committed one");
  opts.AddString("out", &out, "output file");
  opts.AddBool("dequantize", &dequantize, "write dequantized FP32 values");
  if (int rc = opts.ParseOrExit(argc, argv); rc >= 0) return rc;
  if (opts.positional().size() != 1 || out.empty()) {
    std::cerr << "hpctl fetch: expected one TENSOR and --out FILE\n" << opts.Usage();
    return kExitUsage;
  }
  Direction direction;
  if (direction_name == "rowwise") {
    direction = Direction::kRowwise;
  } else if (direction_name == "columnwise") {
    direction = Direction::kColumnwise;
  } else {
    std::cerr << "hpctl fetch: --direction must be rowwise or columnwise\n";
    return kExitUsage;
  }
  auto client = cluster.Connect();
  if (!client.ok()) return ReportFailure("fetch", client.status());
  auto result = (*client)->Fetch(version, {{opts.positional()[0], direction, {}, {}}});
  if (!result.ok()) return ReportFailure("fetch", result.status());
  const client::FetchedTensor& t = result->tensors[0];
  if (absl::Status s = Write(out, t, result->version, dequantize); !s.ok()) {
    return ReportFailure("fetch", s);
  }
  std::cout << absl::StrFormat(
      "%s %s version %d: %s [%d x %d], %d data + %d scale bytes (fp32 would be %d) -> %s\n",
      t.tensor, DirectionName(direction), result->version, FormatName(t.value.format),
      t.value.rows, t.value.cols, t.layout.data_bytes(), t.layout.scale_bytes(),
      result->stats.fp32_equivalent.total(), out);
  return kExitOk;
}

}  // namespace

HPCTL_REGISTER_COMMAND(fetch, "fetch one direction of one tensor to a safetensors file",
                       RunFetch);

}  // namespace hpctl
}  // namespace paramd
