#include "server/gpu_backend/published_meta.h"

#include <array>
#include <utility>

#include "common/gpu_status.h"
#include "common/status_macros.h"
#include "kernels/reference.h"
#include "server/gpu_backend/spec_rules.h"

namespace paramd {
namespace gpu_backend {

void DescribeShard(int i, const ShardDef& d, const TensorDef& t, const float* scalars,
                   const float* amax, const GpuPublishedDirection device[2],
                   TensorScalingInfo* info, std::vector<PublishedPiece>* pieces) {
  const HybridSpec& spec = t.spec;
  info->held = true;
  for (int dir = 0; dir < 2; ++dir) {
    const QuantSpec& qs = rules::SpecOf(spec, dir);
    const Direction direction = static_cast<Direction>(dir);
    // The tensor's reduced amax of this direction (slot 2t+1: the
    // dequantized rowwise values of a rowwise_dequantized copy).
    const float global = amax[dir == 1 && rules::Dequantized(spec) ? 1 : 0];
    const float* s = scalars + dir * GpuShardStore::kScalarsPerDirection;
    float scale = 1.0f;
    if (rules::Uses(spec, dir) && rules::PerTensorFp8(qs.format)) {
      scale = s[GpuShardStore::kScalarScale];  // the exact multiplier of this cast
    } else if (qs.format == Format::kFp8Current) {
      scale = ref::ScalingFromAmax(qs, global).scale;
    }
    const float info_amax = rules::NeedsReduce(spec, dir) ? global : 0.0f;
    (dir == 0 ? info->rowwise_scale : info->columnwise_scale) = scale;
    (dir == 0 ? info->rowwise_amax : info->columnwise_amax) = info_amax;
    if (!rules::Uses(spec, dir)) continue;
    PublishedPiece p;
    p.shard = i;
    p.tensor = d.tensor;
    p.row_begin = d.row_begin;
    p.row_end = d.row_end;
    p.direction = direction;
    p.layout = device[dir].layout;
    p.q.format = qs.format;
    p.q.direction = direction;
    p.q.rows = d.rows();
    p.q.cols = t.cols;
    p.q.scale_inv = s[GpuShardStore::kScalarInv];
    if (NeedsGlobalAmax(qs.format)) p.q.amax = s[GpuShardStore::kScalarAmax];
    p.scale = scale;
    pieces->push_back(std::move(p));
  }
}

absl::Status CopyBucketToHost(GpuShardStore& store, const std::vector<TensorDef>& tensors,
                              const std::vector<ShardDef>& shards, int64_t version,
                              const StepBucket& b, bool bytes, cudaStream_t* stream,
                              PublishedVersion* out) {
  ScopedDevice guard(store.device());
  if (*stream == nullptr) {
    GPU_RETURN_IF_ERROR(cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking));
  }
  const cudaStream_t copy_stream = *stream;
  std::vector<float> amax(2 * (b.tensor_end - b.tensor_begin));
  GPU_RETURN_IF_ERROR(cudaMemcpyAsync(amax.data(), store.amax_vector() + 2 * b.tensor_begin,
                                      amax.size() * 4, cudaMemcpyDeviceToHost, copy_stream));
  std::vector<PublishedPiece> pieces;
  std::vector<std::array<GpuPublishedDirection, 2>> dirs(b.shards.size());
  std::vector<std::array<float, 2 * GpuShardStore::kScalarsPerDirection>> scalars(b.shards.size());
  for (size_t k = 0; k < b.shards.size(); ++k) {
    const ShardDef& d = shards[b.shards[k]];
    for (int dir = 0; dir < 2; ++dir) {
      if (!rules::Uses(tensors[d.tensor].spec, dir)) continue;
      ASSIGN_OR_RETURN(dirs[k][dir],
                       store.Published(version, b.shards[k], static_cast<Direction>(dir)));
      // scale_inv is the first of the direction's scalars.
      GPU_RETURN_IF_ERROR(cudaMemcpyAsync(
          scalars[k].data() + dir * GpuShardStore::kScalarsPerDirection, dirs[k][dir].scale_inv,
          GpuShardStore::kScalarsPerDirection * 4, cudaMemcpyDeviceToHost, copy_stream));
    }
  }
  GPU_RETURN_IF_ERROR(cudaStreamSynchronize(copy_stream));
  std::vector<GpuPublishedDirection> device;
  for (size_t k = 0; k < b.shards.size(); ++k) {
    const ShardDef& d = shards[b.shards[k]];
    DescribeShard(b.shards[k], d, tensors[d.tensor], scalars[k].data(),
                  amax.data() + 2 * (d.tensor - b.tensor_begin), dirs[k].data(),
                  &out->tensors[d.tensor], &pieces);
    for (int dir = 0; dir < 2; ++dir) {
      if (dirs[k][dir].present) device.push_back(dirs[k][dir]);
    }
  }
  if (static_cast<int>(pieces.size()) != b.piece_end - b.piece_begin) {
    return absl::InternalError("pipelined step: piece count");
  }
  for (size_t j = 0; j < pieces.size() && bytes; ++j) {
    PublishedPiece& p = pieces[j];
    const GpuPublishedDirection& dev = device[j];
    p.q.data.resize(dev.layout.data_bytes());
    p.q.scales.resize(dev.layout.scale_bytes());
    GPU_RETURN_IF_ERROR(cudaMemcpyAsync(p.q.data.data(), dev.data, p.q.data.size(),
                                        cudaMemcpyDeviceToHost, copy_stream));
    if (dev.scales != nullptr && !p.q.scales.empty()) {
      GPU_RETURN_IF_ERROR(cudaMemcpyAsync(p.q.scales.data(), dev.scales, p.q.scales.size(),
                                          cudaMemcpyDeviceToHost, copy_stream));
    }
  }
  GPU_RETURN_IF_ERROR(cudaStreamSynchronize(copy_stream));
  for (size_t j = 0; j < pieces.size(); ++j) out->pieces[b.piece_begin + j] = std::move(pieces[j]);
  return absl::OkStatus();
}

}  // namespace gpu_backend
}  // namespace paramd
