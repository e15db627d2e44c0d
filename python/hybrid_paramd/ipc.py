"""Same-GPU sessions: a trainer on a daemon's own GPU reads the daemon's
published weights in place (client/c_api_ipc.h; docs/ARCHITECTURE.md
"Co-located trainers").

    with hp.Client(address) as c, hp.IpcSession(c, daemon=0) as s:
        v = s.acquire()                      # pins the latest version
        w = v["w", "rowwise"].data           # torch CUDA tensor: the daemon's bytes
        ...
        v = s.acquire(v.version + 1)         # pins v+1, then releases v

No copy: the torch tensors are views (torch.as_tensor over
__cuda_array_interface__) of the daemon's published buffers, mapped into
this process. They are valid while the version stays acquired: until the
next acquire() or release() of the session, or its close(). The daemon's
step that would rewrite them waits for the pin meanwhile. Do not keep the
tensors past the release: the memory stays mapped (no crash) but holds
later versions' bytes. Copy (`.clone()`) what must outlive the pin.

Gradients: gradient_buffer(nbytes) gives a uint8 CUDA tensor the daemon
maps; view it as the gradients' dtype, write into it, and push({name:
tensor}) with tensors lying in it: the daemon reads them in place (NaN /
Inf, stale, duplicate pushes refused, nothing added).

The library must be built with --config=cuda (Unimplemented otherwise).
One session is used by one thread at a time; close sessions before their
Client.
"""

import ctypes

import torch

from . import _capi
from . import client as _client
from . import errors
from . import formats as F

__all__ = ["IpcSession", "IpcVersion", "IpcView"]


class _View(ctypes.Structure):
    _fields_ = [
        ("tensor", ctypes.c_char_p),
        ("direction", ctypes.c_int32),
        ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64),
        ("row_begin", ctypes.c_int64),
        ("row_end", ctypes.c_int64),
        ("data", ctypes.c_void_p),
        ("data_bytes", ctypes.c_uint64),
        ("scales", ctypes.c_void_p),
        ("scale_bytes", ctypes.c_uint64),
        ("scale_inv", ctypes.c_void_p),
        ("amax", ctypes.c_void_p),
    ]


from ._capi import _P, _vp, _i32, _i64, _sz, _st  # noqa: E402  (the same ctypes aliases)

_SIGNATURES = {
    "hpd_ipc_open": (_i32, [_vp, _i32, _i32, _i64, _P(_vp), _st]),
    "hpd_ipc_close": (_i32, [_vp, _st]),
    "hpd_ipc_acquire": (_i32, [_vp, _i64, _P(ctypes.c_char_p), _P(_i32), _sz, _P(_i64), _P(_sz),
                               _st]),
    "hpd_ipc_view_at": (_i32, [_vp, _sz, _P(_View), _st]),
    "hpd_ipc_release": (_i32, [_vp, _st]),
    "hpd_ipc_gradient_buffer": (_i32, [_vp, ctypes.c_uint64, _P(_vp), _st]),
    "hpd_ipc_push": (_i32, [_vp, _i64, _P(_capi.Gradient), _sz, _P(_capi.PushResult), _st]),
    "hpd_ipc_stats": (_i32, [_vp, _P(_i64), _P(_i64), _st]),
}
_ready = False


def _lib():
    global _ready
    lib = _capi.lib()
    if not _ready:
        for name, (restype, argtypes) in _SIGNATURES.items():
            f = getattr(lib, name, None)
            if f is None:
                raise errors.Unimplemented(
                    12, "%s has no same-GPU calls (%s): rebuild it" % (lib.path, name))
            f.restype = restype
            f.argtypes = argtypes
        _ready = True
    return lib


class _Cuda:
    """A device buffer for torch.as_tensor (no copy; kept alive by the tensor)."""

    def __init__(self, ptr, nbytes, typestr="|u1", itemsize=1, owner=None):
        self.__cuda_array_interface__ = {
            "shape": (nbytes // itemsize,),
            "typestr": typestr,
            "data": (ptr, False),
            "version": 2,
        }
        self._owner = owner  # the session: the mapping lives as long as it


def _tensor(ptr, nbytes, device, typestr="|u1", itemsize=1, owner=None):
    return torch.as_tensor(_Cuda(ptr, nbytes, typestr, itemsize, owner), device=device)


class IpcView:
    """One published direction of one tensor (this daemon's rows of it) of
    an acquired version, in place.

    data / scales   torch CUDA tensors over the daemon's buffers: for a whole
                    tensor with the dtype and shape of Fetched.data /
                    .scales (client.py); for a piece of a split tensor the
                    raw bytes (uint8); scales None without a scale buffer.
    scale_inv_tensor / amax_tensor   0-dim float32 CUDA tensors (in place).
    scale_inv / amax  their values (a device read).
    whole, rows, cols, row_begin, row_end, info (DirectionInfo), version.
    """

    def __init__(self, session, version, v, info, device):
        self._session = session
        self._generation = session._generation
        self.version = version
        self.tensor = v.tensor.decode()
        self.direction = int(v.direction)
        self.rows, self.cols = int(v.rows), int(v.cols)
        self.row_begin, self.row_end = int(v.row_begin), int(v.row_end)
        self.whole = self.row_begin == 0 and self.row_end == self.rows
        self.info = info
        self._device = device
        self._ptrs = (v.data, int(v.data_bytes), v.scales, int(v.scale_bytes), v.scale_inv, v.amax)
        self._data = self._scales = self._scale_inv = self._amax = None

    def _check(self):
        if self._session._generation != self._generation:
            raise errors.FailedPrecondition(
                9, "version %d of %s was released: acquire it again" % (self.version, self.tensor))

    @property
    def data(self):
        self._check()
        if self._data is None:
            ptr, n = self._ptrs[0], self._ptrs[1]
            raw = _tensor(ptr, n, self._device, owner=self._session)
            if self.whole and self.info is not None:
                raw = raw.view(F.data_dtype(self.info.format, self.info.fp8_type))
                raw = raw.view(self.info.data_shape)
            self._data = raw
        return self._data

    @property
    def scales(self):
        self._check()
        ptr, n = self._ptrs[2], self._ptrs[3]
        if n == 0 or not ptr:
            return None
        if self._scales is None:
            raw = _tensor(ptr, n, self._device, owner=self._session)
            if self.whole and self.info is not None:
                dt = torch.float32 if self.info.scale_elem_bytes == 4 else torch.uint8
                raw = raw.view(dt).view(self.info.scale_shape)
            self._scales = raw
        return self._scales

    @property
    def scale_inv_tensor(self):
        self._check()
        if self._scale_inv is None:
            self._scale_inv = _tensor(self._ptrs[4], 4, self._device, "<f4", 4,
                                      self._session).view(())
        return self._scale_inv

    @property
    def amax_tensor(self):
        self._check()
        if self._amax is None:
            self._amax = _tensor(self._ptrs[5], 4, self._device, "<f4", 4,
                                 self._session).view(())
        return self._amax

    scale_inv = property(lambda self: float(self.scale_inv_tensor.item()))
    amax = property(lambda self: float(self.amax_tensor.item()))
    format = property(lambda self: self.info.format)
    fp8_type = property(lambda self: self.info.fp8_type)
    transposed = property(lambda self: self.info.transposed)

    def dequantize(self, dtype=torch.float32):
        """The [M, K] weight as `dtype` (whole tensors only; a new tensor)."""
        if not self.whole:
            raise errors.InvalidArgument(3, "%s is split across daemons: fetch it with "
                                            "Client.fetch(device='cuda')" % self.tensor)
        return F.dequantize(self, dtype)

    def __repr__(self):
        return "IpcView(%s %s v%d rows [%d, %d) of %d)" % (
            self.tensor, F.DIRECTION_NAMES[self.direction], self.version, self.row_begin,
            self.row_end, self.rows)


class IpcVersion:
    """An acquired version: views by (tensor, direction name or number)."""

    def __init__(self, version, views):
        self.version = version
        self.views = views

    def __getitem__(self, key):
        name, d = key
        d = F.parse_direction(d)
        for v in self.views:
            if v.tensor == name and v.direction == d:
                return v
        raise KeyError(key)

    def __iter__(self):
        return iter(self.views)

    def __len__(self):
        return len(self.views)


class IpcSession:
    """A same-GPU session with daemon `daemon` of `client`'s manifest, which
    must run on CUDA device `device` (default: torch's current device).
    lease: seconds a session not renewed lives on (its keep-alive renews it)."""

    def __init__(self, client, daemon=0, device=None, lease=5.0):
        if not torch.cuda.is_available():
            raise errors.FailedPrecondition(9, "torch sees no CUDA device")
        self._lib = _lib()
        self._client = client
        self._device_index = torch.cuda.current_device() if device is None else int(
            torch.device(device).index if isinstance(device, (str, torch.device)) else device)
        self.device = torch.device("cuda", self._device_index)
        self._generation = 0  # bumped at every acquire / release: views of older ones refuse
        self._buffers = []
        h = ctypes.c_void_p()
        st = _capi.Status()
        _client._raise_for(self._lib.hpd_ipc_open(client._handle(), int(daemon), self._device_index,
                                                  _client._ms(lease), ctypes.byref(h),
                                                  ctypes.byref(st)), st)
        self._h = h

    def _handle(self):
        if self._h is None:
            raise errors.FailedPrecondition(9, "the IPC session is closed")
        return self._h

    def acquire(self, version=-1, names=None, directions=("rowwise", "columnwise")):
        """Pins `version` (-1: the newest this daemon publishes) of `names`
        (None: every tensor this daemon holds) x `directions` (every
        published direction when names is None) and releases the version
        acquired before. Returns an IpcVersion."""
        tensors, dirs = [], []
        if names is not None:
            for n in ([names] if isinstance(names, str) else names):
                for d in directions:
                    tensors.append(str(n).encode())
                    dirs.append(F.parse_direction(d))
        n = len(tensors)
        t_arr = (ctypes.c_char_p * max(n, 1))(*tensors)
        d_arr = (ctypes.c_int32 * max(n, 1))(*dirs)
        got = ctypes.c_int64()
        count = ctypes.c_size_t()
        st = _capi.Status()
        self._generation += 1
        _client._raise_for(self._lib.hpd_ipc_acquire(self._handle(), int(version), t_arr, d_arr, n,
                                                     ctypes.byref(got), ctypes.byref(count),
                                                     ctypes.byref(st)), st)
        manifest = self._client.manifest()
        views = []
        for i in range(count.value):
            v = _View()
            _client._raise_for(self._lib.hpd_ipc_view_at(self._h, i, ctypes.byref(v),
                                                         ctypes.byref(st)), st)
            name = v.tensor.decode()
            info = manifest[name].direction(int(v.direction)) if name in manifest else None
            views.append(IpcView(self, got.value, v, info, self.device))
        return IpcVersion(got.value, views)

    def release(self):
        """Releases the acquired version (its views refuse from now on)."""
        self._generation += 1
        st = _capi.Status()
        _client._raise_for(self._lib.hpd_ipc_release(self._handle(), ctypes.byref(st)), st)

    def gradient_buffer(self, nbytes):
        """A uint8 CUDA tensor of `nbytes` the daemon maps (owned by the
        session, freed at close)."""
        p = ctypes.c_void_p()
        st = _capi.Status()
        _client._raise_for(self._lib.hpd_ipc_gradient_buffer(self._handle(), int(nbytes),
                                                             ctypes.byref(p), ctypes.byref(st)),
                           st)
        t = _tensor(p.value, int(nbytes), self.device, owner=self)
        self._buffers.append(t)
        return t

    def push(self, version, gradients):
        """Pushes {name: CUDA tensor (float32 or bfloat16, the whole tensor,
        lying in a gradient_buffer)} for `version`; the daemon reads them in
        place. Synchronises the current stream first. Returns
        (pushers_received, pushers_expected)."""
        arr = (_capi.Gradient * max(len(gradients), 1))()
        keep = []
        for i, (name, t) in enumerate(gradients.items()):
            if t.dtype not in (torch.float32, torch.bfloat16):
                raise errors.InvalidArgument(3, "gradient %s: float32 or bfloat16, not %s" %
                                             (name, t.dtype))
            if not t.is_contiguous():
                raise errors.InvalidArgument(3, "gradient %s is not contiguous" % name)
            enc = str(name).encode()
            keep.append(enc)
            arr[i].tensor = enc
            arr[i].dtype = 1 if t.dtype == torch.bfloat16 else 0
            arr[i].data = t.data_ptr()
            arr[i].bytes = t.numel() * t.element_size()
        torch.cuda.current_stream(self.device).synchronize()
        r = _capi.PushResult()
        st = _capi.Status()
        _client._raise_for(self._lib.hpd_ipc_push(self._handle(), int(version), arr,
                                                  len(gradients), ctypes.byref(r),
                                                  ctypes.byref(st)), st)
        return r.pushers_received, r.pushers_expected

    def stats(self):
        """(page_acquires, rpc_acquires): how the acquires were pinned."""
        a, b = ctypes.c_int64(), ctypes.c_int64()
        st = _capi.Status()
        _client._raise_for(self._lib.hpd_ipc_stats(self._handle(), ctypes.byref(a),
                                                   ctypes.byref(b), ctypes.byref(st)), st)
        return a.value, b.value

    def close(self):
        """Releases the pin, unmaps the daemon's buffers and ends the session
        (idempotent). Synchronises the device first: no kernel may still
        read the mappings."""
        if self._h is not None:
            torch.cuda.synchronize(self.device)
            self._generation += 1
            h, self._h = self._h, None
            self._buffers = []
            st = _capi.Status()
            _client._raise_for(self._lib.hpd_ipc_close(h, ctypes.byref(st)), st)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass
