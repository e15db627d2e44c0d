#!/usr/bin/env python3
"""An independent reader of Hugging Face safetensors exports.

Written from the format description only (https://github.com/huggingface/
safetensors), with the Python standard library and `struct`: it shares no
code with the C++ writer, so that tests can check the writer against it.

    read_safetensors.py PATH [--masters DIR] [--dtype bf16|fp32]
                             [--format pt] [--dump NAME] [--quiet]

PATH is a directory holding model.safetensors.index.json (or
model.safetensors), an index file, or one .safetensors file. The reader
checks every file (those the index names and any other .safetensors file
beside it: header length, JSON header, dtypes, shapes, data_offsets
that tile the data section exactly, file size), and for an index that every
tensor of every shard is listed exactly once, in the file that holds it, and
that metadata.total_size is the sum of the tensors' bytes.

--masters DIR compares each tensor with the FP32 masters in DIR
(masters.json: {name: shape}; <name>.f32: little-endian float32): BF16 data
must be the round-to-nearest-even of the master (a NaN master must give a
NaN), FP32 data must be bit-identical. Exit status 0 when every check
passes, 1 otherwise (each failure is printed).
"""

import argparse
import json
import math
import os
import struct
import sys

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
INDEX_NAME = "model.safetensors.index.json"


class FormatError(Exception):
    pass


def bf16_to_float(bits):
    """BF16 bit pattern -> Python float (exact: BF16 is the top half of FP32)."""
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def float_bits(value):
    return struct.unpack("<I", struct.pack("<f", value))[0]


def bf16_rne_bits(f32_bits):
    """Round-to-nearest-even of an FP32 bit pattern to BF16 bits (None for NaN)."""
    if (f32_bits & 0x7FFFFFFF) > 0x7F800000:
        return None
    upper = f32_bits >> 16
    lower = f32_bits & 0xFFFF
    if lower > 0x8000 or (lower == 0x8000 and (upper & 1)):
        upper += 1  # a carry into the exponent is right (up to Inf)
    return upper & 0xFFFF


def is_bf16_nan(bits):
    return (bits & 0x7F80) == 0x7F80 and (bits & 0x007F) != 0


class SafetensorsFile:
    """One parsed and validated .safetensors file."""

    def __init__(self, path):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise FormatError(f"{path}: shorter than 8 bytes")
            (header_len,) = struct.unpack("<Q", head)
            if header_len < 2 or 8 + header_len > size:
                raise FormatError(f"{path}: header length {header_len} does not fit {size} bytes")
            raw = f.read(header_len)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"{path}: header is not UTF-8 JSON: {e}")
        if not isinstance(header, dict):
            raise FormatError(f"{path}: header is not a JSON object")
        self.data_start = 8 + header_len
        self.data_len = size - self.data_start
        self.metadata = header.pop("__metadata__", None)
        if self.metadata is not None:
            if not isinstance(self.metadata, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in self.metadata.items()):
                raise FormatError(f"{path}: __metadata__ must map strings to strings")
        self.tensors = {}
        spans = []
        for name, info in header.items():
            if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
                raise FormatError(f"{path}: tensor {name}: wants exactly dtype, shape, data_offsets")
            dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
            if dtype not in DTYPE_SIZES:
                raise FormatError(f"{path}: tensor {name}: unknown dtype {dtype!r}")
            if not isinstance(shape, list) or not all(
                    isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                raise FormatError(f"{path}: tensor {name}: bad shape {shape!r}")
            if (not isinstance(offsets, list) or len(offsets) != 2 or
                    not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
                raise FormatError(f"{path}: tensor {name}: bad data_offsets {offsets!r}")
            begin, end = offsets
            count = 1
            for d in shape:
                count *= d
            if not 0 <= begin <= end or end - begin != count * DTYPE_SIZES[dtype]:
                raise FormatError(f"{path}: tensor {name}: data_offsets {offsets} do not hold "
                                  f"{count} x {dtype}")
            self.tensors[name] = (dtype, shape, begin, end)
            spans.append((begin, end, name))
        spans.sort()
        position = 0
        for begin, end, name in spans:
            if begin != position:
                raise FormatError(f"{path}: tensor {name} starts at {begin}, expected {position} "
                                  f"(gap or overlap)")
            position = end
        if position != self.data_len:
            raise FormatError(f"{path}: tensors cover {position} data bytes, file has {self.data_len}")

    def read(self, name):
        dtype, shape, begin, end = self.tensors[name]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            data = f.read(end - begin)
        if len(data) != end - begin:
            raise FormatError(f"{self.path}: tensor {name}: truncated")
        return dtype, shape, data


def open_model(path):
    """Returns (files by name, weight_map or None, index metadata or None)."""
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_NAME)
        if os.path.exists(index):
            path = index
        else:
            path = os.path.join(path, "model.safetensors")
    if not path.endswith(".json"):
        f = SafetensorsFile(path)
        return {os.path.basename(path): f}, None, None
    with open(path, "rb") as f:
        try:
            index = json.loads(f.read().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"{path}: not JSON: {e}")
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise FormatError(f"{path}: no weight_map object")
    weight_map = index["weight_map"]
    metadata = index.get("metadata", {})
    if not isinstance(metadata, dict):
        raise FormatError(f"{path}: metadata is not an object")
    directory = os.path.dirname(path)
    files = {}
    for tensor, file_name in weight_map.items():
        if not isinstance(file_name, str) or "/" in file_name or file_name in ("", ".", ".."):
            raise FormatError(f"{path}: tensor {tensor} maps to a bad file name {file_name!r}")
        if file_name not in files:
            files[file_name] = SafetensorsFile(os.path.join(directory, file_name))
    # Shards beside the index that it does not mention are checked too: their
    # tensors would be missing from the index.
    for file_name in sorted(os.listdir(directory or ".")):
        if file_name.endswith(".safetensors") and file_name not in files:
            files[file_name] = SafetensorsFile(os.path.join(directory, file_name))
    return files, weight_map, metadata


def check_index(files, weight_map, metadata):
    """Every tensor of every shard is in the index exactly once, and vice versa."""
    errors = []
    seen = {}
    for file_name, f in sorted(files.items()):
        for tensor in f.tensors:
            if tensor in seen:
                errors.append(f"tensor {tensor} is in both {seen[tensor]} and {file_name}")
            seen[tensor] = file_name
            if weight_map.get(tensor) != file_name:
                errors.append(f"tensor {tensor} of {file_name} is mapped to "
                              f"{weight_map.get(tensor)!r}")
    for tensor, file_name in weight_map.items():
        if tensor not in files[file_name].tensors:
            errors.append(f"index maps {tensor} to {file_name}, which does not hold it")
    total = sum(e - b for f in files.values() for (_, _, b, e) in f.tensors.values())
    if "total_size" in metadata and metadata["total_size"] != total:
        errors.append(f"metadata.total_size {metadata['total_size']} != {total} data bytes")
    return errors


def check_masters(files, masters_dir, want_dtype):
    errors = []
    with open(os.path.join(masters_dir, "masters.json")) as f:
        shapes = json.load(f)
    where = {t: f for f in files.values() for t in f.tensors}
    if set(shapes) != set(where):
        errors.append(f"tensors differ: exported {sorted(where)}, masters {sorted(shapes)}")
    for name, shape in sorted(shapes.items()):
        if name not in where:
            continue
        dtype, got_shape, data = where[name].read(name)
        if got_shape != shape:
            errors.append(f"{name}: shape {got_shape}, master shape {shape}")
            continue
        if dtype != want_dtype:
            errors.append(f"{name}: dtype {dtype}, expected {want_dtype}")
            continue
        with open(os.path.join(masters_dir, name + ".f32"), "rb") as f:
            raw = f.read()
        count = len(raw) // 4
        master_bits = struct.unpack(f"<{count}I", raw)
        if dtype == "F32":
            if data != raw:
                errors.append(f"{name}: FP32 data differs from the masters")
            continue
        got = struct.unpack(f"<{count}H", data)
        bad = 0
        for i, (m, g) in enumerate(zip(master_bits, got)):
            want = bf16_rne_bits(m)
            ok = is_bf16_nan(g) if want is None else g == want
            if not ok:
                if bad < 5:
                    errors.append(f"{name}[{i}]: master 0x{m:08x} -> BF16 0x{g:04x} "
                                  f"({bf16_to_float(g)!r}), expected "
                                  f"{'a NaN' if want is None else hex(want)}")
                bad += 1
        if bad:
            errors.append(f"{name}: {bad} of {count} values differ")
    return errors


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--masters", help="directory with masters.json and <name>.f32")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--format", help="required __metadata__ format (e.g. pt)")
    parser.add_argument("--dump", help="print the values of one tensor")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    try:
        files, weight_map, metadata = open_model(args.path)
    except (FormatError, OSError) as e:
        print(f"FAIL: {e}")
        return 1
    errors = []
    if weight_map is not None:
        errors += check_index(files, weight_map, metadata)
    if args.format is not None:
        for file_name, f in sorted(files.items()):
            if (f.metadata or {}).get("format") != args.format:
                errors.append(f"{file_name}: __metadata__ {f.metadata!r} lacks format "
                              f"{args.format!r}")
    if args.masters:
        errors += check_masters(files, args.masters, "BF16" if args.dtype == "bf16" else "F32")
    if args.dump:
        for f in files.values():
            if args.dump in f.tensors:
                dtype, shape, data = f.read(args.dump)
                if dtype == "BF16":
                    values = [bf16_to_float(b) for b in struct.unpack(f"<{len(data) // 2}H", data)]
                elif dtype == "F32":
                    values = list(struct.unpack(f"<{len(data) // 4}f", data))
                else:
                    values = list(data)
                print(json.dumps({"name": args.dump, "dtype": dtype, "shape": shape,
                                  "values": [v if math.isfinite(v) else str(v) for v in values]}))
    count = sum(len(f.tensors) for f in files.values())
    for e in errors:
        print(f"FAIL: {e}")
    if not args.quiet:
        print(f"{'FAILED' if errors else 'OK'}: {len(files)} file(s), {count} tensor(s), "
              f"{sum(f.data_len for f in files.values())} data bytes")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
