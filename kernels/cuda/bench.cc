// //kernels/cuda:bench — the issue-3 kernel benchmark.
//
// 1.07 B parameters = 8 x (8192 x 16384) FP32 (one multi-tensor launch per
// kernel). Each kernel: warm-up, then --reps runs each timed with CUDA
// events; the median is reported with the bytes it must move (each input
// read once, each output written once), GB/s, and the ratio to a
// device-to-device copy measured in the same run. Prints a plain table;
// --json=PATH writes the same numbers.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/gpu_status.h"
#include "kernels/cuda/amax.h"
#include "kernels/cuda/device_tuning.h"
#include "kernels/cuda/optimizer.h"
#include "kernels/cuda/quantize.h"
#include "kernels/cuda/scaling.h"
#include "kernels/format.h"

ABSL_FLAG(int, reps, 30, "timed runs per kernel (median reported)");
ABSL_FLAG(int, warmup, 3, "untimed runs per kernel before timing");
ABSL_FLAG(int, tensors, 8, "number of 8192 x 16384 tensors");
ABSL_FLAG(int64_t, rows, 8192, "rows per tensor");
ABSL_FLAG(int64_t, cols, 16384, "cols per tensor");
ABSL_FLAG(std::string, json, "", "write results as JSON to this path");
ABSL_FLAG(std::string, only, "", "run only kernels whose name contains this");

namespace paramd {
namespace gpu {
namespace {

#define BENCH_CHECK(expr)                                                        \
  do {                                                                           \
    absl::Status s_ = (expr);                                                    \
    if (!s_.ok()) {                                                              \
      fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, s_.ToString().c_str()); \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

struct Result {
  std::string name;
  double bytes_per_elem = 0;
  double ms = 0;
  double gbps = 0;
  double ratio = 0;
  double target = 0;  // 0: none
};

void* DeviceAlloc(size_t bytes) {
  void* p = nullptr;
  BENCH_CHECK(GPU_STATUS(cudaMalloc(&p, bytes)));
  return p;
}

// Median of `reps` event-timed runs of fn(), after `warmup` runs.
template <typename Fn>
double TimeMs(Fn fn) {
  const int warmup = absl::GetFlag(FLAGS_warmup), reps = absl::GetFlag(FLAGS_reps);
  for (int i = 0; i < warmup; ++i) fn();
  BENCH_CHECK(GPU_STATUS(cudaDeviceSynchronize()));
  cudaEvent_t a, b;
  BENCH_CHECK(GPU_STATUS(cudaEventCreate(&a)));
  BENCH_CHECK(GPU_STATUS(cudaEventCreate(&b)));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    BENCH_CHECK(GPU_STATUS(cudaEventRecord(a)));
    fn();
    BENCH_CHECK(GPU_STATUS(cudaEventRecord(b)));
    BENCH_CHECK(GPU_STATUS(cudaEventSynchronize(b)));
    float ms = 0;
    BENCH_CHECK(GPU_STATUS(cudaEventElapsedTime(&ms, a, b)));
    t.push_back(ms);
  }
  BENCH_CHECK(GPU_STATUS(cudaEventDestroy(a)));
  BENCH_CHECK(GPU_STATUS(cudaEventDestroy(b)));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Random-ish values of a spread of magnitudes (never zeros), generated on
// the host with all cores.
std::vector<float> HostValues(int64_t n, float scale, bool positive) {
  std::vector<float> v(n);
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      uint64_t s = 0x9E3779B97F4A7C15ull * (t + 1);
      for (int64_t i = t; i < n; i += threads) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        float u = static_cast<float>(s >> 40) * (1.0f / 16777216.0f) - 0.5f;
        if (u == 0.0f) u = 0.25f;
        u *= scale * std::ldexp(1.0f, static_cast<int>((s >> 20) & 7) - 3);
        v[i] = positive ? std::fabs(u) : u;
      }
    });
  }
  for (auto& th : pool) th.join();
  return v;
}

int Run() {
  const int T = absl::GetFlag(FLAGS_tensors);
  const int64_t M = absl::GetFlag(FLAGS_rows), K = absl::GetFlag(FLAGS_cols);
  const int64_t per = M * K, total = per * T;
  const std::string only = absl::GetFlag(FLAGS_only);
  auto want = [&](const std::string& name) {
    return only.empty() || name.find(only) != std::string::npos;
  };

  cudaDeviceProp prop;
  BENCH_CHECK(GPU_STATUS(cudaGetDeviceProperties(&prop, 0)));
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  printf("device: %s, %d SMs, L2 %d MB, driver %d, runtime %d\n", prop.name,
         prop.multiProcessorCount, prop.l2CacheSize >> 20, driver, runtime);
  printf("problem: %d x (%lld x %lld) FP32 = %.3f G params; reps %d (median), warmup %d\n", T,
         static_cast<long long>(M), static_cast<long long>(K), total / 1e9,
         absl::GetFlag(FLAGS_reps), absl::GetFlag(FLAGS_warmup));
  const OnePassTuning tuning = OnePassTuningFor(0);
  printf(
      "one-pass step default: L2 prefetch %s (%s; peak %.0f GB/s over %d SMs = %.1f GB/s per "
      "SM, threshold %.0f)\n",
      tuning.l2_prefetch ? "on" : "off", tuning.source.c_str(), tuning.peak_gb_per_s, tuning.sms,
      tuning.sms > 0 ? tuning.peak_gb_per_s / tuning.sms : 0.0, kOnePassPrefetchMinGBPerSm);

  // Inputs: master, moments, gradient (each T tensors, contiguous).
  const std::vector<float> hp = HostValues(per, 1.0f, false);
  const std::vector<float> hv = HostValues(per, 1e-4f, true);
  float* master = static_cast<float*>(DeviceAlloc(total * 4));
  float* m = static_cast<float*>(DeviceAlloc(total * 4));
  float* v = static_cast<float*>(DeviceAlloc(total * 4));
  float* g = static_cast<float*>(DeviceAlloc(total * 4));
  for (int t = 0; t < T; ++t) {
    BENCH_CHECK(
        GPU_STATUS(cudaMemcpy(master + t * per, hp.data(), per * 4, cudaMemcpyHostToDevice)));
    BENCH_CHECK(GPU_STATUS(cudaMemcpy(g + t * per, hp.data(), per * 4, cudaMemcpyHostToDevice)));
    BENCH_CHECK(GPU_STATUS(cudaMemcpy(m + t * per, hv.data(), per * 4, cudaMemcpyHostToDevice)));
    BENCH_CHECK(GPU_STATUS(cudaMemcpy(v + t * per, hv.data(), per * 4, cudaMemcpyHostToDevice)));
  }
  // Outputs: room for two directions of 2 bytes/element plus scales.
  uint8_t* out_row = static_cast<uint8_t*>(DeviceAlloc(total * 4 + (64 << 20)));
  uint8_t* out_col = static_cast<uint8_t*>(DeviceAlloc(total * 2 + (64 << 20)));
  float* scalars = static_cast<float*>(DeviceAlloc(4096));
  {
    std::vector<float> init(1024, 0.0f);
    init[0] = 64.0f;  // FP8 scale
    init[1] = 8.0f;   // NVFP4 global amax (|values| <= 8)
    BENCH_CHECK(GPU_STATUS(cudaMemcpy(scalars, init.data(), 4096, cudaMemcpyHostToDevice)));
  }
  float* d_scale = scalars;
  float* d_A = scalars + 1;
  float* amax_slots = scalars + 64;  // per tensor

  std::vector<Result> results;
  double copy_gbps = 0;
  auto report = [&](const std::string& name, double bytes_per_elem, double ms, double target) {
    Result r;
    r.name = name;
    r.bytes_per_elem = bytes_per_elem;
    r.ms = ms;
    r.gbps = bytes_per_elem * total / (ms * 1e-3) / 1e9;
    r.ratio = copy_gbps > 0 ? r.gbps / copy_gbps : 1.0;
    r.target = target;
    results.push_back(r);
    printf("  %-44s %7.3f ms %8.1f GB/s  ratio %.3f%s\n", name.c_str(), ms, r.gbps, r.ratio,
           target > 0
               ? absl::StrFormat("  (target %.2f %s)", target, r.ratio >= target ? "met" : "MISSED")
                     .c_str()
               : "");
    fflush(stdout);
  };

  // Device-to-device copy of the master: 4 bytes read + 4 written per element.
  {
    const double ms = TimeMs([&] {
      BENCH_CHECK(GPU_STATUS(cudaMemcpyAsync(m, master, total * 4, cudaMemcpyDeviceToDevice)));
    });
    copy_gbps = 8.0 * total / (ms * 1e-3) / 1e9;
    report("d2d copy (cudaMemcpyAsync)", 8.0, ms, 0);
    BENCH_CHECK(GPU_STATUS(cudaMemcpy(m, v, total * 4, cudaMemcpyDeviceToDevice)));
  }

  // Places the buffers of direction d (0 rowwise, 1 columnwise) of one
  // [M, K] tensor in the output arenas at off_r / off_c (advanced, 256-byte
  // aligned); returns the bytes per element they hold.
  auto Place = [&](const QuantSpec& q, int d, DirectionBuffers& b, size_t& off_r, size_t& off_c) {
    const Layout l = *ComputeLayout(q, d == 0 ? Direction::kRowwise : Direction::kColumnwise, M, K);
    uint8_t* base = d == 0 ? out_row : out_col;
    size_t& off = d == 0 ? off_r : off_c;
    b.data = base + off;
    off += (l.data_bytes() + 255) / 256 * 256;
    if (l.scale_bytes() > 0) {
      b.scales = base + off;
      off += (l.scale_bytes() + 255) / 256 * 256;
    }
    return static_cast<double>(l.data_bytes() + l.scale_bytes()) / per;
  };

  // Quantize configurations.
  struct QCfg {
    std::string name;
    Format row, col;
    bool row_usage = true, col_usage = true;
    SourceDtype source = SourceDtype::kBf16;
    ColumnwiseSource cs = ColumnwiseSource::kOriginal;
    int variant = 0;
    double target = 0;
    int two_d = -1;  // -1: the format's default; 0 / 1: QuantSpec::two_d of both directions
  };
  const std::vector<QCfg> qcfgs = {
      {"fp8 per-tensor row+col^T (src bf16)", Format::kFp8Current, Format::kFp8Current, true, true,
       SourceDtype::kBf16, ColumnwiseSource::kOriginal, 0, 0.90},
      {"fp8 per-tensor row+col^T (src fp32)", Format::kFp8Current, Format::kFp8Current, true, true,
       SourceDtype::kFp32, ColumnwiseSource::kOriginal, 0, 0.90},
      {"fp8 per-tensor row only", Format::kFp8Current, Format::kFp8Current, true, false,
       SourceDtype::kBf16, ColumnwiseSource::kOriginal, 0, 0},
      {"fp8 per-tensor col^T only", Format::kFp8Current, Format::kFp8Current, false, true,
       SourceDtype::kBf16, ColumnwiseSource::kOriginal, 0, 0},
      {"mxfp8 row+col", Format::kMxfp8, Format::kMxfp8, true, true, SourceDtype::kBf16,
       ColumnwiseSource::kOriginal, 0, 0.90},
      {"nvfp4 16x16 row+col^T", Format::kNvfp4, Format::kNvfp4, true, true, SourceDtype::kBf16,
       ColumnwiseSource::kOriginal, 0, 0.90},
      {"nvfp4 16x16 row+col^T (per-element E2M1)", Format::kNvfp4, Format::kNvfp4, true, true,
       SourceDtype::kBf16, ColumnwiseSource::kOriginal, 4, 0},
      {"nvfp4 1x16 row+col^T", Format::kNvfp4, Format::kNvfp4, true, true, SourceDtype::kBf16,
       ColumnwiseSource::kOriginal, 0, 0.90, /*two_d=*/0},
      {"fp8 block 128x128 row+col^T", Format::kFp8Block128x128, Format::kFp8Block128x128, true,
       true, SourceDtype::kBf16, ColumnwiseSource::kOriginal, 0, 0.90},
      {"fp8 block 1x128 row+col^T", Format::kFp8Block1x128, Format::kFp8Block1x128, true, true,
       SourceDtype::kBf16, ColumnwiseSource::kOriginal, 0, 0.90},
      {"bf16 identity row", Format::kIdentityBf16, Format::kIdentityBf16, true, false,
       SourceDtype::kBf16, ColumnwiseSource::kOriginal, 0, 0},
      {"hybrid fp8 row + mxfp8 col (row_dequant)", Format::kFp8Current, Format::kMxfp8, true, true,
       SourceDtype::kBf16, ColumnwiseSource::kRowwiseDequantized, 0, 0.90},
      {"hybrid fp8 row + mxfp8 col", Format::kFp8Current, Format::kMxfp8, true, true,
       SourceDtype::kBf16, ColumnwiseSource::kOriginal, 0, 0.90},
      {"hybrid mxfp8 row + fp8 col^T", Format::kMxfp8, Format::kFp8Current, true, true,
       SourceDtype::kBf16, ColumnwiseSource::kOriginal, 0, 0.90},
      {"hybrid nvfp4 row + fp8 col^T", Format::kNvfp4, Format::kFp8Current, true, true,
       SourceDtype::kBf16, ColumnwiseSource::kOriginal, 0, 0.90},
  };
  for (const QCfg& c : qcfgs) {
    if (!want(c.name)) continue;
    HybridSpec h;
    h.rowwise = DefaultQuantSpec(c.row);
    h.columnwise = DefaultQuantSpec(c.col);
    if (c.two_d >= 0) h.rowwise.two_d = h.columnwise.two_d = c.two_d == 1;
    h.rowwise_usage = c.row_usage;
    h.columnwise_usage = c.col_usage;
    h.source_dtype = c.source;
    h.columnwise_source = c.cs;
    std::vector<QuantizeTensorArgs> args;
    double bytes = 4.0;  // input
    size_t off_r = 0, off_c = 0;
    for (int t = 0; t < T; ++t) {
      QuantizeTensorArgs a;
      a.source = master + t * per;
      a.rows = M;
      a.cols = K;
      a.spec = h;
      a.rowwise_scaling = {d_scale, d_A};
      a.columnwise_scaling = {d_scale, d_A};
      for (int d = 0; d < 2; ++d) {
        const bool used = d == 0 ? c.row_usage : c.col_usage;
        if (!used) continue;
        const double b = Place(d == 0 ? h.rowwise : h.columnwise, d,
                               d == 0 ? a.rowwise : a.columnwise, off_r, off_c);
        if (t == 0) bytes += b;
      }
      args.push_back(a);
    }
    QuantizeOptions opt;
    opt.variant = c.variant;
    const double ms = TimeMs([&] { BENCH_CHECK(QuantizeHybrid(args, nullptr, opt)); });
    report(c.name, bytes, ms, c.target);
  }

  // amax over the master (rounded to BF16).
  if (want("amax")) {
    std::vector<AmaxArgs> args;
    for (int t = 0; t < T; ++t) {
      AmaxArgs a;
      a.source = master + t * per;
      a.count = per;
      a.amax = amax_slots + t;
      args.push_back(a);
    }
    const double ms = TimeMs([&] { BENCH_CHECK(ComputeAmax(args, nullptr)); });
    report("amax (multi-tensor, src bf16)", 4.0, ms, 0);
  }
  // Per-block partial amaxes (ComputeBlockAmax) of the 8 tensors in one call.
  for (const AmaxBlockShape b :
       {AmaxBlockShape{16, 16}, AmaxBlockShape{1, 32}, AmaxBlockShape{128, 128}}) {
    const std::string name =
        absl::StrCat("block amax ", b.block_rows, "x", b.block_cols, " (src bf16)");
    if (!want(name)) continue;
    std::vector<BlockAmaxArgs> args;
    for (int t = 0; t < T; ++t) {
      BlockAmaxArgs a;
      a.source = master + t * per;
      a.rows = M;
      a.cols = K;
      a.blocks = b;
      args.push_back(a);
    }
    const int64_t n = PackBlockAmaxOffsets(absl::MakeSpan(args));
    float* out = reinterpret_cast<float*>(out_row);
    const double ms = TimeMs([&] { BENCH_CHECK(ComputeBlockAmax(args, out, n, nullptr)); });
    report(name, 4.0 + 4.0 * n / total, ms, 0.90);
  }

  // Optimizers: read p, m, v, g; write p, m, v = 28 bytes (SGD: 20).
  std::vector<OptimizerTensor> opt;
  for (int t = 0; t < T; ++t) {
    OptimizerTensor o;
    o.param = master + t * per;
    o.exp_avg = m + t * per;
    o.exp_avg_sq = v + t * per;
    o.grad = g + t * per;
    o.count = per;
    o.amax = amax_slots + t;
    opt.push_back(o);
  }
  AdamWHyper ah;
  ah.lr = 1e-6;
  ah.step = 10;
  double adam_no_amax_ms = 0;
  if (want("adamw")) {
    adam_no_amax_ms =
        TimeMs([&] { BENCH_CHECK(AdamWStep(opt, ah, nullptr, /*with_amax=*/false)); });
    report("adamw (no amax)", 28.0, adam_no_amax_ms, 0);
    const double ms = TimeMs([&] { BENCH_CHECK(AdamWStep(opt, ah, nullptr, /*with_amax=*/true)); });
    report("adamw + amax", 28.0, ms, 0.90);
    printf("  adamw + amax vs without: %+.2f%% (target within 3%%)\n",
           100.0 * (ms / adam_no_amax_ms - 1.0));
  }
  if (want("sgd")) {
    SgdHyper sh;
    sh.lr = 1e-6;
    std::vector<OptimizerTensor> sopt = opt;
    for (auto& o : sopt) o.exp_avg_sq = nullptr;
    const double ms = TimeMs([&] { BENCH_CHECK(SgdStep(sopt, sh, nullptr)); });
    report("sgd momentum + amax", 20.0, ms, 0);
  }
  // The one-pass step (AdamWStepAndQuantize): read p, m, v, g; write p, m, v
  // and both quantized directions, for formats whose scale is known before
  // the step.
  // The rows in parentheses are the same step with one thing changed in its
  // load (QuantizeVariant; the others use the default).
  struct FCfg {
    std::string name;
    Format fmt;
    int variant = 0;
  };
  for (const FCfg& c : std::vector<FCfg>{
           {"fused adamw + fp8 delayed row+col^T", Format::kFp8Delayed},
           {"fused adamw + mxfp8 row+col", Format::kMxfp8},
           {"fused adamw + fp8 block 128x128 row+col^T", Format::kFp8Block128x128},
           {"fused adamw + fp8 block 1x128 row+col^T", Format::kFp8Block1x128},
           {"fused adamw + bf16 row", Format::kIdentityBf16},
           {"fused adamw + fp8 delayed row+col^T (no prefetch)", Format::kFp8Delayed, 1},
           {"fused adamw + fp8 delayed row+col^T (prefetch 1)", Format::kFp8Delayed, 5},
           {"fused adamw + fp8 delayed row+col^T (evict-first)", Format::kFp8Delayed, 2},
           {"fused adamw + fp8 delayed row+col^T (evict-first, prefetch 2)", Format::kFp8Delayed,
            3},
           {"fused adamw + mxfp8 row+col (no prefetch)", Format::kMxfp8, 1},
           {"fused adamw + mxfp8 row+col (prefetch 1)", Format::kMxfp8, 5},
           {"fused adamw + mxfp8 row+col (evict-first)", Format::kMxfp8, 2},
           {"fused adamw + mxfp8 row+col (evict-first, prefetch 2)", Format::kMxfp8, 3}}) {
    if (!want(c.name)) continue;
    std::vector<AdamWQuantizeArgs> fargs;
    size_t off_r = 0, off_c = 0;
    double bytes = 28.0;
    for (int t = 0; t < T; ++t) {
      AdamWQuantizeArgs a;
      a.opt = opt[t];
      a.quant.rows = M;
      a.quant.cols = K;
      a.quant.spec.rowwise = DefaultQuantSpec(c.fmt);
      a.quant.spec.columnwise = DefaultQuantSpec(c.fmt);
      a.quant.spec.columnwise_usage = c.fmt != Format::kIdentityBf16;
      a.quant.rowwise_scaling.scale = d_scale;
      a.quant.columnwise_scaling.scale = d_scale;
      for (int d = 0; d < 2; ++d) {
        if (d == 1 && !a.quant.spec.columnwise_usage) continue;
        const double b = Place(DefaultQuantSpec(c.fmt), d,
                               d == 0 ? a.quant.rowwise : a.quant.columnwise, off_r, off_c);
        if (t == 0) bytes += b;
      }
      a.quant.rowwise.amax = amax_slots + 32 + t;
      fargs.push_back(a);
    }
    QuantizeOptions qo;
    qo.variant = c.variant;
    const double ms = TimeMs([&] { BENCH_CHECK(AdamWStepAndQuantize(fargs, ah, nullptr, qo)); });
    report(c.name, bytes, ms, 0.90);
  }

  // The publish step of FP8 current scaling (it needs the new master's
  // amax, so it reads the master twice): AdamW + amax, the scale, then FP8
  // row + col^T. Byte floor 28 + 4 + 2 = 34 B/elem.
  if (want("publish")) {
    float* cur_scale = scalars + 128;  // per tensor
    std::vector<CurrentScalingArgs> cs;
    std::vector<QuantizeTensorArgs> qargs;
    for (int t = 0; t < T; ++t) {
      CurrentScalingArgs c;
      c.amax = amax_slots + t;
      c.scale = cur_scale + t;
      c.spec = DefaultQuantSpec(Format::kFp8Current);
      cs.push_back(c);
      QuantizeTensorArgs q;
      q.source = master + t * per;
      q.rows = M;
      q.cols = K;
      q.spec.rowwise = DefaultQuantSpec(Format::kFp8Current);
      q.spec.columnwise = DefaultQuantSpec(Format::kFp8Current);
      q.rowwise_scaling.scale = cur_scale + t;
      q.columnwise_scaling.scale = cur_scale + t;
      q.rowwise.data = out_row + t * per;
      q.columnwise.data = out_col + t * per;
      q.rowwise.scale_inv = scalars + 256 + t;
      qargs.push_back(q);
    }
    const double ms = TimeMs([&] {
      BENCH_CHECK(GPU_STATUS(cudaMemsetAsync(amax_slots, 0, T * sizeof(float), nullptr)));
      BENCH_CHECK(AdamWStep(opt, ah, nullptr, /*with_amax=*/true));
      BENCH_CHECK(CurrentScalingUpdate(cs, nullptr));
      BENCH_CHECK(QuantizeHybrid(qargs, nullptr));
    });
    report("publish fp8 current: adamw+amax, scale, row+col^T", 34.0, ms, 0.90);
  }

  const std::string json = absl::GetFlag(FLAGS_json);
  if (!json.empty()) {
    FILE* f = fopen(json.c_str(), "w");
    if (f == nullptr) {
      fprintf(stderr, "cannot write %s\n", json.c_str());
      return 1;
    }
    fprintf(f,
            "{\n  \"device\": \"%s\",\n  \"sms\": %d,\n  \"params\": %lld,\n  \"copy_gbps\": "
            "%.1f,\n  \"one_pass_l2_prefetch\": %s,\n  \"kernels\": [\n",
            prop.name, prop.multiProcessorCount, static_cast<long long>(total), copy_gbps,
            tuning.l2_prefetch ? "true" : "false");
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      fprintf(f,
              "    {\"name\": \"%s\", \"bytes_per_elem\": %.4f, \"ms\": %.4f, \"gbps\": %.1f, "
              "\"ratio_to_copy\": %.4f, \"target\": %.2f}%s\n",
              r.name.c_str(), r.bytes_per_elem, r.ms, r.gbps, r.ratio, r.target,
              i + 1 < results.size() ? "," : "");
    }
    fprintf(f, "  ]\n}\n");
    fclose(f);
  }
  printf("\n%-46s %9s %9s %10s %7s %7s\n", "kernel", "B/elem", "ms", "GB/s", "ratio", "target");
  for (const Result& r : results) {
    printf("%-46s %9.4f %9.3f %10.1f %7.3f %7s\n", r.name.c_str(), r.bytes_per_elem, r.ms, r.gbps,
           r.ratio, r.target > 0 ? absl::StrFormat("%.2f", r.target).c_str() : "-");
  }
  return 0;
}

}  // namespace
}  // namespace gpu
}  // namespace paramd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return paramd::gpu::Run();
}
