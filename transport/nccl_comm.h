// File: transport/nccl_comm.h
//
// INTERNAL to the "nccl" backend (nccl_transport_impl.h): one NCCL communicator
// with the stream, events and staging buffers its transfers use, and how one
// is started: non-blocking init (StartComm, for direction and group
// communicators), or a blocking 2-rank one whose init and warm-up transfer
// run on a detached helper thread (StartPairComm; nccl_transport.h says
// why). Threading: a Comm is used by one thread at a time (its owner holds
// the lock of the direction or group it belongs to); the Creation it may
// point to is shared with the helper thread under Creation::mu.
#ifndef PARAMD_TRANSPORT_NCCL_COMM_H_
#define PARAMD_TRANSPORT_NCCL_COMM_H_

#include <cstddef>
#include <memory>
#include <vector>

#include <cuda_runtime.h>
#include <nccl.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace paramd {
namespace transport_internal {

// The creation of a blocking pair communicator on a helper thread
// (StartPairComm): init, then one warm-up transfer that connects the pair's
// p2p channels, so that later ncclGroupEnd calls only enqueue. Shared by
// the helper and the Comm; whoever sees the other gone cleans up: a
// creation the Comm abandoned (deadline, shutdown) is aborted by the helper
// once NCCL returns (a helper whose peer never joins stays blocked in
// ncclCommInitRankConfig until the process ends: a leaked thread, never a
// hang of the caller).
struct Creation {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  bool abandoned ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
  ncclComm_t comm ABSL_GUARDED_BY(mu) = nullptr;  // set when done and ok
};

// One communicator with its stream, events and staging buffers. Destroying
// it aborts the communicator (safe with operations in flight).
struct Comm {
  explicit Comm(int device) : device(device) {}
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  // Grows the device staging buffer (and the pinned host one when `host`)
  // to at least `bytes`; their contents are not kept.
  absl::Status EnsureStaging(size_t bytes, bool host);

  const int device;
  ncclComm_t comm = nullptr;
  // The other ranks on it: a wait on it fails at once when one of them
  // hangs up (SocketChannel::PeerGone).
  std::vector<int> peers;
  // Completion of the groups of a message of more than kMaxGroupsInFlight
  // (nccl_transport_impl.h) groups, slot k % kMaxGroupsInFlight (created on
  // first need).
  std::vector<cudaEvent_t> group_done;
  // A blocking pair communicator still being created (comm null until
  // Ready takes it); null otherwise.
  std::shared_ptr<Creation> creation;
  cudaStream_t stream = nullptr;
  cudaEvent_t done = nullptr;
  cudaEvent_t ready = nullptr;
  void* dev = nullptr;
  size_t dev_size = 0;
  void* pinned = nullptr;
  size_t pinned_size = 0;
};

// Starts (does not wait for) a non-blocking communicator init.
absl::StatusOr<std::unique_ptr<Comm>> StartComm(int device, int nranks, int rank,
                                                const ncclUniqueId& id);

// PARAMD_NCCL_BLOCKING (read at endpoint open): the direction
// communicators are blocking (the default: faster enqueue, see
// nccl_transport.h) unless it is "0" (non-blocking: the earlier kind, kept
// for A/B runs and as a fallback).
bool BlockingPairsFromEnv();

// Starts the creation of a blocking 2-rank communicator on a detached
// helper thread; Comm::creation tracks it (Ready waits for it).
absl::StatusOr<std::unique_ptr<Comm>> StartPairComm(int device, int rank, const ncclUniqueId& id,
                                                    absl::Time deadline);

}  // namespace transport_internal
}  // namespace paramd

#endif  // PARAMD_TRANSPORT_NCCL_COMM_H_
