// Throughput of the CPU reference on a 4096 x 4096 weight, per format and
// direction: bazel run -c opt //kernels:reference_benchmark
#include <random>
#include <vector>

#include <benchmark/benchmark.h>

#include "kernels/reference.h"

namespace paramd::ref {
namespace {

constexpr int64_t kM = 4096, kK = 4096;

const std::vector<float>& Weight() {
  static const std::vector<float>* const w = [] {
    auto* v = new std::vector<float>(kM * kK);
    std::mt19937 rng(1);
    std::normal_distribution<float> d(0.0f, 0.02f);
    for (float& x : *v) x = d(rng);
    *v = RoundToSource(*v, SourceDtype::kBf16);
    return v;
  }();
  return *w;
}

// Arguments: format, direction (0 rowwise, 1 columnwise).
void BM_Quantize(benchmark::State& state) {
  const QuantSpec spec = DefaultQuantSpec(static_cast<Format>(state.range(0)));
  const Direction d = static_cast<Direction>(state.range(1));
  const TensorScaling scaling = ScalingFromAmax(spec, Amax(Weight()));
  for (auto _ : state) {
    auto q = Quantize(Weight(), kM, kK, spec, d, scaling);
    benchmark::DoNotOptimize(q);
  }
  state.SetLabel(std::string(FormatName(spec.format)) + " " + std::string(DirectionName(d)));
  state.SetItemsProcessed(state.iterations() * kM * kK);
}

void BM_Dequantize(benchmark::State& state) {
  const QuantSpec spec = DefaultQuantSpec(static_cast<Format>(state.range(0)));
  const Direction d = static_cast<Direction>(state.range(1));
  const auto q = Quantize(Weight(), kM, kK, spec, d, ScalingFromAmax(spec, Amax(Weight())));
  for (auto _ : state) {
    auto x = Dequantize(*q, spec);
    benchmark::DoNotOptimize(x);
  }
  state.SetLabel(std::string(FormatName(spec.format)) + " " + std::string(DirectionName(d)));
  state.SetItemsProcessed(state.iterations() * kM * kK);
}

void AllFormats(benchmark::internal::Benchmark* b) {
  for (int f = 0; f <= 7; ++f) {
    for (int d = 0; d <= 1; ++d) b->Args({f, d});
  }
  b->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_Quantize)->Apply(AllFormats);
BENCHMARK(BM_Dequantize)->Apply(AllFormats);

}  // namespace
}  // namespace paramd::ref
