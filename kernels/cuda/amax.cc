#include "kernels/cuda/amax.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "common/gpu_status.h"
#include "kernels/cuda/misc_launch.h"

namespace paramd {
namespace gpu {

absl::Status ComputeAmax(absl::Span<const AmaxArgs> tensors, cudaStream_t stream,
                         bool zero_first) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const AmaxArgs& a = tensors[i];
    if (a.count < 0 || (a.count > 0 && a.source == nullptr) || a.amax == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("amax tensor ", i, ": need count >= 0, a source and an output"));
    }
  }
  if (zero_first) {
    for (const AmaxArgs& a : tensors) GPU_RETURN_IF_ERROR(cudaMemsetAsync(a.amax, 0, sizeof(float), stream));
  }
  auto batch = std::make_unique<detail::AmaxBatch>();
  size_t i = 0;
  while (i < tensors.size()) {
    batch->num = 0;
    batch->total_chunks = 0;
    for (; i < tensors.size() && batch->num < detail::kMaxAmaxItems; ++i) {
      const AmaxArgs& a = tensors[i];
      if (a.count == 0) continue;
      detail::AmaxItem& t = batch->t[batch->num++];
      t.src = a.source;
      t.count = a.count;
      t.out = a.amax;
      t.src_bf16 = a.input_type == InputType::kBf16;
      t.round_bf16 = !t.src_bf16 && a.source_dtype == SourceDtype::kBf16;
      t.vec = (reinterpret_cast<uintptr_t>(a.source) & 15) == 0;
      t.chunk_begin = batch->total_chunks;
      batch->total_chunks += (a.count + detail::kAmaxChunk - 1) / detail::kAmaxChunk;
    }
    GPU_RETURN_IF_ERROR(detail::LaunchAmax(*batch, stream));
  }
  return absl::OkStatus();
}

}  // namespace gpu
}  // namespace paramd
