#!/usr/bin/env python3
"""Python fetch vs the C++ client's fetch of the same bytes in the same run,
and the Python overhead of a fetch of many tensors.

Starts a cluster (coordinator + 2 daemons, --daemon_flags for e.g. the gpu
backend), loads a model of --tensors [--rows, --cols] FP32 tensors with FP8
(current scaling) rowwise copies, then alternates rounds of --repeats
fetches of every rowwise copy from `cpp_client_tool bench` (C++ client,
preallocated buffers) and from hybrid_paramd (reusing its buffers: out=;
and allocating fresh torch memory). Prints JSON: median seconds of each,
their ratio, and the Python-side overhead (call time minus time inside the
C library).

    python3 python/tests/fetch_bench.py --server=bazel-bin/server/hybrid-paramd \\
        --cpp_tool=bazel-bin/python/tests/cpp_client_tool
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import hybrid_paramd as hp  # noqa: E402
from hybrid_paramd import cluster as hpc  # noqa: E402
from hybrid_paramd import safetensors_io  # noqa: E402

RECIPE = ('default_spec { rowwise { format: FP8_CURRENT } columnwise { format: FP8_CURRENT } '
          'columnwise_usage: false }')


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--cpp_tool", required=True)
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--cols", type=int, default=512)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--daemon_flags", default="")
    p.add_argument("--device", default="cpu", help="Python fetch destination")
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="hp_bench_")
    path = os.path.join(tmp, "m.safetensors")
    g = torch.Generator().manual_seed(0)
    safetensors_io.save({"t%03d" % i: torch.randn(a.rows, a.cols, generator=g)
                         for i in range(a.tensors)}, path)
    with hpc.LocalCluster(a.server, daemons=2, daemon_flags=a.daemon_flags.split()) as cl:
        c = hp.Client(cl.address, observer=True)
        hpc.load_when_ready(c, path, RECIPE, timeout=120)
        cpp, py_reuse, py_alloc, overhead, lib = [], [], [], [], []
        cpp_faults, py_faults = [], []
        nbytes = 0
        r = c.fetch(-1, device=a.device)  # warm up, and the buffers to reuse
        for _ in range(a.rounds):
            out = subprocess.run([a.cpp_tool, "bench", cl.address, "row", str(a.repeats)],
                                 check=True, capture_output=True, text=True, timeout=600)
            j = json.loads(out.stdout)
            cpp += j["seconds"]
            cpp_faults.append(j["page_faults_per_fetch"])
            nbytes = j["bytes"]
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(a.repeats):
                t = time.perf_counter()
                r = c.fetch(-1, device=a.device, out=r)
                if a.device != "cpu":
                    torch.cuda.synchronize()
                py_reuse.append(time.perf_counter() - t)
                overhead.append(r.seconds - r.library_seconds)
                lib.append(r.library_seconds)
            py_faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) /
                             a.repeats)
            for _ in range(a.repeats):
                t = time.perf_counter()
                r2 = c.fetch(-1, device=a.device)
                py_alloc.append(time.perf_counter() - t)
                del r2
        assert r.stats["rowwise_bytes"] == nbytes, (r.stats, nbytes)
        c.close()
    med = statistics.median
    res = {
        "tensors": a.tensors, "shape": [a.rows, a.cols], "bytes": nbytes,
        "repeats": a.repeats * a.rounds, "device": a.device,
        "cpp_seconds_median": med(cpp),
        "python_reuse_seconds_median": med(py_reuse),
        "python_alloc_seconds_median": med(py_alloc),
        "ratio_reuse": med(py_reuse) / med(cpp),
        "ratio_alloc": med(py_alloc) / med(cpp),
        "python_overhead_ms_median": 1000 * med(overhead),
        "python_overhead_ms_max": 1000 * max(overhead),
        "library_seconds_median": med(lib),
        # Minor page faults per fetch (C++ tool process / this process,
        # reused destinations): receive buffers faulted in again show here.
        "cpp_page_faults_per_fetch": med(cpp_faults),
        "python_page_faults_per_fetch": med(py_faults),
    }
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
