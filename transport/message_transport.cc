#include "transport/message_transport.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace paramd {
namespace transport_internal {
namespace {

constexpr uint64_t kCollectiveBit = uint64_t{1} << 63;

// FNV-1a over the ranks: the same in every process (unlike absl::Hash).
uint32_t GroupHash(absl::Span<const int> group) {
  uint32_t h = 2166136261u;
  for (int r : group) {
    for (int b = 0; b < 4; ++b) {
      h ^= (static_cast<uint32_t>(r) >> (8 * b)) & 0xFF;
      h *= 16777619u;
    }
  }
  return h & 0x7FFFFFFF;
}

absl::Span<const uint8_t> AsBytes(absl::Span<const float> v) {
  return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(float));
}

absl::Status WithContext(const absl::Status& s, absl::string_view context) {
  return absl::Status(s.code(), absl::StrCat(context, ": ", s.message()));
}

}  // namespace

absl::Status Mailbox::Deliver(int src, uint64_t tag, std::string bytes) {
  absl::MutexLock lock(&mu_);
  if (closed_) return absl::UnavailableError("the receiving rank has shut down");
  queues_[Key(src, tag)].push_back(std::move(bytes));
  return absl::OkStatus();
}

absl::StatusOr<size_t> Mailbox::Receive(int src, uint64_t tag, absl::Span<uint8_t> out,
                                        absl::Time deadline) {
  const Key key(src, tag);
  absl::MutexLock lock(&mu_);
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return closed_ || queues_.contains(key) || gone_.contains(src);
  };
  mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
  if (closed_) return absl::CancelledError("transport shut down while receiving");
  auto it = queues_.find(key);
  if (it == queues_.end()) {
    if (auto gone = gone_.find(src); gone != gone_.end()) {
      return absl::UnavailableError(
          gone->second.empty() ? absl::StrCat("rank ", src, " has shut down") : gone->second);
    }
    return absl::DeadlineExceededError(
        absl::StrCat("no message from rank ", src, " with tag ", tag, " before the deadline"));
  }
  std::string message = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) queues_.erase(it);
  if (message.size() > out.size()) {
    return absl::InvalidArgumentError(absl::StrCat("message from rank ", src, " with tag ", tag,
                                                   " has ", message.size(), " bytes, the buffer ",
                                                   out.size()));
  }
  if (!message.empty()) std::memcpy(out.data(), message.data(), message.size());
  return message.size();
}

void Mailbox::MarkGone(int src, absl::string_view why) {
  absl::MutexLock lock(&mu_);
  gone_.emplace(src, std::string(why));
}

void Mailbox::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  queues_.clear();
}

bool Mailbox::closed() const {
  absl::MutexLock lock(&mu_);
  return closed_;
}

MessageTransport::MessageTransport(int rank, int world_size, std::shared_ptr<Mailbox> mailbox)
    : rank_(rank), world_size_(world_size), mailbox_(std::move(mailbox)) {}

absl::Status MessageTransport::CheckPeer(int peer) const {
  if (shut_down()) return absl::FailedPreconditionError("transport is shut down");
  if (peer < 0 || peer >= world_size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer ", peer, " is outside the world of ", world_size_));
  }
  return absl::OkStatus();
}

absl::Status MessageTransport::Send(int peer, uint64_t tag, absl::Span<const uint8_t> bytes,
                                    absl::Time deadline) {
  if (tag > kMaxUserTag) return absl::InvalidArgumentError("tag above kMaxUserTag");
  return SendChecked(peer, tag, bytes, deadline);
}

absl::Status MessageTransport::SendChecked(int peer, uint64_t tag, absl::Span<const uint8_t> bytes,
                                           absl::Time deadline) {
  RETURN_IF_ERROR(CheckPeer(peer));
  if (absl::Now() > deadline) {
    return absl::DeadlineExceededError(absl::StrCat("send to rank ", peer, ": deadline passed"));
  }
  return DoSend(peer, tag, bytes, deadline);
}

absl::StatusOr<size_t> MessageTransport::Recv(int peer, uint64_t tag, absl::Span<uint8_t> buffer,
                                              absl::Time deadline) {
  RETURN_IF_ERROR(CheckPeer(peer));
  if (tag > kMaxUserTag) return absl::InvalidArgumentError("tag above kMaxUserTag");
  return mailbox_->Receive(peer, tag, buffer, deadline);
}

void MessageTransport::Shutdown() {
  shut_down_.store(true);
  mailbox_->Close();
}

absl::StatusOr<uint64_t> MessageTransport::NextCollectiveTag(absl::Span<const int> group) {
  if (group.empty()) return absl::InvalidArgumentError("empty group");
  bool has_self = false;
  for (size_t i = 0; i < group.size(); ++i) {
    if (group[i] < 0 || group[i] >= world_size_ || (i > 0 && group[i] <= group[i - 1])) {
      return absl::InvalidArgumentError("group must be strictly increasing ranks inside the world");
    }
    has_self |= group[i] == rank_;
  }
  if (!has_self) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank_, " is not in the group"));
  }
  absl::MutexLock lock(&mu_);
  const uint32_t seq = collective_seq_[std::vector<int>(group.begin(), group.end())]++;
  return kCollectiveBit | (uint64_t{GroupHash(group)} << 32) | seq;
}

absl::Status MessageTransport::AllReduceMax(absl::Span<const int> group, absl::Span<float> values,
                                            absl::Time deadline) {
  if (shut_down()) return absl::FailedPreconditionError("transport is shut down");
  ASSIGN_OR_RETURN(const uint64_t tag, NextCollectiveTag(group));
  if (group.size() == 1) return absl::OkStatus();
  const int root = group[0];
  const size_t n = values.size();
  // Result message: one status byte (an absl::StatusCode), then the values.
  std::vector<uint8_t> result(1 + n * sizeof(float), 0);

  if (rank_ != root) {
    RETURN_IF_ERROR(WithContext(SendChecked(root, tag, AsBytes(values), deadline),
                                absl::StrCat("all-reduce: contribution to rank ", root)));
    absl::StatusOr<size_t> got = mailbox_->Receive(root, tag, absl::MakeSpan(result), deadline);
    if (!got.ok()) {
      return WithContext(got.status(), absl::StrCat("all-reduce: result from rank ", root));
    }
    if (*got >= 1 && result[0] != 0) {
      return absl::Status(static_cast<absl::StatusCode>(result[0]),
                          absl::StrCat("all-reduce failed at rank ", root));
    }
    if (*got != result.size()) {
      return absl::InvalidArgumentError("all-reduce: group members disagree on the size");
    }
    if (n > 0) std::memcpy(values.data(), result.data() + 1, n * sizeof(float));
    return absl::OkStatus();
  }

  std::vector<float> acc(values.begin(), values.end());
  std::vector<float> in(n);
  absl::Status failure;
  for (size_t m = 1; m < group.size() && failure.ok(); ++m) {
    absl::StatusOr<size_t> got = mailbox_->Receive(
        group[m], tag, absl::MakeSpan(reinterpret_cast<uint8_t*>(in.data()), n * sizeof(float)),
        deadline);
    if (!got.ok()) {
      failure = WithContext(got.status(), absl::StrCat("all-reduce: from rank ", group[m]));
    } else if (*got != n * sizeof(float)) {
      failure = absl::InvalidArgumentError(absl::StrCat("all-reduce: rank ", group[m], " sent ",
                                                        *got / sizeof(float), " values, rank ",
                                                        root, " has ", n));
    } else {
      for (size_t i = 0; i < n; ++i) acc[i] = MaxIgnoringNan(acc[i], in[i]);
    }
  }
  absl::Span<const uint8_t> message = absl::MakeConstSpan(result);
  absl::Time send_deadline = deadline;
  if (!failure.ok()) {
    // Tell the members at once instead of letting them wait out the deadline.
    result[0] = static_cast<uint8_t>(failure.code());
    message = message.subspan(0, 1);
    send_deadline = std::max(deadline, absl::Now() + absl::Seconds(1));
  } else if (n > 0) {
    std::memcpy(result.data() + 1, acc.data(), n * sizeof(float));
  }
  absl::Status sent;
  for (size_t m = 1; m < group.size(); ++m) {
    absl::Status s = SendChecked(group[m], tag, message, send_deadline);
    if (!s.ok() && sent.ok()) {
      sent = WithContext(s, absl::StrCat("all-reduce: result to rank ", group[m]));
    }
  }
  RETURN_IF_ERROR(failure);
  if (n > 0) std::memcpy(values.data(), acc.data(), n * sizeof(float));
  return sent;
}

}  // namespace transport_internal
}  // namespace paramd
