"""Step time of hp.distribute + hp.ClusterOptimizer against the hand-written
loop over torch_glue.ClusterModel that they replace (fetch, forward,
backward, push, wait), on one cluster, the same model, recipe and batches.
The two loops alternate in blocks, in turn first and second (ABBA), so
that drift and warm-up hit both; the figure is the median over block pairs
of the ratio of their median step times (target <= 1.02). --pin gives the
cluster's processes and this trainer disjoint halves of the CPUs, so that
the daemons' threads do not preempt the timed loop.

    python3 python/tests/distribute_bench.py --server bazel-bin/server/hybrid-paramd \\
        [--device cuda --daemon_flags="--backend=gpu --gpu=0"] [--pin] [--json out.json]

HYBRID_PARAMD_LIB names libhybrid_paramd.so (else the source tree's).
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

import hybrid_paramd as hp  # noqa: E402
from hybrid_paramd import cluster as hpc  # noqa: E402
from hybrid_paramd import torch_glue  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self, vocab, d, layers):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
            torch.nn.Linear(4 * d, d)) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def loss_of(model, x, y):
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             y.reshape(-1))


def hand_written(client, model, data, steps, device):
    """The loop train_gpt.py had before distribute: ClusterModel by hand."""
    client.load_state_dict({n: p.detach() for n, p in model.named_parameters()},
                           recipe_text=hp.recipe_text(model, "fp8"), force=True)
    cm = torch_glue.ClusterModel(client, model, device="cpu" if device.type == "cpu" else device,
                                 compute_device=device)
    v = client.wait_for_version(0)
    times = []
    for i in range(steps):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        cm.load(v)
        loss_of(model, x, y).backward()
        cm.push(v)
        v = client.wait_for_version(v + 1)
        times.append(time.perf_counter() - t0)
    return times


def distributed(client, model, data, steps, device):
    model = hp.distribute(model, client, recipe="fp8", force=True,
                          fetch_device="cpu" if device.type == "cpu" else device)
    opt = hp.ClusterOptimizer(model)
    times = []
    for i in range(steps):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True, help="the hybrid-paramd binary")
    p.add_argument("--daemon_flags", default="")
    p.add_argument("--device", default="cpu")
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="steps per block")
    p.add_argument("--blocks", type=int, default=3, help="blocks of each loop, alternating")
    p.add_argument("--pin", action="store_true",
                   help="the cluster on the upper half of the CPUs, this process on the lower")
    p.add_argument("--json", default="")
    a = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if a.pin and len(cpus) >= 4:
        trainer_cpus, cluster_cpus = set(cpus[:len(cpus) // 2]), set(cpus[len(cpus) // 2:])
        os.sched_setaffinity(0, cluster_cpus)  # inherited by the cluster's processes
        torch.set_num_threads(len(trainer_cpus))
    else:
        trainer_cpus = None
    device = torch.device(a.device)
    torch.manual_seed(0)
    vocab = 512
    start = Net(vocab, a.d_model, a.layers).state_dict()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, vocab, (a.batch, a.context), generator=g).to(device),
             torch.randint(0, vocab, (a.batch, a.context), generator=g).to(device))
            for _ in range(8)]
    flags = ["--optimizer=adamw", "--lr=1e-3"] + a.daemon_flags.split()
    times = {"hand_written": [], "distribute": []}
    pairs = []  # per block: distribute's median / the hand-written loop's
    with hpc.LocalCluster(a.server, daemons=2, expected_pushers=1, daemon_flags=flags) as cl:
        if trainer_cpus:
            os.sched_setaffinity(0, trainer_cpus)
        admin = hp.Client(cl.address, observer=True)
        admin.load_state_dict(start, recipe_text=None)  # daemons up before timing
        loops = [("hand_written", hand_written), ("distribute", distributed)]
        for b in range(a.blocks):
            block = {}
            for name, loop in (loops if b % 2 == 0 else loops[::-1]):
                model = Net(vocab, a.d_model, a.layers)
                model.load_state_dict(start)
                model.to(device)
                with hp.Client(cl.address, name=name) as c:
                    t = loop(c, model, data, a.steps + 2, device)[2:]  # the first warm caches
                times[name] += t
                block[name] = sorted(t)[len(t) // 2]
            pairs.append(block["distribute"] / block["hand_written"])
        admin.close()
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    out = {
        "device": str(device), "params": sum(t.numel() for t in start.values()),
        "steps_each": len(times["distribute"]),
        "hand_written_step_ms_median": 1e3 * med["hand_written"],
        "distribute_step_ms_median": 1e3 * med["distribute"],
        "ratio": med["distribute"] / med["hand_written"],
        # Robust to drift between blocks: the median of the adjacent blocks' ratios.
        "ratio_of_adjacent_blocks_median": sorted(pairs)[len(pairs) // 2],
        "block_ratios": pairs,
        "pinned": bool(trainer_cpus),
        "cpus": len(cpus),
        "date": time.strftime("%Y-%m-%d"),
    }
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
