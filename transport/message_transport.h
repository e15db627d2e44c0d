// File: transport/message_transport.h
//
// Internal to transport/: what the buffered backends ("local", "host")
// share. A Mailbox holds the messages delivered to one rank until a Recv
// takes them; MessageTransport implements the Transport contract (argument
// checks, shutdown rules, Recv, and AllReduceMax as gather-to-the-lowest-
// rank plus broadcast over reserved tags) on top of a backend's DoSend.
#ifndef PARAMD_TRANSPORT_MESSAGE_TRANSPORT_H_
#define PARAMD_TRANSPORT_MESSAGE_TRANSPORT_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "transport/transport.h"

namespace paramd {
namespace transport_internal {

// Messages delivered to one rank, queued per (source rank, tag) in arrival
// order. Thread-safe; Receive blocks (on an absl::Mutex condition) until a
// message, the sender's departure, Close() or the deadline.
class Mailbox {
 public:
  // Queues a message. UNAVAILABLE once closed.
  absl::Status Deliver(int src, uint64_t tag, std::string bytes);

  // Takes the oldest message from (src, tag) into `out` (see
  // Transport::Recv for the codes). CANCELLED if closed while waiting.
  absl::StatusOr<size_t> Receive(int src, uint64_t tag, absl::Span<uint8_t> out,
                                 absl::Time deadline);

  // `src` has left: Receives from it with nothing queued fail UNAVAILABLE,
  // with `why` as the message ("rank N has shut down" when empty); waiting
  // Receives wake at once. Messages already queued are still received. The
  // first reason given for a rank is kept. Idempotent.
  void MarkGone(int src, absl::string_view why = "");

  // Wakes every waiter (CANCELLED) and refuses later deliveries; drops what
  // is queued. Idempotent.
  void Close();
  bool closed() const;

 private:
  using Key = std::pair<int, uint64_t>;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<Key, std::deque<std::string>> queues_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int, std::string> gone_ ABSL_GUARDED_BY(mu_);  // rank -> why
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

// Base of the mailbox backends. Subclasses implement DoSend (deliver into
// the peer's mailbox), CanConnect and backend(), and extend Shutdown (call
// MessageTransport::Shutdown from theirs).
class MessageTransport : public Transport {
 public:
  MessageTransport(int rank, int world_size, std::shared_ptr<Mailbox> mailbox);

  int rank() const final { return rank_; }
  int world_size() const final { return world_size_; }
  absl::Status Send(int peer, uint64_t tag, absl::Span<const uint8_t> bytes,
                    absl::Time deadline) final;
  absl::StatusOr<size_t> Recv(int peer, uint64_t tag, absl::Span<uint8_t> buffer,
                              absl::Time deadline) final;
  absl::Status AllReduceMax(absl::Span<const int> group, absl::Span<float> values,
                            absl::Time deadline) final;
  // Marks the transport shut down and closes its mailbox.
  void Shutdown() override;

  // The mailbox Recv takes from, for another channel that delivers into it
  // (transport/socket_channel.h).
  std::shared_ptr<Mailbox> shared_mailbox() const { return mailbox_; }

 protected:
  // Delivers to `peer`'s mailbox as coming from rank(). Arguments are
  // checked; `tag` may be a reserved collective tag.
  virtual absl::Status DoSend(int peer, uint64_t tag, absl::Span<const uint8_t> bytes,
                              absl::Time deadline) = 0;

  bool shut_down() const { return shut_down_.load(); }
  // FAILED_PRECONDITION after Shutdown, INVALID_ARGUMENT for a bad peer.
  absl::Status CheckPeer(int peer) const;
  Mailbox& mailbox() { return *mailbox_; }

 private:
  absl::Status SendChecked(int peer, uint64_t tag, absl::Span<const uint8_t> bytes,
                           absl::Time deadline);
  absl::StatusOr<uint64_t> NextCollectiveTag(absl::Span<const int> group);

  const int rank_;
  const int world_size_;
  const std::shared_ptr<Mailbox> mailbox_;
  std::atomic<bool> shut_down_{false};
  absl::Mutex mu_;
  absl::flat_hash_map<std::vector<int>, uint32_t> collective_seq_ ABSL_GUARDED_BY(mu_);
};

}  // namespace transport_internal
}  // namespace paramd

#endif  // PARAMD_TRANSPORT_MESSAGE_TRANSPORT_H_
