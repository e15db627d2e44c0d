"""ctypes bindings of client/c_api.h (libhybrid_paramd.so).

How the library is found:
  1. $HYBRID_PARAMD_LIB (the path of the .so) when set: that file or an
     error, never another;
  else the first that exists of
  2. _lib/libhybrid_paramd.so in this package (the wheel of
     `bazel build //python:wheel`, python/build_wheel.py);
  3. libhybrid_paramd.so next to this file (a copy of the package);
  4. bazel-bin/client/libhybrid_paramd.so of the source tree this package
     sits in (python/hybrid_paramd -> ../../bazel-bin), after
     `bazel build //client:libhybrid_paramd.so`.
The library is loaded RTLD_LOCAL and exports only the hpd_* functions.
"""

import ctypes
import os
import threading

API_VERSION = 1005  # HPD_API_VERSION this module was written against
MAX_RANK = 8
PUSH_PARTIAL = 1  # HPD_PUSH_PARTIAL


class Status(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int32), ("message", ctypes.c_char * 1024)]


class ConnectOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("address", ctypes.c_char_p),
        ("name", ctypes.c_char_p),
        ("observer", ctypes.c_int32),
        ("pusher", ctypes.c_int32),
        ("expected_pushers", ctypes.c_int32),
        ("connect_timeout_ms", ctypes.c_int64),
        ("call_timeout_ms", ctypes.c_int64),
        ("max_chunk_bytes", ctypes.c_int64),
        ("tls_root_certs_path", ctypes.c_char_p),
        ("tls_cert_chain_path", ctypes.c_char_p),
        ("tls_private_key_path", ctypes.c_char_p),
        ("token", ctypes.c_char_p),
        ("tls_server_name", ctypes.c_char_p),
        ("token_file", ctypes.c_char_p),
    ]


class DirectionInfo(ctypes.Structure):
    _fields_ = [
        ("published", ctypes.c_int32),
        ("format", ctypes.c_int32),
        ("fp8_type", ctypes.c_int32),
        ("transposed", ctypes.c_int32),
        ("two_d", ctypes.c_int32),
        ("scale_elem_bytes", ctypes.c_int32),
        ("data_rows", ctypes.c_int64),
        ("data_row_bytes", ctypes.c_int64),
        ("data_bytes", ctypes.c_int64),
        ("scale_rows", ctypes.c_int64),
        ("scale_cols", ctypes.c_int64),
        ("scale_bytes", ctypes.c_int64),
    ]


class TensorInfo(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * MAX_RANK),
        ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64),
        ("num_pieces", ctypes.c_int32),
        ("dir", DirectionInfo * 2),
    ]


class FetchTarget(ctypes.Structure):
    _fields_ = [
        ("tensor", ctypes.c_char_p),
        ("direction", ctypes.c_int32),
        ("data", ctypes.c_void_p),
        ("data_bytes", ctypes.c_uint64),
        ("scales", ctypes.c_void_p),
        ("scale_bytes", ctypes.c_uint64),
        ("scale_inv", ctypes.c_void_p),
        ("amax", ctypes.c_void_p),
    ]


class FetchOutput(ctypes.Structure):
    _fields_ = [("scale_inv", ctypes.c_float), ("amax", ctypes.c_float)]


class FetchStats(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_int64),
        ("rowwise_bytes", ctypes.c_int64),
        ("columnwise_bytes", ctypes.c_int64),
        ("rowwise_bf16_bytes", ctypes.c_int64),
        ("columnwise_bf16_bytes", ctypes.c_int64),
    ]


class Gradient(ctypes.Structure):
    _fields_ = [
        ("tensor", ctypes.c_char_p),
        ("dtype", ctypes.c_int32),
        ("data", ctypes.c_void_p),
        ("bytes", ctypes.c_uint64),
    ]


class PushResult(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_int64),
        ("bytes_sent", ctypes.c_int64),
        ("pushers_received", ctypes.c_int32),
        ("pushers_expected", ctypes.c_int32),
    ]


class VersionInfo(ctypes.Structure):
    _fields_ = [
        ("committed_version", ctypes.c_int64),
        ("rewound", ctypes.c_int32),
        ("rewound_to_version", ctypes.c_int64),
        ("recovery_epoch", ctypes.c_int64),
    ]


PROGRESS_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
VERSION_EVENT_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p,
                                    ctypes.POINTER(VersionInfo))


class LoadOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("model", ctypes.c_char_p),
        ("recipe_text", ctypes.c_char_p),
        ("force", ctypes.c_int32),
        ("stream", ctypes.c_int32),
        ("timeout_ms", ctypes.c_int64),
        ("progress", PROGRESS_FN),
        ("progress_arg", ctypes.c_void_p),
    ]


DTYPE_F32 = 0   # HPD_DTYPE_F32
DTYPE_BF16 = 1  # HPD_DTYPE_BF16
# Frozen buffers (loaded, checkpointed, exported whole, never stepped).
DTYPE_F64, DTYPE_I64, DTYPE_I32, DTYPE_I16, DTYPE_I8, DTYPE_U8, DTYPE_BOOL = range(2, 9)
DTYPE_U16, DTYPE_U32, DTYPE_U64 = 9, 10, 11
DTYPE_F8_E4M3, DTYPE_F8_E5M2, DTYPE_F8_E8M0 = 12, 13, 14
# The safetensors names of the frozen buffers' dtypes (for errors).
DTYPE_NAMES = {DTYPE_F64: "F64", DTYPE_I64: "I64", DTYPE_I32: "I32", DTYPE_I16: "I16",
               DTYPE_I8: "I8", DTYPE_U8: "U8", DTYPE_BOOL: "BOOL", DTYPE_U16: "U16",
               DTYPE_U32: "U32", DTYPE_U64: "U64", DTYPE_F8_E4M3: "F8_E4M3",
               DTYPE_F8_E5M2: "F8_E5M2", DTYPE_F8_E8M0: "F8_E8M0"}
VALUES = {"master": 0, "rowwise": 1, "columnwise": 2}  # HPD_VALUES_*


class HostTensor(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("ndim", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("data", ctypes.c_void_p),
        ("data_bytes", ctypes.c_int64),
    ]


class ReadOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("version", ctypes.c_int64),
        ("dtype", ctypes.c_int32),
        ("values", ctypes.c_int32),
        ("checkpoint_dir", ctypes.c_char_p),
        ("timeout_ms", ctypes.c_int64),
    ]


TENSOR_DEST_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
                                  ctypes.POINTER(ctypes.c_int64), ctypes.c_int32,
                                  ctypes.c_int32, ctypes.c_int64)

_P = ctypes.POINTER
_vp = ctypes.c_void_p
_i32 = ctypes.c_int32
_i64 = ctypes.c_int64
_sz = ctypes.c_size_t
_st = _P(Status)

_SIGNATURES = {
    "hpd_api_version": (_i32, []),
    "hpd_code_name": (ctypes.c_char_p, [_i32]),
    "hpd_has_cuda": (_i32, []),
    "hpd_connect_options_init": (None, [_P(ConnectOptions)]),
    "hpd_connect": (_i32, [_P(ConnectOptions), _P(_vp), _st]),
    "hpd_close": (_i32, [_vp, _st]),
    "hpd_member": (_i32, [_vp, _P(_i32), ctypes.c_char_p, _sz, _st]),
    "hpd_get_manifest": (_i32, [_vp, _i32, _P(_vp), _st]),
    "hpd_manifest_free": (None, [_vp]),
    "hpd_manifest_num_tensors": (_i32, [_vp, _P(_i64), _st]),
    "hpd_manifest_summary": (_i32, [_vp, _P(_i32), _P(_i32), _P(_i64), _st]),
    "hpd_manifest_tensor": (_i32, [_vp, _i64, _P(TensorInfo), _st]),
    "hpd_manifest_find": (_i32, [_vp, ctypes.c_char_p, _P(_i64), _st]),
    "hpd_wait_for_version": (_i32, [_vp, _i64, _i64, _P(_i64), _st]),
    "hpd_fetch": (_i32, [_vp, _i64, _P(FetchTarget), _sz, _i64, _P(FetchOutput),
                         _P(FetchStats), _st]),
    "hpd_fetch_device": (_i32, [_vp, _i64, _P(FetchTarget), _sz, _i32, _vp, _i64,
                                _P(FetchStats), _st]),
    "hpd_push_gradients": (_i32, [_vp, _i64, _P(Gradient), _sz, _i32, _vp, _i64,
                                  _P(PushResult), _st]),
    "hpd_push_gradients_ex": (_i32, [_vp, _i64, _P(Gradient), _sz, _i32, _vp, _i64,
                                     ctypes.c_uint32, _P(PushResult), _st]),
    "hpd_status_json": (_i32, [_vp, _i32, _i64, _P(_vp), _st]),
    "hpd_load": (_i32, [_vp, ctypes.c_char_p, ctypes.c_char_p, _i64, _P(_i64), _st]),
    "hpd_step": (_i32, [_vp, _i64, _i32, _i64, _P(_i64), _st]),
    "hpd_wait_for_version_info": (_i32, [_vp, _i64, _i64, _P(VersionInfo), _st]),
    "hpd_watch_version": (_i32, [_vp, _i64, _i64, VERSION_EVENT_FN, _vp, _st]),
    "hpd_load_options_init": (None, [_P(LoadOptions)]),
    "hpd_load_model": (_i32, [_vp, _P(LoadOptions), _P(_i64), _st]),
    "hpd_set_optimizer_schedule": (_i32, [_vp, ctypes.c_char_p, _i32, ctypes.c_float, _i64,
                                          _P(_vp), _st]),
    "hpd_free_string": (None, [_vp]),
    "hpd_load_tensors": (_i32, [_vp, _P(HostTensor), _i64, _P(LoadOptions), _P(_i64), _st]),
    "hpd_read_options_init": (None, [_P(ReadOptions)]),
    "hpd_read_version": (_i32, [_vp, _P(ReadOptions), TENSOR_DEST_FN, _vp, _P(_i64), _st]),
    "hpd_export": (_i32, [_vp, ctypes.c_char_p, _P(ReadOptions), _i64, _i32, _i32, _P(_vp),
                          _st]),
    "hpd_checkpoint_call": (_i32, [_vp, ctypes.c_char_p, ctypes.c_char_p, _i64, _P(_vp), _st]),
}

_lib = None
_lib_lock = threading.Lock()


def library_candidates():
    """The paths tried, in order (see the module docstring)."""
    env = os.environ.get("HYBRID_PARAMD_LIB")
    if env:
        return [env]
    here = os.path.dirname(os.path.abspath(__file__))
    return [
        os.path.join(here, "_lib", "libhybrid_paramd.so"),
        os.path.join(here, "libhybrid_paramd.so"),
        os.path.join(here, "..", "..", "bazel-bin", "client", "libhybrid_paramd.so"),
    ]


def lib():
    """The loaded library (loaded on first use)."""
    global _lib
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        tried = library_candidates()
        path = next((p for p in tried if os.path.exists(p)), None)
        if path is None and os.environ.get("HYBRID_PARAMD_LIB"):
            raise OSError("libhybrid_paramd.so not found at $HYBRID_PARAMD_LIB=%s; unset it "
                          "to use the package's own library" % tried[0])
        if path is None:
            raise OSError(
                "libhybrid_paramd.so not found; tried " + ", ".join(tried) +
                ". Install the wheel (`bazel build //python:wheel`), build the library "
                "(`bazel build //client:libhybrid_paramd.so`) or set HYBRID_PARAMD_LIB to "
                "its path")
        l = ctypes.CDLL(os.path.abspath(path), mode=os.RTLD_LOCAL | os.RTLD_NOW)
        for name, (restype, argtypes) in _SIGNATURES.items():
            f = getattr(l, name)
            f.restype = restype
            f.argtypes = argtypes
        version = l.hpd_api_version()
        if version // 1000 != API_VERSION // 1000 or version < API_VERSION:
            raise OSError("%s has C API version %d; this package needs %d.x >= %d" %
                          (path, version, API_VERSION // 1000, API_VERSION))
        l.path = path
        _lib = l
        return l
