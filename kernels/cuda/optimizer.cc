#include "kernels/cuda/optimizer.h"

#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/gpu_status.h"
#include "common/status_macros.h"
#include "kernels/adamw_fold.h"
#include "kernels/cuda/optimizer_launch.h"
#include "kernels/cuda/quantize_internal.h"

namespace paramd {
namespace gpu {
namespace {

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// kernels/adamw_fold.h's fold, the one server/step/optimizer.cc uses (the daemon's
// float options widen exactly to double), so device and host AdamW produce
// identical bits; copied into the kernels' own parameter struct.
detail::AdamHyper FoldAdam(const AdamWHyper& h) {
  const AdamWConstants c =
      FoldAdamWConstants(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.step);
  detail::AdamHyper a;
  a.decay = c.decay;
  a.beta1 = c.beta1;
  a.one_minus_beta1 = c.one_minus_beta1;
  a.beta2 = c.beta2;
  a.one_minus_beta2 = c.one_minus_beta2;
  a.eps = c.eps;
  a.step_size = c.step_size;
  a.rsqrt_bias2 = c.rsqrt_bias2;
  return a;
}

absl::Status CheckTensor(const OptimizerTensor& t, size_t i, bool adam) {
  if (t.count < 0 ||
      (t.count > 0 && (t.param == nullptr || t.grad == nullptr ||
                       (adam && (t.exp_avg == nullptr || t.exp_avg_sq == nullptr))))) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer tensor ", i,
                                                   ": need count >= 0, param, grad",
                                                   adam ? ", exp_avg and exp_avg_sq" : ""));
  }
  return absl::OkStatus();
}

absl::Status Launch(absl::Span<const OptimizerTensor> tensors, bool adam,
                    const detail::AdamHyper& ah, const detail::SgdHyper& sh,
                    const float* grad_scale, bool with_amax, cudaStream_t stream) {
  for (size_t i = 0; i < tensors.size(); ++i) RETURN_IF_ERROR(CheckTensor(tensors[i], i, adam));
  auto batch = std::make_unique<detail::OptBatch>();
  batch->adam = ah;
  batch->sgd = sh;
  batch->grad_scale = grad_scale;
  size_t i = 0;
  while (i < tensors.size()) {
    batch->num = 0;
    batch->total_chunks = 0;
    for (; i < tensors.size() && batch->num < detail::kMaxOptItems; ++i) {
      const OptimizerTensor& a = tensors[i];
      if (a.count == 0) continue;
      detail::OptItem& t = batch->t[batch->num++];
      t.param = a.param;
      t.m = a.exp_avg;
      t.v = a.exp_avg_sq;
      t.param_out = a.param_out != nullptr ? a.param_out : a.param;
      t.m_out = a.exp_avg_out != nullptr ? a.exp_avg_out : a.exp_avg;
      t.v_out = a.exp_avg_sq_out != nullptr ? a.exp_avg_sq_out : a.exp_avg_sq;
      t.grad = a.grad;
      t.amax = a.amax;
      t.count = a.count;
      t.round_bf16 = a.amax_source == SourceDtype::kBf16;
      t.vec = Aligned16(a.param) && Aligned16(a.grad) &&
              (a.exp_avg == nullptr || Aligned16(a.exp_avg)) &&
              (a.exp_avg_sq == nullptr || Aligned16(a.exp_avg_sq)) && Aligned16(t.param_out) &&
              (t.m_out == nullptr || Aligned16(t.m_out)) &&
              (t.v_out == nullptr || Aligned16(t.v_out));
      t.chunk_begin = batch->total_chunks;
      batch->total_chunks += (a.count + detail::kOptChunk - 1) / detail::kOptChunk;
    }
    GPU_RETURN_IF_ERROR(detail::LaunchOptimizer(*batch, adam ? 0 : 1, with_amax ? 1 : 0, stream));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AdamWStep(absl::Span<const OptimizerTensor> tensors, const AdamWHyper& hyper,
                       cudaStream_t stream, bool with_amax) {
  if (hyper.step < 1) return absl::InvalidArgumentError("AdamW step must be >= 1");
  return Launch(tensors, true, FoldAdam(hyper), detail::SgdHyper{}, hyper.grad_scale, with_amax,
                stream);
}

absl::Status SgdStep(absl::Span<const OptimizerTensor> tensors, const SgdHyper& hyper,
                     cudaStream_t stream, bool with_amax) {
  detail::SgdHyper s;
  s.lr = static_cast<float>(hyper.lr);
  s.momentum = static_cast<float>(hyper.momentum);
  s.one_minus_dampening = static_cast<float>(1.0 - hyper.dampening);
  s.weight_decay = static_cast<float>(hyper.weight_decay);
  s.nesterov = hyper.nesterov;
  s.first_step = hyper.first_step;
  return Launch(tensors, false, detail::AdamHyper{}, s, hyper.grad_scale, with_amax, stream);
}

absl::Status AdamWStepAndQuantize(absl::Span<const AdamWQuantizeArgs> tensors,
                                  const AdamWHyper& hyper, cudaStream_t stream,
                                  const QuantizeOptions& options) {
  if (hyper.step < 1) return absl::InvalidArgumentError("AdamW step must be >= 1");
  std::vector<detail::TensorDesc> descs;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const AdamWQuantizeArgs& a = tensors[i];
    RETURN_IF_ERROR(CheckTensor(a.opt, i, true));
    if (a.opt.param_out != nullptr || a.opt.exp_avg_out != nullptr ||
        a.opt.exp_avg_sq_out != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", i, ": the one-pass step updates in place only"));
    }
    QuantizeTensorArgs q = a.quant;
    q.source = a.opt.param;
    q.input_type = InputType::kFp32;
    if (q.rows * q.cols != a.opt.count) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", i, ": rows * cols = ", q.rows * q.cols, " but count = ", a.opt.count));
    }
    const bool deq = q.spec.columnwise_source == ColumnwiseSource::kRowwiseDequantized;
    const bool row_used = q.spec.rowwise_usage || (q.spec.columnwise_usage && deq);
    for (const auto& [used, fmt] : {std::pair<bool, Format>{row_used, q.spec.rowwise.format},
                                    {q.spec.columnwise_usage, q.spec.columnwise.format}}) {
      if (used && (fmt == Format::kFp8Current || fmt == Format::kNvfp4)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor ", i, ": ", FormatName(fmt),
            " needs this step's amax before quantizing; use AdamWStep + QuantizeHybrid"));
      }
    }
    auto d = internal::MakeTensorDesc(q, internal::Mode::kQuantize);
    if (!d.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", i, ": ", d.status().message()));
    }
    d->opt.param = a.opt.param;
    d->opt.m = a.opt.exp_avg;
    d->opt.v = a.opt.exp_avg_sq;
    d->opt.grad = a.opt.grad;
    d->src_vec = q.cols % 4 == 0 && Aligned16(a.opt.param) && Aligned16(a.opt.exp_avg) &&
                 Aligned16(a.opt.exp_avg_sq) && Aligned16(a.opt.grad);
    descs.push_back(*d);
  }
  const detail::AdamHyper ah = FoldAdam(hyper);
  return internal::LaunchTensorDescs(descs, &ah, options.variant, stream, hyper.grad_scale);
}

}  // namespace gpu
}  // namespace paramd
