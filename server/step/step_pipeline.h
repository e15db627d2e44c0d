// File: server/step/step_pipeline.h
//
// The step of ShardSet::Step (server/step/shard_set.h) run bucket by bucket, so
// that the gradients of bucket b+1 can still be arriving while the
// optimizer steps bucket b and the quantized copies of bucket b-1 are
// already being sent (docs/ARCHITECTURE.md "Pipelined step").
//
// A bucket is a run of consecutive manifest tensors of about
// `bucket_elements` parameters (a larger tensor is a bucket of its own).
// Buckets depend on the manifest only, so every daemon cuts the same ones
// and makes the same all-reduce calls in the same order. Per bucket:
//
//   1. hooks.await_bucket(b): blocks until the bucket's gradients are
//      complete (every pusher's share arrived) and may hand over the
//      gradient to step with;
//   2. optimizer on the bucket's shards (into copies);
//   3. the bucket's partial amaxes, ONE all-reduce MAX (plus a second one
//      for the bucket's tensors whose rowwise_dequantized columnwise copy
//      needs the global rowwise scale), scaling and quantization;
//   4. hooks.on_bucket_ready(b): the bucket's pieces of the version are
//      final for this attempt (not yet published: a later bucket may fail).
//
// Then one more all-reduce (the commit barrier) and the commit. Every
// all-reduce carries one extra "abandon" slot: a daemon whose await or
// before_commit failed sets it, so every daemon leaves the step at the same
// call (their collective sequences stay aligned) and none commits.
//
// Gradient clipping / skip_step need the global norm before any optimizer
// step: with a config that needs it (OptimizerOptions::needs_grad_norm) the
// pipeline first awaits EVERY bucket, all-reduces the norm slots
// (server/step/grad_norm.h), and only then steps and quantizes bucket by bucket.
// Pushes then do not overlap the optimizer; quantization and sends still do.
//
// Equal bytes: for the same gradients, the published version (pieces in the
// same order, scaling, delayed state, report) and the committed state are
// those of ShardSet::Step (//server/step:step_pipeline_test checks every format).
// A failure at any point commits nothing, as ShardSet::Step.
//
// Threading: RunPipelinedStep runs on the caller's thread (the daemon's
// worker) with the ShardSet's usual rule (nothing else touches it, except
// through the hooks' own synchronisation). The hooks are called on that
// thread. `out` may be read by other threads: piece k once the
// on_bucket_ready of its bucket has been called (and only pieces of ready
// buckets); its other fields only after the call returned OK.
#ifndef PARAMD_SERVER_STEP_STEP_PIPELINE_H_
#define PARAMD_SERVER_STEP_STEP_PIPELINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/step/shard_set.h"

namespace paramd {

// Default bucket size: 4 Mi parameters (16 MiB of FP32 masters).
constexpr int64_t kDefaultStepBucketElements = int64_t{1} << 22;

struct StepBucket {
  int tensor_begin = 0;  // manifest tensors [tensor_begin, tensor_end)
  int tensor_end = 0;
  std::vector<int> shards;  // this daemon's shards of them (ShardSet order)
  int piece_begin = 0;      // their pieces in PublishedVersion::pieces
  int piece_end = 0;
};

// The buckets of `set`'s manifest (every tensor in exactly one, in order).
// `bucket_elements` < 1: one bucket per tensor.
std::vector<StepBucket> PlanStepBuckets(const ShardSet& set, int64_t bucket_elements);
// The same over a manifest's `tensors` and this daemon's `shards` (sorted by
// (tensor, row_begin), as ShardSet and ShardBackend keep them).
std::vector<StepBucket> PlanStepBuckets(const std::vector<TensorDef>& tensors,
                                        const std::vector<ShardDef>& shards,
                                        int64_t bucket_elements);

// Bucket gradients handed over by await_bucket: per shard of the bucket (in
// StepBucket::shards order) rows*cols FP32 values. Left empty, the step
// uses the ShardSet's own accumulators (ShardSet::gradient).
using BucketGradients = std::vector<std::vector<float>>;

struct PipelinedStepHooks {
  // Null: every bucket is ready at once (the accumulators hold everything).
  // An error abandons the step on every daemon; RunPipelinedStep returns it.
  std::function<absl::Status(const StepBucket& bucket, BucketGradients* gradients)> await_bucket;
  // Called after a bucket's all-reduce and quantization, before it is
  // announced: an error (something the bucket used went away while the
  // all-reduce waited) keeps the bucket unannounced and abandons the step
  // at the next all-reduce. Null: OK.
  std::function<absl::Status()> check_bucket;
  // Null: nobody listens. Must not block long or touch the ShardSet.
  std::function<void(int bucket)> on_bucket_ready;
  // Whether anyone reads a ready bucket's host bytes now (the daemon: an
  // as_ready fetch is parked). Null: always. The cpu backend ignores it
  // (its buckets are on the host anyway); the gpu backend
  // (ShardBackend::StepPipelined) neither copies nor announces a bucket
  // while it is false, and copies the buckets it skipped before it
  // announces a later one, so announced buckets stay a prefix with bytes.
  std::function<bool()> host_readers;
  // Called after the last bucket, before the commit barrier; an error
  // abandons the step on every daemon (e.g. a push used by the step failed
  // after its bucket). Null: OK.
  std::function<absl::Status()> before_commit;
};

// What a step returns when it was abandoned: another daemon's await or
// before_commit failed, or a hook returned StepAbandonedError. ABORTED,
// nothing committed; the step can be run again.
bool IsStepAbandoned(const absl::Status& status);
// The error a hook returns to abandon the step (ABORTED "pipelined step
// abandoned: <why>"). Returned from an await before the step's first
// all-reduce, the step leaves at once, without any all-reduce: the other
// daemons wait in that all-reduce for the step's next attempt, whose calls
// line up with theirs.
absl::Status StepAbandonedError(absl::string_view why);

// The version a pipelined step of `buckets` (of a manifest of
// `num_tensors` tensors) fills: `new_version` with a slot per piece, so that
// readers may hold it before the step starts.
std::shared_ptr<PublishedVersion> NewPipelinedVersion(int64_t new_version,
                                                      const std::vector<StepBucket>& buckets,
                                                      int num_tensors);

// One pipelined step of `set` producing `new_version` (ShardSet::Step's
// arguments) into `out` (from NewPipelinedVersion; null: a new one).
// Returns `out` on success. `buckets` from PlanStepBuckets(set, ...).
absl::StatusOr<std::shared_ptr<const PublishedVersion>> RunPipelinedStep(
    ShardSet& set, int64_t new_version, bool apply_optimizer, const AllReduceMaxFn& all_reduce,
    bool update_delayed, const std::vector<StepBucket>& buckets, const PipelinedStepHooks& hooks,
    std::shared_ptr<PublishedVersion> out);

}  // namespace paramd

#endif  // PARAMD_SERVER_STEP_STEP_PIPELINE_H_
