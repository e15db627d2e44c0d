// The one table of who may call what (auth/security.h: MethodPolicy). Every
// RPC handler of hybrid-paramd asks Authenticator::Authorize with its full
// method name; a method missing here is refused (PERMISSION_DENIED), and
// //auth:security_test checks that every method of the project's services
// has a row. docs/SECURITY.md shows this table to users: keep them in step.
//
// `roles` apply with a token file (--auth_token_file). `internal` methods
// change the cluster's state on behalf of the coordinator or a daemon; they
// need a cluster secret even without a token file.
#include "absl/container/flat_hash_map.h"
#include "auth/security.h"

namespace paramd {
namespace auth {
namespace {

constexpr Role kT = Role::kTrainer;
constexpr Role kO = Role::kOperator;
constexpr Role kC = Role::kCluster;

const std::vector<MethodPolicy>& Table() {
  static const auto* table = new std::vector<MethodPolicy>{
      // ---- paramd.rpc.Coordinator
      // Observers and non-pushing trainers; joining as a pusher or a
      // daemon is checked by the two sub-policies below.
      {"/paramd.rpc.Coordinator/Join", {kT, kO, kC}},
      {kJoinAsPusher, {kT}},
      // A daemon's join hands it the cluster secret. Without a token file
      // a new daemon may join while the world is incomplete; a rejoin
      // (taking over an existing rank) needs a cluster credential.
      {kJoinAsDaemon, {kC}},
      {"/paramd.rpc.Coordinator/Leave", {kT, kO}},
      {"/paramd.rpc.Coordinator/GetManifest", {kT, kO, kC}},
      {"/paramd.rpc.Coordinator/WaitForVersion", {kT, kO, kC}},
      {"/paramd.rpc.Coordinator/WatchVersion", {kT, kO, kC}},
      {"/paramd.rpc.Coordinator/Load", {kO}},
      {"/paramd.rpc.Coordinator/Step", {kO}},
      {"/paramd.rpc.Coordinator/GetStatus", {kO}},
      {"/paramd.rpc.Coordinator/SetOptimizerSchedule", {kO}},
      {"/paramd.rpc.Coordinator/ReportVersion", {kC}, /*internal=*/true},
      // A daemon's lease renewal (a forged one would keep a dead daemon
      // "alive" or learn whether a rank was replaced).
      {"/paramd.rpc.Coordinator/Heartbeat", {kC}, /*internal=*/true},
      // ---- paramd.rpc.Daemon
      {"/paramd.rpc.Daemon/PushGradients", {kT}},
      {"/paramd.rpc.Daemon/PushGradientsDevice", {kT}},
      {"/paramd.rpc.Daemon/Fetch", {kT, kO}},
      {"/paramd.rpc.Daemon/OpenDeviceChannel", {kT, kO}},
      {"/paramd.rpc.Daemon/FetchDevice", {kT, kO}},
      // The values of a declared model, streamed by whoever loads it.
      {"/paramd.rpc.Daemon/PushWeights", {kO}},
      {"/paramd.rpc.Daemon/GetStats", {kO, kC}},
      {"/paramd.rpc.Daemon/LoadShards", {kC}, /*internal=*/true},
      {"/paramd.rpc.Daemon/Step", {kC}, /*internal=*/true},
      // The coordinator's optimizer config, pushed to every daemon.
      {"/paramd.rpc.Daemon/SetOptimizer", {kC}, /*internal=*/true},
      // The coordinator's recovery of a replaced daemon (server/coordinator/recovery.h).
      {"/paramd.rpc.Daemon/PrepareRecovery", {kC}, /*internal=*/true},
      {"/paramd.rpc.Daemon/Recover", {kC}, /*internal=*/true},
      // In-memory snapshots between buddy daemons (server/snapshot/snapshot.h).
      {"/paramd.rpc.Daemon/PutSnapshot", {kC}, /*internal=*/true},
      {"/paramd.rpc.Daemon/GetSnapshot", {kC}, /*internal=*/true},
      // ---- paramd.rpc.DaemonIpc (same-GPU sessions: trainers on the daemon's GPU)
      {"/paramd.rpc.DaemonIpc/OpenIpcSession", {kT, kO}},
      {"/paramd.rpc.DaemonIpc/IpcKeepAlive", {kT, kO}},
      {"/paramd.rpc.DaemonIpc/CloseIpcSession", {kT, kO}},
      {"/paramd.rpc.DaemonIpc/PinIpc", {kT, kO}},
      {"/paramd.rpc.DaemonIpc/UnpinIpc", {kT, kO}},
      {"/paramd.rpc.DaemonIpc/PushGradientsIpc", {kT}},
      // ---- paramd.checkpoint.CheckpointCoordinator
      {"/paramd.checkpoint.CheckpointCoordinator/Checkpoint", {kO}},
      {"/paramd.checkpoint.CheckpointCoordinator/ListCheckpoints", {kO}},
      {"/paramd.checkpoint.CheckpointCoordinator/DescribeCheckpoint", {kO}},
      // ---- paramd.checkpoint.CheckpointDaemon
      {"/paramd.checkpoint.CheckpointDaemon/WriteShard", {kC}, /*internal=*/true},
      // hpctl export reads the masters from every daemon.
      {"/paramd.checkpoint.CheckpointDaemon/ExportRows", {kO, kC}},
      // ---- paramd.transport.DataPlane (the daemons' host data plane)
      {"/paramd.transport.DataPlane/Deliver", {kC}, /*internal=*/true},
      {"/paramd.transport.DataPlane/Ping", {kC}, /*internal=*/true},
      {"/paramd.transport.DataPlane/Goodbye", {kC}, /*internal=*/true},
  };
  return *table;
}

}  // namespace

const std::vector<MethodPolicy>& AllPolicies() { return Table(); }

const MethodPolicy* FindPolicy(absl::string_view method) {
  static const auto* index = [] {
    auto* m = new absl::flat_hash_map<absl::string_view, const MethodPolicy*>();
    for (const MethodPolicy& p : Table()) (*m)[p.method] = &p;
    return m;
  }();
  auto it = index->find(method);
  return it == index->end() ? nullptr : it->second;
}

}  // namespace auth
}  // namespace paramd
