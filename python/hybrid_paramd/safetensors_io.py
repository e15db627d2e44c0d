"""safetensors files from Python: through the maintained `safetensors`
package when it is installed, else a small reader and writer of the format
(an 8-byte little-endian header length, a JSON header, the data) that maps
the file instead of reading it into memory. hpctl and the daemons use the
C++ reader (//safetensors)."""

import json
import struct

import numpy as np
import torch

try:  # pip's safetensors; Debian 12 does not package it
    from safetensors import safe_open as _safe_open
    from safetensors.torch import save_file as _save_file
except ImportError:
    _safe_open = _save_file = None

_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8",
    torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
    torch.float64: "F64", torch.bool: "BOOL",
}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPES[torch.float8_e4m3fn] = "F8_E4M3"
    _DTYPES[torch.float8_e5m2] = "F8_E5M2"
_BY_NAME = {v: k for k, v in _DTYPES.items()}


def uses_safetensors_package():
    """True when load and save go through the `safetensors` package."""
    return _safe_open is not None


def save(tensors, path, metadata=None):
    """Writes {name: tensor} (tensors of the dtypes above, on any device)."""
    tensors = {n: t.detach().contiguous().cpu() for n, t in tensors.items()}
    meta = {str(k): str(v) for k, v in metadata.items()} if metadata else None
    if _save_file is not None:
        # The package refuses tensors sharing memory (tied weights): give
        # each its own.
        _save_file({n: t.clone() for n, t in tensors.items()}, path, metadata=meta)
        return
    header = {"__metadata__": meta} if meta else {}
    off = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for t in tensors.values():
            if t.numel():
                f.write(t.view(-1).view(torch.uint8).numpy().tobytes())


def load(path):
    """{name: CPU tensor} of a file (F8 dtypes as uint8 where torch lacks
    them), and the metadata dict. Without the `safetensors` package the
    tensors are copy-on-write views of the mapped file: pages are read when
    a tensor is used, and writing to a tensor never changes the file."""
    if _safe_open is not None:
        with _safe_open(path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", None) or {}
    data = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + n) if any(
        h["data_offsets"][1] > h["data_offsets"][0] for h in header.values()) else None
    out = {}
    for name, h in header.items():
        b, e = h["data_offsets"]
        dt = _BY_NAME.get(h["dtype"], torch.uint8)
        if e <= b:
            out[name] = torch.empty(h["shape"], dtype=dt)
            continue
        raw = torch.from_numpy(data[b:e])
        if b % torch.empty((), dtype=dt).element_size():
            raw = raw.clone()  # an offset the element type cannot view in place
        out[name] = raw.view(dt).reshape(h["shape"])
    return out, meta
