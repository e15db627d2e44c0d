/* File: client/c_api_ipc.h
 *
 * The same-GPU path of the C API (client/c_api.h; docs/ARCHITECTURE.md
 * "Co-located trainers"): a trainer on the GPU of a --backend=gpu daemon
 * reads that daemon's published buffers in place, through CUDA virtual
 * memory mappings, and pushes gradients the daemon reads in place.
 *
 *   hpd_ipc* s; hpd_ipc_open(client, 0, device, 0, &s, &st);
 *   size_t n; int64_t v;
 *   hpd_ipc_acquire(s, HPD_LATEST, NULL, NULL, 0, &v, &n, &st);  // pins v
 *   hpd_ipc_view view; hpd_ipc_view_at(s, 0, &view, &st);
 *   ... view.data: device pointer to the daemon's bytes of version v ...
 *   hpd_ipc_acquire(s, v + 1, ...);  // pins v + 1, then releases v
 *   hpd_ipc_close(s, &st);
 *
 * Zero copies: the pointers of an acquired version are the daemon's own
 * buffers, valid until the next hpd_ipc_acquire or hpd_ipc_release on the
 * session, or until the session dies (the daemon's step that would rewrite
 * them waits for the pin meanwhile; a killed trainer's pins lapse with its
 * lease). A dead daemon is reported at the next call (UNAVAILABLE); the
 * mappings stay mapped until hpd_ipc_close, so a kernel still reading them
 * reads the last bytes, never freed memory. The hand-over of v + 1 needs no
 * RPC once a version of each double-buffer slot was acquired with the same
 * targets (the session's shared pin page).
 *
 * Builds without CUDA return UNIMPLEMENTED from hpd_ipc_open. Status codes,
 * handles and threading as in c_api.h; one hpd_ipc is used by one thread at
 * a time, and every hpd_ipc of a client is closed before hpd_close.
 */
#ifndef PARAMD_CLIENT_C_API_IPC_H_
#define PARAMD_CLIENT_C_API_IPC_H_

#include "client/c_api.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct hpd_ipc hpd_ipc;

/* Opens a same-GPU session with daemon `daemon_rank` of the client's
 * manifest, which must run on CUDA device `device` of this process.
 * lease_ms 0: 5 s. FAILED_PRECONDITION: the daemon is on another GPU, runs
 * the cpu backend or has no exportable memory (fetch with
 * hpd_fetch_device instead); INVALID_ARGUMENT: no such rank. */
HPD_EXPORT int32_t hpd_ipc_open(hpd_client* client, int32_t daemon_rank, int32_t device,
                                int64_t lease_ms, hpd_ipc** ipc, hpd_status* status);
/* Releases the acquired version, unmaps everything and ends the session. */
HPD_EXPORT int32_t hpd_ipc_close(hpd_ipc* ipc, hpd_status* status);

/* One published direction of one tensor (this daemon's rows of it) of the
 * acquired version. Pointers are device memory of the session's device;
 * `tensor` belongs to the session and lives as long as the pointers. */
typedef struct hpd_ipc_view {
  const char* tensor;
  int32_t direction; /* HPD_ROWWISE / HPD_COLUMNWISE */
  int64_t rows;      /* the whole tensor's M and K */
  int64_t cols;
  int64_t row_begin; /* this daemon's rows [row_begin, row_end) */
  int64_t row_end;
  void* data;
  uint64_t data_bytes;
  void* scales; /* NULL when scale_bytes is 0 */
  uint64_t scale_bytes;
  float* scale_inv; /* one device float each */
  float* amax;
} hpd_ipc_view;

/* Pins `version` (HPD_LATEST: the newest this daemon publishes) of `count`
 * targets (tensors[i], directions[i]; count 0: every tensor and direction
 * this daemon holds), releases the version acquired before, and returns
 * the version and the number of views (one per target and piece, target
 * order). NOT_FOUND: the daemon does not hold that version (any more) or
 * the tensor; FAILED_PRECONDITION: a direction that is not published;
 * UNAVAILABLE: the daemon died. */
HPD_EXPORT int32_t hpd_ipc_acquire(hpd_ipc* ipc, int64_t version, const char* const* tensors,
                                   const int32_t* directions, size_t count,
                                   int64_t* acquired_version, size_t* num_views,
                                   hpd_status* status);
/* View `index` of the acquired version (INVALID_ARGUMENT past num_views or
 * with nothing acquired). */
HPD_EXPORT int32_t hpd_ipc_view_at(hpd_ipc* ipc, size_t index, hpd_ipc_view* view,
                                   hpd_status* status);
/* Releases the acquired version: its pointers must not be used after. */
HPD_EXPORT int32_t hpd_ipc_release(hpd_ipc* ipc, hpd_status* status);

/* Device memory of at least `bytes` that the daemon maps: gradients pushed
 * from it with hpd_ipc_push are read there, in place. Owned by the session
 * (freed by hpd_ipc_close). */
HPD_EXPORT int32_t hpd_ipc_gradient_buffer(hpd_ipc* ipc, uint64_t bytes, void** device_ptr,
                                           hpd_status* status);
/* Pushes this trainer's gradients for `version` to this daemon (whole
 * tensors lying in hpd_ipc_gradient_buffer memory; the daemon reads its
 * rows of each). The rules and codes of hpd_push_gradients (stale
 * FAILED_PRECONDITION, duplicate ALREADY_EXISTS, early OUT_OF_RANGE, NaN /
 * Inf INVALID_ARGUMENT: nothing added). The caller's work writing the
 * gradients must be complete (synchronise its stream first). On return the
 * buffers may be reused. `result` may be NULL. */
HPD_EXPORT int32_t hpd_ipc_push(hpd_ipc* ipc, int64_t version, const hpd_gradient* gradients,
                                size_t count, hpd_push_result* result, hpd_status* status);

/* How the acquires so far were pinned: through the shared pin page (no RPC)
 * or over an RPC. Either pointer may be NULL. */
HPD_EXPORT int32_t hpd_ipc_stats(hpd_ipc* ipc, int64_t* page_acquires, int64_t* rpc_acquires,
                                 hpd_status* status);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* PARAMD_CLIENT_C_API_IPC_H_ */
