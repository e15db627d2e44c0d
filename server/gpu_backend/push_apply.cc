#include "server/gpu_backend/push_apply.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/gpu_status.h"
#include "common/status_macros.h"
#include "server/gpu_backend/accumulate.h"
#include "server/gpu_backend/finite_check.h"
#include "server/gpu_backend/push_write.h"

namespace paramd {
namespace gpu_backend {
namespace {

// Offset alignment of the widened pieces' scratch (the BF16 accumulate
// kernel loads 16 bytes at a time).
constexpr size_t kAlign = 256;

size_t Aligned(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// The BF16 accumulate kernel needs 16-byte aligned accumulator and source
// (a piece whose row offset is not a multiple of 8 elements is not): such a
// piece is first widened into FP32 scratch by copies alone (zeroed words,
// each BF16 copied into the high half of its little-endian FP32 word: the
// exact widening) and then added by the FP32 kernel, the same FP32 add.
bool NeedsWidening(const float* acc, const void* grad, bool bf16) {
  return bf16 && (reinterpret_cast<uintptr_t>(acc) % 16 != 0 ||
                  reinterpret_cast<uintptr_t>(grad) % 16 != 0);
}

}  // namespace

absl::Status CheckPushFinite(absl::Span<const DevicePushSource> pieces, uint32_t* flag,
                             cudaStream_t stream) {
  GPU_RETURN_IF_ERROR(cudaMemsetAsync(flag, 0, sizeof(uint32_t), stream));
  for (const DevicePushSource& p : pieces) {
    GPU_RETURN_IF_ERROR(LaunchNonFiniteCheck(p.source, p.bf16, p.count, flag, stream));
  }
  uint32_t bad = 0;
  GPU_RETURN_IF_ERROR(
      cudaMemcpyAsync(&bad, flag, sizeof(uint32_t), cudaMemcpyDeviceToHost, stream));
  GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (bad != 0) {
    return absl::InvalidArgumentError(
        "device push holds a non-finite gradient value (NaN/Inf are refused); nothing applied");
  }
  return absl::OkStatus();
}

static absl::Status CheckPieces(const GpuShardStore& store,
                                absl::Span<const DevicePushSource> pieces) {
  for (const DevicePushSource& p : pieces) {
    const GpuShardDef* shard = p.shard >= 0 && p.shard < static_cast<int>(store.shards().size())
                                   ? &store.shards()[p.shard]
                                   : nullptr;
    if (shard == nullptr || p.offset < 0 || p.count < 0 ||
        p.offset + p.count > shard->rows * shard->cols) {
      return absl::InvalidArgumentError(absl::StrCat("device push piece [", p.offset, ", +",
                                                     p.count, ") outside shard ", p.shard));
    }
  }
  return absl::OkStatus();
}

absl::Status ApplyCheckedPush(GpuShardStore& store, absl::Span<const DevicePushSource> pieces,
                              uint32_t* flag, bool refuse_non_finite) {
  ScopedDevice guard(store.device());
  RETURN_IF_ERROR(CheckPieces(store, pieces));
  const cudaStream_t stream = store.stream();
  // Which pieces land in a zero accumulator, decided before any of them is
  // written (pieces of one push never overlap: the service checks that).
  std::vector<char> write(pieces.size(), 0);
  std::vector<DevicePushSource> adds;
  for (size_t i = 0; i < pieces.size(); ++i) {
    write[i] = store.grad_zero(pieces[i].shard) ? 1 : 0;
    if (!write[i]) adds.push_back(pieces[i]);
  }
  GPU_RETURN_IF_ERROR(cudaMemsetAsync(flag, 0, sizeof(uint32_t), stream));
  cudaError_t e = cudaSuccess;
  for (size_t i = 0; i < pieces.size() && e == cudaSuccess; ++i) {
    const DevicePushSource& p = pieces[i];
    e = write[i] ? LaunchWriteChecked(store.grad(p.shard) + p.offset, p.source, p.bf16, p.count,
                                      flag, stream)
                 : LaunchNonFiniteCheck(p.source, p.bf16, p.count, flag, stream);
  }
  uint32_t bad = 0;
  if (e == cudaSuccess) {
    e = cudaMemcpyAsync(&bad, flag, sizeof(uint32_t), cudaMemcpyDeviceToHost, stream);
  }
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess || (bad != 0 && refuse_non_finite)) {
    // Back to zeros: the refused push adds nothing.
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (!write[i]) continue;
      cudaMemsetAsync(store.grad(pieces[i].shard) + pieces[i].offset, 0,
                      pieces[i].count * sizeof(float), stream);
    }
    GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    GPU_RETURN_IF_ERROR(e);
    return absl::InvalidArgumentError(
        "device push holds a non-finite gradient value (NaN/Inf are refused); nothing applied");
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (write[i]) store.note_grad_written(pieces[i].shard);
  }
  if (!adds.empty()) {
    RETURN_IF_ERROR(EnqueuePushAdds(store, adds, /*last_pusher=*/false));
    GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  }
  return absl::OkStatus();
}

absl::Status EnqueuePushAdds(GpuShardStore& store, absl::Span<const DevicePushSource> pieces,
                             bool last_pusher) {
  ScopedDevice guard(store.device());
  // Every piece is checked before the first add: a refusal changes nothing.
  RETURN_IF_ERROR(CheckPieces(store, pieces));
  const cudaStream_t stream = store.stream();
  // Phase 1 (touches no accumulator): widen the pieces that need it.
  std::vector<const void*> sources(pieces.size());
  std::vector<bool> widened(pieces.size(), false);
  size_t wide_bytes = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const DevicePushSource& p = pieces[i];
    sources[i] = p.source;
    widened[i] = NeedsWidening(store.grad(p.shard) + p.offset, p.source, p.bf16);
    if (widened[i]) wide_bytes += Aligned(p.count * sizeof(float));
  }
  void* wide = nullptr;
  if (wide_bytes > 0) {
    GPU_RETURN_IF_ERROR(cudaMallocAsync(&wide, wide_bytes, stream));
    size_t at = 0;
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (!widened[i]) continue;
      const int64_t n = pieces[i].count;
      char* dst = static_cast<char*>(wide) + at;
      cudaError_t e = cudaMemsetAsync(dst, 0, n * sizeof(float), stream);
      if (e == cudaSuccess) {
        e = cudaMemcpy2DAsync(dst + 2, sizeof(float), sources[i], 2, 2, n, cudaMemcpyDeviceToDevice,
                              stream);
      }
      if (e != cudaSuccess) {
        cudaFreeAsync(wide, stream);
        GPU_RETURN_IF_ERROR(e);
      }
      sources[i] = dst;
      at += Aligned(n * sizeof(float));
    }
  }
  // Phase 2: the adds, piece by piece in order (the store's: the last
  // pusher's whole rows take the norm's row sums in the add). Only a launch
  // failure (a broken device) can stop it part-way.
  absl::Status s;
  for (size_t i = 0; i < pieces.size() && s.ok(); ++i) {
    const DevicePushSource& p = pieces[i];
    s = store.AddPiece(p.shard, p.offset, sources[i], p.bf16 && !widened[i], p.count, last_pusher);
  }
  if (wide != nullptr) cudaFreeAsync(wide, stream);
  return s;
}

}  // namespace gpu_backend
}  // namespace paramd
