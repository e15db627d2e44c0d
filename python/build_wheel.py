#!/usr/bin/env python3
"""Writes the hybrid_paramd wheel (PEP 427) with the standard library only:
the Python package, libhybrid_paramd.so as hybrid_paramd/_lib/, and a
generated hybrid_paramd/_version.py.

    build_wheel.py --out_dir DIR --status stable-status.txt --lib libhybrid_paramd.so \
                   python/hybrid_paramd/*.py

The version is STABLE_PARAMD_VERSION of Bazel's stable-status.txt, the key
common/build_info_gen.sh stamps into `hybrid-paramd --version` (both come
from VERSION through tools/workspace_status.sh; "0.0.0" when it is empty,
as there). The platform tag is linux_<machine>, the machine read from the
library's ELF header; it is no manylinux tag: the library links Debian 12's
gRPC, protobuf and Abseil shared libraries. The archive is reproducible
(sorted entries, fixed timestamps). Used by //python:wheel (python/wheel.bzl).
"""

import argparse
import base64
import hashlib
import os
import re
import struct
import sys
import zipfile

NAME = "hybrid_paramd"  # distribution and import name
LIB = "libhybrid_paramd.so"
# ELF e_machine -> the machine part of a platform tag.
ELF_MACHINES = {3: "i686", 62: "x86_64", 183: "aarch64", 21: "ppc64le", 22: "s390x"}
ZIP_TIME = (1980, 1, 1, 0, 0, 0)

SUMMARY = ("Python client of hybrid-paramd: fetch hybrid-quantized weights, push "
           "gradients (ctypes over libhybrid_paramd.so)")

DESCRIPTION = """\
The PyTorch trainer's client of a hybrid-paramd cluster: `import hybrid_paramd`.
Pure Python over the C API of `hybrid_paramd/_lib/libhybrid_paramd.so`
(ctypes); `$HYBRID_PARAMD_LIB`, when set, names another build of the library.

Runtime: Linux {machine}, Debian 12. The bundled library links Debian 12's
shared libraries of gRPC, protobuf and Abseil (and through them OpenSSL,
zlib, c-ares and RE2); install them with
`apt-get install libgrpc++1.51 libprotobuf32 libabsl20220623`. The package
imports torch (>= 1.13) and uses numpy: Debian's `python3-torch` and
`python3-numpy` (a virtual environment made with `--system-site-packages`
sees them) or pip's.
"""


def stamped_version(status_path):
    with open(status_path) as f:
        for line in f:
            key, _, value = line.rstrip("\n").partition(" ")
            if key == "STABLE_PARAMD_VERSION":
                return value.strip() or "0.0.0"
    return "0.0.0"


def elf_machine(path):
    with open(path, "rb") as f:
        head = f.read(20)
    if len(head) < 20 or head[:4] != b"\x7fELF":
        sys.exit("build_wheel: %s is not an ELF file" % path)
    endian = "<" if head[5] == 1 else ">"
    (machine,) = struct.unpack(endian + "H", head[18:20])
    if machine not in ELF_MACHINES:
        sys.exit("build_wheel: %s: unknown ELF machine %d" % (path, machine))
    return ELF_MACHINES[machine]


def record_hash(data):
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def add(zf, record, arcname, data, mode=0o644):
    info = zipfile.ZipInfo(arcname, date_time=ZIP_TIME)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = (0o100000 | mode) << 16  # a regular file with this mode
    info.create_system = 3  # Unix, so that the mode is read
    zf.writestr(info, data)
    if record is not None:
        record.append("%s,%s,%d" % (arcname, record_hash(data), len(data)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", required=True, help="directory the .whl is written into")
    p.add_argument("--status", required=True, help="Bazel's stable-status.txt")
    p.add_argument("--lib", required=True, help="libhybrid_paramd.so")
    p.add_argument("sources", nargs="+", help="the package's .py files")
    a = p.parse_args()

    version = stamped_version(a.status)
    # A PEP 440 public version (what VERSION holds: "0.1.0", "1.2.0rc1").
    if not re.fullmatch(r"[0-9]+(\.[0-9]+)*((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?",
                        version):
        sys.exit("build_wheel: version %r (VERSION) is not a PEP 440 version" % version)
    machine = elf_machine(a.lib)
    tag = "py3-none-linux_" + machine
    dist_info = "%s-%s.dist-info" % (NAME, version)
    wheel_name = "%s-%s-%s.whl" % (NAME, version, tag)

    files = {}
    for src in a.sources:
        base = os.path.basename(src)
        if not base.endswith(".py") or base == "_version.py" or base in files:
            sys.exit("build_wheel: unexpected source %s" % src)
        with open(src, "rb") as f:
            files[base] = f.read()

    metadata = "\n".join([
        "Metadata-Version: 2.1",
        "Name: " + NAME,
        "Version: " + version,
        "Summary: " + SUMMARY,
        "Platform: Linux",
        "Requires-Python: >=3.9",
        # Debian 12's python3-torch calls itself 1.13.0a0+gitunknown, which
        # >=1.13 would exclude as a pre-release.
        "Requires-Dist: torch>=1.13.0a0",
        "Requires-Dist: numpy",
        "Description-Content-Type: text/markdown",
        "",
        DESCRIPTION.format(machine=machine),
    ])
    wheel = "\n".join([
        "Wheel-Version: 1.0",
        "Generator: hybrid-paramd python/build_wheel.py",
        "Root-Is-Purelib: false",
        "Tag: " + tag,
        "",
    ])
    version_py = ('"""Written by python/build_wheel.py: the VERSION the wheel was built '
                  'from."""\n__version__ = %r\n' % version)

    os.makedirs(a.out_dir, exist_ok=True)
    out = os.path.join(a.out_dir, wheel_name)
    record = []
    with zipfile.ZipFile(out, "w") as zf:
        for base in sorted(files):
            add(zf, record, "%s/%s" % (NAME, base), files[base])
        add(zf, record, NAME + "/_version.py", version_py.encode())
        with open(a.lib, "rb") as f:
            add(zf, record, "%s/_lib/%s" % (NAME, LIB), f.read(), mode=0o755)
        add(zf, record, dist_info + "/METADATA", metadata.encode())
        add(zf, record, dist_info + "/WHEEL", wheel.encode())
        add(zf, record, dist_info + "/top_level.txt", (NAME + "\n").encode())
        record.append(dist_info + "/RECORD,,")
        add(zf, None, dist_info + "/RECORD", ("\n".join(record) + "\n").encode())
    print(out)


if __name__ == "__main__":
    main()
