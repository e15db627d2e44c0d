// File: deploy/demo_trainer.h
//
// One data-parallel trainer of the demo, run as its own process (the demo
// binary re-executed with --trainer_rank). Each step it
//   1. fetches version v: the ROWWISE copy of every weight (forward) and the
//      COLUMNWISE copy of the weights whose data gradient it needs (all but
//      the first layer; a weight that publishes no columnwise copy uses its
//      rowwise one, as a Blackwell trainer would);
//   2. dequantizes them on the CPU (ref::Dequantize) and computes the
//      gradients of its slice of the step's batch (deploy/model.h);
//   3. pushes them (FP32 or BF16) for version v, and waits for v + 1.
// After the last step it fetches the final version and (rank 0) evaluates
// the loss on the held-out batch.
//
// Progress is reported as one JSON object per line on `out` (the pipe the
// orchestrator reads); see demo_report.h for the fields.
//
// Blocking: RunTrainer blocks for the whole run. Not thread-safe.
#ifndef PARAMD_DEPLOY_DEMO_TRAINER_H_
#define PARAMD_DEPLOY_DEMO_TRAINER_H_

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "deploy/model.h"
#include "deploy/training.h"

namespace paramd {
namespace demo {

struct TrainerConfig {
  std::string coordinator_address;
  int64_t rank = 0;  // 0 .. schedule.num_trainers - 1
  ModelConfig model;
  TrainSchedule schedule;
  bool push_bf16 = false;
  absl::Duration call_timeout = absl::Seconds(30);
};

// Runs the trainer. Errors carry the failing call's status.
absl::Status RunTrainer(const TrainerConfig& config, std::ostream& out);

}  // namespace demo
}  // namespace paramd

#endif  // PARAMD_DEPLOY_DEMO_TRAINER_H_
