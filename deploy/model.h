// File: deploy/model.h
//
// The demo's model and training math, in plain C++ on the CPU.
//
// The model is a bias-free MLP classifier
//
//   x[B][in] -> W0 -> ReLU -> W1 -> ReLU -> ... -> W_last -> softmax
//
// with weights W_l[M][K] (M = out features, K = in features, row-major, the
// FORMATS.md convention), trained with softmax cross-entropy on synthetic
// data: inputs are standard normal and labels come from a fixed random
// "teacher" MLP, so the task is learnable and fully deterministic.
//
// A training step reads the weights twice, the way a low-precision trainer
// does (FORMATS.md §0):
//   - the forward GEMM `Y = X · Wᵀ` reads `forward` weights (the dequantized
//     ROWWISE copy in the distributed demo);
//   - the data-gradient GEMM `dX = dY · W` reads `backward` weights (the
//     dequantized COLUMNWISE copy);
//   - the weight gradient `dW = dYᵀ · X` is computed from the activations.
// The FP32 baseline passes the FP32 masters for both.
//
// Everything here is pure and deterministic: same inputs, same bits out, on
// any machine (no threads, no fast math, fixed summation order). All
// functions are thread-compatible (no shared state).
#ifndef PARAMD_DEPLOY_MODEL_H_
#define PARAMD_DEPLOY_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace paramd {
namespace demo {

struct ModelConfig {
  int64_t input_dim = 64;
  // Hidden widths; with the defaults the weights are
  //   layers.0.mlp.up.weight   [1024][64]
  //   layers.1.mlp.down.weight [256][1024]
  //   layers.2.attn.proj.weight [64][256]
  //   head.weight              [16][64]
  // The first two (1024 and 256 rows) are large enough to be cut into
  // 128-row shards.
  std::vector<int64_t> hidden = {1024, 256, 64};
  int64_t num_classes = 16;
  // Weight names, one per layer. The math is a plain MLP; the names follow
  // transformer conventions so that deploy/recipes/demo.textproto's rules
  // (mlp / attn / head) give the layers different hybrid formats. Empty:
  // "layers.<l>.weight".
  std::vector<std::string> names = {"layers.0.mlp.up.weight", "layers.1.mlp.down.weight",
                                    "layers.2.attn.proj.weight", "head.weight"};
  uint64_t init_seed = 1;  // student weights
  uint64_t data_seed = 2;  // teacher weights and inputs
  int64_t teacher_hidden = 32;
};

// One weight tensor of the model.
struct WeightShape {
  std::string name;  // ModelConfig::names[l]
  int64_t rows = 0;  // M (out features)
  int64_t cols = 0;  // K (in features)
  int64_t size() const { return rows * cols; }
};

// The weights in layer order. InvalidArgument for non-positive sizes or a
// names list of the wrong length.
absl::StatusOr<std::vector<WeightShape>> ModelShapes(const ModelConfig& config);

// Deterministic initial weights from config.init_seed (He-normal; the logits
// layer 20x smaller), one row-major vector per ModelShapes() entry.
absl::StatusOr<std::vector<std::vector<float>>> InitialWeights(const ModelConfig& config);

// A batch of samples: inputs [size][input_dim] and class labels.
struct Batch {
  int64_t size = 0;
  std::vector<float> inputs;
  std::vector<int32_t> labels;
};

// The synthetic task. Cheap to copy; construction draws the teacher.
class SyntheticTask {
 public:
  explicit SyntheticTask(const ModelConfig& config);

  // Batch number `index` (any uint64) of `size` samples. Same (index, size),
  // same batch. Evaluation batches use indices with the top bit set, so
  // they never coincide with training batches 0, 1, 2, ...
  Batch MakeBatch(uint64_t index, int64_t size) const;
  Batch MakeEvalBatch(int64_t size) const { return MakeBatch(uint64_t{1} << 63, size); }

 private:
  ModelConfig config_;
  std::vector<float> teacher0_;  // [teacher_hidden][input_dim]
  std::vector<float> teacher1_;  // [num_classes][teacher_hidden]
};

// Read-only FP32 views of every weight, [rows][cols], in ModelShapes order.
using WeightViews = std::vector<absl::Span<const float>>;

// Views over owned weight vectors.
WeightViews ViewsOf(const std::vector<std::vector<float>>& weights);

struct StepGradients {
  double loss_sum = 0;  // sum of per-sample cross-entropy over [begin, end)
  int64_t samples = 0;  // end - begin
  int64_t correct = 0;  // argmax == label
  // dLoss/dW per weight (ModelShapes order), where Loss = loss_sum /
  // normalizer: summing the gradients of disjoint slices that share one
  // normalizer gives exactly the gradient of the mean over their union.
  std::vector<std::vector<float>> weight_grads;
};

// Forward on samples [begin, end) of `batch` with `forward` weights, then
// backward with `backward` weights for the data gradients. InvalidArgument
// when a view's size does not match its shape or the range is bad.
absl::StatusOr<StepGradients> ComputeGradients(const ModelConfig& config,
                                               const WeightViews& forward,
                                               const WeightViews& backward, const Batch& batch,
                                               int64_t begin, int64_t end, int64_t normalizer);

// Mean cross-entropy of `weights` on the whole batch (forward only).
absl::StatusOr<double> MeanLoss(const ModelConfig& config, const WeightViews& weights,
                                const Batch& batch);

}  // namespace demo
}  // namespace paramd

#endif  // PARAMD_DEPLOY_MODEL_H_
