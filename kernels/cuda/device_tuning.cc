#include "kernels/cuda/device_tuning.h"

#include <array>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>

#include <cuda_runtime_api.h>

namespace paramd {
namespace gpu {
namespace {

constexpr int kMaxDevices = 64;

OnePassTuning Measure(int device) {
  OnePassTuning t;
  const char* env = std::getenv("PARAMD_ONE_PASS_PREFETCH");
  int clock_khz = 0, bus_bits = 0, sms = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();  // not sticky; leave no error for the next call to find
    clock_khz = bus_bits = sms = 0;
  }
  // Double data rate: two transfers per memory clock.
  t.peak_gb_per_s = 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;
  t.sms = sms;
  if (env != nullptr && (std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0)) {
    t.l2_prefetch = env[0] == '1';
    t.source = "PARAMD_ONE_PASS_PREFETCH";
  } else if (t.peak_gb_per_s <= 0 || sms <= 0) {
    t.l2_prefetch = true;
    t.source = "device attributes unknown";
  } else {
    t.l2_prefetch = OnePassPrefetchPays(t.peak_gb_per_s, sms);
    t.source = "rule";
  }
  return t;
}

}  // namespace

bool OnePassPrefetchPays(double peak_gb_per_s, int sms) {
  if (peak_gb_per_s <= 0 || sms <= 0) return true;
  return peak_gb_per_s / sms >= kOnePassPrefetchMinGBPerSm;
}

OnePassTuning OnePassTuningFor(int device) {
  static std::mutex mu;
  static std::array<std::optional<OnePassTuning>, kMaxDevices> cache;
  if (device < 0 || device >= kMaxDevices) return Measure(device);
  std::lock_guard<std::mutex> lock(mu);
  if (!cache[device].has_value()) cache[device] = Measure(device);
  return *cache[device];
}

}  // namespace gpu
}  // namespace paramd
