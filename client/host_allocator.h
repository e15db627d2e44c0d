// File: client/host_allocator.h
//
// Inside client::Client (not for users): the process-wide glibc malloc
// settings a fast host fetch needs.
//
// Why: gRPC receives every fetch stream into read buffers it mallocs (up to
// 4 MiB each) and frees once their bytes are copied out. With glibc's
// default, dynamically adjusted thresholds, those frees hand the memory back
// to the kernel (heap trimming, munmap) and the next reads fault it in
// again: measured with `perf record -e page-faults`, 85 % of a fetch's page
// faults are the kernel's recvmsg writing into fresh gRPC buffers, about one
// fault per 4 KiB received, costing a third of the client's CPU time. How
// much is trimmed depends on the state of the process's heap, so the same
// fetch ran at different speeds in a small C++ program and inside Python.
//
// TuneHostAllocator() fixes the thresholds (mallopt): allocations below
// 32 MiB come from the heap, and up to 64 MiB of free memory at the top of
// a heap stays mapped, so the buffers are reused without faults. Larger
// allocations are still mmap'ed and returned at free. This changes malloc
// for the whole process (at most 64 MiB more resident after a peak); it is
// applied once, at the first Client::Connect, unless
// ClientOptions::tune_host_allocator is false, the environment has
// PARAMD_CLIENT_MALLOC_TUNING=0, or GLIBC_TUNABLES already sets a malloc
// threshold (the user's choice wins). No-op without glibc.
//
// Thread-safe (the first call does the work).
#ifndef PARAMD_CLIENT_HOST_ALLOCATOR_H_
#define PARAMD_CLIENT_HOST_ALLOCATOR_H_

namespace paramd {
namespace client {
namespace internal {

// Returns whether the settings are in force (set now or by an earlier call).
bool TuneHostAllocator();

}  // namespace internal
}  // namespace client
}  // namespace paramd

#endif  // PARAMD_CLIENT_HOST_ALLOCATOR_H_
