// File: server/snapshot/snapshot.h
//
// In-memory snapshots of a daemon's state (docs/ARCHITECTURE.md
// "Snapshots"). Every `every_steps` optimizer steps the daemon copies the
// state that produced the version it just published (FP32 masters,
// optimizer moments, step and skipped-step counters, optimizer config,
// per-tensor delayed-scaling state and the scales the version was cast
// with) to host memory, and sends that copy to one buddy daemon (rank r ->
// rank (r+1) mod n), so that losing a whole host still leaves one copy of
// every rank. A recovery restores a replacement's rank from its buddy's
// copy and every other rank from its own (server/coordinator/recovery.h).
//
// Cost on the daemon's worker (what a step waits for): right after the
// step, the small state is captured and the backend captures its arrays
// (ShardBackend::CaptureState): the cpu backend hands out its live state,
// which the keeper's own thread copies while the daemon serves fetches and
// takes pushes (they write the gradient accumulators, which a snapshot
// does not read); the next step waits only for what is left of that copy
// (BeforeStep). The gpu backend copies masters and moments into a device
// spare on a side stream (the next step's device work waits for that copy
// on the device, not the worker) and the keeper's thread downloads the
// spare; without room for a spare its capture reads the live device
// buffers and is waited for like the cpu one. The buddy send runs on
// another thread after the copy and never holds up a step. A capture waits
// for the previous snapshot's copy (a gpu spare is reused): snapshots
// further apart than a copy never wait.
//
// Each daemon keeps its newest `keep` complete snapshots and, per rank it
// is buddy of, the newest copy received. With keep = 2, when a rank dies
// after its buddy got its copy of V but before another rank finished its
// own copy of V, every rank still has V - N. Host memory: up to keep + 1
// copies of a daemon's masters and moments (the state itself not counted
// for the gpu backend, which keeps it on the device).
//
// Threading: thread-safe. AfterPublish, BeforeChange, BeforeStep, SetModel,
// DropAll and AfterRecovery are called on the daemon's worker (they order the copy
// against the state's next change); the rest from any thread. The RPC
// entry points never block.
#ifndef PARAMD_SERVER_SNAPSHOT_SNAPSHOT_H_
#define PARAMD_SERVER_SNAPSHOT_SNAPSHOT_H_

#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "auth/security.h"
#include "grpcpp/grpcpp.h"
#include "proto/paramd.grpc.pb.h"
#include "server/backend/shard_backend.h"
#include "server/rpc/serial_worker.h"
#include "server/snapshot/restore.h"
#include "server/step/shard_set.h"

namespace paramd {

// One rank's state of one version. Immutable once complete.
struct DaemonSnapshot {
  rpc::SnapshotHeader header;
  // By shard (header.shards order): master, first moment, second moment
  // (moments empty when header.shards[i].moments says so).
  std::vector<std::array<std::vector<float>, 3>> arrays;
};

// Of `shards` of `tensors` (names, shapes, row ranges): equal on a
// replacement of the same rank under the same plan.
uint64_t ShardLayoutHash(const std::vector<TensorDef>& tensors,
                         const std::vector<ShardDef>& shards);

// Puts `snapshot` into `shards` (the backend's state_sink()) as RestoreShardSet
// (server/snapshot/restore.h) puts a checkpoint: masters, moments, counters, optimizer config, and
// each delayed direction's scale set to the one the version was cast with; returns the post-update
// states for ApplyDelayedStates after the republishing step. FAILED_PRECONDITION for a snapshot of
// another layout or optimizer kind.
absl::StatusOr<std::vector<SavedDelayedState>> RestoreSnapshot(const DaemonSnapshot& snapshot,
                                                               ShardStateSink& shards);

// The daemons' gRPC addresses by rank (Manifest.daemons; "" for a rank
// missing there).
std::vector<std::string> DaemonAddresses(const rpc::Manifest& manifest);

// The most array bytes one SnapshotChunk carries, whatever
// SnapshotOptions::chunk_bytes says: 4 MiB (gRPC's default receive limit)
// less room for the chunk's other fields.
inline constexpr int64_t kMaxSnapshotChunkBytes = (int64_t{4} << 20) - (int64_t{64} << 10);

struct SnapshotOptions {
  // Snapshot every N optimizer steps (versions that are multiples of N);
  // 0: never (the buddy copies of others are still kept and served).
  int every_steps = 0;
  int keep = 2;
  // Of one buddy send / one fetch of a snapshot.
  absl::Duration transfer_timeout = absl::Minutes(5);
  // Array bytes per SnapshotChunk message. Capped at kMaxSnapshotChunkBytes:
  // a chunk's framing (shard, array, offset) comes on top of its data, and a
  // message over gRPC's default 4 MiB receive limit is refused by the reader.
  int64_t chunk_bytes = int64_t{1} << 20;
  // How this daemon calls other daemons: TLS and the cluster secret
  // (set once joined).
  auth::TlsConfig tls;
  std::shared_ptr<auth::BearerToken> token;
};

class SnapshotKeeper {
 public:
  explicit SnapshotKeeper(SnapshotOptions options);
  // Finishes a copy in progress, cancels a send in progress.
  ~SnapshotKeeper();
  SnapshotKeeper(const SnapshotKeeper&) = delete;
  SnapshotKeeper& operator=(const SnapshotKeeper&) = delete;

  // ---- On the daemon's worker ----

  // A model of `model_generation` (Manifest.model_generation: every
  // snapshot taken from now on records it) is installed as `rank`;
  // `addresses` are the daemons' gRPC addresses by rank (the buddy is
  // rank+1 mod n). When the buddy's address changed (it was replaced), the
  // newest own snapshot is sent to it again. Buddy copies of older
  // generations are dropped.
  void SetModel(int rank, std::vector<std::string> addresses, uint64_t layout_hash,
                int64_t model_generation);
  // A new model (LoadShards): every snapshot held is dropped.
  void DropAll();
  // `published` was just published by `backend` after an optimizer step:
  // if its version is a multiple of every_steps, captures a snapshot
  // (the arrays are copied on the keeper's thread).
  void AfterPublish(ShardBackend& backend, const PublishedVersion& published);
  // Before anything changes the backend's state or its host view (a load,
  // a restore, a checkpoint): waits for the copy of a snapshot in progress.
  void BeforeChange();
  // Before a step: waits for a copy in progress only if it reads the live
  // state (StateCapture::reads_live_state).
  void BeforeStep();
  // The daemon went back to `version` (a recovery): snapshots of newer
  // versions (another history) are dropped, `restored` (the one it
  // restored from, null for a checkpoint) is kept as its own, and
  // snapshots may be dropped again (see Held).
  void AfterRecovery(int64_t version, std::shared_ptr<const DaemonSnapshot> restored);

  // ---- Recovery, any thread ----

  // What this daemon holds (its own and its buddy copies, each with its
  // model generation). Nothing is dropped from then until AfterRecovery,
  // so that what the coordinator picks from this stays here.
  std::vector<rpc::SnapshotHeld> HoldForRecovery();
  // The snapshot of `rank` at `version` of model `model_generation` held
  // here, or null (also when one of that rank and version is of another
  // model).
  std::shared_ptr<const DaemonSnapshot> Find(int rank, int64_t version,
                                             int64_t model_generation) const;
  // Reads it from the daemon at `address` (Daemon.GetSnapshot). Blocking.
  absl::StatusOr<std::shared_ptr<const DaemonSnapshot>> Fetch(const std::string& address, int rank,
                                                              int64_t version,
                                                              int64_t model_generation);

  // ---- RPC bodies (authorized by the caller) ----
  grpc::ServerReadReactor<rpc::SnapshotChunk>* StartPut(grpc::CallbackServerContext* context,
                                                        rpc::PutSnapshotResponse* response);
  grpc::ServerWriteReactor<rpc::SnapshotChunk>* StartGet(const rpc::GetSnapshotRequest& request);

  // DaemonStats snapshot_* fields.
  void FillStats(rpc::DaemonStats* stats) const;

  // Used by the Put reactor: a complete copy received from `rank`'s daemon.
  // Kept unless it is of an older model generation than this daemon's
  // model or than a copy of that rank already held (a send that was slow
  // across a load); a newer generation's copy replaces that rank's others.
  void AddBuddyCopy(std::shared_ptr<const DaemonSnapshot> snapshot);

 private:
  struct Pending;
  void Copy(const std::shared_ptr<Pending>& pending);
  void Send(const std::shared_ptr<const DaemonSnapshot>& snapshot);
  void TrimLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for the copy in progress (all of it, or only one reading the
  // live state); returns the seconds waited.
  double WaitFor(bool live_readers_only);
  double WaitForCopy();
  std::string capture_kind() const;

  const SnapshotOptions options_;
  mutable absl::Mutex mu_;
  int rank_ ABSL_GUARDED_BY(mu_) = -1;
  std::vector<std::string> addresses_ ABSL_GUARDED_BY(mu_);
  uint64_t layout_hash_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t model_generation_ ABSL_GUARDED_BY(mu_) = 0;                           // SetModel's
  std::deque<std::shared_ptr<const DaemonSnapshot>> own_ ABSL_GUARDED_BY(mu_);  // oldest first
  // The arrays of the last own snapshot that TrimLocked dropped while
  // nothing else held it; the next snapshot's copy writes into them (the
  // same sizes under the same model) instead of faulting in and filling
  // fresh memory.
  std::vector<std::array<std::vector<float>, 3>> recycled_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::deque<std::shared_ptr<const DaemonSnapshot>>> buddy_ ABSL_GUARDED_BY(mu_);
  bool frozen_ ABSL_GUARDED_BY(mu_) = false;  // between HoldForRecovery and AfterRecovery
  std::shared_ptr<Pending> copying_ ABSL_GUARDED_BY(mu_);        // copy in progress
  grpc::ClientContext* sending_ ABSL_GUARDED_BY(mu_) = nullptr;  // send in progress
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  // The last snapshot's figures (DaemonStats).
  double last_block_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  double last_copy_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  std::string capture_kind_ ABSL_GUARDED_BY(mu_);  // StateCapture::kind
  std::unique_ptr<SerialWorker> thread_;           // copies
  std::unique_ptr<SerialWorker> sender_;           // buddy sends (a slow one never holds up a copy)
};

}  // namespace paramd

#endif  // PARAMD_SERVER_SNAPSHOT_SNAPSHOT_H_
