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
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "checkpoint/export.h"
#include "checkpoint/remote_export.h"
#include "common/file_util.h"
#include "hpctl/cluster.h"
#include "hpctl/command.h"
#include "hpctl/export_dir.h"
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
      "shards (BF16: round to nearest even, a NaN stays NaN) and stream them here. A version "
      "the daemons no longer hold is read from its checkpoint in --checkpoint_dir, if any. DIR must "
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
  checkpoint::RemoteExportOptions remote;
  if (direction == "master") {
    remote.values = checkpoint::ExportValuesKind::kMaster;
  } else if (direction == "rowwise") {
    remote.values = checkpoint::ExportValuesKind::kRowwise;
  } else if (direction == "columnwise") {
    remote.values = checkpoint::ExportValuesKind::kColumnwise;
  } else {
    return usage_error("--direction must be master, rowwise or columnwise");
  }

  if (!overwrite) {  // refuse a non-empty --out before any work
    if (auto empty = PrepareExportDir(out, false); !empty.ok()) {
      return ReportFailure("export", empty.status());
    }
  }
  auto security = cluster.Security();
  if (!security.ok()) return ReportFailure("export", security.status());
  remote.security = *security;
  auto client = cluster.Connect();
  if (!client.ok()) return ReportFailure("export", client.status());
  auto manifest = (*client)->RefreshManifest(cluster.timeout());
  if (!manifest.ok()) return ReportFailure("export", manifest.status());
  if (manifest->committed_version < 0) {
    return ReportFailure("export", absl::FailedPreconditionError("no model loaded"));
  }
  if (version > manifest->committed_version) {
    return ReportFailure("export", absl::FailedPreconditionError(absl::StrCat(
                                       "version ", version, " is not committed yet (committed: ",
                                       manifest->committed_version, ")")));
  }
  remote.version = static_cast<uint64_t>(version >= 0 ? version : manifest->committed_version);
  remote.checkpoint_dir = checkpoint_dir;

  std::vector<checkpoint::ExportTensor> tensors;
  std::map<std::string, std::vector<checkpoint::RemotePiece>> pieces;
  for (const client::TensorMeta& tensor : manifest->tensors) {
    tensors.push_back({tensor.name, tensor.shape, tensor.rows, tensor.cols});
    for (const client::PieceLocation& piece : tensor.pieces) {
      pieces[tensor.name].push_back({piece.row_begin, piece.row_end, piece.daemon_address});
    }
  }
  if (overwrite) {
    // Only now that the cluster answered, right before writing, so that an
    // export that cannot start leaves the older one in place.
    auto removed = PrepareExportDir(out, true);
    if (!removed.ok()) return ReportFailure("export", removed.status());
    if (!removed->empty()) {
      std::cerr << "removed " << removed->size() << " file(s) of the older export in " << out
                << "\n";
    }
  }
  auto source = checkpoint::NewRemoteExportSource(std::move(pieces), remote);
  ProgressBar bar(progress && StderrIsTerminal());
  checkpoint::ExportOptions options;
  options.out_dir = out;
  options.dtype = *dtype;
  options.max_shard_bytes = *shard_bytes;
  options.modes = FileModes::ForGroupReadable(group_readable);
  options.progress = [&bar](uint64_t done, uint64_t total) { bar.Update(done, total); };
  const auto start = std::chrono::steady_clock::now();
  auto result = checkpoint::ExportSafetensors(tensors, *source, options);
  if (!result.ok()) return ReportFailure("export", result.status());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << absl::StrFormat(
      "exported version %d (%s, %s): %d tensors, %.1f MB in %d file(s) + index to %s "
      "in %.2f s (%.0f MB/s)\n",
      remote.version, checkpoint::ExportDtypeName(*dtype), direction, result->num_tensors,
      result->total_bytes / 1e6, static_cast<int>(result->files.size()) - 1, out, seconds,
      result->total_bytes / 1e6 / std::max(seconds, 1e-9));
  return kExitOk;
}

}  // namespace

HPCTL_REGISTER_COMMAND(export, "write a version as BF16 (or FP32) Hugging Face safetensors",
                       RunExport);

}  // namespace hpctl
}  // namespace paramd
