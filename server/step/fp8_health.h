// File: server/step/fp8_health.h
//
// The FP8/FP4 health of a published quantized buffer, read from its codes:
// the fraction of elements at the format's largest magnitude (saturated:
// clamped by the cast, or exactly at amax) and at zero magnitude (flushed
// to zero by the cast, or exactly zero in the source). Served per tensor
// and direction on /metrics (server/metrics.h).
//
// Cost is bounded: at most `max_samples` elements, evenly spread over the
// buffer, are read. Thread-safe (pure).
#ifndef PARAMD_SERVER_STEP_FP8_HEALTH_H_
#define PARAMD_SERVER_STEP_FP8_HEALTH_H_

#include <cstdint>
#include <optional>

#include "kernels/format.h"

namespace paramd {

struct CodeCounts {
  int64_t sampled = 0;
  int64_t saturated = 0;
  int64_t zero = 0;
};

// nullopt for formats without narrow codes (BF16/FP32 passthrough) and for
// buffers whose bytes are not on the host (the gpu backend publishes on the
// device).
std::optional<CodeCounts> CountCodes(const QuantizedTensor& q, Fp8Type fp8_type,
                                     int64_t max_samples);

}  // namespace paramd

#endif  // PARAMD_SERVER_STEP_FP8_HEALTH_H_
