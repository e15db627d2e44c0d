// File: kernels/cuda/device_tuning.h
//
// Settings of the kernels' tuning knobs chosen per device, so that the
// default path (what the daemons run) is the fast one on each card.
//
// The one-pass AdamW + quantize step (AdamWStepAndQuantize) can keep the
// rows of its next load step on their way into L2 (a bulk prefetch one step
// ahead). That pays where the memory system needs more bytes in flight per
// SM than the loads alone keep there, and costs issue slots and L2 traffic
// where it does not: on one H200 (4.8 TB/s peak over 132 SMs) the default
// step reached 0.883 of copy with the prefetch and 0.820 without; on one
// H100 SXM (3.35 TB/s over 132 SMs) 0.836 with and 0.92 without
// (docs/BENCHMARKS.md). The rule is the peak bandwidth per SM against
// kOnePassPrefetchMinGBPerSm, between the two.
//
// PARAMD_ONE_PASS_PREFETCH=0 or 1 in the environment overrides the rule
// (for measuring a card the rule has not seen).
//
// Threading: any thread; the first call per device reads its attributes
// (microseconds) and caches them.
#ifndef PARAMD_KERNELS_CUDA_DEVICE_TUNING_H_
#define PARAMD_KERNELS_CUDA_DEVICE_TUNING_H_

#include <string>

namespace paramd {
namespace gpu {

// Peak memory bandwidth per SM (GB/s) from which the one-pass step's load
// prefetches into L2.
inline constexpr double kOnePassPrefetchMinGBPerSm = 30.0;

struct OnePassTuning {
  bool l2_prefetch = true;
  // Peak memory bandwidth (GB/s) and SM count the rule read; 0 when the
  // device did not report them (the prefetch stays on, the built-in default).
  double peak_gb_per_s = 0.0;
  int sms = 0;
  // Why: "rule" or "PARAMD_ONE_PASS_PREFETCH" or "device attributes unknown".
  std::string source;
};

// The rule alone: prefetch when peak_gb_per_s / sms >= the threshold; on
// when either is unknown (<= 0).
bool OnePassPrefetchPays(double peak_gb_per_s, int sms);

// The settings for `device` (a CUDA ordinal; an invalid one gets the
// built-in default).
OnePassTuning OnePassTuningFor(int device);

}  // namespace gpu
}  // namespace paramd

#endif  // PARAMD_KERNELS_CUDA_DEVICE_TUNING_H_
