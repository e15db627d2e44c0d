// File: server/checkpointing.h
//
// Hooks the checkpoint services of checkpoint/ (CheckpointDaemon,
// CheckpointCoordinator: Checkpoint, ListCheckpoints, DescribeCheckpoint,
// WriteShard, ExportRows) into a hybrid-paramd process: the
// CheckpointableDaemon seam over the CPU daemon (state read while the
// daemon's worker is parked, so no step commits meanwhile) and a
// ClusterView over the in-process coordinator.
//
// Thread-safe. The Daemon / Coordinator must outlive what is returned.
#ifndef PARAMD_SERVER_CHECKPOINTING_H_
#define PARAMD_SERVER_CHECKPOINTING_H_

#include <memory>

#include "checkpoint/daemon_state.h"
#include "checkpoint/service.h"
#include "server/coordinator/coordinator.h"
#include "server/daemon/daemon.h"

namespace paramd {

std::unique_ptr<checkpoint::CheckpointableDaemon> NewCheckpointableDaemon(Daemon* daemon);
std::unique_ptr<checkpoint::ClusterView> NewInProcessClusterView(Coordinator* coordinator);

}  // namespace paramd

#endif  // PARAMD_SERVER_CHECKPOINTING_H_
