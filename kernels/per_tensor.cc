// §1/§2 FP8 per-tensor scaling. Delayed and current scaling differ only in
// where `scaling.scale` comes from (DelayedScalingState vs ScalingFromAmax);
// the cast is the same: q = enc8(mul(x, scale)), scale_inv = rcp(scale).
// The tensor is one block of the shared block loops.
#include "kernels/reference.h"
#include "kernels/reference_internal.h"

namespace paramd {
namespace ref {
namespace internal {

void QuantizePerTensorRowwise(const SourceMatrix& src, const QuantSpec& spec,
                              const TensorScaling& scaling, QuantizedTensor& q) {
  const BlockGrid whole{src.rows, src.cols, src.rows, src.cols};
  EncodeFp8Blocks(src.values, whole, {scaling.scale}, spec.fp8_type, q.data.data());
  q.scale_inv = 1.0f / scaling.scale;
  // What delayed scaling records (amax of the unscaled input, §1).
  q.amax = BlockAmaxes(src.values, whole)[0];
}

void DequantizePerTensorRowwise(const EncodedView& v, const QuantSpec& spec, MatrixRowsOut& out) {
  const BlockGrid whole{v.rows, v.cols, v.rows, v.cols};
  DecodeFp8Blocks(v.data, whole, {v.scale_inv}, spec.fp8_type, out);
}

}  // namespace internal
}  // namespace ref
}  // namespace paramd
