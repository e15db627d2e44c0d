// hpctl fetch: one direction of one tensor, as a trainer would receive it,
// written to a safetensors file, the user's only (0600) unless
// --group_readable.
#include <cstring>
#include <iostream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "hpctl/cluster.h"
#include "hpctl/command.h"
#include "kernels/format.h"
#include "kernels/reference.h"
#include "safetensors/safetensors.h"

namespace paramd {
namespace hpctl {
namespace {

absl::Status Write(const std::string& path, const client::FetchedTensor& t, int64_t version,
                   bool dequantize, mode_t mode) {
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
        path, {{t.tensor, st::Dtype::kF32, {q.rows, q.cols}}}, metadata, mode);
    if (!writer.ok()) return writer.status();
    absl::Status s = (*writer)->WriteTensor(
        t.tensor, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(values->data()),
                                      values->size() * sizeof(float)));
    return s.ok() ? (*writer)->Finish() : s;
  }
  // The buffers under the tensor's name, typed where safetensors has the
  // type: FP8 data as F8_E4M3 / F8_E5M2, identity data as BF16 / F32,
  // packed FP4 as U8; scales as F32, F8_E8M0 (MXFP8) or F8_E4M3 (NVFP4's
  // UE4M3); per-tensor scalars as their own F32 tensors.
  metadata["content"] = absl::StrCat("FORMATS.md buffers: '", t.tensor, "' (data), '", t.tensor,
                                     ".scales', '", t.tensor, ".scale_inv', '", t.tensor,
                                     ".amax' where the format has them; see hpctl fetch --help");
  const Layout& l = t.layout;
  st::Dtype data_dtype = st::Dtype::kU8;
  int64_t elem = 1;
  switch (q.format) {
    case Format::kIdentityBf16:
      data_dtype = st::Dtype::kBF16, elem = 2;
      break;
    case Format::kIdentityFp32:
      data_dtype = st::Dtype::kF32, elem = 4;
      break;
    case Format::kNvfp4:
      metadata["element"] = "e2m1x2 (two FP4 codes per byte, even index in the low nibble)";
      break;
    default:
      data_dtype = t.spec.fp8_type == Fp8Type::kE5M2 ? st::Dtype::kF8E5M2 : st::Dtype::kF8E4M3;
  }
  const bool per_tensor = q.format == Format::kFp8Delayed || q.format == Format::kFp8Current;
  const bool has_amax = per_tensor || q.format == Format::kNvfp4;
  std::vector<st::TensorSpec> specs;
  if (l.scale_bytes() > 0) {
    const st::Dtype sd = l.scale_elem_bytes == 4      ? st::Dtype::kF32
                         : q.format == Format::kMxfp8 ? st::Dtype::kF8E8M0
                                                      : st::Dtype::kF8E4M3;
    specs.push_back({t.tensor + ".scales", sd, {l.scale_rows, l.scale_cols}});
  }
  if (per_tensor) specs.push_back({t.tensor + ".scale_inv", st::Dtype::kF32, {}});
  if (has_amax) specs.push_back({t.tensor + ".amax", st::Dtype::kF32, {}});
  specs.push_back({t.tensor, data_dtype, {l.data_rows, l.data_row_bytes / elem}});
  auto writer = st::SafetensorsWriter::Create(path, specs, metadata, mode);
  if (!writer.ok()) return writer.status();
  auto scalar = [](const float& f) {
    return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(&f), sizeof(float));
  };
  if (l.scale_bytes() > 0) RETURN_IF_ERROR((*writer)->WriteTensor(t.tensor + ".scales", q.scales));
  if (per_tensor)
    RETURN_IF_ERROR((*writer)->WriteTensor(t.tensor + ".scale_inv", scalar(q.scale_inv)));
  if (has_amax) RETURN_IF_ERROR((*writer)->WriteTensor(t.tensor + ".amax", scalar(q.amax)));
  RETURN_IF_ERROR((*writer)->WriteTensor(t.tensor, q.data));
  return (*writer)->Finish();
}

// A version newer than the committed one is waited for (up to `timeout`),
// saying so, and refused by name if it does not come: a bare fetch would wait
// as long and then say only "Deadline Exceeded".
absl::Status WaitUntilCommitted(client::Client& client, int64_t version, absl::Duration timeout) {
  if (version < 0) return CommittedVersion(client, timeout, "fetch").status();
  ASSIGN_OR_RETURN(const client::Manifest manifest, client.RefreshManifest(timeout));
  if (version <= manifest.committed_version) return absl::OkStatus();
  std::cerr << "hpctl fetch: version " << version
            << " is not committed yet (committed: " << manifest.committed_version
            << "); waiting up to " << absl::FormatDuration(timeout) << " (--timeout)\n";
  absl::StatusOr<int64_t> committed = client.WaitForVersion(version, timeout);
  if (absl::IsDeadlineExceeded(committed.status())) {
    return absl::DeadlineExceededError(absl::StrCat(
        "version ", version, " was not committed within ", absl::FormatDuration(timeout),
        " (--timeout); the committed version is ", manifest.committed_version));
  }
  return committed.status();
}

int RunFetch(int argc, char** argv) {
  ClusterOptions cluster;
  std::string direction_name = "rowwise";
  std::string out;
  int64_t version = -1;
  bool dequantize = false;
  bool group_readable = false;
  OptionParser opts(
      "hpctl fetch TENSOR --out FILE [--direction rowwise|columnwise] [--version V] "
      "[--dequantize] [--group_readable]",
      "Fetches one published direction of one tensor (assembled from every daemon holding a "
      "piece of it) and writes a safetensors file with the buffers exactly as in FORMATS.md: "
      "TENSOR (the data: F8_E4M3 / F8_E5M2 for FP8 formats, BF16 / F32 for identity formats, "
      "U8 packed for NVFP4; [data_rows, elements per row], [K, M] when transposed), "
      "TENSOR.scales (F32, F8_E8M0 for MXFP8, F8_E4M3 for NVFP4's UE4M3; [scale_rows, "
      "scale_cols]) where the format has a scale buffer, and scalar F32 TENSOR.scale_inv "
      "(per-tensor FP8) and TENSOR.amax (per-tensor FP8, NVFP4); format, direction, version, "
      "rows, cols, scale_inv and amax are in the metadata too. --dequantize writes the FP32 "
      "[rows, cols] values instead. The file is written 0600 (0640 with --group_readable), "
      "whatever the umask.");
  cluster.AddTo(opts);
  opts.AddString("direction", &direction_name, "rowwise or columnwise");
  opts.AddInt("version", &version, "version to fetch; -1 = the committed one");
  opts.AddString("out", &out, "output file");
  opts.AddBool("dequantize", &dequantize, "write dequantized FP32 values");
  opts.AddBool("group_readable", &group_readable, "write the file 0640 (default 0600)");
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
  if (absl::Status s = WaitUntilCommitted(**client, version, cluster.timeout()); !s.ok()) {
    return ReportFailure("fetch", s);
  }
  auto result = (*client)->Fetch(version, {{opts.positional()[0], direction, {}, {}}});
  if (!result.ok()) return ReportFailure("fetch", result.status());
  const client::FetchedTensor& t = result->tensors[0];
  if (absl::Status s = Write(out, t, result->version, dequantize,
                             FileModes::ForGroupReadable(group_readable).file);
      !s.ok()) {
    return ReportFailure("fetch", s);
  }
  std::cout << absl::StrFormat(
      "%s %s version %d: %s [%d x %d], %d data + %d scale bytes (fp32 would be %d) -> %s\n",
      t.tensor, DirectionName(direction), result->version, FormatName(t.value.format), t.value.rows,
      t.value.cols, t.layout.data_bytes(), t.layout.scale_bytes(),
      result->stats.fp32_equivalent.total(), out);
  return kExitOk;
}

}  // namespace

HPCTL_REGISTER_COMMAND(fetch, "fetch one direction of one tensor to a safetensors file", RunFetch);

}  // namespace hpctl
}  // namespace paramd
