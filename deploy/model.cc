#include "deploy/model.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace paramd {
namespace demo {
namespace {

// SplitMix64: tiny, fast and identical everywhere (std::normal_distribution
// is not specified bit for bit across standard libraries).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in (0, 1].
  double Uniform() { return (static_cast<double>(Next() >> 11) + 1.0) * 0x1.0p-53; }
  // Box-Muller; one normal per call keeps the stream position simple.
  float Normal() {
    const double u1 = Uniform();
    const double u2 = Uniform();
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }

 private:
  uint64_t state_;
};

uint64_t MixSeed(uint64_t seed, uint64_t stream) {
  Rng rng(seed ^ (stream * 0xD1B54A32D192ED03ull));
  return rng.Next();
}

std::vector<float> NormalMatrix(Rng& rng, int64_t rows, int64_t cols, float stddev) {
  std::vector<float> m(rows * cols);
  for (float& v : m) v = rng.Normal() * stddev;
  return m;
}

// y[b][m] = sum_k x[b][k] * w[m][k]. The weight is transposed once so the
// inner loop is a contiguous axpy (vectorizes without reassociation, hence
// bit-reproducible).
std::vector<float> ForwardGemm(absl::Span<const float> x, int64_t batch, absl::Span<const float> w,
                               int64_t rows, int64_t cols) {
  std::vector<float> wt(rows * cols);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t k = 0; k < cols; ++k) wt[k * rows + m] = w[m * cols + k];
  }
  std::vector<float> y(batch * rows, 0.0f);
  for (int64_t b = 0; b < batch; ++b) {
    float* __restrict yb = y.data() + b * rows;
    const float* xb = x.data() + b * cols;
    for (int64_t k = 0; k < cols; ++k) {
      const float xv = xb[k];
      if (xv == 0.0f) continue;  // ReLU zeros: skipping adds nothing
      const float* __restrict wk = wt.data() + k * rows;
      for (int64_t m = 0; m < rows; ++m) yb[m] += xv * wk[m];
    }
  }
  return y;
}

// dx[b][k] = sum_m dy[b][m] * w[m][k].
std::vector<float> DataGradGemm(absl::Span<const float> dy, int64_t batch,
                                absl::Span<const float> w, int64_t rows, int64_t cols) {
  std::vector<float> dx(batch * cols, 0.0f);
  for (int64_t b = 0; b < batch; ++b) {
    float* __restrict dxb = dx.data() + b * cols;
    for (int64_t m = 0; m < rows; ++m) {
      const float g = dy[b * rows + m];
      if (g == 0.0f) continue;
      const float* __restrict wm = w.data() + m * cols;
      for (int64_t k = 0; k < cols; ++k) dxb[k] += g * wm[k];
    }
  }
  return dx;
}

// dw[m][k] = sum_b dy[b][m] * x[b][k].
std::vector<float> WeightGradGemm(absl::Span<const float> dy, absl::Span<const float> x,
                                  int64_t batch, int64_t rows, int64_t cols) {
  std::vector<float> dw(rows * cols, 0.0f);
  for (int64_t b = 0; b < batch; ++b) {
    const float* xb = x.data() + b * cols;
    for (int64_t m = 0; m < rows; ++m) {
      const float g = dy[b * rows + m];
      if (g == 0.0f) continue;
      float* __restrict dwm = dw.data() + m * cols;
      for (int64_t k = 0; k < cols; ++k) dwm[k] += g * xb[k];
    }
  }
  return dw;
}

absl::Status CheckViews(const std::vector<WeightShape>& shapes, const WeightViews& views,
                        absl::string_view what) {
  if (views.size() != shapes.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": expected ", shapes.size(), " weights, got ", views.size()));
  }
  for (size_t l = 0; l < shapes.size(); ++l) {
    if (static_cast<int64_t>(views[l].size()) != shapes[l].size()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", shapes[l].name, " has ",
                                                     views[l].size(), " values, expected ",
                                                     shapes[l].size()));
    }
  }
  return absl::OkStatus();
}

struct ForwardPass {
  // inputs[l] = input of layer l ([n][cols_l]); pre[l] = its output before
  // the ReLU (the last one is the logits).
  std::vector<std::vector<float>> inputs;
  std::vector<std::vector<float>> pre;
};

ForwardPass RunForward(const std::vector<WeightShape>& shapes, const WeightViews& w,
                       absl::Span<const float> x, int64_t n) {
  ForwardPass pass;
  std::vector<float> h(x.begin(), x.end());
  for (size_t l = 0; l < shapes.size(); ++l) {
    std::vector<float> a = ForwardGemm(h, n, w[l], shapes[l].rows, shapes[l].cols);
    pass.inputs.push_back(std::move(h));
    if (l + 1 < shapes.size()) {
      h = a;
      for (float& v : h) v = std::max(v, 0.0f);
    }
    pass.pre.push_back(std::move(a));
  }
  return pass;
}

// Cross-entropy of one row of logits; writes softmax(z) - onehot into dz.
double CrossEntropy(const float* z, int64_t classes, int32_t label, float* dz, bool* correct) {
  float zmax = z[0];
  int64_t argmax = 0;
  for (int64_t c = 1; c < classes; ++c) {
    if (z[c] > zmax) zmax = z[c], argmax = c;
  }
  double sum = 0;
  for (int64_t c = 0; c < classes; ++c) sum += std::exp(static_cast<double>(z[c] - zmax));
  const double log_sum = std::log(sum);
  if (dz != nullptr) {
    for (int64_t c = 0; c < classes; ++c) {
      dz[c] = static_cast<float>(std::exp(static_cast<double>(z[c] - zmax) - log_sum));
    }
    dz[label] -= 1.0f;
  }
  *correct = argmax == label;
  return log_sum - static_cast<double>(z[label] - zmax);
}

}  // namespace

absl::StatusOr<std::vector<WeightShape>> ModelShapes(const ModelConfig& config) {
  std::vector<int64_t> dims = {config.input_dim};
  dims.insert(dims.end(), config.hidden.begin(), config.hidden.end());
  dims.push_back(config.num_classes);
  if (!config.names.empty() && config.names.size() + 1 != dims.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(config.names.size(), " names for ", dims.size() - 1, " layers"));
  }
  std::vector<WeightShape> shapes;
  for (size_t l = 0; l + 1 < dims.size(); ++l) {
    if (dims[l] < 1 || dims[l + 1] < 1) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", l, " has a non-positive size"));
    }
    shapes.push_back(
        {config.names.empty() ? absl::StrCat("layers.", l, ".weight") : config.names[l],
         dims[l + 1], dims[l]});
  }
  return shapes;
}

absl::StatusOr<std::vector<std::vector<float>>> InitialWeights(const ModelConfig& config) {
  ASSIGN_OR_RETURN(const std::vector<WeightShape> shapes, ModelShapes(config));
  std::vector<std::vector<float>> weights;
  for (size_t l = 0; l < shapes.size(); ++l) {
    const WeightShape& s = shapes[l];
    Rng rng(MixSeed(config.init_seed, l));
    // He-normal for ReLU layers; the logits layer starts small so the first
    // loss is near log(num_classes).
    const bool last = l + 1 == shapes.size();
    weights.push_back(NormalMatrix(rng, s.rows, s.cols, std::sqrt((last ? 0.1f : 2.0f) / s.cols)));
  }
  return weights;
}

SyntheticTask::SyntheticTask(const ModelConfig& config) : config_(config) {
  Rng rng(MixSeed(config.data_seed, 0xFFFFFFFFull));
  teacher0_ = NormalMatrix(rng, config.teacher_hidden, config.input_dim, 1.0f);
  teacher1_ = NormalMatrix(rng, config.num_classes, config.teacher_hidden, 1.0f);
}

Batch SyntheticTask::MakeBatch(uint64_t index, int64_t size) const {
  Batch batch;
  batch.size = size;
  Rng rng(MixSeed(config_.data_seed, index));
  batch.inputs = NormalMatrix(rng, size, config_.input_dim, 1.0f);
  std::vector<float> hidden =
      ForwardGemm(batch.inputs, size, teacher0_, config_.teacher_hidden, config_.input_dim);
  for (float& v : hidden) v = std::max(v, 0.0f);
  std::vector<float> logits =
      ForwardGemm(hidden, size, teacher1_, config_.num_classes, config_.teacher_hidden);
  batch.labels.resize(size);
  for (int64_t b = 0; b < size; ++b) {
    const float* z = logits.data() + b * config_.num_classes;
    batch.labels[b] = static_cast<int32_t>(std::max_element(z, z + config_.num_classes) - z);
  }
  return batch;
}

WeightViews ViewsOf(const std::vector<std::vector<float>>& weights) {
  WeightViews views;
  for (const auto& w : weights) views.emplace_back(w);
  return views;
}

absl::StatusOr<StepGradients> ComputeGradients(const ModelConfig& config,
                                               const WeightViews& forward,
                                               const WeightViews& backward, const Batch& batch,
                                               int64_t begin, int64_t end, int64_t normalizer) {
  ASSIGN_OR_RETURN(const std::vector<WeightShape> shapes, ModelShapes(config));
  RETURN_IF_ERROR(CheckViews(shapes, forward, "forward weights"));
  RETURN_IF_ERROR(CheckViews(shapes, backward, "backward weights"));
  if (begin < 0 || end > batch.size || begin >= end || normalizer < 1) {
    return absl::InvalidArgumentError(absl::StrCat("bad sample range [", begin, ", ", end, ") of ",
                                                   batch.size, " / ", normalizer));
  }
  const int64_t n = end - begin;
  const int64_t classes = config.num_classes;
  ForwardPass pass = RunForward(
      shapes, forward,
      absl::MakeConstSpan(batch.inputs).subspan(begin * config.input_dim, n * config.input_dim), n);

  StepGradients out;
  out.samples = n;
  std::vector<float> grad(n * classes);
  const float inv_norm = 1.0f / static_cast<float>(normalizer);
  for (int64_t b = 0; b < n; ++b) {
    bool correct = false;
    out.loss_sum += CrossEntropy(pass.pre.back().data() + b * classes, classes,
                                 batch.labels[begin + b], grad.data() + b * classes, &correct);
    out.correct += correct;
  }
  for (float& g : grad) g *= inv_norm;

  out.weight_grads.resize(shapes.size());
  for (size_t l = shapes.size(); l-- > 0;) {
    const WeightShape& s = shapes[l];
    out.weight_grads[l] = WeightGradGemm(grad, pass.inputs[l], n, s.rows, s.cols);
    if (l == 0) break;
    std::vector<float> dh = DataGradGemm(grad, n, backward[l], s.rows, s.cols);
    const std::vector<float>& pre = pass.pre[l - 1];
    for (size_t i = 0; i < dh.size(); ++i) {
      if (pre[i] <= 0.0f) dh[i] = 0.0f;
    }
    grad = std::move(dh);
  }
  return out;
}

absl::StatusOr<double> MeanLoss(const ModelConfig& config, const WeightViews& weights,
                                const Batch& batch) {
  ASSIGN_OR_RETURN(const std::vector<WeightShape> shapes, ModelShapes(config));
  RETURN_IF_ERROR(CheckViews(shapes, weights, "weights"));
  if (batch.size < 1) return absl::InvalidArgumentError("empty batch");
  ForwardPass pass = RunForward(shapes, weights, batch.inputs, batch.size);
  double sum = 0;
  for (int64_t b = 0; b < batch.size; ++b) {
    bool correct = false;
    sum += CrossEntropy(pass.pre.back().data() + b * config.num_classes, config.num_classes,
                        batch.labels[b], nullptr, &correct);
  }
  return sum / batch.size;
}

}  // namespace demo
}  // namespace paramd
