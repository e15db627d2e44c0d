// File: server/step/push_pipeline.h
//
// The daemon's gradient pushes of one version as they stream in, for the
// pipelined step (server/step/step_pipeline.h; `hybrid-paramd
// --pipelined_step`). The optimizer of a bucket may start once every
// expected pusher's share of the bucket has ARRIVED, before the pushes have
// ended; a push stays atomic all the same: it counts only on its end
// marker, and a push that fails after the step used some of its buckets
// abandons the step (nothing is committed, the step starts again without
// it). So the pushes are never summed into the backend's accumulators
// here: each stream's pieces stay staged (owned by this object once the
// stream ends) until the step that used them is published, and each
// bucket's gradient is summed from them, per element in the order the
// pushes began, starting from 0 (the sequential path's order for two
// pushers; for three or more both orders are "not otherwise defined").
//
// Cost: a daemon holds every pusher's staged share of the version until the
// step ends (the sequential path holds a push only while it streams).
//
// Rules for streams (refused with the status given, nothing applied):
//   - pieces of one stream come in non-decreasing manifest tensor order
//     (the client sends them so): INVALID_ARGUMENT otherwise, since a bucket
//     already stepped cannot take more;
//   - one stream per (pusher, version) at a time: UNAVAILABLE for a second
//     one while the first is still open (retry once it ended).
//
// Which pushes a step uses: the first `expected` (in the order they began)
// whose share of the first bucket has arrived; later buckets wait for the
// same pushes. The step commits only once each of them has committed.
//
// Threading: thread-safe. Streams call Open/Progress/Commit/Close from gRPC
// threads; the daemon's worker calls the step side (BeginAttempt,
// AwaitBucket, AwaitCommit, EndAttempt, Published). AwaitBucket/AwaitCommit
// block (bounded by `give_up`).
#ifndef PARAMD_SERVER_STEP_PUSH_PIPELINE_H_
#define PARAMD_SERVER_STEP_PUSH_PIPELINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/step/chunks.h"
#include "server/step/shard_set.h"
#include "server/step/step_pipeline.h"

namespace paramd {

class PushPipeline {
 public:
  // `shards`: this daemon's (ModelView::shards, ShardSet order) of
  // `tensors`. `expected_pushers` <= 0: steps come only from admin Step.
  PushPipeline(std::vector<TensorDef> tensors, std::vector<ShardDef> shards, int expected_pushers);
  ~PushPipeline();

  class Stream;

  // ---- Push streams ----

  // A push stream of `pusher` for `version` began (after the daemon's own
  // checks). UNAVAILABLE while another stream of `pusher` is open.
  absl::StatusOr<std::shared_ptr<Stream>> Open(int64_t version, const std::string& pusher);
  // After every chunk: `pieces` is the stream's staged pieces so far (the
  // last one still filling when `last_open`). The stream must keep them
  // (their value buffers) alive until Close. INVALID_ARGUMENT for a piece of
  // an earlier tensor than the stream's previous one.
  absl::Status Progress(Stream& stream, const std::vector<StagedPiece>& pieces, bool last_open);
  // The daemon counted the push (its commit rules passed).
  void Commit(Stream& stream);
  // The stream failed (before its reactor goes away: a pusher that saw the
  // error and pushes again must find its old stream failed, not open).
  void Fail(Stream& stream);
  // The stream ended, committed or not; takes its pieces. A stream not
  // committed counts as failed: a step that used it is abandoned.
  void Close(const std::shared_ptr<Stream>& stream, std::vector<StagedPiece> pieces);

  // ---- The step (the daemon's worker) ----

  // A step of `version` begins. `pushes_only_committed`: an admin step (or
  // a retry): it uses the committed pushes, none of the open ones.
  void BeginAttempt(int64_t version, bool only_committed);
  // PipelinedStepHooks::await_bucket. Blocks until the bucket's share of
  // the step's pushes has arrived, then sums it into `gradients`. Errors
  // (IsStepAbandoned): a push used by this attempt failed; `yield()` became
  // true while waiting (the worker has other work); no push is streaming
  // and the bucket cannot become ready (the step waits for the next push to
  // begin); DEADLINE_EXCEEDED (not abandoned) at `give_up`.
  absl::Status AwaitBucket(const StepBucket& bucket, BucketGradients* gradients, absl::Time give_up,
                           const std::function<bool()>& yield);
  // PipelinedStepHooks::check_bucket: the abandon error if a push the
  // attempt used has failed meanwhile.
  absl::Status CheckUsed() const;
  // PipelinedStepHooks::before_commit: until every push used has committed
  // (same errors).
  absl::Status AwaitCommit(absl::Time give_up, const std::function<bool()>& yield);
  // The attempt ended (published, failed or abandoned).
  void EndAttempt();
  // Whether a new attempt for `version` could get past its first bucket
  // without another push beginning: a push is streaming, or the committed
  // ones are enough.
  bool CanProgress(int64_t version) const;
  // The step to `version + 1` was published: drops the pushes of `version`.
  void Published(int64_t version);
  // Wakes the waits (yield() may have changed).
  void Wake();

 private:
  // Streams of the current version that count (not failed), in open order.
  std::vector<std::shared_ptr<Stream>> LiveLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `s` has delivered every piece of tensors < `tensor_end`.
  static bool DeliveredLocked(const Stream& s, int tensor_end);
  absl::Status UsedFailedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for a change (or ~20 ms); false once `give_up` has passed.
  bool WaitLocked(absl::Time give_up) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::vector<TensorDef> tensors_;
  const std::vector<ShardDef> shards_;
  const int expected_;

  mutable absl::Mutex mu_;
  int64_t version_ ABSL_GUARDED_BY(mu_) = -1;
  std::vector<std::shared_ptr<Stream>> streams_ ABSL_GUARDED_BY(mu_);
  // The attempt's pushes (fixed by its first bucket).
  bool attempt_ ABSL_GUARDED_BY(mu_) = false;
  bool only_committed_ ABSL_GUARDED_BY(mu_) = false;
  bool used_fixed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::shared_ptr<Stream>> used_ ABSL_GUARDED_BY(mu_);
  int64_t wakes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace paramd

#endif  // PARAMD_SERVER_STEP_PUSH_PIPELINE_H_
