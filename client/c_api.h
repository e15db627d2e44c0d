/* File: client/c_api.h
 *
 * The stable C API of the hybrid-paramd trainer client, for languages other
 * than C++ (the Python package python/hybrid_paramd calls it through ctypes).
 * It wraps client::Client (client/client.h) and, in builds with
 * --config=cuda, gpu_fetch::DeviceFetcher (client/gpu_fetch/device_fetcher.h).
 *
 * The shared library //client:libhybrid_paramd.so exports exactly the
 * functions below (a version script; everything else, including our own
 * C++ code, is linked statically and hidden), so it can be loaded into a
 * process that already holds torch, grpcio and protobuf. It links Debian's
 * Abseil, gRPC and protobuf shared libraries dynamically.
 *
 *   hpd_connect_options o; hpd_connect_options_init(&o);
 *   o.address = "127.0.0.1:7070";
 *   hpd_status st; hpd_client* c;
 *   if (hpd_connect(&o, &c, &st) != HPD_OK) { fprintf(stderr, "%s\n", st.message); ... }
 *   int64_t v; hpd_wait_for_version(c, 0, 30000, &v, &st);
 *   hpd_manifest* m; hpd_get_manifest(c, 0, &m, &st);
 *   hpd_tensor_info t; hpd_manifest_tensor(m, 0, &t, &st);
 *   ... allocate t.dir[HPD_ROWWISE].data_bytes / .scale_bytes ...
 *   hpd_fetch_target target = {t.name, HPD_ROWWISE, data, n, scales, ns};
 *   hpd_fetch_output out; hpd_fetch(c, v, &target, 1, 0, &out, NULL, &st);
 *   hpd_manifest_free(m); hpd_close(c);
 *
 * Status: every function that can fail returns an int32 status code, the
 * gRPC / absl code number (0 OK, 3 INVALID_ARGUMENT, 5 NOT_FOUND, 9
 * FAILED_PRECONDITION, 12 UNIMPLEMENTED, 14 UNAVAILABLE, ...; the meaning of
 * each for a retry is the table in client/client.h), and fills `*status`
 * (code + NUL-terminated message) when `status` is not NULL. Nothing in
 * this API aborts the process on bad input: a NULL or unknown handle, a NULL
 * pointer, a buffer of the wrong size, an unreachable cluster all return a
 * code (a C++ exception inside is caught and returned as INTERNAL or
 * RESOURCE_EXHAUSTED).
 *
 * Versioning: HPD_API_VERSION is the version of this header;
 * hpd_api_version() is the library's. A library accepts a caller of the
 * same major version (HPD_API_VERSION / 1000); minor versions only add
 * functions and append fields to structs that carry `struct_size`.
 *
 * Ownership: handles (hpd_client, hpd_manifest) are created by this
 * library and freed only by their free function (hpd_close,
 * hpd_manifest_free). Strings returned inside a hpd_tensor_info belong to
 * the hpd_manifest and live as long as it. Strings returned as `char**`
 * are freed with hpd_free_string. Buffers passed in (fetch destinations,
 * gradients) stay the caller's; the library only touches them during the
 * call.
 *
 * Threading: a hpd_client may be used from several threads at once (as
 * client::Client); every call blocks the calling thread until it is done or
 * its timeout passes (timeout_ms 0: the client's call timeout). Device
 * fetches and pushes through one client are serialised. hpd_close must not
 * race with other calls on the same client. A hpd_manifest is immutable and
 * may be read from any thread.
 */
#ifndef PARAMD_CLIENT_C_API_H_
#define PARAMD_CLIENT_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(HPD_BUILDING_LIBRARY)
#define HPD_EXPORT __attribute__((visibility("default")))
#else
#define HPD_EXPORT
#endif

/* major * 1000 + minor. 1001 added TLS / token connect options
 * (tls_server_name, token_file appended), hpd_load_model, hpd_wait_for_version_info,
 * hpd_set_optimizer_schedule; 1002 added hpd_watch_version; 1003 added
 * hpd_push_gradients_ex (HPD_PUSH_PARTIAL), and a push that leaves out
 * tensors without that flag is refused; 1005 added the frozen-buffer dtypes
 * (HPD_DTYPE_F64 ... HPD_DTYPE_F8_E8M0) to hpd_load_tensors and
 * hpd_read_version. */
#define HPD_API_VERSION 1005

/* Status codes (gRPC / absl numbering). */
#define HPD_OK 0
#define HPD_CANCELLED 1
#define HPD_UNKNOWN 2
#define HPD_INVALID_ARGUMENT 3
#define HPD_DEADLINE_EXCEEDED 4
#define HPD_NOT_FOUND 5
#define HPD_ALREADY_EXISTS 6
#define HPD_PERMISSION_DENIED 7
#define HPD_RESOURCE_EXHAUSTED 8
#define HPD_FAILED_PRECONDITION 9
#define HPD_ABORTED 10
#define HPD_OUT_OF_RANGE 11
#define HPD_UNIMPLEMENTED 12
#define HPD_INTERNAL 13
#define HPD_UNAVAILABLE 14
#define HPD_UNAUTHENTICATED 16

/* Directions (kernels/format.h Direction). */
#define HPD_ROWWISE 0
#define HPD_COLUMNWISE 1

/* Formats (kernels/format.h Format, docs/FORMATS.md). */
#define HPD_FORMAT_IDENTITY_BF16 0
#define HPD_FORMAT_IDENTITY_FP32 1
#define HPD_FORMAT_FP8_DELAYED 2
#define HPD_FORMAT_FP8_CURRENT 3
#define HPD_FORMAT_MXFP8 4
#define HPD_FORMAT_NVFP4 5
#define HPD_FORMAT_FP8_BLOCK_128X128 6
#define HPD_FORMAT_FP8_BLOCK_1X128 7

/* FP8 element types. */
#define HPD_FP8_E4M3 0
#define HPD_FP8_E5M2 1

/* Gradient element types. */
#define HPD_GRAD_FP32 0
#define HPD_GRAD_BF16 1

#define HPD_MAX_RANK 8
#define HPD_STATUS_MESSAGE_BYTES 1024

typedef struct hpd_status {
  int32_t code;
  char message[HPD_STATUS_MESSAGE_BYTES]; /* NUL-terminated, truncated */
} hpd_status;

typedef struct hpd_client hpd_client;
typedef struct hpd_manifest hpd_manifest;

/* The library's HPD_API_VERSION. */
HPD_EXPORT int32_t hpd_api_version(void);
/* The name of a status code ("UNAVAILABLE"); a static string. */
HPD_EXPORT const char* hpd_code_name(int32_t code);

/* ---- Connect ---- */

typedef struct hpd_connect_options {
  uint32_t struct_size;       /* sizeof(hpd_connect_options): set by _init */
  const char* address;        /* coordinator "host:port"; NULL or "": $PARAMD_COORDINATOR,
                               * else "127.0.0.1:7070" */
  const char* name;           /* for status listings; NULL or "": "<hostname>:<pid>" */
  int32_t observer;           /* 0: trainer (joins with a rank), 1: observer (tools) */
  int32_t pusher;             /* trainers: 1 if this trainer pushes gradients */
  int32_t expected_pushers;   /* > 0: fail unless the coordinator expects this many */
  int64_t connect_timeout_ms; /* 0: 10 s */
  int64_t call_timeout_ms;    /* 0: 30 s */
  int64_t max_chunk_bytes;    /* 0: server default */
  /* Security (docs/SECURITY.md); NULL or "" = unset. A CA turns TLS on: the
   * PEM roots that signed the servers' certificates (unset, with no client
   * certificate either: $HPCTL_TLS_CA if set). A client certificate and its
   * key (both or neither) are for servers that require mutual TLS.
   * Inconsistent files are INVALID_ARGUMENT; a missing file NOT_FOUND, an
   * unreadable one PERMISSION_DENIED. A TLS server called without a CA, a
   * plaintext server called with one, a certificate the CA did not sign are
   * FAILED_PRECONDITION at once, in words. */
  const char* tls_root_certs_path;  /* --tls_ca */
  const char* tls_cert_chain_path;  /* --tls_cert */
  const char* tls_private_key_path; /* --tls_key */
  /* The bearer token presented on every call to a cluster started with
   * --auth_token_file (trainers: a `trainer` token; tools that load or
   * step: `operator`). Give `token` or `token_file`, not both. */
  const char* token;
  /* ---- since 1001 (read only when struct_size covers them) ---- */
  /* The name the servers' certificates must carry instead of the host of
   * the address called. */
  const char* tls_server_name;
  /* A file holding the token: one bare token, or `ROLE TOKEN` lines (then
   * the `trainer` line for trainers, the `operator` line for observers).
   * With neither token nor token_file, the file the environment variable
   * HPCTL_TOKEN_FILE names, if set (as hpctl). */
  const char* token_file;
} hpd_connect_options;

/* Fills `options` with the defaults above (address NULL). */
HPD_EXPORT void hpd_connect_options_init(hpd_connect_options* options);

/* Connects, joins and reads the manifest; `*client` is set on success (NULL
 * otherwise). UNAVAILABLE if the coordinator is unreachable within
 * connect_timeout_ms (also a TLS server called in plaintext, or a server
 * certificate the CA did not sign); UNAUTHENTICATED without a token the
 * cluster knows, PERMISSION_DENIED for a token of another role. */
HPD_EXPORT int32_t hpd_connect(const hpd_connect_options* options, hpd_client** client,
                               hpd_status* status);
/* Leaves the cluster (best effort) and frees the client. NULL is a no-op
 * (OK); an unknown handle is INVALID_ARGUMENT. */
HPD_EXPORT int32_t hpd_close(hpd_client* client, hpd_status* status);

/* This member's data-plane rank (-1 for observers) and member id (copied
 * into `id`, `id_bytes` including the NUL; may be NULL/0). */
HPD_EXPORT int32_t hpd_member(hpd_client* client, int32_t* rank, char* id, size_t id_bytes,
                              hpd_status* status);

/* ---- Manifest ---- */

/* One direction of one tensor: its format and the exact byte layout a fetch
 * fills (kernels/format.h Layout). */
typedef struct hpd_direction_info {
  int32_t published;        /* 0: the tensor does not publish this direction */
  int32_t format;           /* HPD_FORMAT_* */
  int32_t fp8_type;         /* HPD_FP8_* (FP8 formats and MXFP8) */
  int32_t transposed;       /* data is [K][M] (FORMATS.md) */
  int32_t two_d;            /* MXFP8 32x32 / NVFP4 16x16 tiles */
  int32_t scale_elem_bytes; /* 1 (E8M0/UE4M3), 4 (fp32), 0: no scale buffer */
  int64_t data_rows;
  int64_t data_row_bytes;
  int64_t data_bytes;
  int64_t scale_rows;
  int64_t scale_cols;
  int64_t scale_bytes;
} hpd_direction_info;

typedef struct hpd_tensor_info {
  const char* name; /* owned by the manifest */
  int32_t ndim;     /* of the shape in the model file (<= HPD_MAX_RANK) */
  int64_t shape[HPD_MAX_RANK];
  int64_t rows;              /* M: product of shape[:-1] */
  int64_t cols;              /* K: shape[-1] */
  int32_t num_pieces;        /* shard pieces (daemons holding rows of it) */
  hpd_direction_info dir[2]; /* [HPD_ROWWISE], [HPD_COLUMNWISE] */
} hpd_tensor_info;

/* The client's manifest (refresh != 0: read again from the coordinator
 * first). Free with hpd_manifest_free. */
HPD_EXPORT int32_t hpd_get_manifest(hpd_client* client, int32_t refresh, hpd_manifest** manifest,
                                    hpd_status* status);
HPD_EXPORT void hpd_manifest_free(hpd_manifest* manifest);
HPD_EXPORT int32_t hpd_manifest_num_tensors(const hpd_manifest* manifest, int64_t* count,
                                            hpd_status* status);
/* Cluster-wide numbers: daemons, pushers expected, committed version when
 * read (-1: no model). */
HPD_EXPORT int32_t hpd_manifest_summary(const hpd_manifest* manifest, int32_t* num_daemons,
                                        int32_t* expected_pushers, int64_t* committed_version,
                                        hpd_status* status);
/* Tensor `index` in manifest order (OUT_OF_RANGE past the end). */
HPD_EXPORT int32_t hpd_manifest_tensor(const hpd_manifest* manifest, int64_t index,
                                       hpd_tensor_info* info, hpd_status* status);
/* The index of the tensor called `name` (NOT_FOUND if none). */
HPD_EXPORT int32_t hpd_manifest_find(const hpd_manifest* manifest, const char* name, int64_t* index,
                                     hpd_status* status);

/* ---- Versions ---- */

/* Blocks until the committed version is >= min_version; `*version` gets it.
 * DEADLINE_EXCEEDED after timeout_ms (0: 30 s). ABORTED if the cluster
 * rewound meanwhile (a daemon was lost and replaced): the message says
 * "rewound to version V"; hpd_wait_for_version_info returns V instead. */
HPD_EXPORT int32_t hpd_wait_for_version(hpd_client* client, int64_t min_version, int64_t timeout_ms,
                                        int64_t* version, hpd_status* status);

typedef struct hpd_version_info {
  int64_t committed_version;
  /* 1 when every daemon went back to an earlier version since this
   * client's last wait (docs/ARCHITECTURE.md "Recovery"): committed_version
   * is then rewound_to_version, possibly below min_version, and the trainer
   * goes back to it (its data too) and pushes for it next. Each rewind is
   * reported once per client. */
  int32_t rewound;
  int64_t rewound_to_version; /* valid when rewound */
  int64_t recovery_epoch;     /* recoveries the cluster has completed */
} hpd_version_info;

/* The same wait, with a rewind reported in `*info` (OK) rather than as
 * ABORTED. The client's manifest is refreshed after a rewind (a
 * replacement daemon serves the lost rank at another address). */
HPD_EXPORT int32_t hpd_wait_for_version_info(hpd_client* client, int64_t min_version,
                                             int64_t timeout_ms, hpd_version_info* info,
                                             hpd_status* status);

/* Called by hpd_watch_version on the calling thread for each version
 * event; return nonzero to keep watching, 0 to stop (the watch then
 * returns OK). `event` is valid during the call only. */
typedef int32_t (*hpd_version_event_fn)(void* arg, const hpd_version_info* event);

/* Streams the committed version (Coordinator.WatchVersion): `on_event`
 * gets it once it is >= min_version and again at every newer commit, until
 * it returns 0 (OK), timeout_ms passes (DEADLINE_EXCEEDED; 0: 30 s) or the
 * stream fails (UNAVAILABLE, ...). A rewind comes as
 * an event with `rewound` set (committed_version = rewound_to_version,
 * possibly below earlier events), reported once per client as by
 * hpd_wait_for_version_info, after the client's manifest was refreshed.
 * Blocks; INVALID_ARGUMENT for a NULL `on_event`. (Since 1002.) */
HPD_EXPORT int32_t hpd_watch_version(hpd_client* client, int64_t min_version, int64_t timeout_ms,
                                     hpd_version_event_fn on_event, void* arg, hpd_status* status);

/* ---- Fetch ---- */

#define HPD_LATEST (-1)

/* One (tensor, direction) and its caller-owned destinations: at least
 * data_bytes / scale_bytes of the tensor's hpd_direction_info (scales may
 * be NULL when scale_bytes is 0). For device fetches the pointers are device
 * memory of `device`, and scale_inv / amax point to one device float each
 * (required); host fetches ignore those two and return the values in
 * hpd_fetch_output. */
typedef struct hpd_fetch_target {
  const char* tensor;
  int32_t direction; /* HPD_ROWWISE / HPD_COLUMNWISE */
  void* data;
  uint64_t data_bytes;
  void* scales;
  uint64_t scale_bytes;
  void* scale_inv; /* device fetch only */
  void* amax;      /* device fetch only */
} hpd_fetch_target;

/* Per target: per-tensor FP8 scale_inv (1 for other formats) and the amax
 * of the direction (NVFP4: the global amax A). */
typedef struct hpd_fetch_output {
  float scale_inv;
  float amax;
} hpd_fetch_output;

typedef struct hpd_fetch_stats {
  int64_t version;       /* the version fetched (HPD_LATEST resolved) */
  int64_t rowwise_bytes; /* payload received (data + scales) */
  int64_t columnwise_bytes;
  int64_t rowwise_bf16_bytes; /* what the same fetch would move as BF16 */
  int64_t columnwise_bf16_bytes;
} hpd_fetch_stats;

/* Fetches `count` targets of `version` (HPD_LATEST: the committed one) into
 * host memory. All or nothing: on error the destinations may be partly
 * written. `outputs` has `count` entries; `stats` may be NULL.
 * INVALID_ARGUMENT for a buffer smaller than the layout, a bad direction or
 * a target given twice; NOT_FOUND for an unknown tensor or a dropped
 * version; FAILED_PRECONDITION for a direction the tensor does not publish. */
HPD_EXPORT int32_t hpd_fetch(hpd_client* client, int64_t version, const hpd_fetch_target* targets,
                             size_t count, int64_t timeout_ms, hpd_fetch_output* outputs,
                             hpd_fetch_stats* stats, hpd_status* status);

/* The same into device memory of CUDA device `device` over the daemons'
 * NCCL device channels (the daemons must run --backend=gpu). Waits for
 * `cuda_stream` (a cudaStream_t, NULL: the legacy default stream) first;
 * when it returns the bytes are in place for work on any stream. Builds
 * without CUDA return UNIMPLEMENTED. The per-tensor values land in the
 * targets' device scale_inv / amax floats. `stats` may be NULL. */
HPD_EXPORT int32_t hpd_fetch_device(hpd_client* client, int64_t version,
                                    const hpd_fetch_target* targets, size_t count, int32_t device,
                                    void* cuda_stream, int64_t timeout_ms, hpd_fetch_stats* stats,
                                    hpd_status* status);
/* Whether this build has the device path (1) or not (0). */
HPD_EXPORT int32_t hpd_has_cuda(void);

/* ---- Push ---- */

/* A gradient of one whole tensor: rows * cols little-endian values, row
 * major, `bytes` = rows * cols * (4 or 2). */
typedef struct hpd_gradient {
  const char* tensor;
  int32_t dtype; /* HPD_GRAD_FP32 / HPD_GRAD_BF16 */
  const void* data;
  uint64_t bytes;
} hpd_gradient;

typedef struct hpd_push_result {
  int64_t version;
  int64_t bytes_sent;
  int32_t pushers_received;
  int32_t pushers_expected;
} hpd_push_result;

/* Pushes this trainer's gradients for `version` (every gradient of the step
 * in one call; tensors left out count as zero). device < 0: host memory;
 * device >= 0: CUDA device memory of that device, pushed over the device
 * channels after waiting for `cuda_stream` (UNIMPLEMENTED without CUDA).
 * `result` may be NULL. Codes as client::Client::PushGradients. */
HPD_EXPORT int32_t hpd_push_gradients(hpd_client* client, int64_t version,
                                      const hpd_gradient* gradients, size_t count, int32_t device,
                                      void* cuda_stream, int64_t timeout_ms,
                                      hpd_push_result* result, hpd_status* status);
/* hpd_push_gradients with flags. Without HPD_PUSH_PARTIAL a push must give
 * every tensor of the model (INVALID_ARGUMENT names the missing ones); with
 * it, the tensors left out count as zero for this pusher. */
#define HPD_PUSH_PARTIAL 1u
HPD_EXPORT int32_t hpd_push_gradients_ex(hpd_client* client, int64_t version,
                                         const hpd_gradient* gradients, size_t count,
                                         int32_t device, void* cuda_stream, int64_t timeout_ms,
                                         uint32_t flags, hpd_push_result* result,
                                         hpd_status* status);

/* ---- Administration and status ---- */

/* The cluster's status (rpc::GetStatusResponse) as JSON; free `*json` with
 * hpd_free_string. */
HPD_EXPORT int32_t hpd_status_json(hpd_client* client, int32_t include_shards, int64_t timeout_ms,
                                   char** json, hpd_status* status);
/* Loads a safetensors file readable by every daemon with a recipe (protobuf
 * text, may be NULL) and refreshes the manifest; `*version` = 0. A cluster
 * holding a model refuses (FAILED_PRECONDITION); hpd_load_model below also
 * replaces models, streams directories and sharded checkpoints. */
HPD_EXPORT int32_t hpd_load(hpd_client* client, const char* safetensors_path,
                            const char* recipe_text, int64_t timeout_ms, int64_t* version,
                            hpd_status* status);
/* Progress of a streamed load: payload bytes sent of the total. Called
 * from the library's threads, one call at a time. */
typedef void (*hpd_progress_fn)(void* arg, int64_t bytes_sent, int64_t bytes_total);

typedef struct hpd_load_options {
  uint32_t struct_size; /* sizeof(hpd_load_options): set by _init */
  /* A .safetensors file, a directory (its model.safetensors.index.json if
   * there is one, else every *.safetensors in it) or a Hugging Face index
   * file (model.safetensors.index.json of a sharded checkpoint). */
  const char* model;
  const char* recipe_text; /* protobuf text; NULL: the coordinator's recipe */
  /* 1: replace a model the cluster holds (its training state is discarded,
   * the committed version goes back to 0); 0: FAILED_PRECONDITION then. */
  int32_t force;
  /* 1: this process reads the files and streams the values to the daemons
   * (Daemon.PushWeights; no path shared with them; F32, BF16, F16 tensors).
   * 0: a single file is read by the daemons at its path (made absolute
   * here); directories and indexes are always streamed. */
  int32_t stream;
  int64_t timeout_ms;       /* 0: 1 hour */
  hpd_progress_fn progress; /* streamed loads; may be NULL */
  void* progress_arg;
} hpd_load_options;

/* Fills `options` with the defaults above (model NULL). */
HPD_EXPORT void hpd_load_options_init(hpd_load_options* options);
/* Loads a model as hpctl load does and refreshes the manifest; `*version`
 * gets the committed version (0). NOT_FOUND for a missing path,
 * INVALID_ARGUMENT for a bad index, recipe or tensor dtype,
 * FAILED_PRECONDITION for a cluster that holds a model without force,
 * PERMISSION_DENIED for a path outside the servers' --model_root. */
HPD_EXPORT int32_t hpd_load_model(hpd_client* client, const hpd_load_options* options,
                                  int64_t* version, hpd_status* status);

/* Replaces the learning-rate schedule of the cluster's optimizer between
 * steps (Coordinator.SetOptimizerSchedule, an operator call): `schedule`
 * is a paramd.recipe.LrSchedule (proto/optimizer.proto) in protobuf text
 * ("warmup_steps: 10 decay: COSINE decay_steps: 100 min_lr: 1e-5") or as
 * JSON (when it starts with '{'); has_lr != 0 also sets the peak lr. The
 * optimizer config now in force is returned as JSON in `*optimizer_json`
 * (may be NULL; free with hpd_free_string). INVALID_ARGUMENT for a
 * schedule that does not parse or that the optimizer refuses;
 * FAILED_PRECONDITION while a daemon is unreachable (retry). */
HPD_EXPORT int32_t hpd_set_optimizer_schedule(hpd_client* client, const char* schedule,
                                              int32_t has_lr, float lr, int64_t timeout_ms,
                                              char** optimizer_json, hpd_status* status);

/* Admin step from the committed `version`; wait != 0: `*new_version` is the
 * newly committed version. */
HPD_EXPORT int32_t hpd_step(hpd_client* client, int64_t version, int32_t wait, int64_t timeout_ms,
                            int64_t* new_version, hpd_status* status);
HPD_EXPORT void hpd_free_string(char* s);

/* ---- Models in memory, versions read back, exports and checkpoints ---- */

/* Element types of hpd_host_tensor and hpd_read_options: the trained
 * weights are F32 or BF16. The others are the dtypes of frozen buffers
 * (tensors loaded, checkpointed and exported whole, never stepped: integer
 * position ids, boolean masks, step counters, F64 constants). */
#define HPD_DTYPE_F32 0
#define HPD_DTYPE_BF16 1
#define HPD_DTYPE_F64 2
#define HPD_DTYPE_I64 3
#define HPD_DTYPE_I32 4
#define HPD_DTYPE_I16 5
#define HPD_DTYPE_I8 6
#define HPD_DTYPE_U8 7
#define HPD_DTYPE_BOOL 8
#define HPD_DTYPE_U16 9
#define HPD_DTYPE_U32 10
#define HPD_DTYPE_U64 11
/* FP8 tensors of a model file (a pre-quantized checkpoint's weights and
 * scales) are frozen buffers too: bytes kept as they are. */
#define HPD_DTYPE_F8_E4M3 12
#define HPD_DTYPE_F8_E5M2 13
#define HPD_DTYPE_F8_E8M0 14

/* One tensor in the caller's host memory: C-contiguous, little-endian,
 * `data_bytes` = product(shape) * element size. */
typedef struct hpd_host_tensor {
  const char* name;
  const int64_t* shape;
  int32_t ndim;
  int32_t dtype; /* HPD_DTYPE_F32 or _BF16: a weight; another HPD_DTYPE_: frozen */
  const void* data;
  int64_t data_bytes;
} hpd_host_tensor;

/* Loads `tensors` as a model (Coordinator.Load of their declarations, then
 * Daemon.PushWeights of their values, as a streamed hpd_load_model) and
 * refreshes the manifest; `*version` = 0. Tensors of a frozen-buffer dtype
 * travel whole with the declaration (at most the cluster's
 * --max_frozen_bytes in all, else RESOURCE_EXHAUSTED). `options` as for
 * hpd_load_model except `model` and `stream`, which are ignored. The
 * buffers are read during the call only. INVALID_ARGUMENT names a tensor
 * with a bad name, dtype, shape or byte count, or a name given twice; the
 * rest as hpd_load_model. */
HPD_EXPORT int32_t hpd_load_tensors(hpd_client* client, const hpd_host_tensor* tensors,
                                    int64_t count, const hpd_load_options* options,
                                    int64_t* version, hpd_status* status);

/* What hpd_read_version and hpd_export read of a version. */
#define HPD_VALUES_MASTER 0     /* the FP32 masters */
#define HPD_VALUES_ROWWISE 1    /* the published rowwise copy, dequantized */
#define HPD_VALUES_COLUMNWISE 2 /* the published columnwise copy, dequantized */

typedef struct hpd_read_options {
  uint32_t struct_size; /* sizeof(hpd_read_options): set by _init */
  int64_t version;      /* -1 (default): the committed version */
  int32_t dtype;        /* HPD_DTYPE_BF16 (default; round to nearest even) or _F32 */
  int32_t values;       /* HPD_VALUES_MASTER (default) */
  /* Where the daemons look for a checkpoint of a version they no longer
   * hold in memory (below their --checkpoint_dir); NULL: that directory. */
  const char* checkpoint_dir;
  int64_t timeout_ms; /* of each tensor piece's stream; 0: 10 minutes */
} hpd_read_options;
HPD_EXPORT void hpd_read_options_init(hpd_read_options* options);

/* Where hpd_read_version writes one tensor: called once per tensor, in
 * manifest order, then once per frozen buffer (with its own `dtype`),
 * before its bytes are read; returns a buffer of `bytes` bytes (row-major,
 * `dtype` elements) that stays valid until the call returns, or NULL to
 * stop the read (CANCELLED; a tensor of 0 bytes may get NULL). Called on
 * the thread of hpd_read_version. */
typedef void* (*hpd_tensor_dest_fn)(void* arg, const char* name, const int64_t* shape, int32_t ndim,
                                    int32_t dtype, int64_t bytes);

/* Reads every tensor of a committed version from the daemons that hold it
 * into the buffers `dest` returns; `*version` gets the version read.
 * FAILED_PRECONDITION when no model is loaded or the version is not
 * committed; NOT_FOUND when no daemon holds it any more (nor a checkpoint
 * of it); UNAVAILABLE for a dead daemon. */
HPD_EXPORT int32_t hpd_read_version(hpd_client* client, const hpd_read_options* options,
                                    hpd_tensor_dest_fn dest, void* dest_arg, int64_t* version,
                                    hpd_status* status);

/* Writes a version as Hugging Face safetensors into `out_dir`, as
 * `hpctl export` does: shards of at most `max_shard_bytes` (0: 5 GB), an
 * index written last, files 0600 and directories 0700 (0640 / 0750 with
 * `group_readable`). `out_dir` must be new or empty unless `overwrite`
 * (then an older export's files are removed first; other files stay).
 * `*result_json` (may be NULL; free with hpd_free_string) gets
 * {"version", "files", "total_bytes", "num_tensors", "removed"}. */
HPD_EXPORT int32_t hpd_export(hpd_client* client, const char* out_dir,
                              const hpd_read_options* options, int64_t max_shard_bytes,
                              int32_t overwrite, int32_t group_readable, char** result_json,
                              hpd_status* status);

/* The coordinator's checkpoint calls (hpctl checkpoint), request and
 * response as JSON (proto/checkpoint_service.proto field names):
 *   "create":   CheckpointRequest {"dir", "version", "keep"} -> CheckpointResponse
 *   "list":     ListCheckpointsRequest {"dir"} -> ListCheckpointsResponse
 *   "describe": DescribeCheckpointRequest {"dir", "version", "verify"}
 *               -> DescribeCheckpointResponse
 * `request_json` NULL or "" is the empty request. INVALID_ARGUMENT for an
 * unknown call or a request that does not parse. Free `*response_json`
 * with hpd_free_string. */
HPD_EXPORT int32_t hpd_checkpoint_call(hpd_client* client, const char* call,
                                       const char* request_json, int64_t timeout_ms,
                                       char** response_json, hpd_status* status);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* PARAMD_CLIENT_C_API_H_ */
