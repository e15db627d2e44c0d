// Process-wide malloc thresholds for fetch receive buffers
// (client/host_allocator.h).
#include "client/host_allocator.h"

#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace paramd {
namespace client {
namespace internal {
namespace {

// Below glibc's ceiling for M_MMAP_THRESHOLD (HEAP_MAX_SIZE / 2 = 32 MiB on
// 64-bit) and above gRPC's largest read buffer (4 MiB).
constexpr int kMmapThreshold = 32 << 20;
// Free memory kept at the top of a heap: the read buffers of a few fetch
// streams in flight.
constexpr int kTrimThreshold = 64 << 20;

bool Tune() {
#if defined(__GLIBC__)
  if (const char* e = std::getenv("PARAMD_CLIENT_MALLOC_TUNING");
      e != nullptr && std::strcmp(e, "0") == 0) {
    return false;
  }
  if (const char* t = std::getenv("GLIBC_TUNABLES");
      t != nullptr && (std::strstr(t, "mmap_threshold") || std::strstr(t, "trim_threshold"))) {
    return false;
  }
  return mallopt(M_MMAP_THRESHOLD, kMmapThreshold) == 1 &&
         mallopt(M_TRIM_THRESHOLD, kTrimThreshold) == 1;
#else
  return false;
#endif
}

}  // namespace

bool TuneHostAllocator() {
  static const bool tuned = Tune();  // once per process (thread-safe static)
  return tuned;
}

}  // namespace internal
}  // namespace client
}  // namespace paramd
