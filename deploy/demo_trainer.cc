#include "deploy/demo_trainer.h"

#include <iostream>
#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/status_macros.h"
#include "deploy/demo_report.h"
#include "kernels/reference.h"

namespace paramd {
namespace demo {
namespace {

double MsSince(absl::Time start) { return absl::ToDoubleMilliseconds(absl::Now() - start); }

// The weights of one version as the model reads them.
struct StepWeights {
  std::vector<std::vector<float>> forward;   // dequantized rowwise copies
  std::vector<std::vector<float>> backward;  // dequantized columnwise copies (or empty)
  WeightViews ForwardViews() const { return ViewsOf(forward); }
  WeightViews BackwardViews() const {
    WeightViews v = ViewsOf(forward);
    for (size_t l = 0; l < backward.size(); ++l) {
      if (!backward[l].empty()) v[l] = backward[l];
    }
    return v;
  }
};

class Trainer {
 public:
  Trainer(const TrainerConfig& config, std::unique_ptr<client::Client> client,
          std::vector<WeightShape> shapes)
      : config_(config), client_(std::move(client)), shapes_(std::move(shapes)) {}

  // What to fetch: rowwise for every layer; columnwise where a data
  // gradient is computed (not layer 0) and the tensor publishes one.
  std::vector<client::FetchTarget> Targets(bool with_backward) const {
    const client::Manifest m = client_->manifest();
    std::vector<client::FetchTarget> targets;
    for (size_t l = 0; l < shapes_.size(); ++l) {
      targets.push_back({shapes_[l].name, Direction::kRowwise, {}, {}});
      const client::TensorMeta* meta = m.Find(shapes_[l].name);
      if (with_backward && l > 0 && meta->Publishes(Direction::kColumnwise)) {
        targets.push_back({shapes_[l].name, Direction::kColumnwise, {}, {}});
      }
    }
    return targets;
  }

  absl::StatusOr<StepWeights> Dequantize(const client::FetchResult& fetched) const {
    StepWeights w;
    w.forward.resize(shapes_.size());
    w.backward.resize(shapes_.size());
    for (const client::FetchedTensor& t : fetched.tensors) {
      size_t l = 0;
      while (shapes_[l].name != t.tensor) ++l;
      ASSIGN_OR_RETURN(std::vector<float> values, ref::Dequantize(t.value, t.spec));
      (t.value.direction == Direction::kRowwise ? w.forward[l] : w.backward[l]) = std::move(values);
    }
    return w;
  }

  absl::Status Step(int64_t step, int64_t version, std::ostream& out) {
    StepReport report;
    report.rank = config_.rank;
    report.step = step;
    report.version = version;
    const absl::Time start = absl::Now();

    ASSIGN_OR_RETURN(client::FetchResult fetched,
                     client_->Fetch(version, Targets(/*with_backward=*/true)));
    report.fetch_ms = MsSince(start);
    report.received = {fetched.stats.received.rowwise, fetched.stats.received.columnwise};
    report.fp32 = {fetched.stats.fp32_equivalent.rowwise, fetched.stats.fp32_equivalent.columnwise};
    report.bf16 = {fetched.stats.bf16_equivalent.rowwise, fetched.stats.bf16_equivalent.columnwise};
    for (const client::FetchedTensor& t : fetched.tensors) {
      report.scales.push_back({t.tensor, std::string(DirectionName(t.value.direction)),
                               std::string(FormatName(t.value.format)), t.value.scale_inv,
                               t.value.amax});
    }

    const absl::Time compute_start = absl::Now();
    ASSIGN_OR_RETURN(const StepWeights weights, Dequantize(fetched));
    const Batch batch = task_.MakeBatch(step, config_.schedule.batch_size);
    const auto [begin, end] = TrainerSlice(config_.schedule, config_.rank);
    ASSIGN_OR_RETURN(StepGradients grads, ComputeGradients(config_.model, weights.ForwardViews(),
                                                           weights.BackwardViews(), batch, begin,
                                                           end, config_.schedule.batch_size));
    report.loss_sum = grads.loss_sum;
    report.samples = grads.samples;
    report.correct = grads.correct;
    std::vector<std::vector<uint16_t>> bf16(shapes_.size());
    std::vector<client::Gradient> push;
    for (size_t l = 0; l < shapes_.size(); ++l) {
      if (config_.push_bf16) {
        for (float g : grads.weight_grads[l]) bf16[l].push_back(ref::EncodeBf16(g));
        push.push_back(client::Gradient::Bf16(shapes_[l].name, bf16[l]));
      } else {
        push.push_back(client::Gradient::Fp32(shapes_[l].name, grads.weight_grads[l]));
      }
    }
    report.compute_ms = MsSince(compute_start);

    const absl::Time push_start = absl::Now();
    RETURN_IF_ERROR(client_->PushGradients(version, push).status());
    report.push_ms = MsSince(push_start);
    const absl::Time wait_start = absl::Now();
    RETURN_IF_ERROR(client_->WaitForVersion(version + 1, config_.call_timeout).status());
    report.wait_ms = MsSince(wait_start);
    report.step_ms = MsSince(start);
    out << ToJsonLine(report) << std::endl;
    return absl::OkStatus();
  }

  absl::Status Final(int64_t version, std::ostream& out) {
    FinalReport report;
    report.rank = config_.rank;
    report.version = version;
    if (config_.rank == 0) {
      ASSIGN_OR_RETURN(client::FetchResult fetched,
                       client_->Fetch(version, Targets(/*with_backward=*/false)));
      ASSIGN_OR_RETURN(const StepWeights weights, Dequantize(fetched));
      const Batch eval = task_.MakeEvalBatch(config_.schedule.eval_batch_size);
      ASSIGN_OR_RETURN(report.eval_loss, MeanLoss(config_.model, weights.ForwardViews(), eval));
      report.eval_samples = eval.size;
    }
    out << ToJsonLine(report) << std::endl;
    return absl::OkStatus();
  }

 private:
  const TrainerConfig config_;
  std::unique_ptr<client::Client> client_;
  const std::vector<WeightShape> shapes_;
  const SyntheticTask task_{config_.model};
};

}  // namespace

absl::Status RunTrainer(const TrainerConfig& config, std::ostream& out) {
  ASSIGN_OR_RETURN(std::vector<WeightShape> shapes, ModelShapes(config.model));
  client::ClientOptions options;
  options.coordinator_address = config.coordinator_address;
  options.role = client::ClientOptions::Role::kTrainer;
  options.pusher = true;
  options.expected_pushers = static_cast<int>(config.schedule.num_trainers);
  options.name = absl::StrCat("demo-trainer-", config.rank);
  options.call_timeout = config.call_timeout;
  ASSIGN_OR_RETURN(std::unique_ptr<client::Client> client, client::Client::Connect(options));
  ASSIGN_OR_RETURN(const int64_t first, client->WaitForVersion(0, config.call_timeout));
  ASSIGN_OR_RETURN(const client::Manifest manifest, client->RefreshManifest());
  for (const WeightShape& s : shapes) {
    const client::TensorMeta* meta = manifest.Find(s.name);
    if (meta == nullptr || meta->rows != s.rows || meta->cols != s.cols) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the loaded model does not match the demo model: tensor ", s.name, " [", s.rows, "x",
          s.cols, "] is ", meta == nullptr ? "missing" : "of another shape"));
    }
  }
  client::Client* const c = client.get();
  Trainer trainer(config, std::move(client), std::move(shapes));
  // A step that fails because a daemon was lost (UNAVAILABLE from the dead
  // one, a refused push while the cluster recovers, ABORTED "rewound to
  // version V" from the wait) is resumed from the version the cluster
  // rewound to, with that version's batch (the data rewinds too).
  int rewinds = 0;
  for (int64_t step = 0; step < config.schedule.steps;) {
    const int64_t version = first + step;
    absl::Status s = trainer.Step(step, version, out);
    if (s.ok()) {
      ++step;
      continue;
    }
    std::optional<int64_t> rewound = client::RewoundTo(s);
    if (!rewound && (absl::IsUnavailable(s) || absl::IsFailedPrecondition(s) ||
                     absl::IsOutOfRange(s) || absl::IsNotFound(s))) {
      ASSIGN_OR_RETURN(client::VersionInfo info,
                       c->WaitForVersionInfo(version + 1, config.call_timeout));
      rewound = info.rewound_to;
      if (!rewound) {  // the step completed after all
        ++step;
        continue;
      }
    }
    if (!rewound || *rewound < first || ++rewinds > 10) return s;
    std::cerr << "trainer " << config.rank << ": the cluster rewound to version " << *rewound
              << " (" << s.message() << "); resuming from it" << std::endl;
    step = *rewound - first;
  }
  return trainer.Final(first + config.schedule.steps, out);
}

}  // namespace demo
}  // namespace paramd
