"""Minimal safetensors reading and writing with the standard library and
torch (the format: an 8-byte little-endian header length, a JSON header,
the data). For tests and examples; hpctl and the daemons use the C++
reader."""

import json
import struct

import torch

_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8",
    torch.int8: "I8", torch.int32: "I32", torch.int64: "I64", torch.float64: "F64",
}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPES[torch.float8_e4m3fn] = "F8_E4M3"
    _DTYPES[torch.float8_e5m2] = "F8_E5M2"
_BY_NAME = {v: k for k, v in _DTYPES.items()}


def save(tensors, path, metadata=None):
    """Writes {name: tensor} (CPU tensors of the dtypes above)."""
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs = []
    off = 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        b = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def load(path):
    """{name: tensor} of a file (F8 dtypes as uint8 where torch lacks them),
    and the metadata dict."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    out = {}
    for name, h in header.items():
        b, e = h["data_offsets"]
        dt = _BY_NAME.get(h["dtype"], torch.uint8)
        raw = torch.frombuffer(bytearray(data[b:e]), dtype=torch.uint8) if e > b else \
            torch.empty(0, dtype=torch.uint8)
        out[name] = raw.view(dt).reshape(h["shape"])
    return out, meta
