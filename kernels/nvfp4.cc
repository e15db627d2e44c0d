// §4 NVFP4 (D4, D7, D11): E2M1 elements, one UE4M3 scale per 1x16 block of
// a row (or per 16x16 tile with spec.two_d, the weight default, written into
// every row of the tile), and the tensor's global amax A.
#include <algorithm>
#include <cfloat>
#include <cmath>

#include "kernels/reference.h"
#include "kernels/reference_internal.h"

namespace paramd {
namespace ref {
namespace internal {
namespace {

constexpr int64_t kBlock = 16;

// S_enc = min(div(2688, A), FLT_MAX), and 1 where that is meaningless:
// A == 0, S_enc == 0 (A = Inf) or A = NaN (D4).
float GlobalEncodeScale(float a) {
  if (a == 0.0f || std::isnan(a) || std::isinf(a)) return 1.0f;
  const float s = std::min(2688.0f / a, FLT_MAX);
  return s == 0.0f ? 1.0f : s;
}

}  // namespace

void QuantizeNvfp4Rowwise(const SourceMatrix& src, const QuantSpec& spec,
                          const TensorScaling& scaling, QuantizedTensor& q) {
  const BlockGrid grid{src.rows, src.cols, spec.two_d ? kBlock : 1, kBlock};
  const std::vector<float> amax = BlockAmaxes(src.values, grid);
  const float s_enc = GlobalEncodeScale(scaling.global_amax);
  const float s_dec = 1.0f / s_enc;
  const float block_factor = s_enc * Rcp6();  // mul(S_enc, RCP6), rounded once
  std::vector<uint8_t> sd(amax.size());
  std::vector<float> enc(amax.size());
  for (size_t b = 0; b < amax.size(); ++b) {
    sd[b] = EncodeE4M3(amax[b] * block_factor);
    // sd == 0 gives 1/0 = Inf -> FLT_MAX (its block is all zeros anyway).
    enc[b] = std::min(1.0f / (DecodeE4M3(sd[b]) * s_dec), FLT_MAX);
  }
  EncodeFp4Blocks(src.values, grid, enc, q.data.data());
  StoreScaleBytes(sd, grid, 1, kBlock, src.layout.scale_cols, q.scales.data());  // [i][j/16]
  q.amax = scaling.global_amax;  // A is stored, not S_enc (§4)
}

void DequantizeNvfp4Rowwise(const EncodedView& v, const QuantSpec& /*spec*/, MatrixRowsOut& out) {
  // x^ = e2m1(q) * mul(mul(e4m3_value(sd), A), RCP2688) (D4: TE's decode).
  const BlockGrid grid{v.rows, v.cols, 1, kBlock};
  const std::vector<uint8_t> sd = LoadScaleBytes(v.scales, grid, v.layout.scale_cols);
  std::vector<float> dec(sd.size());
  for (size_t b = 0; b < sd.size(); ++b) dec[b] = (DecodeE4M3(sd[b]) * v.amax) * Rcp2688();
  DecodeFp4Blocks(v.data, grid, dec, out);
}

}  // namespace internal
}  // namespace ref
}  // namespace paramd
