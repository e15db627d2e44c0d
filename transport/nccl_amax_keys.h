// File: transport/nccl_amax_keys.h
//
// Internal to the "nccl" backend: floats <-> order-preserving uint32 keys,
// so that an NCCL all-reduce of keys with ncclMax computes FORMATS.md's amax
// maximum (MaxIgnoringNan in transport.h): NaN maps below -Inf (ignored
// unless every member has NaN, then decodes to NaN), +0 ranks above -0, Inf
// takes part. In place on the device; enqueue-only on `stream`.
#ifndef PARAMD_TRANSPORT_NCCL_AMAX_KEYS_H_
#define PARAMD_TRANSPORT_NCCL_AMAX_KEYS_H_

#include <cstddef>

#include <cuda_runtime_api.h>

namespace paramd {
namespace nccl_internal {

// `values` holds `count` floats; afterwards, their keys (same 4 bytes each).
cudaError_t LaunchEncodeAmaxKeys(void* values, size_t count, cudaStream_t stream);
// The inverse (key 0 becomes the canonical NaN 0x7FC00000).
cudaError_t LaunchDecodeAmaxKeys(void* values, size_t count, cudaStream_t stream);

// The same maps on the host (tests).
unsigned EncodeAmaxKeyHost(float value);
float DecodeAmaxKeyHost(unsigned key);

}  // namespace nccl_internal
}  // namespace paramd

#endif  // PARAMD_TRANSPORT_NCCL_AMAX_KEYS_H_
