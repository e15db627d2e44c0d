// hpctl step: the coordinator's admin step (every daemon steps from the
// committed version with whatever gradients it has summed).
#include <iostream>
#include <string>

#include "hpctl/cluster.h"
#include "hpctl/command.h"

namespace paramd {
namespace hpctl {
namespace {

int RunStep(int argc, char** argv) {
  ClusterOptions cluster;
  int64_t version = -1;
  bool wait = true;
  OptionParser opts("hpctl step [--version V] [--nowait] [--address HOST:PORT]",
                    "Makes every daemon step from version V (default: the committed version) "
                    "with the gradients summed so far (missing pushers count as zero), and "
                    "waits for the commit of V+1. Refused if V is not the committed version "
                    "(a guard against double steps).");
  cluster.AddTo(opts);
  opts.AddInt("version", &version, "version to step from; -1 = the committed one");
  opts.AddBool("wait", &wait, "wait for the commit of the next version");
  if (int rc = opts.ParseOrExit(argc, argv); rc >= 0) return rc;
  if (!opts.positional().empty()) {
    std::cerr << "hpctl step: unexpected argument '" << opts.positional()[0] << "'\n"
              << opts.Usage();
    return kExitUsage;
  }
  auto client = cluster.Connect();
  if (!client.ok()) return ReportFailure("step", client.status());
  if (version < 0) {
    auto committed = CommittedVersion(**client, cluster.timeout(), "step");
    if (!committed.ok()) return ReportFailure("step", committed.status());
    version = *committed;
  }
  auto next = (*client)->Step(version, wait);
  if (!next.ok()) return ReportFailure("step", next.status());
  std::cout << "stepped from version " << version << "; committed version " << *next << "\n";
  return kExitOk;
}

}  // namespace

HPCTL_REGISTER_COMMAND(step, "admin step: every daemon steps from the committed version", RunStep);

}  // namespace hpctl
}  // namespace paramd
