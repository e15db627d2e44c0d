"""The formats of docs/FORMATS.md as seen from torch: names, the dtype
of each published buffer, and dequantization to float (on any device)."""

import torch

IDENTITY_BF16 = 0
IDENTITY_FP32 = 1
FP8_DELAYED = 2
FP8_CURRENT = 3
MXFP8 = 4
NVFP4 = 5
FP8_BLOCK_128X128 = 6
FP8_BLOCK_1X128 = 7

FORMAT_NAMES = {
    IDENTITY_BF16: "identity_bf16", IDENTITY_FP32: "identity_fp32",
    FP8_DELAYED: "fp8_delayed", FP8_CURRENT: "fp8_current", MXFP8: "mxfp8", NVFP4: "nvfp4",
    FP8_BLOCK_128X128: "fp8_block128x128", FP8_BLOCK_1X128: "fp8_block1x128",
}
FP8_FORMATS = (FP8_DELAYED, FP8_CURRENT, MXFP8, FP8_BLOCK_128X128, FP8_BLOCK_1X128)
PER_TENSOR_FP8 = (FP8_DELAYED, FP8_CURRENT)

E4M3 = 0
E5M2 = 1
ROWWISE = 0
COLUMNWISE = 1
DIRECTION_NAMES = {ROWWISE: "rowwise", COLUMNWISE: "columnwise"}

# torch >= 2.1 has FP8 dtypes; older torch gets uint8 buffers and the tag.
HAS_FP8_DTYPES = hasattr(torch, "float8_e4m3fn") and hasattr(torch, "float8_e5m2")


def parse_direction(d):
    if d in (ROWWISE, "rowwise", "row"):
        return ROWWISE
    if d in (COLUMNWISE, "columnwise", "col"):
        return COLUMNWISE
    raise ValueError("direction must be 'rowwise' or 'columnwise', not %r" % (d,))


def element_name(fmt, fp8_type):
    """The element encoding of a data buffer: 'bf16', 'fp32', 'e4m3',
    'e5m2' or 'e2m1x2' (two FP4 codes per byte)."""
    if fmt == IDENTITY_BF16:
        return "bf16"
    if fmt == IDENTITY_FP32:
        return "fp32"
    if fmt == NVFP4:
        return "e2m1x2"
    return "e5m2" if fp8_type == E5M2 else "e4m3"


def data_dtype(fmt, fp8_type):
    """The torch dtype of a data buffer of `fmt`."""
    if fmt == IDENTITY_BF16:
        return torch.bfloat16
    if fmt == IDENTITY_FP32:
        return torch.float32
    if fmt in FP8_FORMATS and HAS_FP8_DTYPES:
        return torch.float8_e5m2 if fp8_type == E5M2 else torch.float8_e4m3fn
    return torch.uint8


def scale_name(fmt):
    """The encoding of a scale buffer's entries ('e8m0', 'ue4m3', 'fp32')
    or None for formats without one."""
    return {MXFP8: "e8m0", NVFP4: "ue4m3", FP8_BLOCK_128X128: "fp32",
            FP8_BLOCK_1X128: "fp32"}.get(fmt)


# ---- dequantization (FORMATS.md decoding rules, in float32) ----

_FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0,
               -6.0]


def _fp8_to_float(u8, fp8_type):
    """float32 values of FP8 bytes (uint8 tensor), any device, any torch."""
    b = u8.to(torch.int32)
    sign = torch.where((b & 0x80) != 0, -1.0, 1.0)
    if fp8_type == E5M2:
        e, m, bias, mbits = (b >> 2) & 0x1F, b & 0x3, 15, 2
    else:
        e, m, bias, mbits = (b >> 3) & 0xF, b & 0x7, 7, 3
    m = m.to(torch.float32)
    e_f = e.to(torch.float32)
    normal = torch.pow(2.0, e_f - bias) * (1.0 + m / (1 << mbits))
    sub = torch.pow(torch.tensor(2.0, device=u8.device), 1 - bias) * (m / (1 << mbits))
    v = torch.where(e == 0, sub, normal)
    if fp8_type == E5M2:
        v = torch.where(e == 0x1F, torch.where(m == 0, float("inf"), float("nan")), v)
    else:
        v = torch.where((e == 0xF) & (m == 7), float("nan"), v)
    return sign * v


def fp8_bytes_to_float(data, fp8_type):
    """float32 of an FP8 tensor (torch FP8 dtype or uint8 bytes)."""
    if data.dtype != torch.uint8:
        if data.device.type == "cuda" or data.dtype in (getattr(torch, "float8_e4m3fn", None),
                                                         getattr(torch, "float8_e5m2", None)):
            try:
                return data.to(torch.float32)
            except (RuntimeError, TypeError):
                data = data.view(torch.uint8)
    return _fp8_to_float(data, fp8_type)


def e8m0_to_float(u8):
    """2^(e-127) of E8M0 bytes; 0xFF is NaN."""
    e = u8.to(torch.float32)
    v = torch.pow(2.0, e - 127.0)
    return torch.where(u8 == 0xFF, float("nan"), v)


def fp4_unpack(packed, count):
    """float32 of packed E2M1 codes along the last dim: `count` values per
    row from packed.shape[-1] bytes (low nibble first)."""
    table = torch.tensor(_FP4_VALUES, dtype=torch.float32, device=packed.device)
    lo = (packed & 0xF).long()
    hi = (packed >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return table[codes[..., :count]]


def _expand_blocks(scales, rows, cols, block_rows, block_cols):
    """A [ceil(rows/br)+pad, ceil(cols/bc)+pad] scale grid to one value per
    element of [rows, cols]."""
    nr = -(-rows // block_rows)
    nc = -(-cols // block_cols)
    s = scales[:nr, :nc]
    s = s.repeat_interleave(block_rows, dim=0)[:rows]
    return s.repeat_interleave(block_cols, dim=1)[:, :cols]


def dequantize(fetched, dtype=torch.float32):
    """The logical [M, K] weight (2-D; fetched.shape gives the model's shape)
    of one fetched direction, as `dtype`, on the fetched tensor's device.
    Transposed copies ([K][M] buffers) are transposed back."""
    fmt = fetched.format
    rows, cols = fetched.rows, fetched.cols
    t = fetched.transposed
    # The buffer's own [R, C] geometry (transposed: R = K, C = M).
    R, C = (cols, rows) if t else (rows, cols)
    if fmt in (IDENTITY_BF16, IDENTITY_FP32):
        return fetched.data.reshape(rows, cols).to(dtype)
    if fmt == NVFP4:
        # Scales are per 16 along the buffer's rows in both directions (2-D
        # tiles write their value into every row of the tile), UE4M3.
        q = fp4_unpack(fetched.data.view(torch.uint8), C)
        s = _expand_blocks(_fp8_to_float(fetched.scales.view(torch.uint8), E4M3), R, C, 1, 16)
        # decode: q * mul(mul(sd, A), RN(1/2688)) (D4)
        a = fetched.amax_tensor.to(q.device)  # stays on the device (no sync)
        v = q * ((s * a) * torch.tensor(1.0 / 2688.0, dtype=torch.float32, device=q.device))
    else:
        q = fp8_bytes_to_float(fetched.data, fetched.fp8_type).reshape(R, C)
        if fmt in PER_TENSOR_FP8:
            v = q * fetched.scale_inv_tensor.to(q.device)
        elif fmt == MXFP8:
            # Never transposed; rowwise scale [i][j/32], columnwise [i/32][j]
            # (2-D tiles repeat their value in the same layout).
            s = e8m0_to_float(fetched.scales.view(torch.uint8))
            blocks = (1, 32) if fetched.direction == ROWWISE else (32, 1)
            v = q * _expand_blocks(s, R, C, *blocks)
        elif fmt == FP8_BLOCK_128X128:
            v = q * _expand_blocks(fetched.scales.view(torch.float32), R, C, 128, 128)
        elif fmt == FP8_BLOCK_1X128:
            # 1x128 scales are stored block-major: entry [block][row of the buffer].
            nb = -(-C // 128)
            s = fetched.scales.view(torch.float32)[:nb, :R].t()
            v = q * _expand_blocks(s, R, C, 1, 128)
        else:
            raise ValueError("unknown format %d" % fmt)
    if t:
        v = v.t()
    return v.reshape(rows, cols).to(dtype)
