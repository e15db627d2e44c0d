// File: tests/checkpoint_test_util.h
//
// Helpers for the multi-process checkpoint / export tests against real
// hybrid-paramd processes (tests/server_test_util.h's RawCluster): the
// CheckpointCoordinator RPC, a restore (Load of a checkpoint), FP32 masters read back through the
// daemons' ExportRows, a byte snapshot of a version (masters and every published copy) to compare a
// restored cluster with, SIGKILL of the cluster's coordinator process, and running a program
// (hpctl, python3) to its end.
//
// Not thread-safe, except Checkpoint(), which may run on another thread
// (it uses its own channel).
#ifndef PARAMD_TESTS_CHECKPOINT_TEST_UTIL_H_
#define PARAMD_TESTS_CHECKPOINT_TEST_UTIL_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/checkpoint_service.pb.h"
#include "tests/server_test_util.h"

namespace paramd {
namespace testing {

// CheckpointCoordinator.Checkpoint of `version` (-1 = the committed one)
// on the coordinator at `address`; `keep` as in CheckpointRequest.
grpc::Status CheckpointVia(const std::string& address, int64_t version, absl::Duration timeout,
                           checkpoint::CheckpointResponse* response = nullptr, int keep = 0);
// CheckpointVia on `cluster`'s coordinator (its --checkpoint_dir), 30 s.
grpc::Status Checkpoint(RawCluster& cluster, int64_t version);

// Coordinator.Load of the newest complete checkpoint of the store at
// `path` (a restore), retried while UNAVAILABLE (daemons still joining),
// then RefreshManifest. The version it republished. `force`: over a
// loaded model.
absl::StatusOr<int64_t> Restore(RawCluster& cluster, const std::string& path, bool force = false);

// The FP32 masters of `tensor` at `version` (the daemons' current version),
// read through every daemon's ExportRows (EXPORT_DTYPE_FP32, master values)
// and assembled in row order.
absl::StatusOr<std::vector<float>> ExportMasters(RawCluster& cluster, int64_t version,
                                                 const std::string& tensor);

// Every byte of version `version` as the cluster serves it: per tensor the
// FP32 masters ("<t>/master") and, per published direction, the assembled
// data, scales and scale_inv bits ("<t>/rowwise/data", ...).
using Snapshot = std::map<std::string, std::string>;
absl::StatusOr<Snapshot> TakeSnapshot(RawCluster& cluster, int64_t version);
// "" if equal, else the first differing key and how it differs.
std::string CompareSnapshots(const Snapshot& want, const Snapshot& got);

// SIGKILLs the coordinator process of `cluster` (found as the child of this
// process started with --port_file=<cluster dir>/coordinator.port) and
// returns once it is dead (TestCluster reaps it later).
absl::Status KillCoordinator(TestCluster& cluster);

// A program run to completion (argv[0]: a path, no PATH lookup): its exit
// code (-1 if it did not exit normally within `timeout`) and its stdout and
// stderr interleaved. The output goes through a file in `scratch_dir`.
struct ProgramRun {
  int exit_code = -1;
  std::string out;
};
ProgramRun RunProgram(const std::vector<std::string>& argv, const std::string& scratch_dir,
                      absl::Duration timeout = absl::Seconds(60));

// The first executable `name` on $PATH (then /usr/bin), or "".
std::string FindOnPath(const std::string& name);

}  // namespace testing
}  // namespace paramd

#endif  // PARAMD_TESTS_CHECKPOINT_TEST_UTIL_H_
