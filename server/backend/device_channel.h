// File: server/backend/device_channel.h
//
// The daemon's side of one device channel (docs/ARCHITECTURE.md, "Device
// fetch through the daemon"): a
// 2-rank NCCL transport world between this daemon (rank 0) and one trainer
// (rank 1), over which FetchDevice sends published device buffers of the
// gpu backend straight into the trainer's GPU memory. Host-only interface:
// the implementation (server/gpu_backend/device_channel.cc, NCCL +
// fetch_server) registers itself when linked into hybrid-paramd under
// --config=cuda, so the default (cpu) build carries no CUDA dependency and
// answers FAILED_PRECONDITION.
//
// Threading: Connect, Send, ReceivePush and ApplyPush are called from one
// thread (the channel's serial worker in server/daemon/daemon_device.cc); Shutdown from
// any thread, at any time, and it unblocks a Send or ReceivePush in
// progress. The destructor must not race with the others.
#ifndef PARAMD_SERVER_BACKEND_DEVICE_CHANNEL_H_
#define PARAMD_SERVER_BACKEND_DEVICE_CHANNEL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/format.h"
#include "server/backend/shard_backend.h"

namespace paramd {

// One published direction of one of the daemon's shards (index into the
// backend's shards()).
struct DeviceFetchItem {
  int shard = 0;
  Direction direction = Direction::kRowwise;
};

// One piece of a device gradient push (PushGradientsDevice): `count`
// elements (BF16 when `bf16`, else FP32) added into shard `shard`'s FP32
// accumulator from element `offset` on.
struct DevicePushPiece {
  int shard = 0;
  int64_t offset = 0;
  int64_t count = 0;
  bool bf16 = false;
};

// The received bytes of one device push, in device memory of the channel's
// device, not yet added anywhere. Destroying it frees them (ordered after
// any ApplyPush that read them). Owned by the caller of ReceivePush.
class StagedDevicePush {
 public:
  virtual ~StagedDevicePush() = default;
};

class DeviceChannel {
 public:
  virtual ~DeviceChannel() = default;

  // This end's transport endpoint address (send it to the trainer).
  virtual std::string address() const = 0;
  // The CUDA device (ordinal in this process) the endpoint is bound to.
  virtual int device() const = 0;

  // Joins the 2-rank world {this (rank 0), trainer_address (rank 1)}.
  // Once, before Send. Does not wait for the trainer.
  virtual absl::Status Connect(const std::string& trainer_address) = 0;

  // Sends `items` of `version` of `backend` to the trainer as one transport
  // message with `tag` (format/fetch_plan.h gives the piece
  // order). Blocks until the bytes have left the device buffers, the
  // deadline passes (DEADLINE_EXCEEDED), the trainer is gone (UNAVAILABLE) or
  // Shutdown() (CANCELLED). FAILED_PRECONDITION if `backend` is not the gpu
  // backend; NOT_FOUND if it does not hold `version`. The caller keeps the
  // version's buffers from being rewritten until Send returns.
  // `in_flight`: `version` is the backend's step in flight, whose work was
  // enqueued (ShardBackend::set_step_enqueued fired for it): each item
  // leaves once its tensor's quantization has completed on the device, so
  // Send may return before the step finishes; the bytes are those of the
  // version only if the step then succeeds (the caller says so).
  virtual absl::Status Send(ShardBackend& backend, int64_t version,
                            absl::Span<const DeviceFetchItem> items, uint64_t tag,
                            absl::Time deadline, bool in_flight = false) = 0;

  // Device gradient push, step 1: receives one
  // transport message with `tag` from the trainer, one piece per entry of
  // `pieces` (sizes count * 2 or 4 bytes), into staging memory of this
  // channel (not the accumulators). Blocks until every byte has arrived,
  // the deadline passes (DEADLINE_EXCEEDED), the trainer is gone
  // (UNAVAILABLE) or Shutdown() (CANCELLED); on error nothing is staged.
  // INVALID_ARGUMENT when a value is NaN or infinite (the whole message was
  // received: the channel stays usable), unless `accept_non_finite` (the
  // optimizer's non_finite: SKIP_STEP, where the step then skips).
  virtual absl::StatusOr<std::unique_ptr<StagedDevicePush>> ReceivePush(
      absl::Span<const DevicePushPiece> pieces, uint64_t tag, absl::Time deadline,
      bool accept_non_finite) = 0;

  // Step 2: enqueues the adds of `staged` (from ReceivePush of this channel)
  // into `backend`'s accumulators on its stream, piece by piece in order:
  // the same kernel and element order as the gpu backend's AccumulateHost
  // (FP32 add; BF16 widened exactly first). Call with the daemon's push
  // lock held and no step running (as ShardBackend::AccumulateGradient).
  // `last_pusher`: the push completing the version (the gradient norm's
  // row sums of whole-row pieces are taken in the add, as
  // ShardBackend::AccumulateGradient). FAILED_PRECONDITION if `backend` is
  // not the gpu backend.
  virtual absl::Status ApplyPush(ShardBackend& backend, StagedDevicePush& staged,
                                 bool last_pusher) = 0;

  // Leaves the world: a Send in progress returns, the trainer's receives
  // fail with UNAVAILABLE. Idempotent, thread-safe.
  virtual void Shutdown() = 0;
};

// Opens the daemon's endpoint of a new channel on the device of the gpu
// backend (CUDA device 0 of this process: select the physical GPU with
// CUDA_VISIBLE_DEVICES or hybrid-paramd --gpu), its control channels
// listening on `listen_address` ("ip:port"; "" = 127.0.0.1:0, one machine;
// "0.0.0.0:0" across machines, advertised as `advertise_host`, "" = this
// machine's hostname) and accepting only a peer that proves
// `secret`, the channel's one-time secret (transport/channel_secret.h;
// the daemon hands it to the trainer in DeviceChannelEvent.channel_secret).
using DeviceChannelOpener = std::function<absl::StatusOr<std::unique_ptr<DeviceChannel>>(
    const std::string& listen_address, const std::string& advertise_host,
    const std::string& secret)>;

// Called once at static init by the implementation's library (alwayslink).
// Returns true (for use in a static initialiser).
bool RegisterDeviceChannelOpener(DeviceChannelOpener opener);

// A new channel endpoint. FAILED_PRECONDITION when this binary has no
// implementation (built without --config=cuda); the opener's status else.
absl::StatusOr<std::unique_ptr<DeviceChannel>> OpenDeviceChannel(const std::string& listen_address,
                                                                 const std::string& advertise_host,
                                                                 const std::string& secret);

// OK if `presented` (FetchDeviceRequest / PushGradientsDeviceRequest
// .channel_secret) is `expected`, the secret of channel `channel`
// (constant time); PERMISSION_DENIED otherwise: the caller may hold a
// valid token, but it did not open this channel, so it may neither make
// the daemon send this channel's trainer bytes nor receive from it.
absl::Status CheckDeviceChannelSecret(const std::string& presented, const std::string& expected,
                                      uint64_t channel);

}  // namespace paramd

#endif  // PARAMD_SERVER_BACKEND_DEVICE_CHANNEL_H_
