// File: server/step/optimizer_test_model.h
//
// TEST ONLY. The model of the optimizer step tests (cpu:
// server/step/optimizer_step_test.cc, gpu: gpu_backend/gpu_backend_clip_test.cc):
// a weight split across daemons, a bias with its own lr multiplier and no
// weight decay, a wide tensor (cols > 256 norm lanes) with its own decay
// split across two daemons, and a frozen tensor; its 1- and 3-daemon
// layouts (128-row aligned, as the planner cuts); random values.
#ifndef PARAMD_SERVER_STEP_OPTIMIZER_TEST_MODEL_H_
#define PARAMD_SERVER_STEP_OPTIMIZER_TEST_MODEL_H_

#include <random>
#include <vector>

#include "server/step/shard_set.h"

namespace paramd {
namespace testing {

inline std::vector<TensorDef> OptimizerTestModel(const HybridSpec& spec) {
  std::vector<TensorDef> t(4);
  t[0] = {"layers.0.weight", 384, 40, spec, {}};
  t[1] = {"layers.0.bias", 1, 40, spec, {}};
  t[1].optimizer.lr_multiplier = 2.0f;
  t[1].optimizer.weight_decay = 0.0f;
  t[2] = {"embed.weight", 256, 300, spec, {}};
  t[2].optimizer.weight_decay = 0.5f;
  t[3] = {"frozen.weight", 130, 8, spec, {}};
  t[3].optimizer.frozen = true;
  return t;
}

// Shards per daemon for 1 or 3 daemons.
inline std::vector<std::vector<ShardDef>> OptimizerTestLayout(int daemons) {
  if (daemons == 1) return {{{0, 0, 384}, {1, 0, 1}, {2, 0, 256}, {3, 0, 130}}};
  return {{{0, 0, 128}, {1, 0, 1}, {3, 0, 130}},
          {{0, 128, 256}, {2, 0, 128}},
          {{0, 256, 384}, {2, 128, 256}}};
}

inline std::vector<float> RandomGradient(int64_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

}  // namespace testing
}  // namespace paramd

#endif  // PARAMD_SERVER_STEP_OPTIMIZER_TEST_MODEL_H_
