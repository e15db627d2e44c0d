#include "server/step/push_pipeline.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace paramd {

class PushPipeline::Stream {
 public:
  enum class State { kOpen, kCommitted, kFailed };
  // A complete piece: rows [row_begin, row_end) of this daemon's shard
  // `shard`; `values` point into the stream's staged buffers (stable: the
  // assembler never touches a complete piece, and moving the staged vector
  // into `owned` keeps the buffers).
  struct Piece {
    int shard = 0;
    int64_t row_begin = 0;
    const float* values = nullptr;
    int64_t count = 0;
  };

  std::string pusher;
  int64_t version = -1;
  State state = State::kOpen;
  std::vector<Piece> delivered;
  int last_tensor = -1;            // tensor of the newest piece (complete or not)
  bool last_open = false;          // the newest piece is still filling
  std::vector<StagedPiece> owned;  // the staged pieces once the stream ended
};

PushPipeline::PushPipeline(std::vector<TensorDef> tensors, std::vector<ShardDef> shards,
                           int expected_pushers)
    : tensors_(std::move(tensors)), shards_(std::move(shards)), expected_(expected_pushers) {}

PushPipeline::~PushPipeline() = default;

absl::StatusOr<std::shared_ptr<PushPipeline::Stream>> PushPipeline::Open(
    int64_t version, const std::string& pusher) {
  absl::MutexLock lock(&mu_);
  if (version != version_) {
    // Pushes of an older version can no longer count: the daemon's checks
    // let only the current version through.
    streams_.clear();
    version_ = version;
  }
  for (const auto& s : streams_) {
    if (s->pusher == pusher && s->state == Stream::State::kOpen) {
      return absl::UnavailableError(
          absl::StrCat("pusher ", pusher, " is still streaming a push for version ", version,
                       " to this daemon (pipelined step); retry once that stream has ended"));
    }
  }
  auto s = std::make_shared<Stream>();
  s->pusher = pusher;
  s->version = version;
  streams_.push_back(s);
  ++wakes_;
  return s;
}

absl::Status PushPipeline::Progress(Stream& stream, const std::vector<StagedPiece>& pieces,
                                    bool last_open) {
  absl::MutexLock lock(&mu_);
  const size_t complete = pieces.size() - (last_open && !pieces.empty() ? 1 : 0);
  for (size_t k = stream.delivered.size(); k < pieces.size(); ++k) {
    const StagedPiece& p = pieces[k];
    if (p.tensor < stream.last_tensor) {
      return absl::InvalidArgumentError(
          absl::StrCat("pipelined push: a piece of tensor ", tensors_[p.tensor].name,
                       " after one of a later tensor (", tensors_[stream.last_tensor].name,
                       "); send the pieces in manifest order. Nothing applied"));
    }
    stream.last_tensor = p.tensor;
    if (k >= complete) break;
    const int64_t cols = tensors_[p.tensor].cols;
    stream.delivered.push_back(
        {p.shard, p.row_begin, p.values.data(), (p.row_end - p.row_begin) * cols});
  }
  stream.last_open = last_open;
  ++wakes_;
  return absl::OkStatus();
}

void PushPipeline::Commit(Stream& stream) {
  absl::MutexLock lock(&mu_);
  stream.state = Stream::State::kCommitted;
  stream.last_open = false;
  ++wakes_;
}

void PushPipeline::Fail(Stream& stream) {
  absl::MutexLock lock(&mu_);
  if (stream.state == Stream::State::kOpen) stream.state = Stream::State::kFailed;
  ++wakes_;
}

void PushPipeline::Close(const std::shared_ptr<Stream>& stream, std::vector<StagedPiece> pieces) {
  absl::MutexLock lock(&mu_);
  stream->owned = std::move(pieces);
  if (stream->state != Stream::State::kCommitted) {
    stream->state = Stream::State::kFailed;
    // Not used by the attempt: its buffers can go now.
    if (std::find(used_.begin(), used_.end(), stream) == used_.end()) {
      streams_.erase(std::remove(streams_.begin(), streams_.end(), stream), streams_.end());
    }
  }
  ++wakes_;
}

void PushPipeline::BeginAttempt(int64_t version, bool only_committed) {
  absl::MutexLock lock(&mu_);
  if (version != version_) {
    streams_.clear();
    version_ = version;
  }
  attempt_ = true;
  only_committed_ = only_committed;
  used_fixed_ = false;
  used_.clear();
}

void PushPipeline::EndAttempt() {
  absl::MutexLock lock(&mu_);
  attempt_ = false;
  used_fixed_ = false;
  used_.clear();
  streams_.erase(std::remove_if(streams_.begin(), streams_.end(),
                                [](const std::shared_ptr<Stream>& s) {
                                  return s->state == Stream::State::kFailed;
                                }),
                 streams_.end());
}

bool PushPipeline::CanProgress(int64_t version) const {
  absl::MutexLock lock(&mu_);
  if (version != version_) return expected_ <= 0;
  int committed = 0;
  for (const auto& s : streams_) {
    if (s->state == Stream::State::kOpen) return true;
    committed += s->state == Stream::State::kCommitted ? 1 : 0;
  }
  return committed >= expected_;
}

void PushPipeline::Published(int64_t version) {
  absl::MutexLock lock(&mu_);
  if (version == version_) streams_.clear();
  used_.clear();
}

void PushPipeline::Wake() {
  absl::MutexLock lock(&mu_);
  ++wakes_;
}

std::vector<std::shared_ptr<PushPipeline::Stream>> PushPipeline::LiveLocked() const {
  std::vector<std::shared_ptr<Stream>> live;
  for (const auto& s : streams_) {
    if (s->state != Stream::State::kFailed) live.push_back(s);
  }
  return live;
}

bool PushPipeline::DeliveredLocked(const Stream& s, int tensor_end) {
  if (s.state == Stream::State::kCommitted) return true;
  if (s.state == Stream::State::kFailed) return false;
  // Later pieces of a stream never go back to an earlier tensor: a piece of
  // tensor >= tensor_end (complete or not) means the bucket is complete.
  return s.last_tensor >= tensor_end;
}

bool PushPipeline::WaitLocked(absl::Time give_up) {
  const int64_t seen = wakes_;
  auto changed = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return wakes_ != seen; };
  // Bounded waits: the caller polls yield() too.
  mu_.AwaitWithDeadline(absl::Condition(&changed),
                        std::min(give_up, absl::Now() + absl::Milliseconds(20)));
  return absl::Now() < give_up;
}

absl::Status PushPipeline::UsedFailedLocked() const {
  for (const auto& s : used_) {
    if (s->state == Stream::State::kFailed) {
      return StepAbandonedError(absl::StrCat("the push of ", QuoteForMessage(s->pusher),
                                             " for version ", s->version,
                                             " failed after the step used it"));
    }
  }
  return absl::OkStatus();
}

absl::Status PushPipeline::AwaitBucket(const StepBucket& bucket, BucketGradients* gradients,
                                       absl::Time give_up, const std::function<bool()>& yield) {
  std::vector<std::shared_ptr<Stream>> use;
  {
    absl::MutexLock lock(&mu_);
    for (;;) {
      RETURN_IF_ERROR(UsedFailedLocked());
      if (yield && yield()) return StepAbandonedError("the daemon's worker has other work");
      if (!used_fixed_) {
        std::vector<std::shared_ptr<Stream>> ready;
        for (const auto& s : LiveLocked()) {
          const bool committed = s->state == Stream::State::kCommitted;
          if (committed || (!only_committed_ && DeliveredLocked(*s, bucket.tensor_end))) {
            ready.push_back(s);
          }
        }
        if (only_committed_ || expected_ <= 0) {
          // An admin step: the committed pushes, however many.
          used_.clear();
          for (const auto& s : ready) {
            if (s->state == Stream::State::kCommitted) used_.push_back(s);
          }
          used_fixed_ = true;
        } else if (static_cast<int>(ready.size()) >= expected_) {
          used_.assign(ready.begin(), ready.begin() + expected_);
          used_fixed_ = true;
        }
      }
      if (used_fixed_) {
        bool all = true;
        for (const auto& s : used_) all &= DeliveredLocked(*s, bucket.tensor_end);
        if (all) break;
      }
      bool streaming = false;
      for (const auto& s : streams_) streaming |= s->state == Stream::State::kOpen;
      if (!streaming) {
        // Nothing can arrive until another push begins (which starts a new
        // attempt).
        return StepAbandonedError("waiting for pushes that have not begun");
      }
      if (!WaitLocked(give_up)) {
        return absl::DeadlineExceededError(
            "pipelined step: the pushes of the version did not arrive in time");
      }
    }
    use = used_;
  }
  // Sum outside the lock: the used streams' buffers stay alive (they are
  // held here and by the attempt) and complete pieces are never written.
  gradients->clear();
  for (int i : bucket.shards) {
    const ShardDef& d = shards_[i];
    gradients->emplace_back(static_cast<size_t>(d.rows() * tensors_[d.tensor].cols), 0.0f);
  }
  for (const auto& s : use) {
    std::vector<Stream::Piece> pieces;
    {
      absl::MutexLock lock(&mu_);
      pieces = s->delivered;
    }
    for (const Stream::Piece& p : pieces) {
      auto it = std::find(bucket.shards.begin(), bucket.shards.end(), p.shard);
      if (it == bucket.shards.end()) continue;
      std::vector<float>& g = (*gradients)[it - bucket.shards.begin()];
      const ShardDef& d = shards_[p.shard];
      float* dst = g.data() + (p.row_begin - d.row_begin) * tensors_[d.tensor].cols;
      for (int64_t k = 0; k < p.count; ++k) dst[k] += p.values[k];
    }
  }
  return absl::OkStatus();
}

absl::Status PushPipeline::CheckUsed() const {
  absl::MutexLock lock(&mu_);
  return UsedFailedLocked();
}

absl::Status PushPipeline::AwaitCommit(absl::Time give_up, const std::function<bool()>& yield) {
  absl::MutexLock lock(&mu_);
  for (;;) {
    RETURN_IF_ERROR(UsedFailedLocked());
    bool all = true;
    for (const auto& s : used_) all &= s->state == Stream::State::kCommitted;
    if (all) return absl::OkStatus();
    if (yield && yield()) return StepAbandonedError("the daemon's worker has other work");
    if (!WaitLocked(give_up)) {
      return absl::DeadlineExceededError("pipelined step: the pushes it used did not end in time");
    }
  }
}

}  // namespace paramd
