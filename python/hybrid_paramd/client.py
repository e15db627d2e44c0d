"""The trainer's client: connect, manifest, wait, fetch, push (client/c_api.h).

    import hybrid_paramd as hp
    c = hp.Client("127.0.0.1:7070")
    v = c.wait_for_version(0)
    w = c.fetch(v, directions=["rowwise"])          # every tensor's rowwise copy
    f = w["fc1.weight", "rowwise"]                  # a Fetched
    f.data, f.scales, f.scale_inv, f.format_name, f.transposed, f.shape
    c.push_gradients(v, {"fc1.weight": grad})       # CPU or CUDA tensors, numpy on CPU

Every failed call raises hybrid_paramd.Error (a subclass per gRPC code,
e.g. hybrid_paramd.Unavailable) with `.code` / `.code_name`; a rewind of
the cluster (recovery) raises hybrid_paramd.RewoundError (an Aborted) with
`.version`.

Threading: a Client may be used from several threads (the library releases
the GIL during calls); close() must not race with other calls.
"""

import collections
import collections.abc
import ctypes
import json
import operator
import sys
import threading
import time

import torch

from . import _capi
from . import errors
from . import formats as F
from ._util import ms, raise_for
from .state import StateDictMixin
from .fetched import SCALARS_STRIDE, Fetched, FetchResult, _Scalars  # noqa: F401 (re-exported)

_ALIGN = 64  # every buffer of a fetch starts 64-byte aligned in its allocation


_raise_for = raise_for
_ms = ms


def _version(v):
    """An int version (numpy integers too); TypeError for anything else
    (a float such as 1.5 would otherwise be truncated silently)."""
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError("version must be an integer, not %r" % (v,)) from None


def _sequence(x):
    """A name or direction given alone, as a one-element tuple."""
    return (x,) if isinstance(x, (str, int)) else x


VersionInfo = collections.namedtuple("VersionInfo",
                                     ["committed_version", "rewound_to", "recovery_epoch"])
VersionInfo.__doc__ = """What Client.wait_for_version_info returns: the committed version;
rewound_to, None or the version the cluster went back to (then equal to
committed_version: go back to it and push for it next); recovery_epoch, the
recoveries the cluster has completed."""


class DirectionInfo:
    """What a fetch of one direction of one tensor fills (kernels/format.h
    Layout): format, element types and buffer sizes, so callers can
    allocate."""

    __slots__ = ("direction", "published", "format", "format_name", "fp8_type", "element",
                 "transposed", "two_d", "data_shape", "data_bytes", "scale_shape",
                 "scale_bytes", "scale_elem_bytes", "scale_name")

    def __init__(self, direction, d):
        self.direction = direction
        self.published = bool(d.published)
        self.format = d.format
        self.format_name = F.FORMAT_NAMES.get(d.format, "unknown")
        self.fp8_type = d.fp8_type
        self.element = F.element_name(d.format, d.fp8_type)
        self.transposed = bool(d.transposed)
        self.two_d = bool(d.two_d)
        esize = {F.IDENTITY_BF16: 2, F.IDENTITY_FP32: 4}.get(d.format, 1)
        self.data_shape = (d.data_rows, d.data_row_bytes // esize)
        self.data_bytes = d.data_bytes
        self.scale_shape = (d.scale_rows, d.scale_cols)
        self.scale_bytes = d.scale_bytes
        self.scale_elem_bytes = d.scale_elem_bytes
        self.scale_name = F.scale_name(d.format) if d.scale_bytes > 0 else None

    def __repr__(self):
        return "DirectionInfo(%s %s, data %s %d B, scales %s %d B%s)" % (
            F.DIRECTION_NAMES[self.direction], self.format_name, self.data_shape,
            self.data_bytes, self.scale_shape, self.scale_bytes,
            ", transposed" if self.transposed else "")


class TensorInfo:
    """One tensor of the manifest: name, model shape, [M, K] and both
    directions' DirectionInfo (info.rowwise / info.columnwise)."""

    __slots__ = ("name", "shape", "rows", "cols", "num_pieces", "rowwise", "columnwise")

    def __init__(self, t):
        self.name = t.name.decode()
        self.shape = tuple(t.shape[i] for i in range(t.ndim))
        self.rows = t.rows
        self.cols = t.cols
        self.num_pieces = t.num_pieces
        self.rowwise = DirectionInfo(F.ROWWISE, t.dir[0])
        self.columnwise = DirectionInfo(F.COLUMNWISE, t.dir[1])

    def direction(self, d):
        return self.rowwise if F.parse_direction(d) == F.ROWWISE else self.columnwise

    def __repr__(self):
        return "TensorInfo(%s %s: %r, %r)" % (self.name, self.shape, self.rowwise,
                                               self.columnwise)


class Manifest:
    """The cluster's tensors in manifest order (iterable; manifest[name])."""

    def __init__(self, tensors, num_daemons, expected_pushers, committed_version):
        self.tensors = tensors
        self.by_name = {t.name: t for t in tensors}
        self.num_daemons = num_daemons
        self.expected_pushers = expected_pushers
        self.committed_version = committed_version

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)

    def __getitem__(self, name):
        return self.by_name[name]

    def __contains__(self, name):
        return name in self.by_name

    def names(self):
        return [t.name for t in self.tensors]

    def __repr__(self):
        names = self.names()
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        return "Manifest(committed version %d, %d daemons, %d pushers expected, %d tensors: %s)" % (
            self.committed_version, self.num_daemons, self.expected_pushers, len(names), shown)


class _Plan:
    """The fixed part of a fetch of some (tensor, direction) targets: the C
    target array, offsets in one allocation, and what the results need."""

    def __init__(self, manifest, pairs):
        n = len(pairs)
        self.n = n
        self.targets = (_capi.FetchTarget * n)()
        self.outputs = (_capi.FetchOutput * n)()
        self.names = []  # keeps the c_char_p bytes alive
        self.entries = []
        off = 0
        for i, (name, d) in enumerate(pairs):
            if name not in manifest:
                raise errors.NotFound(5, "no tensor %r in the manifest" % (name,))
            t = manifest[name]
            di = t.direction(d)
            if not di.published:
                raise errors.FailedPrecondition(
                    9, "tensor %r does not publish a %s copy" % (name, F.DIRECTION_NAMES[d]))
            b = name.encode()
            self.names.append(b)
            tgt = self.targets[i]
            tgt.tensor = b
            tgt.direction = d
            tgt.data_bytes = di.data_bytes
            tgt.scale_bytes = di.scale_bytes
            data_off = off
            off += (di.data_bytes + _ALIGN - 1) // _ALIGN * _ALIGN
            scale_off = off
            off += (di.scale_bytes + _ALIGN - 1) // _ALIGN * _ALIGN
            self.entries.append((t, di, data_off, scale_off))
        self.total = max(off, 1)
        # The destination addresses now written into `targets` (a fetch
        # into the same memory skips rewriting them).
        self.base = None
        self.scalars_ptr = None
        # Held by the fetch using `targets` / `outputs`; a concurrent fetch
        # of the same targets (another thread) works on copies instead.
        self.lock = threading.Lock()

    def private_arrays(self):
        """Copies of `targets` (destinations to be written) and a fresh
        `outputs`, for a fetch that runs while another holds `lock`."""
        tg = (_capi.FetchTarget * self.n)()
        ctypes.memmove(tg, self.targets, ctypes.sizeof(tg))
        return tg, (_capi.FetchOutput * self.n)()


class Client(StateDictMixin):
    """A connection to a hybrid-paramd cluster (client::Client over the C API).

    Client(address=None, name=None, observer=False, pusher=True, expected_pushers=0,
           connect_timeout=10.0, call_timeout=30.0, max_chunk_bytes=0,
           tls_ca=None, tls_cert=None, tls_key=None, tls_server_name=None,
           token=None, token_file=None)

    address is the coordinator's "host:port"; None: $PARAMD_COORDINATOR,
    else "127.0.0.1:7070". Times are seconds. observer=True joins without a
    rank (tools, tests);
    a trainer with pusher=True is counted among the pushers every step waits
    for.

    Security (docs/SECURITY.md), as hpctl's flags of the same names:
    tls_ca (PEM file of the CA that signed the servers' certificates;
    None, with no tls_cert either: $HPCTL_TLS_CA if set) turns TLS on; tls_cert / tls_key a client certificate for servers that
    require mutual TLS; tls_server_name the name the servers' certificates
    carry if not the address's host. token (a string) or token_file (a
    file with one bare token or `ROLE TOKEN` lines: the `trainer` line for
    trainers, the `operator` line for observers; neither given:
    $HPCTL_TOKEN_FILE if set) for a cluster started with --auth_token_file. A TLS server called in plaintext, a plaintext server
    called with a CA, a certificate the CA did not sign or a missing client
    certificate fail at once with FailedPrecondition saying which; so does
    an address where a daemon answers (naming its coordinator). A missing
    token is Unauthenticated, a token of the wrong role PermissionDenied.
    """

    def __init__(self, address=None, name=None, observer=False, pusher=True, expected_pushers=0,
                 connect_timeout=10.0, call_timeout=30.0, max_chunk_bytes=0,
                 tls_ca=None, tls_cert=None, tls_key=None, tls_server_name=None, token=None,
                 token_file=None):
        self._lib = _capi.lib()
        self._h = None
        self._status = _capi.Status()
        self._plans = {}
        self._manifest = None
        o = _capi.ConnectOptions()
        self._lib.hpd_connect_options_init(ctypes.byref(o))
        enc = lambda s: None if s is None else str(s).encode()
        o.address = enc(address)
        o.name = enc(name)
        o.observer = 1 if observer else 0
        o.pusher = 1 if pusher else 0
        o.expected_pushers = int(expected_pushers)
        o.connect_timeout_ms = _ms(connect_timeout)
        o.call_timeout_ms = _ms(call_timeout)
        o.max_chunk_bytes = int(max_chunk_bytes)
        o.tls_root_certs_path = enc(tls_ca)
        o.tls_cert_chain_path = enc(tls_cert)
        o.tls_private_key_path = enc(tls_key)
        o.tls_server_name = enc(tls_server_name)
        o.token = enc(token)
        o.token_file = enc(token_file)
        h = ctypes.c_void_p()
        st = _capi.Status()
        _raise_for(self._lib.hpd_connect(ctypes.byref(o), ctypes.byref(h), ctypes.byref(st)), st)
        self._h = h

    # ---- lifetime ----

    def close(self):
        """Leaves the cluster and frees the connection (idempotent)."""
        if self._h is not None:
            st = _capi.Status()
            h, self._h = self._h, None
            _raise_for(self._lib.hpd_close(h, ctypes.byref(st)), st)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown; nothing to report to
            pass

    def _handle(self):
        if self._h is None:
            raise errors.FailedPrecondition(9, "the client is closed")
        return self._h

    # ---- manifest and versions ----

    @property
    def rank(self):
        r = ctypes.c_int32()
        st = _capi.Status()
        _raise_for(self._lib.hpd_member(self._handle(), ctypes.byref(r), None, 0,
                                        ctypes.byref(st)), st)
        return r.value

    def manifest(self, refresh=False):
        """The Manifest (refresh=True: read it from the coordinator again)."""
        if self._manifest is not None and not refresh:
            return self._manifest
        st = _capi.Status()
        m = ctypes.c_void_p()
        _raise_for(self._lib.hpd_get_manifest(self._handle(), 1 if refresh else 0,
                                              ctypes.byref(m), ctypes.byref(st)), st)
        try:
            n = ctypes.c_int64()
            _raise_for(self._lib.hpd_manifest_num_tensors(m, ctypes.byref(n), ctypes.byref(st)),
                       st)
            tensors = []
            info = _capi.TensorInfo()
            for i in range(n.value):
                _raise_for(self._lib.hpd_manifest_tensor(m, i, ctypes.byref(info),
                                                         ctypes.byref(st)), st)
                tensors.append(TensorInfo(info))
            nd, ep, cv = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_int64()
            _raise_for(self._lib.hpd_manifest_summary(m, ctypes.byref(nd), ctypes.byref(ep),
                                                      ctypes.byref(cv), ctypes.byref(st)), st)
        finally:
            self._lib.hpd_manifest_free(m)
        self._manifest = Manifest(tensors, nd.value, ep.value, cv.value)
        self._plans.clear()
        return self._manifest

    def wait_for_version_info(self, min_version, timeout=30.0):
        """Blocks until the committed version is >= min_version or the
        cluster rewinds; returns a VersionInfo (DeadlineExceeded after
        `timeout` seconds). Each rewind is reported once per Client."""
        return self._wait_info(min_version, timeout)[0]

    def _wait_info(self, min_version, timeout):
        """(VersionInfo, seconds inside the library)."""
        info = _capi.VersionInfo()
        st = _capi.Status()
        start = time.perf_counter()
        code = self._lib.hpd_wait_for_version_info(self._handle(), _version(min_version), _ms(timeout),
                                                   ctypes.byref(info), ctypes.byref(st))
        seconds = time.perf_counter() - start
        _raise_for(code, st)
        return VersionInfo(info.committed_version,
                           info.rewound_to_version if info.rewound else None,
                           info.recovery_epoch), seconds

    @staticmethod
    def _raise_rewound(min_version, info):
        raise errors.RewoundError(
            info.rewound_to, info.recovery_epoch,
            "wait for version %d: the cluster rewound to version %d (recovery %d: a daemon "
            "was lost and replaced); go back to that version and push for it" %
            (min_version, info.rewound_to, info.recovery_epoch))

    def wait_for_version(self, min_version, timeout=30.0):
        """Blocks until the committed version is >= min_version; returns it
        (DeadlineExceeded after `timeout` seconds). RewoundError (with
        .version) if the cluster rewound meanwhile: go back to that
        version."""
        info = self._wait_info(min_version, timeout)[0]
        if info.rewound_to is not None:
            self._raise_rewound(min_version, info)
        return info.committed_version

    def watch_version(self, on_event, min_version=0, timeout=30.0):
        """Streams the committed version (Coordinator.WatchVersion): calls
        on_event(VersionInfo) on this thread once the committed version is
        >= min_version and again at every newer commit, until on_event
        returns False (then watch_version returns None), `timeout` seconds
        pass (DeadlineExceeded) or the stream fails. A rewind comes as an
        event with rewound_to set (committed_version is then that version,
        possibly below earlier events), reported once per Client as by
        wait_for_version_info; the client's manifest was refreshed first.
        An exception raised by on_event ends the watch and is re-raised
        here."""
        raised = []

        def event(_, info):
            c = info.contents
            try:
                go_on = on_event(VersionInfo(c.committed_version,
                                             c.rewound_to_version if c.rewound else None,
                                             c.recovery_epoch))
            except BaseException as e:  # noqa: B902 (re-raised below, after the C call)
                raised.append(e)
                return 0
            return 0 if go_on is False else 1

        callback = _capi.VERSION_EVENT_FN(event)  # alive for the whole call
        st = _capi.Status()
        code = self._lib.hpd_watch_version(self._handle(), _version(min_version), _ms(timeout),
                                           callback, None, ctypes.byref(st))
        if raised:
            raise raised[0]
        _raise_for(code, st)

    # ---- fetch ----

    def _plan(self, names, directions, targets):
        key = (names if names is None else tuple(names), tuple(directions),
               targets if targets is None else tuple(targets))
        plan = self._plans.get(key)
        if plan is None:
            m = self.manifest()
            dirs = [F.parse_direction(d) for d in directions]
            if targets is not None:
                pairs = [(n, F.parse_direction(d)) for n, d in targets]
            elif names is None:
                pairs = [(t.name, d) for t in m for d in dirs if t.direction(d).published]
            else:
                pairs = [(n, d) for n in names for d in dirs]
            plan = _Plan(m, pairs)
            if len(self._plans) > 64:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _fetch_into(self, plan, own, buf, scalars, dev, version, timeout):
        """The library call of fetch(): plan's targets pointed at `buf` (and,
        for CUDA, at the device slots of `scalars`), which it refills.
        `own`: this call holds plan.lock and may use (and keep) the plan's
        arrays; otherwise it works on private copies. Returns (FetchStats,
        seconds inside the library)."""
        n = plan.n
        if own:
            tg, outputs = plan.targets, plan.outputs
        else:
            tg, outputs = plan.private_arrays()
        base = buf.data_ptr()
        if not own or plan.base != base:
            for i, (_, _, data_off, scale_off) in enumerate(plan.entries):
                t = tg[i]
                t.data = base + data_off
                t.scales = base + scale_off
            if own:
                plan.base = base
        stats = _capi.FetchStats()
        st = _capi.Status()
        if dev.type == "cpu":
            lib_start = time.perf_counter()
            code = self._lib.hpd_fetch(self._handle(), int(version), tg, n, _ms(timeout),
                                       outputs, ctypes.byref(stats), ctypes.byref(st))
            lib_seconds = time.perf_counter() - lib_start
            _raise_for(code, st)
            # hpd_fetch_output is two floats: [scale_inv, amax] per target.
            scalars.set(memoryview(outputs).cast("B").cast("f").tolist(), None)
        elif dev.type == "cuda":
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            # The values stay on the device (no synchronising read here);
            # a reused result's slots are overwritten in stream order.
            slots = scalars.tensor
            if slots is None:
                slots = torch.empty(SCALARS_STRIDE * max(n, 1), dtype=torch.float32, device=dev)
            sp = slots.data_ptr()
            if not own or plan.scalars_ptr != sp:
                for i in range(n):
                    tg[i].scale_inv = sp + 4 * SCALARS_STRIDE * i
                    tg[i].amax = sp + 4 * SCALARS_STRIDE * i + 4
                if own:
                    plan.scalars_ptr = sp
            stream = torch.cuda.current_stream(index).cuda_stream
            lib_start = time.perf_counter()
            code = self._lib.hpd_fetch_device(self._handle(), int(version), tg, n, index,
                                              ctypes.c_void_p(stream), _ms(timeout),
                                              ctypes.byref(stats), ctypes.byref(st))
            lib_seconds = time.perf_counter() - lib_start
            _raise_for(code, st)
            scalars.set(None, slots)
        else:
            raise errors.InvalidArgument(3, "device must be cpu or cuda, not %s" % dev)
        return stats, lib_seconds

    def fetch(self, version=-1, names=None, directions=("rowwise",), device="cpu",
              timeout=None, targets=None, out=None):
        """Fetches (tensor, direction) copies of `version` (-1: the committed
        one) into freshly allocated torch memory on `device` (no extra
        copy: the library writes straight into it). names=None: every
        tensor publishing the direction; a name or a direction may be given
        alone instead of in a list. version: an integer (TypeError else).
        device: "cpu" (host data plane, any daemon backend) or a CUDA device (the daemons' NCCL device
        channels; needs --backend=gpu daemons and a CUDA build of the
        library); the fetch waits for the current CUDA stream first.
        targets: instead of names x directions, an explicit list of
        (name, direction) pairs. out: a previous FetchResult of the same
        targets and device, reused instead of allocating: its memory and
        Fetched objects are overwritten and `out` itself is returned
        (otherwise a new FetchResult). RewoundError when the latest version
        is asked for and the cluster rewound since the last wait."""
        start = time.perf_counter()
        wait_seconds = 0.0
        version = _version(version)
        if names is not None:
            names = _sequence(names)
        directions = _sequence(directions)
        if version < 0:
            # Resolved here (the one WaitForVersion the library would make)
            # so that a rewind raises RewoundError.
            info, wait_seconds = self._wait_info(0, 30.0 if timeout is None else timeout)
            if info.rewound_to is not None:
                self._raise_rewound(0, info)
            version = info.committed_version
        dev = torch.device(device)
        if dev.type == "cuda":
            _check_cuda()
        plan = self._plan(names, directions, targets)
        # A reused result keeps its memory and its objects: nothing of a
        # fetch's size is allocated, in C or in Python.
        reuse = out is not None and out._plan is plan and out._buf.device == dev
        buf = out._buf if reuse else torch.empty(plan.total, dtype=torch.uint8, device=dev)
        own = plan.lock.acquire(blocking=False)
        try:
            scalars = out._scalars if reuse else _Scalars()
            stats, lib_seconds = self._fetch_into(plan, own, buf, scalars, dev, version, timeout)
        finally:
            if own:
                plan.lock.release()
        lib_seconds += wait_seconds
        s = {"rowwise_bytes": stats.rowwise_bytes, "columnwise_bytes": stats.columnwise_bytes,
             "rowwise_bf16_bytes": stats.rowwise_bf16_bytes,
             "columnwise_bf16_bytes": stats.columnwise_bf16_bytes}
        if reuse:
            out._update(stats.version, s, time.perf_counter() - start, lib_seconds)
            return out
        items = [Fetched(t, di, buf, data_off, scale_off, scalars, i)
                 for i, (t, di, data_off, scale_off) in enumerate(plan.entries)]
        result = FetchResult(stats.version, items, s, time.perf_counter() - start, lib_seconds)
        result._plan = plan
        result._buf = buf
        result._scalars = scalars
        return result

    # ---- push ----

    def push_gradients(self, version, gradients, timeout=None, partial=False):
        """Pushes this trainer's gradients for `version`: {name: tensor} of
        whole tensors in the model's shape, float32 or bfloat16 (other
        float dtypes are converted to float32), all on the CPU (torch or
        numpy) or all on one CUDA device (sent over the device channels
        after the current stream). Give every gradient of the step in one
        call: a push that leaves out tensors is refused (InvalidArgument
        naming them) unless `partial=True`, when those count as zero.
        Returns a dict (version, bytes_sent, pushers_received,
        pushers_expected). TypeError for a non-dict or a gradient that is
        not floating point; ValueError for a gradient whose shape is not
        its tensor's (a transposed one has the right size, but not the
        right values in each place)."""
        if not isinstance(gradients, collections.abc.Mapping):
            raise TypeError("gradients must be a dict {tensor name: gradient}, not %s" %
                            type(gradients).__name__)
        self._check_gradient_shapes(gradients)
        n = len(gradients)
        arr = (_capi.Gradient * max(n, 1))()
        keep = []
        device = None
        for i, (name, g) in enumerate(gradients.items()):
            if not isinstance(g, torch.Tensor):
                g = torch.from_numpy(_as_numpy(g))
            if not g.is_floating_point():
                raise TypeError("gradient of %s has dtype %s: give a floating-point tensor" %
                                (name, g.dtype))
            if g.dtype not in (torch.float32, torch.bfloat16):
                g = g.to(torch.float32)
            g = g.contiguous()
            d = g.device
            if device is None:
                device = d
            elif d != device:
                raise errors.InvalidArgument(
                    3, "gradients on %s and %s: push from one device at a time" % (device, d))
            b = name.encode()
            keep.append((b, g))
            arr[i].tensor = b
            arr[i].dtype = 0 if g.dtype == torch.float32 else 1
            arr[i].data = g.data_ptr()
            arr[i].bytes = g.numel() * g.element_size()
        dev_index, stream = -1, None
        if device is not None and device.type == "cuda":
            _check_cuda()
            dev_index = device.index if device.index is not None else torch.cuda.current_device()
            stream = ctypes.c_void_p(torch.cuda.current_stream(dev_index).cuda_stream)
        r = _capi.PushResult()
        st = _capi.Status()
        flags = _capi.PUSH_PARTIAL if partial else 0
        _raise_for(self._lib.hpd_push_gradients_ex(self._handle(), _version(version), arr, n,
                                                   dev_index, stream, _ms(timeout), flags,
                                                   ctypes.byref(r), ctypes.byref(st)), st)
        del keep
        return {"version": r.version, "bytes_sent": r.bytes_sent,
                "pushers_received": r.pushers_received, "pushers_expected": r.pushers_expected}

    def _check_gradient_shapes(self, gradients):
        """ValueError unless each gradient has its tensor's model shape (the
        manifest is read again once if one differs: a new model may have
        been loaded). Unknown names are left to the library's check."""
        def mismatches(manifest):
            shapes = {t.name: tuple(t.shape) for t in manifest.tensors}
            return [(name, tuple(g.shape), shapes[name]) for name, g in gradients.items()
                    if name in shapes and tuple(g.shape) != shapes[name]]
        bad = mismatches(self.manifest())
        if bad:
            bad = mismatches(self.manifest(refresh=True))
        if bad:
            name, got, want = bad[0]
            raise ValueError("gradient of %s has shape %s; the tensor's shape is %s%s" %
                             (name, list(got), list(want),
                              " (%d more gradients of the wrong shape)" % (len(bad) - 1)
                              if len(bad) > 1 else ""))

    # ---- administration ----

    def status(self, include_shards=False, timeout=None):
        """The cluster status (rpc::GetStatusResponse) as a dict."""
        p = ctypes.c_void_p()
        st = _capi.Status()
        _raise_for(self._lib.hpd_status_json(self._handle(), 1 if include_shards else 0,
                                             _ms(timeout), ctypes.byref(p), ctypes.byref(st)),
                   st)
        try:
            return json.loads(ctypes.string_at(p.value).decode())
        finally:
            self._lib.hpd_free_string(p)

    def load(self, model, recipe_text=None, force=False, stream=False, progress=None,
             timeout=None):
        """Loads a model, as `hpctl load`, and refreshes the manifest;
        returns the committed version (0).

        model: a state_dict (a mapping of names to tensors: see
        load_state_dict), a .safetensors file, a directory (its
        model.safetensors.index.json if it has one, else every
        *.safetensors in it) or a Hugging Face index file (a sharded
        checkpoint). A single file is read by the daemons at its path
        unless stream=True; directories and indexes are always streamed:
        this process reads the files and sends the values (F32, BF16, F16)
        to the daemons, so no path need be shared with them; integer, bool
        and F64 tensors are frozen buffers (see load_state_dict). recipe_text:
        a recipe in protobuf text (None: the coordinator's). force=True
        replaces a model the cluster holds (its training state is
        discarded); without it that is FailedPrecondition. progress:
        callable(bytes_sent, bytes_total), called during a streamed load
        (from the library's threads, one call at a time). timeout: seconds
        (None: one hour)."""
        if isinstance(model, collections.abc.Mapping):
            return self.load_state_dict(model, recipe_text, force, progress, timeout)
        if str(model).endswith((".pt", ".pth", ".bin", ".ckpt")):
            raise errors.InvalidArgument(
                3, "%s is a torch pickle, which hybrid-paramd does not read: load it with "
                "sd = torch.load(path, map_location=\"cpu\", weights_only=True), then "
                "client.load_state_dict(sd), or save it as .safetensors" % (model,))
        o, failure = self._load_options(recipe_text, force, timeout, progress)
        o.model = str(model).encode()
        o.stream = 1 if stream else 0
        v = ctypes.c_int64()
        st = _capi.Status()
        _raise_for(self._lib.hpd_load_model(self._handle(), ctypes.byref(o), ctypes.byref(v),
                                            ctypes.byref(st)), st)
        self.manifest(refresh=True)
        self._report_progress_failure(failure)
        return v.value

    def _load_options(self, recipe_text, force, timeout, progress):
        """hpd_load_options for load() and load_state_dict(), and the list
        that receives the first exception the progress callback raises."""
        o = _capi.LoadOptions()
        self._lib.hpd_load_options_init(ctypes.byref(o))
        o.recipe_text = None if recipe_text is None else recipe_text.encode()
        o.force = 1 if force else 0
        o.timeout_ms = 0 if timeout is None else _ms(timeout)
        failure = []
        if progress is not None:
            def call(_, sent, total):
                try:
                    progress(sent, total)
                except Exception as e:  # must not unwind into C
                    if not failure:
                        failure.append(e)
            o.progress = _capi.PROGRESS_FN(call)
        return o, failure

    @staticmethod
    def _report_progress_failure(failure):
        if failure:
            print("hybrid_paramd: the progress callback raised %r" % (failure[0],),
                  file=sys.stderr)

    def set_optimizer_schedule(self, schedule, lr=None, timeout=None):
        """Replaces the learning-rate schedule of the cluster's optimizer
        between steps (an operator call; Coordinator.SetOptimizerSchedule).
        schedule: a dict of paramd.recipe.LrSchedule fields
        (proto/optimizer.proto), e.g. {"warmup_steps": 10, "decay":
        "COSINE", "decay_steps": 100, "min_lr": 1e-5}, or the same in
        protobuf text. lr: also set the peak learning rate. Returns the
        optimizer config now in force as a dict (proto field names).
        InvalidArgument for a schedule the optimizer refuses;
        FailedPrecondition while a daemon is unreachable."""
        text = json.dumps(schedule) if isinstance(schedule, dict) else str(schedule)
        p = ctypes.c_void_p()
        st = _capi.Status()
        _raise_for(self._lib.hpd_set_optimizer_schedule(
            self._handle(), text.encode(), 0 if lr is None else 1,
            0.0 if lr is None else float(lr), _ms(timeout), ctypes.byref(p),
            ctypes.byref(st)), st)
        try:
            return json.loads(ctypes.string_at(p.value).decode())
        finally:
            self._lib.hpd_free_string(p)

    def step(self, version, wait=True, timeout=None):
        """Admin step from the committed `version` (no pushers needed)."""
        v = ctypes.c_int64()
        st = _capi.Status()
        _raise_for(self._lib.hpd_step(self._handle(), _version(version), 1 if wait else 0,
                                      _ms(timeout), ctypes.byref(v), ctypes.byref(st)), st)
        return v.value


def _check_cuda():
    if not _capi.lib().hpd_has_cuda():
        raise errors.Unimplemented(
            12, "%s is a CPU-only build: device fetch and push need a build with "
            "--config=cuda (fetch to device='cpu' instead)" % _capi.lib().path)
    if not torch.cuda.is_available():
        raise errors.FailedPrecondition(9, "torch has no CUDA device")


def _as_numpy(a):
    import numpy as np
    a = np.asarray(a)
    if a.dtype != np.float32:
        a = a.astype(np.float32)
    return np.ascontiguousarray(a)


def has_cuda():
    """Whether the loaded library has the device path (--config=cuda)."""
    return bool(_capi.lib().hpd_has_cuda())


def library_path():
    return _capi.lib().path
