#include "server/step/step_pipeline.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/reference.h"
#include "server/step/grad_norm.h"
#include "server/step/step_scaling.h"

namespace paramd {
namespace {

constexpr int kRow = 0;
constexpr int kCol = 1;
constexpr char kAbandonedPayload[] = "paramd/step-abandoned";

using step_scaling::ColumnwiseNeedsSecondRound;
using step_scaling::DirectionScaling;

// One all-reduce of the step with the abandon slot appended. `local` is
// this daemon's reason to abandon (OK: none). Returns the reason the step
// ends here, if any: the transport's error, `local`, or another daemon's
// abandon.
absl::Status ReduceWithAbandon(const AllReduceMaxFn& all_reduce, std::vector<float>& values,
                               const absl::Status& local, absl::string_view what) {
  values.push_back(local.ok() ? 0.0f : 1.0f);
  absl::Status s = all_reduce(absl::MakeSpan(values));
  const float abandon = values.back();
  values.pop_back();
  if (!s.ok()) return absl::AbortedError(absl::StrCat(what, " all-reduce failed: ", s.message()));
  if (!local.ok()) return local;
  if (abandon > 0.0f) return StepAbandonedError("another daemon left it");
  return absl::OkStatus();
}

}  // namespace

absl::Status StepAbandonedError(absl::string_view why) {
  absl::Status s = absl::AbortedError(absl::StrCat("pipelined step abandoned: ", why));
  s.SetPayload(kAbandonedPayload, absl::Cord("1"));
  return s;
}

bool IsStepAbandoned(const absl::Status& status) {
  return status.GetPayload(kAbandonedPayload).has_value();
}

std::vector<StepBucket> PlanStepBuckets(const ShardSet& set, int64_t bucket_elements) {
  return PlanStepBuckets(set.tensors(), set.shards(), bucket_elements);
}

std::vector<StepBucket> PlanStepBuckets(const std::vector<TensorDef>& tensors,
                                        const std::vector<ShardDef>& shards,
                                        int64_t bucket_elements) {
  std::vector<StepBucket> buckets;
  int64_t in_bucket = 0;
  for (int t = 0; t < static_cast<int>(tensors.size()); ++t) {
    const int64_t n = tensors[t].rows * tensors[t].cols;
    if (buckets.empty() || in_bucket >= bucket_elements || bucket_elements < 1 ||
        in_bucket + n > bucket_elements) {
      if (buckets.empty() || buckets.back().tensor_end > buckets.back().tensor_begin) {
        StepBucket b;
        b.tensor_begin = t;
        b.tensor_end = t;
        buckets.push_back(b);
        in_bucket = 0;
      }
    }
    buckets.back().tensor_end = t + 1;
    in_bucket += n;
  }
  // Shards are sorted by (tensor, row_begin): each bucket's are contiguous,
  // and so are their pieces (rowwise then columnwise per shard).
  size_t i = 0;
  int piece = 0;
  for (StepBucket& b : buckets) {
    b.piece_begin = piece;
    while (i < shards.size() && shards[i].tensor < b.tensor_end) {
      const HybridSpec& spec = tensors[shards[i].tensor].spec;
      b.shards.push_back(static_cast<int>(i));
      piece += (spec.rowwise_usage ? 1 : 0) + (spec.columnwise_usage ? 1 : 0);
      ++i;
    }
    b.piece_end = piece;
  }
  return buckets;
}

// Friend of ShardSet: the per-bucket twin of ShardSet::Step. Each stage is
// Step's, restricted to one bucket's tensors and shards; see shard_set.cc.
class PipelinedStepper {
 public:
  static absl::StatusOr<std::shared_ptr<const PublishedVersion>> Run(
      ShardSet& set, int64_t new_version, bool apply_optimizer, const AllReduceMaxFn& all_reduce,
      bool update_delayed, const std::vector<StepBucket>& buckets, const PipelinedStepHooks& hooks,
      std::shared_ptr<PublishedVersion> out) {
    const std::vector<TensorDef>& tensors = set.tensors_;
    const std::vector<ShardDef>& shards = set.shards_;
    const int num_tensors = static_cast<int>(tensors.size());
    const int num_shards = static_cast<int>(shards.size());
    if (buckets.empty() ? num_tensors != 0 : buckets.back().tensor_end != num_tensors) {
      return absl::InternalError("pipelined step: buckets do not cover the manifest");
    }
    if (out->version != new_version ||
        static_cast<int>(out->pieces.size()) != (buckets.empty() ? 0 : buckets.back().piece_end) ||
        static_cast<int>(out->tensors.size()) != num_tensors) {
      return absl::InternalError("pipelined step: the version was not made for these buckets");
    }

    // Gradients handed over per shard (empty: the accumulator).
    std::vector<std::vector<float>> given(num_shards);
    auto gradient_of = [&](int i) -> absl::Span<const float> {
      return given[i].empty() ? absl::Span<const float>(set.grads_[i])
                              : absl::Span<const float>(given[i]);
    };
    auto await = [&](const StepBucket& b) -> absl::Status {
      if (!hooks.await_bucket) return absl::OkStatus();
      BucketGradients g;
      RETURN_IF_ERROR(hooks.await_bucket(b, &g));
      if (g.empty()) return absl::OkStatus();
      if (g.size() != b.shards.size()) {
        return absl::InternalError("pipelined step: gradients for the wrong number of shards");
      }
      for (size_t k = 0; k < g.size(); ++k) {
        const int i = b.shards[k];
        if (g[k].size() != set.grads_[i].size()) {
          return absl::InternalError("pipelined step: gradient of the wrong size");
        }
        given[i] = std::move(g[k]);
      }
      return absl::OkStatus();
    };

    // 1. Clipping / skip_step: the global norm before any optimizer step,
    // so every bucket first.
    StepReport report = set.last_report_;
    bool skip = false;
    std::vector<bool> awaited(buckets.size(), false);
    if (apply_optimizer && set.optimizer_.needs_grad_norm()) {
      absl::Status local;
      for (size_t b = 0; b < buckets.size() && local.ok(); ++b) {
        local = await(buckets[b]);
        awaited[b] = true;
      }
      if (IsStepAbandoned(local)) return local;  // before any all-reduce
      std::vector<std::vector<double>> row_sum_sq = set.row_sum_sq_;
      if (local.ok()) {
        for (int i = 0; i < num_shards; ++i) {
          if (given[i].empty() && set.fresh_rows_[i] == shards[i].rows()) continue;
          const int64_t cols = tensors[shards[i].tensor].cols;
          const absl::Span<const float> g = gradient_of(i);
          for (int64_t r = 0; r < shards[i].rows(); ++r) {
            row_sum_sq[i][r] = RowSumSq(g.data() + r * cols, cols);
          }
        }
      }
      // GlobalGradSumSq makes exactly one all-reduce call: carry the
      // abandon slot in it.
      absl::Status ended;
      AllReduceMaxFn with_abandon = [&](absl::Span<float> v) {
        std::vector<float> values(v.begin(), v.end());
        ended = ReduceWithAbandon(all_reduce, values, local, "gradient norm");
        std::copy(values.begin(), values.end(), v.begin());
        return absl::OkStatus();
      };
      absl::StatusOr<double> sum_sq = GlobalGradSumSq(tensors, shards, row_sum_sq, with_abandon);
      RETURN_IF_ERROR(ended);
      RETURN_IF_ERROR(sum_sq.status());
      report.grad_norm = std::sqrt(*sum_sq);
      report.clip_factor = ClipFactor(set.optimizer_, *sum_sq);
      skip = !std::isfinite(*sum_sq) && set.optimizer_.non_finite == NonFinitePolicy::kSkipStep;
    }
    const int64_t step = set.optimizer_steps_ + 1;

    std::vector<std::vector<float>> masters(num_shards);
    std::vector<OptimizerState> opt(num_shards);
    std::vector<std::array<DelayedScalingState, 2>> delayed = set.delayed_;
    std::vector<float> amax(2 * num_tensors, 0.0f);
    std::vector<ref::HybridScaling> scaling(num_tensors);

    absl::Status pending;  // check_bucket's abandon, carried by the next all-reduce
    for (size_t bi = 0; bi < buckets.size(); ++bi) {
      const StepBucket& b = buckets[bi];
      const absl::Status local = !pending.ok() ? pending
                                 : awaited[bi] ? absl::OkStatus()
                                               : await(b);
      // Before the step's first all-reduce an abandoning daemon just leaves.
      if (bi == 0 && !awaited[bi] && IsStepAbandoned(local)) return local;
      // 2. Optimizer, into copies.
      if (local.ok()) {
        for (int i : b.shards) {
          masters[i] = set.masters_[i];
          opt[i] = set.opt_[i];
          const TensorOptimizer& t = tensors[shards[i].tensor].optimizer;
          if (!apply_optimizer || skip || t.frozen) continue;
          ApplyOptimizerStep(set.optimizer_,
                             TensorStepHyper(set.optimizer_, t, step, report.clip_factor), step,
                             absl::MakeSpan(masters[i]), gradient_of(i), opt[i]);
        }
      }
      // 3. Partial amaxes of the bucket's tensors, packed as
      // [tensor - tensor_begin][direction].
      const int first = b.tensor_begin;
      const int count = b.tensor_end - b.tensor_begin;
      std::vector<float> bucket_amax(2 * count, 0.0f);
      bool round2 = false;
      for (int t = b.tensor_begin; t < b.tensor_end; ++t) {
        round2 |= ColumnwiseNeedsSecondRound(tensors[t].spec);
      }
      for (int i : local.ok() ? b.shards : std::vector<int>()) {
        const int t = shards[i].tensor;
        RETURN_IF_ERROR(step_scaling::AddPartialAmaxes(
            tensors[t], shards[i], masters[i], delayed[t][kRow],
            &bucket_amax[2 * (t - first) + kRow], &bucket_amax[2 * (t - first) + kCol]));
      }
      RETURN_IF_ERROR(ReduceWithAbandon(all_reduce, bucket_amax, local, "amax"));
      std::copy(bucket_amax.begin(), bucket_amax.end(), amax.begin() + 2 * first);
      for (int t = b.tensor_begin; t < b.tensor_end; ++t) {
        scaling[t].rowwise =
            DirectionScaling(tensors[t].spec.rowwise, delayed[t][kRow], amax[2 * t + kRow]);
      }
      if (round2) {
        std::vector<float> amax2(count, 0.0f);
        for (int i : b.shards) {
          const ShardDef& d = shards[i];
          const TensorDef& t = tensors[d.tensor];
          if (!ColumnwiseNeedsSecondRound(t.spec)) continue;
          ASSIGN_OR_RETURN(const float a, step_scaling::SecondRoundAmax(t, d, masters[i],
                                                                        scaling[d.tensor].rowwise));
          amax2[d.tensor - first] = std::max(amax2[d.tensor - first], a);
        }
        RETURN_IF_ERROR(ReduceWithAbandon(all_reduce, amax2, absl::OkStatus(), "amax (round 2)"));
        for (int t = b.tensor_begin; t < b.tensor_end; ++t) {
          if (ColumnwiseNeedsSecondRound(tensors[t].spec)) amax[2 * t + kCol] = amax2[t - first];
        }
      }
      for (int t = b.tensor_begin; t < b.tensor_end; ++t) {
        scaling[t].columnwise =
            DirectionScaling(tensors[t].spec.columnwise, delayed[t][kCol], amax[2 * t + kCol]);
      }

      // 4. Quantize the bucket's shards into their slots of `out`.
      int piece = b.piece_begin;
      for (int i : b.shards) {
        const ShardDef& d = shards[i];
        const TensorDef& t = tensors[d.tensor];
        RETURN_IF_ERROR(step_scaling::QuantizeShard(
            i, d, t, masters[i], scaling[d.tensor], amax[2 * d.tensor + kRow],
            amax[2 * d.tensor + kCol], [&]() -> PublishedPiece* {
              return piece < b.piece_end ? &out->pieces[piece++] : nullptr;
            }));
        out->tensors[d.tensor].held = true;
      }
      if (piece != b.piece_end) return absl::InternalError("pipelined step: piece count");

      // 5. Delayed scaling of the bucket's tensors (all of them, held here
      // or not, as Step).
      for (int t = b.tensor_begin; t < b.tensor_end; ++t) {
        step_scaling::FinishTensorScaling(tensors[t].spec, update_delayed, amax[2 * t + kRow],
                                          amax[2 * t + kCol], scaling[t], delayed[t],
                                          &out->tensors[t]);
      }
      if (hooks.check_bucket) pending = hooks.check_bucket();
      if (pending.ok() && hooks.on_bucket_ready) hooks.on_bucket_ready(static_cast<int>(bi));
    }

    // 6. Commit barrier: every daemon commits, or none.
    const absl::Status local = !pending.ok()         ? pending
                               : hooks.before_commit ? hooks.before_commit()
                                                     : absl::OkStatus();
    std::vector<float> none;
    RETURN_IF_ERROR(ReduceWithAbandon(all_reduce, none, local, "commit"));

    if (apply_optimizer && !skip) report.lr = ScheduledLr(set.optimizer_, step);
    report.optimizer_steps = set.optimizer_steps_ + (apply_optimizer && !skip ? 1 : 0);
    report.skipped_steps = set.skipped_steps_ + (skip ? 1 : 0);
    out->report = report;
    for (int i = 0; i < num_shards; ++i) {
      set.masters_[i] = std::move(masters[i]);
      set.opt_[i] = std::move(opt[i]);
    }
    set.delayed_ = std::move(delayed);
    if (apply_optimizer) {
      set.optimizer_steps_ = report.optimizer_steps;
      set.skipped_steps_ = report.skipped_steps;
      for (auto& g : set.grads_) std::fill(g.begin(), g.end(), 0.0f);
      std::fill(set.fresh_rows_.begin(), set.fresh_rows_.end(), 0);
    }
    set.last_report_ = report;
    return std::shared_ptr<const PublishedVersion>(std::move(out));
  }
};

std::shared_ptr<PublishedVersion> NewPipelinedVersion(int64_t new_version,
                                                      const std::vector<StepBucket>& buckets,
                                                      int num_tensors) {
  auto out = std::make_shared<PublishedVersion>();
  out->version = new_version;
  out->pieces.resize(buckets.empty() ? 0 : buckets.back().piece_end);
  out->tensors.resize(num_tensors);
  return out;
}

absl::StatusOr<std::shared_ptr<const PublishedVersion>> RunPipelinedStep(
    ShardSet& set, int64_t new_version, bool apply_optimizer, const AllReduceMaxFn& all_reduce,
    bool update_delayed, const std::vector<StepBucket>& buckets, const PipelinedStepHooks& hooks,
    std::shared_ptr<PublishedVersion> out) {
  if (out == nullptr) {
    out = NewPipelinedVersion(new_version, buckets, static_cast<int>(set.tensors().size()));
  }
  return PipelinedStepper::Run(set, new_version, apply_optimizer, all_reduce, update_delayed,
                               buckets, hooks, std::move(out));
}

}  // namespace paramd
