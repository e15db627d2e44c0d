#!/usr/bin/env python3
"""The layering rules of the source tree, checked on every `#include "..."`.

1. Layers. Every top-level package sits on a layer; a file may include a
   header of its own top-level package or of a lower layer, never of a
   peer or a higher one:

     0  common, proto                 (the generated protobuf headers)
     1  kernels                       (formats, reference, CUDA kernels)
     2  format, safetensors, sharding, recipe, auth, ipc
     3  transport
     4  checkpoint
     5  client, server                (peers: neither includes the other)
     6  hpctl, deploy                 (the tools and the process launcher)
     7  fuzz, python, tests, tools

   server/ is layered inside as well (its sub-packages own one part of the
   process each; a sub-package may include its own headers and those of a
   lower sub-layer, never a peer's or a higher one's):

     0  server/rpc                    (request checks, async helpers)
     1  server/step                   (optimizer, shard sets, pipelines)
     2  server/backend                (where shards live: the seams)
     3  server/snapshot, server/ipc
     4  server/gpu_backend, server/coordinator
     5  server/daemon
     6  server                        (the process: gRPC server, metrics, main)

2. Dependencies. A header of this tree included by a file of a C++ target
   must be provided by that target (its srcs or hdrs) or by one of its
   direct `deps` (a transitive dep that happens to bring it is not enough:
   the next edit of that dep breaks the include).

BUILD files are read by evaluating them with stand-ins for the rules
(select() branches are merged, glob() expands), so no Bazel is needed.

  python3 tools/layering_check.py [ROOT]      # exit 1 and a list on violations
"""

import glob as globlib
import os
import re
import sys

LAYERS = [
    ["common", "proto"],
    ["kernels"],
    ["format", "safetensors", "sharding", "recipe", "auth", "ipc"],
    ["transport"],
    ["checkpoint"],
    ["client", "server"],
    ["hpctl", "deploy"],
    ["fuzz", "python", "tests", "tools"],
]
LAYER_OF = {pkg: i for i, pkgs in enumerate(LAYERS) for pkg in pkgs}
SUBLAYERS = {
    "server": [
        ["server/rpc"],
        ["server/step"],
        ["server/backend"],
        ["server/snapshot", "server/ipc"],
        ["server/gpu_backend", "server/coordinator"],
        ["server/daemon"],
        ["server"],
    ],
}


def sublayer(path):
    """(sub-package, its sub-layer) of a file of a package layered inside."""
    top = path.split("/")[0]
    best = None
    for i, pkgs in enumerate(SUBLAYERS.get(top, [])):
        for pkg in pkgs:
            if (path.startswith(pkg + "/") and
                    (best is None or len(pkg) > len(best[0]))):
                best = (pkg, i)
    return best
CC_RULES = ("cc_library", "cc_test", "cc_binary", "paramd_cc_library", "paramd_cc_test",
            "paramd_cc_binary", "cuda_library")
SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


class _Any:
    """Stands in for any symbol a BUILD file loads (constants, macros)."""

    def __call__(self, *args, **kwargs):
        return None

    def __add__(self, other):
        return other

    __radd__ = __add__


def _flatten(value):
    if value is None or isinstance(value, _Any):
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):  # select()
        return [v for branch in value.values() for v in _flatten(branch)]
    out = []
    for v in value:
        out.extend(_flatten(v))
    return out


class _Selected(list):
    """select() result: the union of its branches, usable with +."""


def read_targets(root):
    """{label: {"files": set of repo paths, "deps": [labels], "pkg": pkg}}."""
    targets = {}
    for build in globlib.glob(os.path.join(root, "**", "BUILD"), recursive=True):
        pkg = os.path.relpath(os.path.dirname(build), root)
        if pkg == ".":
            pkg = ""
        if pkg.split("/")[0].startswith(("bazel-", ".")):
            continue

        def rule(kind):
            def add(name=None, srcs=(), hdrs=(), deps=(), textual_hdrs=(), **_):
                if name is None:
                    return
                files = set()
                for f in _flatten(srcs) + _flatten(hdrs) + _flatten(textual_hdrs):
                    if not f.startswith((":", "//", "@")):
                        files.add(os.path.join(pkg, f) if pkg else f)
                if kind == "proto":
                    for f in _flatten(srcs):
                        base = os.path.join(pkg, f[:-len(".proto")])
                        files.update({base + ".pb.h", base + ".grpc.pb.h"})
                targets["//%s:%s" % (pkg, name)] = {
                    "files": files, "deps": [_absolute(d, pkg) for d in _flatten(deps)],
                    "pkg": pkg, "cc": kind in ("cc", "proto")}
            return add

        def glob(include, exclude=(), **_):
            base = os.path.dirname(build)
            out = set()
            for pattern in include:
                out.update(os.path.relpath(p, base)
                           for p in globlib.glob(os.path.join(base, pattern), recursive=True))
            for pattern in exclude:
                out.difference_update(os.path.relpath(p, base)
                                      for p in globlib.glob(os.path.join(base, pattern),
                                                            recursive=True))
            return sorted(out)

        namespace = {"glob": glob, "select": lambda d, **_: _Selected(_flatten(d)),
                     "package": _Any(), "exports_files": _Any(), "licenses": _Any()}
        for kind in CC_RULES:
            namespace[kind] = rule("cc")
        namespace["paramd_proto_library"] = rule("proto")

        def load(_label, *symbols, **aliases):
            for s in list(symbols) + list(aliases):
                namespace.setdefault(s, _Any())

        namespace["load"] = load
        namespace["native"] = type("native", (), {"__getattr__": lambda self, n: namespace.get(
            n, _Any())})()
        source = open(build).read()
        code = compile(source, build, "exec")
        # Any other rule (sh_test, py_test, filegroup, genrule ...) is not C++.
        for name in code.co_names:
            namespace.setdefault(name, _Any())
        exec(code, namespace)  # noqa: S102 (our own BUILD files)
    return targets


def _absolute(label, pkg):
    if label.startswith(":"):
        return "//%s%s" % (pkg, label)
    if label.startswith("//") and ":" not in label:
        return "%s:%s" % (label, label.rsplit("/", 1)[-1])
    return label


def check(root):
    problems = []
    targets = read_targets(root)
    provider = {}  # repo path -> labels that list it
    for label, t in targets.items():
        for f in t["files"]:
            provider.setdefault(f, set()).add(label)
    for label, t in sorted(targets.items()):
        if not t["cc"]:
            continue
        allowed = set(t["files"])
        for d in t["deps"]:
            allowed.update(targets.get(d, {"files": set()})["files"])
        for f in sorted(t["files"]):
            path = os.path.join(root, f)
            if not f.endswith(SOURCE_SUFFIXES) or not os.path.isfile(path):
                continue
            top = f.split("/")[0]
            for inc in INCLUDE.findall(open(path, errors="replace").read()):
                if inc not in provider:
                    continue  # not a file of this tree (system, third-party)
                inc_top = inc.split("/")[0]
                if (inc_top != top and top in LAYER_OF and inc_top in LAYER_OF and
                        LAYER_OF[inc_top] >= LAYER_OF[top]):
                    problems.append("%s: includes %s: %s (layer %d) may not include %s "
                                    "(layer %d)" % (f, inc, top, LAYER_OF[top], inc_top,
                                                    LAYER_OF[inc_top]))
                own, inc_sub = sublayer(f), sublayer(inc)
                if (own and inc_sub and own[0] != inc_sub[0] and inc_sub[1] >= own[1]):
                    problems.append("%s: includes %s: %s (sub-layer %d) may not include %s "
                                    "(sub-layer %d)" % (f, inc, own[0], own[1], inc_sub[0],
                                                        inc_sub[1]))
                if inc not in allowed:
                    problems.append("%s (%s): includes %s, which no direct dep provides (%s)"
                                    % (f, label, inc, " or ".join(sorted(provider[inc]))))
    return sorted(set(problems))


def main(argv):
    root = argv[1] if len(argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))
    problems = check(root)
    for p in problems:
        print(p)
    print("layering: %d problem(s)" % len(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
