#include "kernels/cuda/scaling.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/gpu_status.h"
#include "kernels/cuda/misc_launch.h"

namespace paramd {
namespace gpu {
namespace {

float Fp8MaxOf(Fp8Type t) { return t == Fp8Type::kE5M2 ? 57344.0f : 448.0f; }
constexpr int kMaxHistory = 12288;

}  // namespace

absl::Status CurrentScalingUpdate(absl::Span<const CurrentScalingArgs> tensors,
                                  cudaStream_t stream) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].amax == nullptr || tensors[i].scale == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("current scaling ", i, ": null amax or scale"));
    }
  }
  auto batch = std::make_unique<detail::CurrentBatch>();
  size_t i = 0;
  while (i < tensors.size()) {
    batch->num = 0;
    for (; i < tensors.size() && batch->num < detail::kMaxScalingItems; ++i) {
      const CurrentScalingArgs& a = tensors[i];
      detail::CurrentItem& t = batch->t[batch->num++];
      t.amax = a.amax;
      t.scale = a.scale;
      t.scale_inv = a.scale_inv;
      t.fp8_max = Fp8MaxOf(a.spec.fp8_type);
      t.eps = a.spec.eps;
      t.pow2 = a.spec.pow2_scales;
    }
    GPU_RETURN_IF_ERROR(detail::LaunchCurrentScaling(*batch, stream));
  }
  return absl::OkStatus();
}

absl::Status DelayedScalingUpdate(absl::Span<const DelayedScalingArgs> tensors,
                                  cudaStream_t stream) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const DelayedScalingArgs& a = tensors[i];
    const int len = std::max(a.spec.amax_history_len, 1);
    if (a.history == nullptr || a.scale == nullptr || len > kMaxHistory) {
      return absl::InvalidArgumentError(absl::StrCat(
          "delayed scaling ", i, ": need history, scale and 1 <= len <= ", kMaxHistory));
    }
  }
  auto batch = std::make_unique<detail::DelayedBatch>();
  size_t i = 0;
  while (i < tensors.size()) {
    batch->num = 0;
    batch->max_len = 1;
    for (; i < tensors.size() && batch->num < detail::kMaxScalingItems; ++i) {
      const DelayedScalingArgs& a = tensors[i];
      detail::DelayedItem& t = batch->t[batch->num++];
      t.history = a.history;
      t.len = std::max(a.spec.amax_history_len, 1);
      t.scale = a.scale;
      t.scale_inv = a.scale_inv;
      t.reduced_amax = a.reduced_amax;
      t.scaled_max = std::ldexp(Fp8MaxOf(a.spec.fp8_type), -a.spec.margin);
      t.algo_max = a.spec.amax_algo == AmaxAlgo::kMax;
      batch->max_len = std::max(batch->max_len, t.len);
    }
    GPU_RETURN_IF_ERROR(detail::LaunchDelayedScaling(*batch, stream));
  }
  return absl::OkStatus();
}

}  // namespace gpu
}  // namespace paramd
