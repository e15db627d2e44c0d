// File: server/backend/shard_backend.h
//
// The seam between the daemon (server/daemon/daemon.h) and the state it steps:
// everything the daemon does with its shards goes through ShardBackend.
//
//   cpu: server/step/shard_set.h (FP32 masters, optimizer, reference kernels on
//        the host). Always linked; the default.
//   gpu: server/gpu_backend/daemon_backend.h (GpuShardStore: masters, AdamW
//        moments and accumulators in device memory, fused step). Linked only
//        under --config=cuda; it registers itself here at static init.
//
// Host-side contract shared by both: the daemon writes loaded weights into
// load_master(i) and sums pushed gradients into gradient(i) (host FP32
// rows); Step() consumes them and returns the published version
// (PublishedVersion). The cpu backend's versions carry their bytes; the gpu
// backend's carry the metadata only, and host_bytes() turns one into host
// bytes (copied from the device on first use) for the gRPC Fetch stream and
// checkpoint export.
//
// Threading: as ShardSet (not thread-safe; the daemon's worker steps it and
// the daemon serialises load_master/gradient writes with its own mutex).
#ifndef PARAMD_SERVER_BACKEND_SHARD_BACKEND_H_
#define PARAMD_SERVER_BACKEND_SHARD_BACKEND_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/backend/select.h"
#include "server/step/optimizer.h"
#include "server/step/shard_set.h"
#include "server/step/step_pipeline.h"

namespace paramd {

class Transport;  // transport/transport.h

// A version returned by ShardBackend::Step -> the same version with its
// bytes on the host (QuantizedTensor data and scales filled). NOT_FOUND once
// the backend no longer holds the version. Thread-safe; may block on a
// device-to-host copy.
using HostBytesFn = std::function<absl::StatusOr<std::shared_ptr<const PublishedVersion>>(
    const std::shared_ptr<const PublishedVersion>& version)>;

// What a backend's shards occupy (ShardBackend::memory; DaemonStats).
struct BackendMemory {
  // Elements (parameters) of the shards this backend holds.
  int64_t parameters = 0;
  // Every device byte the backend allocated for them: gpu masters, optimizer
  // moments, accumulators, staging, the two published versions and scaling
  // state. 0 for the cpu backend, whose state lives on the host.
  int64_t device_bytes = 0;
  double device_bytes_per_parameter() const {
    return parameters > 0 ? static_cast<double>(device_bytes) / parameters : 0.0;
  }
};

// What a snapshot (server/snapshot/snapshot.h) takes of a backend's state right
// after a step: the small state at once, the arrays through Copy.
class StateCapture {
 public:
  virtual ~StateCapture() = default;
  // How the arrays are held until Copy: "host" (the cpu backend's live
  // state), "device spare" (a device-side copy), "device direct" (the live
  // device buffers). DaemonStats.snapshot_capture.
  virtual absl::string_view kind() const = 0;
  // Whether Copy reads the backend's live state: then nothing may change
  // that state until Copy has returned (SnapshotKeeper::BeforeStep waits
  // for it). false: the capture holds a copy of its own and the backend
  // orders its later changes after that copy itself.
  virtual bool reads_live_state() const = 0;
  // Blocking, on the snapshot keeper's thread, once: every shard's FP32
  // master, first and second moment as of the capture, by shard
  // (moments empty where the optimizer has none yet).
  virtual absl::Status Copy(std::vector<std::array<std::vector<float>, 3>>& arrays) = 0;
};

// The small state of a capture, taken on the step thread.
struct CapturedState {
  OptimizerOptions optimizer;
  int64_t optimizer_steps = 0;
  int64_t skipped_steps = 0;
  // By manifest tensor index: [rowwise, columnwise] delayed-scaling state
  // after the step (tensors this backend holds no shard of: unset).
  std::vector<std::array<DelayedScalingState, 2>> delayed;
  std::unique_ptr<StateCapture> arrays;
};

class ShardBackend {
 public:
  virtual ~ShardBackend() = default;

  // "cpu" or "gpu".
  virtual absl::string_view name() const = 0;
  virtual const std::vector<TensorDef>& tensors() const = 0;
  virtual const std::vector<ShardDef>& shards() const = 0;

  // The backend's memory now. Thread-safe, unlike the rest of this
  // interface (the daemon reports it from GetStats, beside a Step); it does
  // not block. The default counts the parameters of shards() and no device
  // bytes (the cpu backend); the gpu backend reports its store's
  // allocations, which grow once (by at most 4 MiB) when the first host
  // push allocates the upload staging buffer.
  virtual BackendMemory memory() const {
    BackendMemory m;
    for (const ShardDef& d : shards()) m.parameters += d.rows() * tensors()[d.tensor].cols;
    return m;
  }

  // Row-major [rows][cols] FP32 host rows of shard `i` to load weights into
  // before the first Step (masters start at zero). Writes after the first
  // Step are not supported by the gpu backend (the daemon never does that).
  virtual absl::Span<float> load_master(int i) = 0;
  // Host FP32 gradient accumulator of shard `i`; the daemon adds pushes into
  // it. A successful Step with apply_optimizer zeroes it.
  virtual absl::Span<float> gradient(int i) = 0;

  // Adds `values` (FP32, one push's rows) to shard `i`'s accumulator from
  // element `offset` on; what the daemon calls for every pushed piece. The
  // result is that of adding into gradient(i) in call order (the cpu
  // backend does exactly that); the gpu backend adds on the device (upload
  // + FP32 add, bit-identical), so a step uploads no host accumulator.
  // Same threading as gradient(): never beside Step.
  // `last_pusher`: this is the push that completes the version (the daemon
  // knows it at commit); the backend may then take the gradient norm's row
  // sums of the rows it adds in the same pass (ShardSet::AccumulateGradient)
  // instead of a pass of its own in Step.
  virtual absl::Status AccumulateGradient(int i, int64_t offset, absl::Span<const float> values,
                                          bool last_pusher) = 0;

  // A new optimizer config for the next steps (Daemon.SetOptimizer; the
  // kind stays): ShardSet::SetOptimizer. Same threading as Step.
  virtual absl::Status SetOptimizer(const OptimizerOptions& optimizer) = 0;

  // ShardSet::Step (server/step/shard_set.h). Every daemon of a world must run
  // the same backend: the all-reduce calls differ between backends.
  virtual absl::StatusOr<std::shared_ptr<const PublishedVersion>> Step(
      int64_t new_version, bool apply_optimizer, const AllReduceMaxFn& all_reduce,
      bool update_delayed) = 0;

  // The pipelined step (server/step/step_pipeline.h; the daemon's
  // --pipelined_step): RunPipelinedStep's contract, arguments and results
  // (apply_optimizer is implied), so that both backends serve the same
  // hooks. When hooks.on_bucket_ready(b) is called, the bucket's pieces of
  // `out` carry their bytes on the host (gpu: copied from the device for
  // the daemon's as_ready fetches). Abandoned (IsStepAbandoned) or failed
  // before its commit barrier, nothing changed and the step may run again.
  // Every daemon of a world must run it alike (the daemons' join checks
  // --pipelined_step). Same threading as Step. Default: UNIMPLEMENTED.
  virtual absl::StatusOr<std::shared_ptr<const PublishedVersion>> StepPipelined(
      int64_t new_version, const AllReduceMaxFn& all_reduce, bool update_delayed,
      const std::vector<StepBucket>& buckets, const PipelinedStepHooks& hooks,
      std::shared_ptr<PublishedVersion> out) {
    (void)new_version, (void)all_reduce, (void)update_delayed, (void)buckets, (void)hooks,
        (void)out;
    return absl::UnimplementedError(
        absl::StrCat("the ", name(), " daemon backend has no pipelined step"));
  }

  // The host state for checkpoint write/restore and export (checkpoint/),
  // or null when the backend cannot provide one: callers then return
  // UNIMPLEMENTED. gpu: a mirror downloaded from the device on this call
  // (call it with the worker parked, never beside Step); changes made to it
  // (restore) are uploaded before the next Step.
  virtual ShardSet* host_state() = 0;

  // Where a restore writes (server/step/state_sink.h), or null when the
  // backend cannot restore (callers return UNIMPLEMENTED). Same thread rule
  // as host_state(). The default is host_state(); the gpu backend's writes
  // into device memory without a host mirror.
  virtual ShardStateSink* state_sink() { return host_state(); }

  // Right after a successful optimizer Step, on Step's thread: the state
  // that produced it, for a snapshot. The default (cpu backend) reads
  // host_state() (reads_live_state); the gpu backend copies its masters and
  // moments into a device-side spare on a side stream that the next Step's
  // device work waits for (an event), or, where the device has no room
  // for the spare, hands out the live device buffers (reads_live_state).
  // The StateCapture stays valid after the backend is gone.
  virtual absl::StatusOr<CapturedState> CaptureState();

  // Null when Step's versions already carry their bytes (cpu); else how to
  // get them (gpu). The function stays valid after the backend is gone
  // (it keeps what it needs alive).
  virtual HostBytesFn host_bytes() { return nullptr; }

  // Called by Step, on Step's thread, once the device work of `new_version`
  // has been enqueued and before Step waits for it: from then until Step
  // returns, a device fetch of `new_version` may be sent behind the
  // per-tensor ready events of the step (DeviceChannel::Send with
  // in_flight). Only the gpu backend calls it (the cpu backend's Step
  // publishes bytes it computed on the host). Must not block long or call
  // back into the backend. Set by the daemon before each Step; null: none.
  using StepEnqueuedFn = std::function<void(int64_t new_version)>;
  virtual void set_step_enqueued(StepEnqueuedFn fn) { (void)fn; }

  // The daemons' data-plane transport (null: a single daemon) and the bound
  // on one collective, set by the daemon before each Step. The gpu backend
  // all-reduces its device amax vector on an NCCL transport directly (no
  // host copy, one wait at the end of the step) and skips the all-reduce
  // for a single daemon; other transports, and a backend never told, use
  // Step's AllReduceMaxFn. `transport` outlives the backend's steps.
  virtual void set_data_plane(Transport* transport, absl::Duration timeout) {
    (void)transport;
    (void)timeout;
  }
};

struct ShardBackendOptions {
  OptimizerOptions optimizer;
  // Bound on one step's device work (gpu).
  absl::Duration step_timeout = absl::Seconds(60);
};

using ShardBackendFactory = std::function<absl::StatusOr<std::unique_ptr<ShardBackend>>(
    std::vector<TensorDef> tensors, std::vector<ShardDef> shards,
    const ShardBackendOptions& options)>;

// Called once at static init by the gpu backend's library (alwayslink).
// Returns true (for use in a static initialiser).
bool RegisterGpuShardBackend(ShardBackendFactory factory);
// Whether a gpu backend is linked into this binary.
bool GpuShardBackendLinked();

// The backend `kind` over `shards` of `tensors`. FAILED_PRECONDITION for kGpu
// in a binary built without --config=cuda; otherwise the backend's own
// errors (INVALID_ARGUMENT for bad shards/optimizer, UNIMPLEMENTED for what
// it does not support).
absl::StatusOr<std::unique_ptr<ShardBackend>> CreateShardBackend(
    DaemonBackend kind, std::vector<TensorDef> tensors, std::vector<ShardDef> shards,
    const ShardBackendOptions& options);

}  // namespace paramd

#endif  // PARAMD_SERVER_BACKEND_SHARD_BACKEND_H_
