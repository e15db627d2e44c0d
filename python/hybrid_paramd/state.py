"""Whole models in and out of a cluster, from Python: a torch state_dict
loaded without a file, a committed version read back as torch tensors,
exports to Hugging Face safetensors and checkpoints (client/c_api.h,
"Models in memory, ..."). Non-floating tensors (int64 position ids, bool
masks, step counters) and FP64 ones are frozen buffers: loaded,
checkpointed, exported and returned by state_dict() as they were, never
stepped. Client inherits these methods:

    c.load_state_dict(model.state_dict(), force=True)   # version 0
    sd = c.state_dict()                                  # BF16 masters, CPU
    model.load_state_dict(sd)
    c.checkpoint()                    # {"version": ..., "path": ...}
    c.export("/models/out")           # BF16 safetensors + index
    c.describe_checkpoint()           # the newest checkpoint's manifest
"""

import collections
import collections.abc
import ctypes
import json

import torch

from . import _capi
from . import errors
from ._util import ms, raise_for

_SOURCE_DTYPES = {torch.float32: _capi.DTYPE_F32, torch.bfloat16: _capi.DTYPE_BF16}
_EXACT_AS_FP32 = (torch.float16,)  # widened to FP32 without loss
# Frozen buffers: sent whole, returned as they were.
_FROZEN_DTYPES = {torch.float64: _capi.DTYPE_F64, torch.int64: _capi.DTYPE_I64,
                  torch.int32: _capi.DTYPE_I32, torch.int16: _capi.DTYPE_I16,
                  torch.int8: _capi.DTYPE_I8, torch.uint8: _capi.DTYPE_U8,
                  torch.bool: _capi.DTYPE_BOOL}
for _name, _code in (("uint16", _capi.DTYPE_U16), ("uint32", _capi.DTYPE_U32),
                     ("uint64", _capi.DTYPE_U64),  # torch >= 2.3
                     ("float8_e4m3fn", _capi.DTYPE_F8_E4M3), ("float8_e5m2", _capi.DTYPE_F8_E5M2),
                     ("float8_e8m0fnu", _capi.DTYPE_F8_E8M0)):  # torch >= 2.1, 2.7
    if hasattr(torch, _name):
        _FROZEN_DTYPES[getattr(torch, _name)] = _code
_READ_DTYPES = {"bf16": _capi.DTYPE_BF16, "bfloat16": _capi.DTYPE_BF16,
                "fp32": _capi.DTYPE_F32, "float32": _capi.DTYPE_F32,
                torch.bfloat16: _capi.DTYPE_BF16, torch.float32: _capi.DTYPE_F32}
_TORCH_OF = {_capi.DTYPE_BF16: torch.bfloat16, _capi.DTYPE_F32: torch.float32}
_TORCH_OF.update({code: dtype for dtype, code in _FROZEN_DTYPES.items()})
_NOT_NUMBERS = ("path", "dir", "name", "metadata")  # JSON strings that stay strings


def _names_line(names, limit=8):
    shown = ", ".join(names[:limit])
    return shown + (" and %d more" % (len(names) - limit) if len(names) > limit else "")


def _as_source(name, value):
    """(a contiguous CPU tensor, its C dtype) for one state_dict entry; the
    reason as a string when it cannot be loaded."""
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            return None, "%s is a %s, not a tensor" % (name, type(value).__name__)
    t = value.detach()
    if t.dtype in _EXACT_AS_FP32:
        t = t.float()
    code = _SOURCE_DTYPES.get(t.dtype, _FROZEN_DTYPES.get(t.dtype))
    if code is None:
        return None, "%s is %s" % (name, str(t.dtype).replace("torch.", ""))
    return t.to("cpu").contiguous(), code


def _numbers(x, key=None):
    """Protobuf JSON writes 64-bit integers as strings: back to ints."""
    if isinstance(x, dict):
        return {k: (v if k in _NOT_NUMBERS else _numbers(v, k)) for k, v in x.items()}
    if isinstance(x, list):
        return [_numbers(v, key) for v in x]
    if isinstance(x, str) and x.lstrip("-").isdigit():
        return int(x)
    return x


def _read_options(lib, version, dtype, values, checkpoint_dir, timeout):
    o = _capi.ReadOptions()
    lib.hpd_read_options_init(ctypes.byref(o))
    o.version = int(version)
    if dtype not in _READ_DTYPES:
        raise ValueError("dtype must be torch.bfloat16, torch.float32, 'bf16' or 'fp32', not %r"
                         % (dtype,))
    o.dtype = _READ_DTYPES[dtype]
    if values not in _capi.VALUES:
        raise ValueError("values must be one of %s, not %r" % (sorted(_capi.VALUES), values))
    o.values = _capi.VALUES[values]
    o.checkpoint_dir = None if checkpoint_dir is None else str(checkpoint_dir).encode()
    o.timeout_ms = ms(timeout)
    return o


class StateDictMixin:
    """Client's whole-model methods (see the module docstring). Expects
    self._lib, self._handle() and self.manifest(refresh=True)."""

    def load_state_dict(self, state_dict, recipe_text=None, force=False, progress=None,
                        timeout=None):
        """Loads the tensors of `state_dict` (name -> torch tensor on any
        device, or anything torch.as_tensor takes) as the cluster's model and
        returns the committed version (0). FP32 and BF16 values are sent as
        they are, FP16 as FP32 (exact); CUDA tensors are copied to the host
        first. Integer, bool and FP64 tensors (position ids, masks, step
        counters) are frozen buffers: kept whole, never stepped (at most the
        cluster's --max_frozen_bytes in all, 16 MiB by default), and so are
        FP8 tensors where torch has the dtype. Any other dtype (complex) is
        refused, naming every such tensor, before
        anything is sent. recipe_text, force, progress, timeout: as
        load()."""
        if not isinstance(state_dict, collections.abc.Mapping):
            raise TypeError("state_dict must be a mapping of names to tensors, not %s"
                            % type(state_dict).__name__)
        if not state_dict:
            raise errors.InvalidArgument(3, "the state_dict is empty")
        tensors, refused = [], []
        for name, value in state_dict.items():
            if not isinstance(name, str):
                raise TypeError("state_dict keys must be strings, not %r" % (name,))
            t, dtype = _as_source(name, value)
            if t is None:
                refused.append(dtype)
            else:
                tensors.append((name, t, dtype))
        if refused:
            raise errors.InvalidArgument(
                3, "%d of %d tensors cannot be loaded (FP32, BF16 and FP16 are trained; "
                "integer, bool and FP64 ones kept as frozen buffers): %s" %
                (len(refused), len(state_dict), _names_line(refused)))
        arr = (_capi.HostTensor * len(tensors))()
        keep = []  # the shape arrays and encoded names, alive during the call
        for i, (name, t, dtype) in enumerate(tensors):
            shape = (ctypes.c_int64 * max(1, t.dim()))(*t.shape)
            encoded = name.encode()
            keep.append((shape, encoded))
            arr[i].name = encoded
            arr[i].shape = shape
            arr[i].ndim = t.dim()
            arr[i].dtype = dtype
            arr[i].data = t.data_ptr() if t.numel() else None
            arr[i].data_bytes = t.numel() * t.element_size()
        o, failure = self._load_options(recipe_text, force, timeout, progress)
        v = ctypes.c_int64()
        st = _capi.Status()
        raise_for(self._lib.hpd_load_tensors(self._handle(), arr, len(tensors), ctypes.byref(o),
                                             ctypes.byref(v), ctypes.byref(st)), st)
        self.manifest(refresh=True)
        self._report_progress_failure(failure)
        return v.value

    def state_dict(self, version=-1, dtype=torch.bfloat16, device="cpu", values="master",
                   checkpoint_dir=None, timeout=None):
        """A committed version (-1: the newest) as an OrderedDict of torch
        tensors in manifest order, with the model file's shapes: the FP32
        masters as BF16 (round to nearest even, the export's rounding) or
        FP32 (bit for bit); values="rowwise" / "columnwise" gives the
        published copy of that direction dequantized instead. The frozen
        buffers follow, in their own dtype, as they were loaded. Read from the
        daemons over the network (a version they no longer hold from its
        checkpoint below checkpoint_dir, if any), then moved to `device`.
        FailedPrecondition when no model is loaded or the version is not
        committed; NotFound when it is gone."""
        o = _read_options(self._lib, version, dtype, values, checkpoint_dir, timeout)
        out = collections.OrderedDict()
        failure = []

        def dest(_, name, shape, ndim, c_dtype, nbytes):
            try:
                if c_dtype not in _TORCH_OF:
                    raise TypeError(
                        "frozen buffer %s is %s, which torch %s has no dtype for (FP8 needs "
                        "torch >= 2.1, F8_E8M0 torch >= 2.7; the bytes are in the model's "
                        "checkpoint and its export)" % (name.decode(), _capi.DTYPE_NAMES.get(
                            c_dtype, "dtype %d" % c_dtype), torch.__version__))
                t = torch.empty([shape[i] for i in range(ndim)], dtype=_TORCH_OF[c_dtype])
                out[name.decode()] = t
                return t.data_ptr() if nbytes else None
            except BaseException as e:  # must not unwind into C
                failure.append(e)
                return None

        v = ctypes.c_int64()
        st = _capi.Status()
        code = self._lib.hpd_read_version(self._handle(), ctypes.byref(o),
                                          _capi.TENSOR_DEST_FN(dest), None, ctypes.byref(v),
                                          ctypes.byref(st))
        if failure:
            raise failure[0]
        raise_for(code, st)
        if str(device) != "cpu":
            for name in out:
                out[name] = out[name].to(device)
        return out

    def export(self, path, version=-1, dtype="bf16", values="master", max_shard_bytes=0,
               overwrite=False, group_readable=False, checkpoint_dir=None, timeout=None):
        """Writes a committed version as Hugging Face safetensors into the
        directory `path` on this machine, as `hpctl export` does (shards of
        at most max_shard_bytes, 0: 5 GB; the index last; files 0600 unless
        group_readable). `path` must be new or empty unless overwrite, which
        replaces an older export there. Returns {"version", "files",
        "total_bytes", "num_tensors", "removed"}."""
        o = _read_options(self._lib, version, dtype, values, checkpoint_dir, timeout)
        p = ctypes.c_void_p()
        st = _capi.Status()
        raise_for(self._lib.hpd_export(self._handle(), str(path).encode(), ctypes.byref(o),
                                       int(max_shard_bytes), 1 if overwrite else 0,
                                       1 if group_readable else 0, ctypes.byref(p),
                                       ctypes.byref(st)), st)
        return self._take_json(p)

    def checkpoint(self, dir="", version=-1, keep=0, timeout=None):  # noqa: A002 (as hpctl)
        """Has every daemon write its shards of a committed version (-1: the
        newest) below the servers' --checkpoint_dir (in `dir`, relative to
        it), as `hpctl checkpoint` does; keep > 0 keeps only the newest
        `keep` checkpoints, -1 all, 0 the servers' default. Returns the
        CheckpointResponse as a dict ("version", "path", "total_bytes",
        "already_existed", ...). FailedPrecondition when the servers have no
        --checkpoint_dir."""
        return self._checkpoint_call("create", {"dir": dir, "version": int(version),
                                                "keep": int(keep)}, timeout)

    def list_checkpoints(self, dir="", timeout=None):  # noqa: A002
        """The complete checkpoints in `dir`, oldest first, as dicts."""
        return self._checkpoint_call("list", {"dir": dir}, timeout).get("checkpoints", [])

    def describe_checkpoint(self, version=-1, dir="", verify=False, timeout=None):  # noqa: A002
        """The manifest of checkpoint `version` (-1: the newest) as a dict
        ("path", "manifest": version, tensors, shards, metadata); with
        verify=True every shard file's checksum is checked first."""
        return self._checkpoint_call("describe", {"dir": dir, "version": int(version),
                                                  "verify": bool(verify)}, timeout)

    def _checkpoint_call(self, call, request, timeout):
        p = ctypes.c_void_p()
        st = _capi.Status()
        raise_for(self._lib.hpd_checkpoint_call(self._handle(), call.encode(),
                                                json.dumps(request).encode(), ms(timeout),
                                                ctypes.byref(p), ctypes.byref(st)), st)
        return self._take_json(p)

    def _take_json(self, p):
        try:
            return _numbers(json.loads(ctypes.string_at(p.value).decode()))
        finally:
            self._lib.hpd_free_string(p)
