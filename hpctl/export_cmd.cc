// hpctl export: a committed version as Hugging Face safetensors, computed
// from the FP32 masters on the daemons (BF16 round to nearest even, or
// FP32), streamed to this machine and written as model-0000k-of-0000n
// shards plus model.safetensors.index.json. --direction exports the
// dequantized published copy a trainer saw instead of the master. The files
// are the user's only (0600) unless --group_readable.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "checkpoint/export.h"
#include "checkpoint/export_dir.h"
#include "client/cluster_admin.h"
#include "common/file_util.h"
#include "hpctl/cluster.h"
#include "hpctl/command.h"
#include "hpctl/progress.h"

namespace paramd {
namespace hpctl {
namespace {

int RunExport(int argc, char** argv) {
  ClusterOptions cluster;
  std::string out;
  int64_t version = -1;
  std::string max_shard_size = "5GB";
  std::string dtype_name = "bf16";
  std::string direction = "master";
  std::string checkpoint_dir;
  bool progress = true;
  bool overwrite = false;
  bool group_readable = false;
  OptionParser opts(
      "hpctl export --out DIR [--version V] [--max_shard_size 5GB] [--dtype bf16|fp32] "
      "[--direction master|rowwise|columnwise] [--overwrite] [--group_readable]",
      "Writes version V (default: the committed one) as Hugging Face safetensors in DIR: "
      "model-0000k-of-0000n.safetensors with __metadata__ {\"format\": \"pt\"} and "
      "model.safetensors.index.json (written last). The daemons convert their FP32 master "
      "shards (BF16: round to nearest even, a NaN stays NaN) and stream them here; the model's "
      "frozen buffers (integer, bool, F64 tensors) follow in their own dtype. A version "
      "the daemons no longer hold is read from its checkpoint in --checkpoint_dir, if any. DIR "
      "must "
      "be new or empty; --overwrite replaces an older export there (its shards and index are "
      "removed first, other files such as config.json are kept). The files are written 0600 and "
      "the directories created 0700 (0640 / 0750 with --group_readable), whatever the umask.");
  cluster.AddTo(opts);
  opts.AddString("out", &out, "output directory (created)");
  opts.AddInt("version", &version, "version to export; -1 = the committed one");
  opts.AddString("max_shard_size", &max_shard_size, "largest shard file (5GB, 500MB, 2GiB)");
  opts.AddString("dtype", &dtype_name, "bf16 or fp32");
  opts.AddString("direction", &direction,
                 "master (the FP32 master), or rowwise / columnwise: the dequantized published "
                 "copy of that direction");
  opts.AddString("checkpoint_dir", &checkpoint_dir,
                 "directory below the daemons' --checkpoint_dir to read older versions from");
  opts.AddBool("progress", &progress, "progress bar on a terminal");
  opts.AddBool("overwrite", &overwrite,
               "replace an older export in --out (removes its shards and index first)");
  opts.AddBool("group_readable", &group_readable,
               "write the files 0640 and create directories 0750 (default 0600 / 0700)");
  if (int rc = opts.ParseOrExit(argc, argv); rc >= 0) return rc;
  auto usage_error = [&](const std::string& message) {
    std::cerr << "hpctl export: " << message << "\n\n" << opts.Usage();
    return kExitUsage;
  };
  if (!opts.positional().empty()) return usage_error("unexpected argument " + opts.positional()[0]);
  if (out.empty()) return usage_error("--out is required");
  auto dtype = checkpoint::ParseExportDtype(dtype_name);
  if (!dtype.ok()) return usage_error(std::string(dtype.status().message()));
  auto shard_bytes = checkpoint::ParseByteSize(max_shard_size);
  if (!shard_bytes.ok()) return usage_error(std::string(shard_bytes.status().message()));
  client::OpenVersionOptions read;
  if (direction == "master") {
    read.values = checkpoint::ExportValuesKind::kMaster;
  } else if (direction == "rowwise") {
    read.values = checkpoint::ExportValuesKind::kRowwise;
  } else if (direction == "columnwise") {
    read.values = checkpoint::ExportValuesKind::kColumnwise;
  } else {
    return usage_error("--direction must be master, rowwise or columnwise");
  }
  read.version = version;
  read.checkpoint_dir = checkpoint_dir;
  read.timeout = cluster.timeout();

  if (!overwrite) {  // refuse a non-empty --out before connecting
    if (auto empty = checkpoint::PrepareExportDir(out, false); !empty.ok()) {
      return ReportFailure("export", empty.status());
    }
  }
  auto client = cluster.Connect();
  if (!client.ok()) return ReportFailure("export", client.status());
  ProgressBar bar(progress && StderrIsTerminal());
  checkpoint::ExportOptions options;
  options.out_dir = out;
  options.dtype = *dtype;
  options.max_shard_bytes = *shard_bytes;
  options.modes = FileModes::ForGroupReadable(group_readable);
  options.progress = [&bar](uint64_t done, uint64_t total) { bar.Update(done, total); };
  const auto start = std::chrono::steady_clock::now();
  auto result = client::ExportVersion(**client, read, options, overwrite);
  if (!result.ok()) return ReportFailure("export", result.status());
  if (!result->removed.empty()) {
    std::cerr << "removed " << result->removed.size() << " file(s) of the older export in " << out
              << "\n";
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const checkpoint::ExportResult& files = result->files;
  std::cout << absl::StrFormat(
      "exported version %d (%s, %s): %d tensors, %.1f MB in %d file(s) + index to %s "
      "in %.2f s (%.0f MB/s)\n",
      result->version, checkpoint::ExportDtypeName(*dtype), direction, files.num_tensors,
      files.total_bytes / 1e6, static_cast<int>(files.files.size()) - 1, out, seconds,
      files.total_bytes / 1e6 / std::max(seconds, 1e-9));
  return kExitOk;
}

}  // namespace

HPCTL_REGISTER_COMMAND(export, "write a version as BF16 (or FP32) Hugging Face safetensors",
                       RunExport);

}  // namespace hpctl
}  // namespace paramd
