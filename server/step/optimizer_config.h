// File: server/step/optimizer_config.h
//
// The cluster's optimizer config (proto/optimizer.proto) in and out of
// OptimizerOptions (server/step/optimizer.h): parsing protobuf text, defaults,
// validation, the daemon-flag check done at join, one-line descriptions for
// logs and `hpctl status`.
//
// Pure functions; thread-safe.
#ifndef PARAMD_SERVER_STEP_OPTIMIZER_CONFIG_H_
#define PARAMD_SERVER_STEP_OPTIMIZER_CONFIG_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/optimizer.pb.h"
#include "proto/paramd.pb.h"
#include "server/step/optimizer.h"

namespace paramd {

// Unset fields take OptimizerOptions' defaults; InvalidArgument (naming
// the field) for an invalid config.
absl::StatusOr<OptimizerOptions> OptimizerFromProto(const recipe::OptimizerConfig& proto);
// Every field set (a resolved config).
recipe::OptimizerConfig OptimizerToProto(const OptimizerOptions& options);

// Protobuf text (the --optimizer file); errors name `source`, line and
// column.
absl::StatusOr<OptimizerOptions> ParseOptimizerConfig(absl::string_view text,
                                                      absl::string_view source);
absl::StatusOr<OptimizerOptions> LoadOptimizerConfig(const std::string& path);

// A daemon's command-line settings (JoinRequest.optimizer_flags: only what
// was given is set) against the coordinator's config: FAILED_PRECONDITION
// naming the first disagreeing field with both values, e.g.
//   "flag --lr=0.01 disagrees with the coordinator's optimizer
//    config (lr: 0.001); drop the flag or change the coordinator's config"
absl::Status CheckOptimizerFlags(const recipe::OptimizerConfig& flags,
                                 const OptimizerOptions& config);

// One tensor's overrides from its recipe rule.
TensorOptimizer TensorOptimizerFromRule(const recipe::RuleOptimizer& rule);
// The manifest's resolved form (TensorInfo.optimizer) and back, against
// `config` (an override equal to the config's weight decay is kept as is).
rpc::TensorOptimizer TensorOptimizerToProto(const TensorOptimizer& t,
                                            const OptimizerOptions& config);
TensorOptimizer TensorOptimizerFromProto(const rpc::TensorOptimizer& t);

// "adamw lr=0.001 betas=(0.9,0.999) eps=1e-08 wd=0 schedule=warmup 10 then
// cosine over 90 to 0.0001 clip=1 non_finite=skip_step".
std::string DescribeOptimizer(const OptimizerOptions& options);
std::string DescribeSchedule(const LrSchedule& schedule);

}  // namespace paramd

#endif  // PARAMD_SERVER_STEP_OPTIMIZER_CONFIG_H_
