// hpctl status: membership, versions, per-daemon stats, and every tensor's
// formats with the scales of the published version.
#include <iostream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "format/convert.h"
#include "google/protobuf/util/json_util.h"
#include "hpctl/cluster.h"
#include "hpctl/command.h"
#include "kernels/format.h"
#include "server/step/optimizer_config.h"

namespace paramd {
namespace hpctl {
namespace {

std::string RoleName(rpc::Role role) {
  switch (role) {
    case rpc::ROLE_TRAINER:
      return "trainer";
    case rpc::ROLE_DAEMON:
      return "daemon";
    case rpc::ROLE_OBSERVER:
      return "observer";
    default:
      return "?";
  }
}

// Daemons: their lease (ALIVE, DOWN with why, RECOVERING); others: "".
std::string MemberStateOf(const rpc::Member& m) {
  if (m.role() != rpc::ROLE_DAEMON) return "";
  switch (m.state()) {
    case rpc::MEMBER_STATE_ALIVE:
      return absl::StrFormat("alive (heartbeat %.1fs ago)", m.heartbeat_age_seconds());
    case rpc::MEMBER_STATE_DOWN:
      return absl::StrCat("DOWN: ", m.down_reason());
    case rpc::MEMBER_STATE_RECOVERING:
      return "recovering (replacement getting the rank's state)";
    default:
      return "not joined";
  }
}

std::string FormatOf(rpc::Format format) {
  auto f = FormatFromProto(format);
  return f.ok() ? std::string(FormatName(*f)) : "?";
}

std::string DirectionOf(rpc::Direction direction) {
  auto d = DirectionFromProto(direction);
  return d.ok() ? std::string(DirectionName(*d)) : "?";
}

std::string Bytes(int64_t n) {
  if (n >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", n / double(int64_t{1} << 30));
  if (n >= (1 << 20)) return absl::StrFormat("%.2f MiB", n / double(1 << 20));
  if (n >= (1 << 10)) return absl::StrFormat("%.1f KiB", n / double(1 << 10));
  return absl::StrFormat("%d B", n);
}

std::string DescribeSpec(const rpc::HybridSpec& spec) {
  std::string row =
      spec.has_rowwise_usage() && !spec.rowwise_usage() ? "-" : FormatOf(spec.rowwise().format());
  std::string col = spec.has_columnwise_usage() && !spec.columnwise_usage()
                        ? "-"
                        : FormatOf(spec.columnwise().format());
  return absl::StrFormat("%-18s %-18s %-20s %s", row, col,
                         spec.columnwise_source() == rpc::COLUMNWISE_SOURCE_ROWWISE_DEQUANTIZED
                             ? "rowwise_dequantized"
                             : "original",
                         spec.source_dtype() == rpc::SOURCE_DTYPE_FP32 ? "fp32" : "bf16");
}

// Per daemon and in total: the parameters each holds and the device memory
// its backend allocated for them (DaemonStats.device_bytes: every buffer of
// the gpu store; the cpu backend keeps its state on the host: "-").
void PrintMemory(const rpc::GetStatusResponse& s) {
  std::cout << "\nMEMORY\n"
            << absl::StrFormat("  %4s  %-7s %12s %14s %12s\n", "rank", "backend", "parameters",
                               "device memory", "device B/param");
  int64_t parameters = 0;
  int64_t device_bytes = 0;
  bool any_device = false;
  for (const rpc::DaemonStats& d : s.daemons()) {
    if (d.backend().empty()) {  // no model, or unreachable
      std::cout << absl::StrFormat("  %4d  %-7s %12s %14s %12s\n", d.rank(), "-", "-", "-", "-");
      continue;
    }
    const bool device = d.backend() != "cpu";
    any_device = any_device || device;
    std::cout << absl::StrFormat(
        "  %4d  %-7s %12d %14s %12s\n", d.rank(), d.backend(), d.parameters(),
        device ? Bytes(d.device_bytes()) : "-",
        device ? absl::StrFormat("%.2f", d.device_bytes_per_parameter()) : "-");
    parameters += d.parameters();
    device_bytes += d.device_bytes();
  }
  std::cout << absl::StrFormat(
      "  %-13s %12d %14s %12s\n", "total", parameters, any_device ? Bytes(device_bytes) : "-",
      parameters > 0 && device_bytes > 0
          ? absl::StrFormat("%.2f", static_cast<double>(device_bytes) / parameters)
          : "-");
}

// The loaded model's optimizer config (else the coordinator's), and per
// daemon the step counter, lr, last gradient norm and clip factor.
void PrintOptimizer(const rpc::GetStatusResponse& s) {
  const recipe::OptimizerConfig& proto =
      s.manifest().has_optimizer_config() ? s.manifest().optimizer_config() : s.optimizer();
  absl::StatusOr<OptimizerOptions> o = OptimizerFromProto(proto);
  std::cout << "\nOPTIMIZER " << (o.ok() ? DescribeOptimizer(*o) : o.status().ToString()) << "\n"
            << absl::StrFormat("  %4s  %7s %7s %12s %12s %8s\n", "rank", "step", "skipped", "lr",
                               "grad norm", "clip");
  for (const rpc::DaemonStats& d : s.daemons()) {
    if (!d.error().empty() && d.published_version() < 0) continue;
    std::cout << absl::StrFormat(
        "  %4d  %7d %7d %12.6g %12s %8.4g\n", d.rank(), d.optimizer_steps(), d.skipped_steps(),
        d.lr(), d.grad_norm() < 0 ? std::string("-") : absl::StrFormat("%.6g", d.grad_norm()),
        d.clip_factor() == 0 ? 1.0f : d.clip_factor());
  }
}

// What keeps the cluster from serving after the loss of a daemon, in
// words: a failed recovery, why, and the way out; nothing when it serves.
void PrintRecovery(const rpc::RecoveryStatus& r) {
  if (r.needs_load()) {
    std::cout << "\nCLUSTER CANNOT SERVE: the recovery after a lost daemon failed: " << r.error()
              << "\n  nothing holds the lost rank's state; steps and fetches of new versions "
                 "are refused until it is replaced:\n"
                 "  load the model again (hpctl load MODEL --force), or restore a checkpoint "
                 "(a Load with checkpoint_path and force)\n";
  } else if (r.in_progress()) {
    std::cout << "\nRECOVERY in progress: " << r.state() << "\n";
  } else if (!r.error().empty()) {
    std::cout << "\nRECOVERY failing (retried every 2 s; steps are refused): " << r.error() << "\n";
  } else if (r.epoch() > 0) {
    const rpc::RecoveryPhases& p = r.phases();
    std::cout << absl::StrFormat(
        "\nlast recovery (%d): rank %d replaced from %s, every daemon back at version %d (%d "
        "versions lost), %.2f s after the loss\n  waiting for the replacement %.2f s, prepare "
        "%.2f s, recover %.2f s (slowest daemon: connect %.2f s, snapshot fetch %.2f s, backend "
        "%.2f s, restore %.2f s, republish %.2f s)\n",
        r.epoch(), r.replaced_rank(), r.source(), r.rewound_to_version(), r.versions_lost(),
        r.seconds(), p.wait(), p.prepare(), p.recover(), p.connect(), p.snapshot_fetch(),
        p.backend_create(), p.restore(), p.republish());
  }
}

void PrintStatus(const std::string& address, const rpc::GetStatusResponse& s) {
  std::cout << absl::StrFormat(
      "coordinator %s: committed version %d, %d daemons expected, "
      "%d pushers expected\n",
      address, s.committed_version(), s.expected_daemons(), s.expected_pushers());
  PrintRecovery(s.recovery());
  std::cout << "\nMEMBERS\n"
            << absl::StrFormat("  %-9s %5s  %-24s %-22s %-6s %s\n", "role", "rank", "name",
                               "address", "pusher", "state");
  for (const rpc::Member& m : s.members()) {
    std::cout << absl::StrFormat("  %-9s %5d  %-24s %-22s %-6s %s\n", RoleName(m.role()), m.rank(),
                                 m.name(), m.address(), m.pusher() ? "yes" : "", MemberStateOf(m));
  }
  std::cout << "\nDAEMONS\n"
            << absl::StrFormat("  %4s  %-22s %9s %-8s %7s %6s %9s %12s %12s\n", "rank", "address",
                               "published", "held", "pushers", "steps", "last step", "rowwise out",
                               "colwise out");
  for (const rpc::DaemonStats& d : s.daemons()) {
    std::cout << absl::StrFormat(
        "  %4d  %-22s %9d %-8s %3d/%-3d %6d %8.3fs %12s %12s\n", d.rank(), d.address(),
        d.published_version(), absl::StrJoin(d.held_versions(), ","), d.pushers_received(),
        d.pushers_expected(), d.steps(), d.last_step_seconds(), Bytes(d.bytes_served_rowwise()),
        Bytes(d.bytes_served_columnwise()));
    if (!d.error().empty()) std::cout << "        error: " << d.error() << "\n";
  }
  PrintMemory(s);
  PrintOptimizer(s);
  const rpc::Manifest& m = s.manifest();
  if (m.tensors_size() == 0) {
    std::cout << "\nno model loaded\n";
    return;
  }
  std::cout << "\nTENSORS (optimizer " << m.optimizer() << ")\n"
            << absl::StrFormat("  %-28s %-14s %-18s %-18s %-20s %s\n", "name", "rows x cols",
                               "rowwise", "columnwise", "columnwise source", "source");
  for (const rpc::TensorInfo& t : m.tensors()) {
    std::cout << absl::StrFormat("  %-28s %-14s %s\n", t.name(),
                                 absl::StrCat(t.rows(), "x", t.cols()), DescribeSpec(t.spec()));
  }
  bool header = false;
  for (const rpc::DaemonStats& d : s.daemons()) {
    for (const rpc::ShardStats& shard : d.shards()) {
      if (!header) {
        std::cout << "\nSCALES (published version, per shard)\n"
                  << absl::StrFormat("  %-28s %-11s %6s %-11s %-18s %12s %12s %12s\n", "tensor",
                                     "rows", "daemon", "direction", "format", "scale", "scale_inv",
                                     "amax");
        header = true;
      }
      for (const rpc::DirectionStats& ds : shard.directions()) {
        std::cout << absl::StrFormat("  %-28s %-11s %6d %-11s %-18s %12.6g %12.6g %12.6g\n",
                                     shard.tensor(),
                                     absl::StrCat(shard.row_begin(), "-", shard.row_end()),
                                     d.rank(), DirectionOf(ds.direction()), FormatOf(ds.format()),
                                     ds.scale(), ds.scale_inv(), ds.amax());
      }
    }
  }
}

int RunStatus(int argc, char** argv) {
  ClusterOptions cluster;
  bool json = false;
  bool shards = true;
  OptionParser opts("hpctl status [--address HOST:PORT] [--json] [--noshards]",
                    "Shows the members, the committed version, per-daemon statistics, and each "
                    "tensor's formats with the scales of the published version.");
  cluster.AddTo(opts);
  opts.AddBool("json", &json, "print the GetStatus response as JSON");
  opts.AddBool("shards", &shards, "include per-shard formats and scales");
  if (int rc = opts.ParseOrExit(argc, argv); rc >= 0) return rc;
  if (!opts.positional().empty()) {
    std::cerr << "hpctl status: unexpected argument '" << opts.positional()[0] << "'\n"
              << opts.Usage();
    return kExitUsage;
  }
  auto client = cluster.Connect();
  if (!client.ok()) return ReportFailure("status", client.status());
  auto status = (*client)->Status(shards);
  if (!status.ok()) return ReportFailure("status", status.status());
  if (json) {
    std::string text;
    google::protobuf::util::JsonPrintOptions options;
    options.add_whitespace = true;
    options.preserve_proto_field_names = true;
    if (auto s = google::protobuf::util::MessageToJsonString(*status, &text, options); !s.ok()) {
      return ReportFailure("status", absl::InternalError(s.ToString()));
    }
    std::cout << text << "\n";
    return kExitOk;
  }
  PrintStatus(cluster.address(), *status);
  return kExitOk;
}

}  // namespace

HPCTL_REGISTER_COMMAND(status, "show members, versions, formats and scales", RunStatus);

}  // namespace hpctl
}  // namespace paramd
