// //deploy/gpu_trainer:gpu_trainer — a small GPU training example over the
// GPU daemon and the NCCL data plane. One process, two GPUs: the
// daemon (GPU 0) keeps FP32 masters and AdamW state of a 2-layer linear
// network and publishes hybrid-quantized weights every step; the trainer
// (GPU 1) fetches exactly the directions it uses into its device memory:
//   forward   h = x W1^T, y = h W2^T   from the ROWWISE copies
//   dgrad     dh = dy W2               from W2's COLUMNWISE copy
// With per-tensor FP8 (--format=fp8, default) both are cuBLASLt FP8 GEMMs
// (TN, E4M3 x E4M3 -> FP32, scale_inv pointers), the columnwise copy being
// the transposed [K][M] FP8 buffer. MXFP8 / NVFP4 / blockwise directions are
// dequantized to BF16 (kernels/cuda/dequantize.h) for a BF16 GEMM, as Hopper
// has no GEMM for them. Weight gradients are FP32 GEMMs, pushed to the
// daemon as FP32 over NCCL. The task: regress a random teacher network; the
// MSE loss falls (--check: exit 1 unless final < initial / 20 and, for
// --format=fp8, the FP8 GEMMs ran).
//
// With --coordinator=HOST:PORT the daemon is a real `hybrid-paramd
// --backend=gpu` process instead (start it with --expected_pushers=1 and
// the same --lr): the trainer (GPU --device) writes the initial weights to
// a safetensors file and Loads them, then every step device-fetches the
// directions it uses through the client library (gpu_fetch::DeviceFetcher:
// the fetch of version v+1 waits on the daemon for the step) and pushes its
// FP32 gradients with Client::PushGradients.
#include <unistd.h>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/gpu_fetch/device_fetcher.h"
#include "client/gpu_fetch/fetch.h"
#include "common/gpu_status.h"
#include "common/status_macros.h"
#include "deploy/gpu_trainer/kernels.h"
#include "kernels/cuda/amax.h"
#include "kernels/cuda/dequantize.h"
#include "kernels/cuda/quantize.h"
#include "kernels/cuda/scaling.h"
#include "kernels/format.h"
#include "safetensors/safetensors.h"
#include "server/gpu_backend/fetch_server.h"
#include "server/gpu_backend/shard_store.h"
#include "transport/nccl_transport.h"

ABSL_FLAG(std::string, format, "fp8", "weight format: fp8 (current scaling), mxfp8, nvfp4, block");
ABSL_FLAG(int, steps, 200, "training steps");
ABSL_FLAG(int, batch, 256, "batch size (multiple of 16)");
ABSL_FLAG(int, in, 512, "input width (multiple of 16)");
ABSL_FLAG(int, hidden, 512, "hidden width (multiple of 16)");
ABSL_FLAG(int, out, 256, "output width (multiple of 16)");
ABSL_FLAG(double, lr, 3e-3, "AdamW learning rate");
ABSL_FLAG(bool, check, false, "exit 1 unless the loss fell 20x");
ABSL_FLAG(std::string, coordinator, "",
          "train against real hybrid-paramd daemons at this coordinator (empty: an in-process "
          "daemon on GPU 0)");
ABSL_FLAG(int, device, 1, "with --coordinator: the trainer's GPU");

namespace paramd {
namespace {

using gpu_backend::FetchItem;
using gpu_fetch::DeviceDirection;

absl::Time In(absl::Duration d) { return absl::Now() + d; }

std::vector<float> Random(size_t n, uint32_t seed, float scale) {
  std::vector<float> v(n);
  uint32_t x = seed * 2891336453u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = ((static_cast<int32_t>(x >> 8) - (1 << 23)) * (1.0f / (1 << 23))) * scale;
  }
  return v;
}

absl::StatusOr<float*> Upload(const std::vector<float>& v) {
  float* d = nullptr;
  GPU_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&d), v.size() * 4));
  GPU_RETURN_IF_ERROR(cudaMemcpy(d, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  return d;
}

absl::StatusOr<void*> DeviceAlloc(size_t bytes) {
  void* d = nullptr;
  GPU_RETURN_IF_ERROR(cudaMalloc(&d, bytes));
  GPU_RETURN_IF_ERROR(cudaMemset(d, 0, bytes));
  return d;
}

// Column-major cuBLASLt GEMM D[m][n] = alpha op(A) op(B), FP32 output.
struct Gemm {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = size_t{32} << 20;

  absl::Status Init() {
    GPU_RETURN_IF_ERROR(cublasLtCreate(&handle));
    GPU_RETURN_IF_ERROR(cudaMalloc(&workspace, workspace_bytes));
    return absl::OkStatus();
  }

  // a: rows_a x cols_a stored column-major (lda = rows_a); same for b.
  // FP8 inputs write BF16 (the combination cuBLASLt supports on Hopper;
  // FP32 output was refused with NOT_SUPPORTED on the H200) into a scratch
  // buffer that is then widened to FP32.
  absl::Status Run(bool ta, bool tb, int m, int n, int k, cudaDataType_t type, const void* a,
                   int lda, const float* a_scale, const void* b, int ldb, const float* b_scale,
                   float* d, int ldd, cudaStream_t stream) {
    if (type != CUDA_R_8F_E4M3) {
      return RunTyped(ta, tb, m, n, k, type, a, lda, a_scale, b, ldb, b_scale, CUDA_R_32F, d, ldd,
                      stream);
    }
    const size_t need = size_t{2} * ldd * n;
    if (scratch_bytes < need) {
      if (scratch != nullptr) cudaFree(scratch);
      scratch = nullptr;
      scratch_bytes = 0;
      GPU_RETURN_IF_ERROR(cudaMalloc(&scratch, need));
      scratch_bytes = need;
    }
    if (alpha_dev == nullptr) {
      GPU_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&alpha_dev), 2 * sizeof(float)));
      GPU_RETURN_IF_ERROR(cudaMemset(alpha_dev, 0, 2 * sizeof(float)));
    }
    GPU_RETURN_IF_ERROR(gpu_trainer::LaunchScaleProduct(a_scale, b_scale, alpha_dev, stream));
    absl::Status s = absl::UnimplementedError("");
    if (device_alpha) {
      s = RunTyped(ta, tb, m, n, k, type, a, lda, nullptr, b, ldb, nullptr, CUDA_R_16BF, scratch,
                   ldd, stream, alpha_dev, 1.0f);
      if (s.code() == absl::StatusCode::kUnimplemented) {
        std::printf("FP8 GEMM with a device alpha refused (%s); reading alpha to the host\n",
                    s.ToString().c_str());
        device_alpha = false;
      }
    }
    if (!device_alpha) {
      float host_alpha = 1.0f;
      GPU_RETURN_IF_ERROR(
          cudaMemcpyAsync(&host_alpha, alpha_dev, sizeof(float), cudaMemcpyDeviceToHost, stream));
      GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
      s = RunTyped(ta, tb, m, n, k, type, a, lda, nullptr, b, ldb, nullptr, CUDA_R_16BF, scratch,
                   ldd, stream, nullptr, host_alpha);
    }
    RETURN_IF_ERROR(s);
    GPU_RETURN_IF_ERROR(gpu_trainer::LaunchFromBf16(scratch, d, int64_t{ldd} * n, stream));
    return absl::OkStatus();
  }

  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  void* c_scratch = nullptr;
  size_t c_scratch_bytes = 0;
  // FP8: alpha = scale_inv(A) * scale_inv(B) in device memory (cuBLASLt
  // 13.1 on the H200 refused every FP8 algorithm once A/B scale pointers
  // were set, and ran them without), else read to the host.
  float* alpha_dev = nullptr;  // [0] alpha, [1] beta = 0
  bool device_alpha = true;

  absl::Status RunTyped(bool ta, bool tb, int m, int n, int k, cudaDataType_t type, const void* a,
                        int lda, const float* a_scale, const void* b, int ldb, const float* b_scale,
                        cudaDataType_t out_type, void* d, int ldd, cudaStream_t stream,
                        const float* device_alpha_beta = nullptr, float host_alpha = 1.0f) {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    absl::Status s = [&]() -> absl::Status {
      GPU_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
      GPU_RETURN_IF_ERROR(
          cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
      GPU_RETURN_IF_ERROR(
          cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
      if (a_scale != nullptr) {
        GPU_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
            desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale)));
      }
      if (b_scale != nullptr) {
        GPU_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
            desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale)));
      }
      const float host_values[2] = {host_alpha, 0.0f};
      const float* alpha = host_values;
      const float* beta = host_values + 1;
      if (device_alpha_beta != nullptr) {
        const cublasLtPointerMode_t mode = CUBLASLT_POINTER_MODE_DEVICE;
        GPU_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_POINTER_MODE,
                                                           &mode, sizeof(mode)));
        alpha = device_alpha_beta;
        beta = device_alpha_beta + 1;
      }
      GPU_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&la, type, ta ? k : m, ta ? m : k, lda));
      GPU_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&lb, type, tb ? n : k, tb ? k : n, ldb));
      GPU_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&ld, out_type, m, n, ldd));
      GPU_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&pref));
      GPU_RETURN_IF_ERROR(
          cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                               &workspace_bytes, sizeof(workspace_bytes)));
      cublasLtMatmulHeuristicResult_t results[8];
      int found = 0;
      GPU_RETURN_IF_ERROR(
          cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, ld, ld, pref, 8, results, &found));
      // C must not alias D for some FP8 kernels: give FP8 a separate C.
      void* c = d;
      if (type == CUDA_R_8F_E4M3) {
        const size_t need = size_t{2} * ldd * n;
        if (c_scratch_bytes < need) {
          if (c_scratch != nullptr) cudaFree(c_scratch);
          c_scratch = nullptr;
          c_scratch_bytes = 0;
          GPU_RETURN_IF_ERROR(cudaMalloc(&c_scratch, need));
          c_scratch_bytes = need;
        }
        c = c_scratch;
      }
      // The first algorithm that runs (cuBLASLt's advice: try them in turn).
      absl::Status last = absl::UnimplementedError(
          absl::StrCat("no cuBLASLt algorithm for type ", type, " m ", m, " n ", n, " k ", k));
      for (int i = 0; i < found; ++i) {
        last = GPU_STATUS(cublasLtMatmul(handle, desc, alpha, a, la, b, lb, beta, c, ld, d, ld,
                                         &results[i].algo, workspace, workspace_bytes, stream));
        if (last.ok()) return last;
      }
      return absl::Status(
          last.code(), absl::StrCat(last.message(), " (", found, " algorithms tried, m ", m, " n ",
                                    n, " k ", k, ")"));
    }();
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (desc) cublasLtMatmulDescDestroy(desc);
    return s;
  }
};

// FP8 current-scaling quantization of a trainer activation [rows][cols]
// (row-major) with the issue-3 kernels: amax, scale, cast.
struct Fp8Activation {
  int64_t rows = 0, cols = 0;
  float* amax = nullptr;
  float* scale = nullptr;
  float* scale_inv = nullptr;
  void* data = nullptr;

  absl::Status Init(int64_t r, int64_t c) {
    rows = r;
    cols = c;
    ASSIGN_OR_RETURN(void* scalars, DeviceAlloc(256));
    amax = static_cast<float*>(scalars);
    scale = amax + 1;
    scale_inv = amax + 2;
    ASSIGN_OR_RETURN(data, DeviceAlloc(r * c));
    return absl::OkStatus();
  }

  absl::Status Quantize(const float* source, cudaStream_t stream) {
    gpu::AmaxArgs a;
    a.source = source;
    a.count = rows * cols;
    a.source_dtype = SourceDtype::kFp32;
    a.amax = amax;
    RETURN_IF_ERROR(gpu::ComputeAmax({a}, stream, /*zero_first=*/true));
    gpu::CurrentScalingArgs c;
    c.amax = amax;
    c.scale = scale;
    c.scale_inv = scale_inv;
    c.spec = DefaultQuantSpec(Format::kFp8Current);
    RETURN_IF_ERROR(gpu::CurrentScalingUpdate({c}, stream));
    gpu::QuantizeTensorArgs q;
    q.source = source;
    q.rows = rows;
    q.cols = cols;
    q.spec.rowwise = DefaultQuantSpec(Format::kFp8Current);
    q.spec.source_dtype = SourceDtype::kFp32;
    q.spec.rowwise.source_dtype = SourceDtype::kFp32;
    q.spec.columnwise_usage = false;
    q.rowwise_scaling.scale = scale;
    q.rowwise.data = data;
    return gpu::QuantizeHybrid({q}, stream);
  }
};

HybridSpec WeightSpec(const std::string& name) {
  Format f = Format::kFp8Current;
  if (name == "mxfp8") f = Format::kMxfp8;
  if (name == "nvfp4") f = Format::kNvfp4;
  if (name == "block") f = Format::kFp8Block128x128;
  HybridSpec spec;
  spec.rowwise = DefaultQuantSpec(f);
  spec.columnwise = DefaultQuantSpec(f);
  return spec;
}

// How the trainer gets its weights and gives its gradients: `fetch` fills
// `dst` with {w1 rowwise, w2 rowwise, w2 columnwise} of version `step`;
// `push` sends the FP32 gradients of step `step` (device pointers; the
// trainer's stream is synchronised).
struct TrainerIo {
  int device = 1;
  std::function<absl::Status(int step, std::vector<DeviceDirection>* dst)> fetch;
  std::function<absl::Status(int step, const float* g1, const float* g2)> push;
};

absl::Status Train(const TrainerIo& io, const HybridSpec& spec, bool fp8, int B, int I, int H,
                   int O, int steps, std::vector<float>& losses, bool& fp8_gemms_used) {
  cudaSetDevice(io.device);
  cudaStream_t stream;
  GPU_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Gemm gemm;
  RETURN_IF_ERROR(gemm.Init());
  std::vector<DeviceDirection> dst;  // filled by io.fetch
  // Teacher weights and the dequantized BF16 copies (non-FP8 formats).
  ASSIGN_OR_RETURN(float* t1, Upload(Random(static_cast<size_t>(H) * I, 11, 1.0f / std::sqrt(I))));
  ASSIGN_OR_RETURN(float* t2, Upload(Random(static_cast<size_t>(O) * H, 12, 1.0f / std::sqrt(H))));
  ASSIGN_OR_RETURN(void* w_bf16_0, DeviceAlloc(static_cast<size_t>(H) * I * 2));
  ASSIGN_OR_RETURN(void* w_bf16_1, DeviceAlloc(static_cast<size_t>(O) * H * 2));
  ASSIGN_OR_RETURN(void* w_bf16_1c, DeviceAlloc(static_cast<size_t>(O) * H * 2));
  ASSIGN_OR_RETURN(void* act_bf16, DeviceAlloc(static_cast<size_t>(B) * std::max({I, H, O}) * 2));
  ASSIGN_OR_RETURN(
      void* mem, DeviceAlloc(static_cast<size_t>(B) * (I + 3 * H + 4 * O) * 4 +
                             (static_cast<size_t>(H) * I + static_cast<size_t>(O) * H) * 4 + 256));
  float* x = static_cast<float*>(mem);
  float* h = x + static_cast<size_t>(B) * I;
  float* dh = h + static_cast<size_t>(B) * H;
  float* th = dh + static_cast<size_t>(B) * H;
  float* y = th + static_cast<size_t>(B) * H;
  float* t = y + static_cast<size_t>(B) * O;
  float* dy = t + static_cast<size_t>(B) * O;
  float* g1 = dy + static_cast<size_t>(B) * O;
  float* g2 = g1 + static_cast<size_t>(H) * I;
  float* loss = g2 + static_cast<size_t>(O) * H;
  Fp8Activation x8, h8, dy8;
  RETURN_IF_ERROR(x8.Init(B, I));
  RETURN_IF_ERROR(h8.Init(B, H));
  RETURN_IF_ERROR(dy8.Init(B, O));
  const cudaDataType_t kE4M3 = CUDA_R_8F_E4M3, kBf16 = CUDA_R_16BF, kF32 = CUDA_R_32F;

  auto dequant = [&](const DeviceDirection& d, const QuantSpec& q, Direction dir, int64_t rows,
                     int64_t cols, void* out) -> absl::Status {
    gpu::DequantizeArgs a;
    a.spec = q;
    a.direction = dir;
    a.rows = rows;
    a.cols = cols;
    a.data = d.data;
    a.scales = d.scales;
    a.scale_inv = d.scale_inv;
    a.global_amax = d.amax;
    a.out = out;
    a.output_type = gpu::OutputType::kBf16;
    return gpu::Dequantize({a}, stream);
  };
  // Y[b][m] = X[b][k] W[m][k]^T: column-major D (m x b) = op(A) (m x k) * X_cm (k x b).
  auto forward = [&](int w, const float* in, int k, int m, Fp8Activation& q, float* out,
                     bool use_fp8) -> absl::Status {
    if (use_fp8) {
      RETURN_IF_ERROR(q.Quantize(in, stream));
      return gemm.Run(true, false, m, B, k, kE4M3, dst[w].data, k, dst[w].scale_inv, q.data, k,
                      q.scale_inv, out, m, stream);
    }
    void* wb = w == 0 ? w_bf16_0 : w_bf16_1;
    GPU_RETURN_IF_ERROR(gpu_trainer::LaunchToBf16(in, act_bf16, int64_t{B} * k, stream));
    return gemm.Run(true, false, m, B, k, kBf16, wb, k, nullptr, act_bf16, k, nullptr, out, m,
                    stream);
  };

  bool fp8_gemm = fp8;
  for (int step = 0; step < steps; ++step) {
    RETURN_IF_ERROR(io.fetch(step, &dst));
    if (!fp8_gemm) {
      RETURN_IF_ERROR(dequant(dst[0], spec.rowwise, Direction::kRowwise, H, I, w_bf16_0));
      RETURN_IF_ERROR(dequant(dst[1], spec.rowwise, Direction::kRowwise, O, H, w_bf16_1));
      RETURN_IF_ERROR(dequant(dst[2], spec.columnwise, Direction::kColumnwise, O, H, w_bf16_1c));
    }
    // A fresh batch and its teacher targets (FP32 GEMMs).
    std::vector<float> xb = Random(static_cast<size_t>(B) * I, 1000 + step, 1.0f);
    GPU_RETURN_IF_ERROR(
        cudaMemcpyAsync(x, xb.data(), xb.size() * 4, cudaMemcpyHostToDevice, stream));
    RETURN_IF_ERROR(
        gemm.Run(true, false, H, B, I, kF32, t1, I, nullptr, x, I, nullptr, th, H, stream));
    RETURN_IF_ERROR(
        gemm.Run(true, false, O, B, H, kF32, t2, H, nullptr, th, H, nullptr, t, O, stream));
    // Forward from the fetched rowwise copies.
    absl::Status fwd = forward(0, x, I, H, x8, h, fp8_gemm);
    if (!fwd.ok() && fp8_gemm && fwd.code() == absl::StatusCode::kUnimplemented) {
      std::printf("FP8 GEMM refused by cuBLASLt (%s): falling back to dequantized BF16 GEMMs\n",
                  fwd.ToString().c_str());
      fp8_gemm = false;
      RETURN_IF_ERROR(dequant(dst[0], spec.rowwise, Direction::kRowwise, H, I, w_bf16_0));
      RETURN_IF_ERROR(dequant(dst[1], spec.rowwise, Direction::kRowwise, O, H, w_bf16_1));
      RETURN_IF_ERROR(dequant(dst[2], spec.columnwise, Direction::kColumnwise, O, H, w_bf16_1c));
      fwd = forward(0, x, I, H, x8, h, fp8_gemm);
    }
    RETURN_IF_ERROR(fwd);
    RETURN_IF_ERROR(forward(1, h, H, O, h8, y, fp8_gemm));
    GPU_RETURN_IF_ERROR(cudaMemsetAsync(loss, 0, 4, stream));
    GPU_RETURN_IF_ERROR(gpu_trainer::LaunchMseGrad(y, t, dy, loss, int64_t{B} * O, stream));
    // dgrad dh[b][H] = dy[b][O] W2[O][H]: D (H x b) = op(A) (H x O) * dy_cm (O x b).
    if (fp8_gemm) {
      // Columnwise FP8 is W2^T stored [H][O] = column-major O x H: op T.
      RETURN_IF_ERROR(dy8.Quantize(dy, stream));
      RETURN_IF_ERROR(gemm.Run(true, false, H, B, O, kE4M3, dst[2].data, O, dst[2].scale_inv,
                               dy8.data, O, dy8.scale_inv, dh, H, stream));
    } else {
      // Dequantized columnwise copy in logical [O][H] = column-major H x O: op N.
      GPU_RETURN_IF_ERROR(gpu_trainer::LaunchToBf16(dy, act_bf16, int64_t{B} * O, stream));
      RETURN_IF_ERROR(gemm.Run(false, false, H, B, O, kBf16, w_bf16_1c, H, nullptr, act_bf16, O,
                               nullptr, dh, H, stream));
    }
    // wgrad (FP32): dW2[O][H] = dy^T h: column-major D (H x O) = h_cm (H x b) * dy_cm^T.
    RETURN_IF_ERROR(
        gemm.Run(false, true, H, O, B, kF32, h, H, nullptr, dy, O, nullptr, g2, H, stream));
    RETURN_IF_ERROR(
        gemm.Run(false, true, I, H, B, kF32, x, I, nullptr, dh, H, nullptr, g1, I, stream));
    GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    float l = 0;
    GPU_RETURN_IF_ERROR(cudaMemcpy(&l, loss, 4, cudaMemcpyDeviceToHost));
    losses.push_back(l);
    if (step % 20 == 0 || step == steps - 1) std::printf("step %4d  loss %.6f\n", step, l);
    fp8_gemms_used = fp8_gemm;
    RETURN_IF_ERROR(io.push(step, g1, g2));
  }
  return absl::OkStatus();
}

// The network and run of the flags.
struct Shape {
  int B, I, H, O, steps;
  HybridSpec spec;
  bool fp8;
};
Shape ShapeFromFlags() {
  Shape s{absl::GetFlag(FLAGS_batch),
          absl::GetFlag(FLAGS_in),
          absl::GetFlag(FLAGS_hidden),
          absl::GetFlag(FLAGS_out),
          absl::GetFlag(FLAGS_steps),
          WeightSpec(absl::GetFlag(FLAGS_format)),
          false};
  s.fp8 = s.spec.rowwise.format == Format::kFp8Current;
  return s;
}

std::string RecipeFormat(Format f) {
  switch (f) {
    case Format::kMxfp8:
      return "MXFP8";
    case Format::kNvfp4:
      return "NVFP4";
    case Format::kFp8Block128x128:
      return "FP8_BLOCK_128X128";
    default:
      return "FP8_CURRENT";
  }
}

int Report(const std::vector<float>& losses, bool fp8, bool fp8_gemms_used, int steps,
           const char* where) {
  const float first = losses.front(), last = losses.back();
  std::printf("format %s (%s GEMMs, %s): loss %.6f -> %.6f (%.1fx lower) in %d steps\n",
              absl::GetFlag(FLAGS_format).c_str(), fp8_gemms_used ? "FP8" : "BF16", where, first,
              last, first / last, steps);
  if (absl::GetFlag(FLAGS_check) && !(last < first / 20)) {
    std::printf("CHECK FAILED: loss did not fall 20x\n");
    return 1;
  }
  if (absl::GetFlag(FLAGS_check) && fp8 && !fp8_gemms_used) {
    std::printf("CHECK FAILED: FP8 weights were not consumed by FP8 GEMMs\n");
    return 1;
  }
  return 0;
}

// Against real daemons (--coordinator): Load, then device fetch + push.
int RunWithDaemons() {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  const Shape sh = ShapeFromFlags();
  const int B = sh.B, I = sh.I, H = sh.H, O = sh.O, steps = sh.steps;
  const HybridSpec spec = sh.spec;
  const bool fp8 = sh.fp8;
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  };
  client::ClientOptions options;
  options.coordinator_address = absl::GetFlag(FLAGS_coordinator);
  options.pusher = true;
  options.name = "gpu_trainer";
  absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(options);
  if (!c.ok()) return fail(c.status());
  client::Client& cl = **c;
  // The initial weights, as the in-process run draws them.
  const std::string path = absl::StrCat("/tmp/gpu_trainer_", getpid(), ".safetensors");
  {
    const std::vector<float> w1 = Random(static_cast<size_t>(H) * I, 1, 1.0f / std::sqrt(I));
    const std::vector<float> w2 = Random(static_cast<size_t>(O) * H, 2, 1.0f / std::sqrt(H));
    absl::StatusOr<std::unique_ptr<safetensors::SafetensorsWriter>> w =
        safetensors::SafetensorsWriter::Create(path, {{"w1", safetensors::Dtype::kF32, {H, I}},
                                                      {"w2", safetensors::Dtype::kF32, {O, H}}});
    if (!w.ok()) return fail(w.status());
    for (const auto& [name, v] : {std::make_pair("w1", &w1), std::make_pair("w2", &w2)}) {
      absl::Status s = (*w)->WriteTensor(
          name, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(v->data()), v->size() * 4));
      if (!s.ok()) return fail(s);
    }
    absl::Status s = (*w)->Finish();
    if (!s.ok()) return fail(s);
  }
  const std::string f = RecipeFormat(spec.rowwise.format);
  absl::StatusOr<int64_t> v0 = cl.Load(
      path,
      absl::StrCat("default_spec { rowwise { format: ", f, " } columnwise { format: ", f, " } }"),
      absl::Seconds(60));
  unlink(path.c_str());
  if (!v0.ok()) return fail(v0.status());
  gpu_fetch::DeviceFetcherOptions fo;
  fo.device = absl::GetFlag(FLAGS_device);
  fo.name = "gpu_trainer";
  absl::StatusOr<std::unique_ptr<gpu_fetch::DeviceFetcher>> fetcher =
      gpu_fetch::DeviceFetcher::Create(&cl, fo);
  if (!fetcher.ok()) return fail(fetcher.status());
  TrainerIo io;
  io.device = fo.device;
  double fetch_ms = 0;
  io.fetch = [&](int step, std::vector<DeviceDirection>* dst) -> absl::Status {
    const absl::Time start = absl::Now();
    ASSIGN_OR_RETURN(gpu_fetch::DeviceFetchResult r,
                     (*fetcher)->Fetch(*v0 + step, {{"w1", Direction::kRowwise, {}},
                                                    {"w2", Direction::kRowwise, {}},
                                                    {"w2", Direction::kColumnwise, {}}}));
    fetch_ms += absl::ToDoubleMilliseconds(absl::Now() - start);
    dst->clear();
    for (const gpu_fetch::DeviceFetched& t : r.tensors) dst->push_back(t.buffers);
    return absl::OkStatus();
  };
  std::vector<float> g1h(static_cast<size_t>(H) * I), g2h(static_cast<size_t>(O) * H);
  io.push = [&](int step, const float* g1, const float* g2) -> absl::Status {
    GPU_RETURN_IF_ERROR(cudaMemcpy(g1h.data(), g1, g1h.size() * 4, cudaMemcpyDeviceToHost));
    GPU_RETURN_IF_ERROR(cudaMemcpy(g2h.data(), g2, g2h.size() * 4, cudaMemcpyDeviceToHost));
    return cl
        .PushGradients(*v0 + step,
                       {client::Gradient::Fp32("w1", g1h), client::Gradient::Fp32("w2", g2h)})
        .status();
  };
  std::vector<float> losses;
  bool fp8_gemms_used = false;
  absl::Status s = Train(io, spec, fp8, B, I, H, O, steps, losses, fp8_gemms_used);
  if (!s.ok()) return fail(s);
  std::printf("device fetch through the daemon: %.3f ms per step (incl. waiting for the step)\n",
              fetch_ms / steps);
  return Report(losses, fp8, fp8_gemms_used, steps, "real daemons");
}

int Run() {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  const Shape sh = ShapeFromFlags();
  const int B = sh.B, I = sh.I, H = sh.H, O = sh.O, steps = sh.steps;
  const HybridSpec spec = sh.spec;
  const bool fp8 = sh.fp8;
  int gpus = 0;
  cudaGetDeviceCount(&gpus);
  if (gpus < 2) {
    std::fprintf(stderr, "needs 2 GPUs\n");
    return 1;
  }
  // ---- world: daemon rank 0 on GPU 0, trainer rank 1 on GPU 1 ----
  std::vector<std::unique_ptr<TransportEndpoint>> endpoints;
  std::vector<std::string> addresses;
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    absl::StatusOr<std::unique_ptr<TransportEndpoint>> e = OpenNcclEndpoint();
    if (!e.ok()) {
      std::fprintf(stderr, "%s\n", e.status().ToString().c_str());
      return 1;
    }
    addresses.push_back((*e)->address());
    endpoints.push_back(*std::move(e));
  }
  std::vector<std::unique_ptr<Transport>> world(2);
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        absl::StatusOr<std::unique_ptr<Transport>> t = endpoints[r]->Connect(r, addresses);
        if (t.ok()) world[r] = *std::move(t);
      });
    }
    for (auto& t : threads) t.join();
  }
  if (!world[0] || !world[1]) {
    std::fprintf(stderr, "connect failed\n");
    return 1;
  }
  NcclTransport& daemon_t = *AsNcclTransport(world[0].get());
  NcclTransport& trainer_t = *AsNcclTransport(world[1].get());

  // ---- daemon ----
  cudaSetDevice(0);
  gpu_backend::GpuStoreOptions options;
  options.device = 0;
  options.adamw.lr = absl::GetFlag(FLAGS_lr);
  options.adamw.weight_decay = 0.0;
  options.push_staging_buffers = 1;
  options.push_staging_element_bytes = 4;
  absl::StatusOr<std::unique_ptr<gpu_backend::GpuShardStore>> store_or =
      gpu_backend::GpuShardStore::Create({{"w1", H, I, spec}, {"w2", O, H, spec}}, options);
  if (!store_or.ok()) {
    std::fprintf(stderr, "%s\n", store_or.status().ToString().c_str());
    return 1;
  }
  gpu_backend::GpuShardStore& store = **store_or;
  {
    std::vector<float> w1 = Random(static_cast<size_t>(H) * I, 1, 1.0f / std::sqrt(I));
    std::vector<float> w2 = Random(static_cast<size_t>(O) * H, 2, 1.0f / std::sqrt(H));
    cudaMemcpy(store.master(0), w1.data(), w1.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(store.master(1), w2.data(), w2.size() * 4, cudaMemcpyHostToDevice);
  }
  absl::Status init = store.Step(0, false, nullptr, In(absl::Seconds(30)));
  if (!init.ok()) {
    std::fprintf(stderr, "%s\n", init.ToString().c_str());
    return 1;
  }
  std::printf("daemon: %lld parameters, %.2f device bytes per parameter\n",
              static_cast<long long>(store.parameters()), store.bytes_per_parameter());
  const std::vector<FetchItem> items = {
      {0, Direction::kRowwise}, {1, Direction::kRowwise}, {1, Direction::kColumnwise}};

  std::vector<float> losses;
  bool fp8_gemms_used = false;
  absl::Status trainer_status, daemon_status;
  std::thread daemon_thread([&] {
    cudaSetDevice(0);
    daemon_status = [&]() -> absl::Status {
      for (int step = 0; step < steps; ++step) {
        const uint64_t tag = 1000 + 10 * step;
        RETURN_IF_ERROR(gpu_backend::ServeFetch(daemon_t, 1, tag, store, step, items, false,
                                                In(absl::Seconds(30))));
        for (int w = 0; w < 2; ++w) {
          const size_t bytes = store.shards()[w].rows * store.shards()[w].cols * 4;
          RETURN_IF_ERROR(daemon_t.RecvDevice(1, tag + 1 + w, {{store.push_staging(0), bytes}},
                                              In(absl::Seconds(30))));
          RETURN_IF_ERROR(store.Accumulate(w, store.push_staging(0), /*bf16=*/false));
          GPU_RETURN_IF_ERROR(cudaStreamSynchronize(store.stream()));
        }
        RETURN_IF_ERROR(store.Step(step + 1, true, nullptr, In(absl::Seconds(30))));
      }
      return absl::OkStatus();
    }();
  });

  // ---- trainer ----
  gpu_fetch::DevicePool pool(1);
  TrainerIo io;
  io.device = 1;
  io.fetch = [&](int step, std::vector<DeviceDirection>* dst) -> absl::Status {
    if (dst->empty()) {
      for (const FetchItem& item : items) {
        const auto& s = store.shards()[item.shard];
        ASSIGN_OR_RETURN(
            Layout layout,
            ComputeLayout(item.direction == Direction::kRowwise ? spec.rowwise : spec.columnwise,
                          item.direction, s.rows, s.cols));
        ASSIGN_OR_RETURN(DeviceDirection d, pool.Allocate(layout));
        dst->push_back(d);
      }
    }
    return gpu_fetch::FetchDirections(trainer_t, 0, 1000 + 10 * step, *dst, In(absl::Seconds(30)));
  };
  io.push = [&](int step, const float* g1, const float* g2) -> absl::Status {
    const uint64_t tag = 1000 + 10 * step;
    RETURN_IF_ERROR(trainer_t.SendDevice(0, tag + 1, {{g1, static_cast<size_t>(H) * I * 4}},
                                         nullptr, In(absl::Seconds(30))));
    return trainer_t.SendDevice(0, tag + 2, {{g2, static_cast<size_t>(O) * H * 4}}, nullptr,
                                In(absl::Seconds(30)));
  };
  trainer_status = Train(io, spec, fp8, B, I, H, O, steps, losses, fp8_gemms_used);
  if (!trainer_status.ok()) world[1]->Shutdown();  // unblocks the daemon
  daemon_thread.join();
  if (!trainer_status.ok() || !daemon_status.ok()) {
    std::fprintf(stderr, "trainer: %s\ndaemon: %s\n", trainer_status.ToString().c_str(),
                 daemon_status.ToString().c_str());
    return 1;
  }
  return Report(losses, fp8, fp8_gemms_used, steps, "in-process daemon");
}

}  // namespace
}  // namespace paramd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (!absl::GetFlag(FLAGS_coordinator).empty()) return paramd::RunWithDaemons();
  return paramd::Run();
}
