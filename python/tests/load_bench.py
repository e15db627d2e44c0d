"""Time to load a model into a cluster (coordinator + 2 daemons) from
Python's client.load_state_dict (torch tensors in memory, streamed) against
`hpctl load` of the same bytes as a safetensors file (the daemons read the
file; and with --stream, hpctl reads it and streams it). Each is run
--repeats times, alternating; the figure is the ratio of the medians
(load_state_dict throughput / hpctl load throughput; target >= 0.8).

    python3 python/tests/load_bench.py --server bazel-bin/server/hybrid-paramd \\
        --hpctl bazel-bin/hpctl/hpctl [--gib 1] [--json out.json]

HYBRID_PARAMD_LIB names libhybrid_paramd.so (else the source tree's).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

import hybrid_paramd as hp  # noqa: E402
from hybrid_paramd import cluster as hpc  # noqa: E402
from hybrid_paramd import safetensors_io  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True)
    p.add_argument("--hpctl", required=True)
    p.add_argument("--gib", type=float, default=1.0, help="model size in GiB (FP32)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--daemon_flags", default="")
    p.add_argument("--json", default="")
    a = p.parse_args()
    rows = 4096
    n = max(1, int(a.gib * (1 << 30) / (rows * rows * 4)))
    g = torch.Generator().manual_seed(0)
    sd = {"layers.%d.weight" % i: torch.randn(rows, rows, generator=g) for i in range(n)}
    nbytes = sum(t.numel() * 4 for t in sd.values())
    tmp = tempfile.mkdtemp(prefix="load_bench_")
    path = os.path.join(tmp, "model.safetensors")
    safetensors_io.save(sd, path)
    times = {"load_state_dict": [], "hpctl_load": [], "hpctl_load_stream": []}
    flags = ["--optimizer=sgd", "--lr=0.1"] + a.daemon_flags.split()
    with hpc.LocalCluster(a.server, daemons=2, expected_pushers=1, daemon_flags=flags) as cl:
        admin = hp.Client(cl.address, observer=True)
        hpctl = [a.hpctl, "load", path, "--force", "--progress=false", "--address=" + cl.address]
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            admin.load_state_dict(sd, force=True)
            times["load_state_dict"].append(time.perf_counter() - t0)
            for name, extra in (("hpctl_load", []), ("hpctl_load_stream", ["--stream"])):
                t0 = time.perf_counter()
                subprocess.run(hpctl + extra, check=True, stdout=subprocess.DEVNULL)
                times[name].append(time.perf_counter() - t0)
        admin.close()
    os.remove(path)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    out = {"bytes": nbytes, "tensors": n, "date": time.strftime("%Y-%m-%d")}
    for k, v in med.items():
        out[k + "_s_median"] = v
        out[k + "_GBps"] = nbytes / v / 1e9
    out["ratio_vs_hpctl_load"] = med["hpctl_load"] / med["load_state_dict"]
    out["ratio_vs_hpctl_load_stream"] = med["hpctl_load_stream"] / med["load_state_dict"]
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
