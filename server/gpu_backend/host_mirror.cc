#include "server/gpu_backend/host_mirror.h"

#include <algorithm>
#include <utility>

#include "common/gpu_status.h"
#include "common/scoped_device.h"
#include "common/status_macros.h"
#include "server/gpu_backend/spec_rules.h"

namespace paramd {
namespace gpu_backend {
namespace {

using rules::SpecOf;

size_t ElementCount(const std::vector<TensorDef>& tensors, const ShardDef& shard) {
  return static_cast<size_t>(shard.rows() * tensors[shard.tensor].cols);
}

int MirrorIndex(const ShardSet& mirror, const ShardDef& shard) {
  return mirror.FindShard(shard.tensor, shard.row_begin, shard.row_end);
}

}  // namespace

absl::Status BlockingCopy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (bytes == 0) return absl::OkStatus();
  GPU_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, kind));
  if (kind == cudaMemcpyHostToDevice) GPU_RETURN_IF_ERROR(cudaStreamSynchronize(nullptr));
  return absl::OkStatus();
}

absl::Status DownloadToMirror(GpuShardStore& store, const std::vector<TensorDef>& tensors,
                              const std::vector<ShardDef>& shards, bool sgd,
                              const std::vector<std::vector<float>>* staged_masters,
                              ShardSet& mirror) {
  ScopedDevice guard(store.device());
  const int64_t steps = store.optimizer_steps();
  for (size_t i = 0; i < shards.size(); ++i) {
    const int shard = static_cast<int>(i);
    const int s = MirrorIndex(mirror, shards[i]);
    absl::Span<float> master = mirror.master(s);
    if (staged_masters != nullptr) {
      std::copy((*staged_masters)[i].begin(), (*staged_masters)[i].end(), master.begin());
    } else {
      RETURN_IF_ERROR(BlockingCopy(master.data(), store.master(shard),
                                   master.size() * sizeof(float), cudaMemcpyDeviceToHost));
    }
    OptimizerState state;
    const size_t n = ElementCount(tensors, shards[i]);
    const bool stepped = steps > 0 && !store.shards()[i].frozen;
    if (stepped && store.exp_avg(shard) != nullptr && !(sgd && store.sgd_buffers_fresh())) {
      state.m.resize(n);
      RETURN_IF_ERROR(BlockingCopy(state.m.data(), store.exp_avg(shard), n * sizeof(float),
                                   cudaMemcpyDeviceToHost));
    }
    if (stepped && store.exp_avg_sq(shard) != nullptr) {
      state.v.resize(n);
      RETURN_IF_ERROR(BlockingCopy(state.v.data(), store.exp_avg_sq(shard), n * sizeof(float),
                                   cudaMemcpyDeviceToHost));
    }
    RETURN_IF_ERROR(mirror.SetOptimizerState(s, std::move(state)));
    const HybridSpec& spec = tensors[shards[i].tensor].spec;
    for (int dir = 0; dir < 2; ++dir) {
      float* history = store.history(shard, dir);
      if (history == nullptr) continue;
      DelayedScalingState delayed;
      delayed.amax_history.resize(std::max(SpecOf(spec, dir).amax_history_len, 1));
      RETURN_IF_ERROR(BlockingCopy(delayed.amax_history.data(), history,
                                   delayed.amax_history.size() * sizeof(float),
                                   cudaMemcpyDeviceToHost));
      RETURN_IF_ERROR(BlockingCopy(&delayed.scale, store.scale(shard, dir), sizeof(float),
                                   cudaMemcpyDeviceToHost));
      mirror.SetDelayedState(shards[i].tensor, static_cast<Direction>(dir), std::move(delayed));
    }
  }
  mirror.SetOptimizerSteps(steps);
  return absl::OkStatus();
}

absl::Status UploadShardMaster(GpuShardStore& store, int shard, absl::Span<const float> values) {
  ScopedDevice guard(store.device());
  return BlockingCopy(store.master(shard), values.data(), values.size() * sizeof(float),
                      cudaMemcpyHostToDevice);
}

absl::Status UploadShardMoments(GpuShardStore& store, int shard, size_t n, bool sgd,
                                absl::Span<const float> m, absl::Span<const float> v) {
  ScopedDevice guard(store.device());
  // SGD state with a momentum buffer (a checkpoint or snapshot of a
  // momentum phase) in a store without one (momentum off so far): the
  // buffers are kept, for a later momentum phase, as ShardSet keeps them.
  if (sgd && n > 0 && m.size() == n && store.exp_avg(shard) == nullptr) {
    RETURN_IF_ERROR(store.AllocateMomentumBuffers().status());
  }
  for (int k = 0; k < 2; ++k) {
    float* device = k == 0 ? store.exp_avg(shard) : store.exp_avg_sq(shard);
    const absl::Span<const float> host = k == 0 ? m : v;
    if (device == nullptr) continue;
    if (host.size() == n) {
      RETURN_IF_ERROR(BlockingCopy(device, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    } else {
      GPU_RETURN_IF_ERROR(cudaMemset(device, 0, n * sizeof(float)));
    }
  }
  // The memsets ran on the default stream, which the store's does not wait
  // for (BlockingCopy says why).
  GPU_RETURN_IF_ERROR(cudaStreamSynchronize(nullptr));
  return absl::OkStatus();
}

absl::Status UploadShardDelayed(GpuShardStore& store, const HybridSpec& spec, int shard,
                                Direction d, const DelayedScalingState& state) {
  const int dir = static_cast<int>(d);
  float* history = store.history(shard, dir);
  if (history == nullptr) return absl::OkStatus();
  ScopedDevice guard(store.device());
  std::vector<float> h = state.amax_history;
  h.resize(std::max(SpecOf(spec, dir).amax_history_len, 1), 0.0f);
  RETURN_IF_ERROR(
      BlockingCopy(history, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice));
  return BlockingCopy(store.scale(shard, dir), &state.scale, sizeof(float), cudaMemcpyHostToDevice);
}

absl::Status UploadFromMirror(const ShardSet& mirror, const std::vector<TensorDef>& tensors,
                              const std::vector<ShardDef>& shards, bool sgd, GpuShardStore& store) {
  ScopedDevice guard(store.device());
  // Allocated before any shard is written, so that a shard without
  // momentum beside one with it gets zeroed buffers (and a fresh start).
  bool host_momentum = false;
  for (const ShardDef& shard : shards) {
    const size_t n = ElementCount(tensors, shard);
    host_momentum |= n > 0 && mirror.optimizer_state(MirrorIndex(mirror, shard)).m.size() == n;
  }
  if (sgd && host_momentum) RETURN_IF_ERROR(store.AllocateMomentumBuffers().status());
  std::vector<bool> momentum_zeroed(shards.size());
  for (size_t i = 0; i < shards.size(); ++i) {
    const int shard = static_cast<int>(i);
    const int s = MirrorIndex(mirror, shards[i]);
    const size_t n = ElementCount(tensors, shards[i]);
    RETURN_IF_ERROR(UploadShardMaster(store, shard, mirror.master(s)));
    const OptimizerState& state = mirror.optimizer_state(s);
    RETURN_IF_ERROR(UploadShardMoments(store, shard, n, sgd, state.m, state.v));
    momentum_zeroed[i] = state.m.size() != n;
    for (Direction d : {Direction::kRowwise, Direction::kColumnwise}) {
      RETURN_IF_ERROR(UploadShardDelayed(store, tensors[shards[i].tensor].spec, shard, d,
                                         mirror.delayed_state(shards[i].tensor, d)));
    }
  }
  store.set_optimizer_steps(mirror.optimizer_steps(),
                            sgd && MomentumStartsFresh(store, momentum_zeroed));
  return absl::OkStatus();
}

bool MomentumStartsFresh(GpuShardStore& store, const std::vector<bool>& momentum_zeroed) {
  for (size_t i = 0; i < momentum_zeroed.size(); ++i) {
    // (A frozen tensor's state is always empty: it says nothing.)
    if (momentum_zeroed[i] && !store.shards()[i].frozen &&
        store.exp_avg(static_cast<int>(i)) != nullptr) {
      return true;
    }
  }
  return false;
}

}  // namespace gpu_backend
}  // namespace paramd
