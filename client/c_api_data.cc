// The C API's data path (client/c_api.h): hpd_fetch and hpd_fetch_device
// (into the caller's host or device buffers), hpd_push_gradients(_ex)
// (from host or device memory). Device calls go through one
// gpu_fetch::DeviceFetcher per CUDA device of the handle, built with
// --config=cuda only; a CPU build answers UNIMPLEMENTED with the way out.
#define HPD_BUILDING_LIBRARY 1
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "client/c_api.h"
#include "client/c_api_internal.h"
#include "client/client.h"
#include "common/status_macros.h"
#include "kernels/format.h"

namespace paramd {
namespace {

using capi::NullArgument;
using capi::ParseDirection;
using capi::Timeout;

absl::StatusOr<client::Gradient::DType> ParseGradDtype(int32_t d) {
  if (d == HPD_GRAD_FP32) return client::Gradient::DType::kFp32;
  if (d == HPD_GRAD_BF16) return client::Gradient::DType::kBf16;
  return absl::InvalidArgumentError(absl::StrCat("bad gradient dtype ", d, " (0 fp32, 1 bf16)"));
}

void FillStats(int64_t version, const client::DirectionBytes& received,
               const client::DirectionBytes& bf16, hpd_fetch_stats* stats) {
  if (stats == nullptr) return;
  stats->version = version;
  stats->rowwise_bytes = received.rowwise;
  stats->columnwise_bytes = received.columnwise;
  stats->rowwise_bf16_bytes = bf16.rowwise;
  stats->columnwise_bf16_bytes = bf16.columnwise;
}

absl::Status CheckTargets(const hpd_fetch_target* targets, size_t count) {
  if (count > 0 && targets == nullptr) return NullArgument("targets");
  for (size_t i = 0; i < count; ++i) {
    if (targets[i].tensor == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("targets[", i, "].tensor is NULL"));
    }
    if (targets[i].data == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("targets[", i, "] (", targets[i].tensor, "): data is NULL"));
    }
    if (targets[i].scales == nullptr && targets[i].scale_bytes > 0) {
      return absl::InvalidArgumentError(absl::StrCat("targets[", i, "] (", targets[i].tensor,
                                                     "): scales is NULL with scale_bytes > 0"));
    }
  }
  return absl::OkStatus();
}

absl::Status FetchHost(hpd_client* c, int64_t version, const hpd_fetch_target* targets,
                       size_t count, int64_t timeout_ms, hpd_fetch_output* outputs,
                       hpd_fetch_stats* stats) {
  RETURN_IF_ERROR(CheckTargets(targets, count));
  if (count > 0 && outputs == nullptr) return NullArgument("outputs");
  std::vector<client::FetchTarget> fetch(count);
  for (size_t i = 0; i < count; ++i) {
    const hpd_fetch_target& t = targets[i];
    ASSIGN_OR_RETURN(fetch[i].direction, ParseDirection(t.direction));
    fetch[i].tensor = t.tensor;
    fetch[i].data = absl::MakeSpan(static_cast<uint8_t*>(t.data), t.data_bytes);
    if (t.scales != nullptr) {
      fetch[i].scales = absl::MakeSpan(static_cast<uint8_t*>(t.scales), t.scale_bytes);
    }
    // A zero-byte scale span would read as "no caller buffers" to Client::
    // Fetch when the data span is empty too; data is never empty here.
  }
  ASSIGN_OR_RETURN(client::FetchResult r, c->client->Fetch(version, fetch, Timeout(timeout_ms)));
  for (size_t i = 0; i < count; ++i) {
    outputs[i].scale_inv = r.tensors[i].value.scale_inv;
    outputs[i].amax = r.tensors[i].value.amax;
  }
  FillStats(r.version, r.stats.received, r.stats.bf16_equivalent, stats);
  return absl::OkStatus();
}

#ifdef HPD_WITH_CUDA
absl::StatusOr<gpu_fetch::DeviceFetcher*> FetcherFor(hpd_client* c, int device)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->device_mu) {
  auto it = c->fetchers.find(device);
  if (it != c->fetchers.end()) return it->second.get();
  gpu_fetch::DeviceFetcherOptions options;
  options.device = device;
  ASSIGN_OR_RETURN(std::unique_ptr<gpu_fetch::DeviceFetcher> f,
                   gpu_fetch::DeviceFetcher::Create(c->client.get(), options));
  gpu_fetch::DeviceFetcher* p = f.get();
  c->fetchers.emplace(device, std::move(f));
  return p;
}
#endif

absl::Status FetchDevice(hpd_client* c, int64_t version, const hpd_fetch_target* targets,
                         size_t count, int32_t device, void* cuda_stream, int64_t timeout_ms,
                         hpd_fetch_stats* stats) {
  RETURN_IF_ERROR(CheckTargets(targets, count));
  if (device < 0) return absl::InvalidArgumentError(absl::StrCat("bad CUDA device ", device));
#ifdef HPD_WITH_CUDA
  std::vector<gpu_fetch::DeviceTarget> fetch(count);
  for (size_t i = 0; i < count; ++i) {
    const hpd_fetch_target& t = targets[i];
    if (t.scale_inv == nullptr || t.amax == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "targets[", i, "] (", t.tensor, "): a device fetch needs scale_inv and amax buffers"));
    }
    ASSIGN_OR_RETURN(fetch[i].direction, ParseDirection(t.direction));
    ASSIGN_OR_RETURN(Layout layout, c->client->LayoutOf(t.tensor, fetch[i].direction));
    if (static_cast<int64_t>(t.data_bytes) < layout.data_bytes() ||
        static_cast<int64_t>(t.scale_bytes) < layout.scale_bytes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("buffers for ", t.tensor, " ", DirectionName(fetch[i].direction), " hold ",
                       t.data_bytes, "+", t.scale_bytes, " bytes; the layout needs ",
                       layout.data_bytes(), "+", layout.scale_bytes()));
    }
    fetch[i].tensor = t.tensor;
    fetch[i].dst.data = t.data;
    fetch[i].dst.scales = layout.scale_bytes() > 0 ? t.scales : nullptr;
    fetch[i].dst.scale_inv = static_cast<float*>(t.scale_inv);
    fetch[i].dst.amax = static_cast<float*>(t.amax);
  }
  std::lock_guard<std::mutex> lock(c->device_mu);
  ASSIGN_OR_RETURN(gpu_fetch::DeviceFetcher * fetcher, FetcherFor(c, device));
  ASSIGN_OR_RETURN(
      gpu_fetch::DeviceFetchResult r,
      fetcher->Fetch(version, fetch, static_cast<cudaStream_t>(cuda_stream), Timeout(timeout_ms)));
  client::DirectionBytes bf16;
  for (const gpu_fetch::DeviceFetched& t : r.tensors) bf16[t.direction] += t.rows * t.cols * 2;
  FillStats(r.version, r.received, bf16, stats);
  return absl::OkStatus();
#else
  (void)c, (void)version, (void)cuda_stream, (void)timeout_ms, (void)stats;
  return absl::UnimplementedError(
      "device fetch needs libhybrid_paramd.so built with --config=cuda; this build is CPU only "
      "(fetch into host memory instead)");
#endif
}

absl::Status Push(hpd_client* c, int64_t version, const hpd_gradient* gradients, size_t count,
                  int32_t device, void* cuda_stream, int64_t timeout_ms, uint32_t flags,
                  hpd_push_result* result) {
  if (count > 0 && gradients == nullptr) return NullArgument("gradients");
  if ((flags & ~HPD_PUSH_PARTIAL) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("unknown push flags 0x", absl::Hex(flags)));
  }
  const client::PushCoverage coverage = (flags & HPD_PUSH_PARTIAL) != 0
                                            ? client::PushCoverage::kPartial
                                            : client::PushCoverage::kEveryTensor;
  for (size_t i = 0; i < count; ++i) {
    if (gradients[i].tensor == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("gradients[", i, "].tensor is NULL"));
    }
    if (gradients[i].data == nullptr && gradients[i].bytes > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradients[", i, "] (", gradients[i].tensor, "): data is NULL"));
    }
  }
  client::PushResult r;
  if (device < 0) {
    std::vector<client::Gradient> grads(count);
    for (size_t i = 0; i < count; ++i) {
      grads[i].tensor = gradients[i].tensor;
      ASSIGN_OR_RETURN(grads[i].dtype, ParseGradDtype(gradients[i].dtype));
      grads[i].bytes =
          absl::MakeConstSpan(static_cast<const uint8_t*>(gradients[i].data), gradients[i].bytes);
    }
    ASSIGN_OR_RETURN(r, c->client->PushGradients(version, grads, Timeout(timeout_ms), coverage));
  } else {
#ifdef HPD_WITH_CUDA
    std::vector<gpu_fetch::DeviceGradient> grads(count);
    for (size_t i = 0; i < count; ++i) {
      grads[i].tensor = gradients[i].tensor;
      ASSIGN_OR_RETURN(grads[i].dtype, ParseGradDtype(gradients[i].dtype));
      grads[i].data = gradients[i].data;
      grads[i].bytes = gradients[i].bytes;
    }
    std::lock_guard<std::mutex> lock(c->device_mu);
    ASSIGN_OR_RETURN(gpu_fetch::DeviceFetcher * fetcher, FetcherFor(c, device));
    ASSIGN_OR_RETURN(r, fetcher->Push(version, grads, static_cast<cudaStream_t>(cuda_stream),
                                      Timeout(timeout_ms), coverage));
#else
    (void)cuda_stream;
    return absl::UnimplementedError(
        "pushing gradients from device memory needs libhybrid_paramd.so built with "
        "--config=cuda; this build is CPU only (copy the gradients to the host)");
#endif
  }
  if (result != nullptr) {
    result->version = r.version;
    result->bytes_sent = r.bytes_sent;
    result->pushers_received = r.pushers_received;
    result->pushers_expected = r.pushers_expected;
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace paramd

using paramd::capi::LiveClient;

extern "C" {

int32_t hpd_fetch(hpd_client* client, int64_t version, const hpd_fetch_target* targets,
                  size_t count, int64_t timeout_ms, hpd_fetch_output* outputs,
                  hpd_fetch_stats* stats, hpd_status* status) {
  return paramd::capi::Call(status, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(hpd_client * c, LiveClient(client));
    return paramd::FetchHost(c, version, targets, count, timeout_ms, outputs, stats);
  });
}

int32_t hpd_fetch_device(hpd_client* client, int64_t version, const hpd_fetch_target* targets,
                         size_t count, int32_t device, void* cuda_stream, int64_t timeout_ms,
                         hpd_fetch_stats* stats, hpd_status* status) {
  return paramd::capi::Call(status, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(hpd_client * c, LiveClient(client));
    return paramd::FetchDevice(c, version, targets, count, device, cuda_stream, timeout_ms, stats);
  });
}

int32_t hpd_push_gradients(hpd_client* client, int64_t version, const hpd_gradient* gradients,
                           size_t count, int32_t device, void* cuda_stream, int64_t timeout_ms,
                           hpd_push_result* result, hpd_status* status) {
  return paramd::capi::Call(status, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(hpd_client * c, LiveClient(client));
    return paramd::Push(c, version, gradients, count, device, cuda_stream, timeout_ms,
                        /*flags=*/0, result);
  });
}

int32_t hpd_push_gradients_ex(hpd_client* client, int64_t version, const hpd_gradient* gradients,
                              size_t count, int32_t device, void* cuda_stream, int64_t timeout_ms,
                              uint32_t flags, hpd_push_result* result, hpd_status* status) {
  return paramd::capi::Call(status, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(hpd_client * c, LiveClient(client));
    return paramd::Push(c, version, gradients, count, device, cuda_stream, timeout_ms, flags,
                        result);
  });
}

}  // extern "C"
