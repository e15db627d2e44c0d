"""What a fetch returns: FetchResult (per target a Fetched: torch views of
the fetched buffers, format and layout, scale_inv / amax) and the _Scalars
holder those share. Made by client.Client.fetch."""

import torch

from . import formats as F

# Device fetches: each target's scale_inv and amax floats start a 16-byte
# slot (cuBLASLt wants 16-byte aligned scale pointers).
SCALARS_STRIDE = 4


class Fetched:
    """One fetched direction of one tensor.

    data        torch tensor of the data buffer: bfloat16/float32 [M, K] for
                identity formats; FP8 formats float8_e4m3fn / float8_e5m2
                (torch >= 2.1; uint8 on older torch: see `element`) of
                data_shape ([K, M] when `transposed`); NVFP4 uint8 packed
                two codes per byte.
    scales      uint8 (E8M0 / UE4M3) or float32 tensor [scale_rows,
                scale_cols], or None (formats without a scale buffer).
    scale_inv   per-tensor FP8: rcp(scale) (float; `scale_inv_tensor` as a
                0-dim float32 tensor on the data's device); 1 otherwise.
    amax        the direction's amax (NVFP4: the global A).
                After a CUDA fetch both live on the device: scale_inv_tensor
                / amax_tensor cost nothing, while the first read of a float
                copies every tensor's values of that fetch to the host at
                once (one synchronising copy per fetch, not per tensor).
    format / format_name / element / scale_name / transposed / two_d,
    shape (the model file's shape), rows, cols (M, K).
    The tensors are views into one allocation per fetch.
    """

    __slots__ = ("tensor", "direction", "info", "rows", "cols", "shape", "_buf", "_off", "_soff",
                 "_data", "_scales", "_scalars", "_index")

    def __init__(self, tensor_info, dinfo, buf, off, soff, scalars, index):
        self.tensor = tensor_info.name
        self.direction = dinfo.direction
        self.info = dinfo
        self.rows = tensor_info.rows
        self.cols = tensor_info.cols
        self.shape = tensor_info.shape
        self._buf = buf
        self._off = off
        self._soff = soff
        self._data = None
        self._scales = None
        self._scalars = scalars  # the fetch's _Scalars, shared by its targets
        self._index = index

    @property
    def scale_inv(self):
        return self._scalars.get(self._index, 0)

    @property
    def amax(self):
        return self._scalars.get(self._index, 1)

    # Views are made on first access: a fetch of many tensors costs one
    # allocation, not a view per buffer.
    @property
    def data(self):
        if self._data is None:
            i = self.info
            raw = self._buf[self._off:self._off + i.data_bytes]
            dt = F.data_dtype(i.format, i.fp8_type)
            self._data = raw.view(dt).view(i.data_shape)
        return self._data

    @property
    def scales(self):
        i = self.info
        if i.scale_bytes == 0:
            return None
        if self._scales is None:
            raw = self._buf[self._soff:self._soff + i.scale_bytes]
            dt = torch.float32 if i.scale_elem_bytes == 4 else torch.uint8
            self._scales = raw.view(dt).view(i.scale_shape)
        return self._scales

    @property
    def scale_inv_tensor(self):
        t = self._scalars.tensor
        if t is not None:
            return t[SCALARS_STRIDE * self._index]
        return torch.tensor(self.scale_inv, dtype=torch.float32, device=self._buf.device)

    @property
    def amax_tensor(self):
        t = self._scalars.tensor
        if t is not None:
            return t[SCALARS_STRIDE * self._index + 1]
        return torch.tensor(self.amax, dtype=torch.float32, device=self._buf.device)

    format = property(lambda self: self.info.format)
    format_name = property(lambda self: self.info.format_name)
    fp8_type = property(lambda self: self.info.fp8_type)
    element = property(lambda self: self.info.element)
    scale_name = property(lambda self: self.info.scale_name)
    transposed = property(lambda self: self.info.transposed)
    two_d = property(lambda self: self.info.two_d)

    def dequantize(self, dtype=torch.float32):
        """The [M, K] weight as `dtype` (formats.dequantize)."""
        return F.dequantize(self, dtype)

    def __repr__(self):
        return "Fetched(%s %s %s, data %s%s)" % (
            self.tensor, F.DIRECTION_NAMES[self.direction], self.format_name,
            tuple(self.info.data_shape), ", transposed" if self.transposed else "")


class _Scalars:
    """The scale_inv / amax floats of one fetch's targets, shared by its
    Fetched objects: host floats of a CPU fetch ([scale_inv, amax] per
    target), or a CUDA fetch's device slots (SCALARS_STRIDE per target),
    copied to the host once, all together, when a float is first read."""

    __slots__ = ("tensor", "_host", "_stride")

    def __init__(self):
        self.set(None, None)

    def set(self, host, tensor):
        self._host = host
        self.tensor = tensor
        self._stride = 2 if tensor is None else SCALARS_STRIDE

    def get(self, index, which):
        if self._host is None:
            self._host = self.tensor.cpu().tolist()
        return self._host[self._stride * index + which]


class FetchResult:
    """result[name, direction] -> Fetched (direction 'rowwise'/'columnwise'
    or 0/1); result[name] when one direction was fetched. `version`,
    `stats` (bytes received per direction and their BF16 equivalent),
    `seconds` (wall time of the call) and `library_seconds` (time spent
    inside the C library)."""

    def __init__(self, version, items, stats, seconds, library_seconds):
        self.items = items  # list of Fetched in target order
        self._index = {(f.tensor, f.direction): f for f in items}
        self._update(version, stats, seconds, library_seconds)

    def _update(self, version, stats, seconds, library_seconds):
        self.version = version
        self.stats = stats
        self.seconds = seconds
        self.library_seconds = library_seconds

    def __getitem__(self, key):
        if isinstance(key, tuple):
            name, d = key
            return self._index[(name, F.parse_direction(d))]
        matches = [f for f in self.items if f.tensor == key]
        if len(matches) != 1:
            raise KeyError("%r: give (name, direction); %d directions fetched" %
                           (key, len(matches)))
        return matches[0]

    def __iter__(self):
        return iter(self.items)

    def __len__(self):
        return len(self.items)

    def __repr__(self):
        return "FetchResult(version %d, %d tensor-directions, %.2f ms: %r)" % (
            self.version, len(self.items), self.seconds * 1e3, self.items)
