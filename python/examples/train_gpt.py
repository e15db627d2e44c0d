#!/usr/bin/env python3
"""Trains a small GPT (plain torch) whose weights live in a hybrid-paramd
cluster, beside a plain torch AdamW baseline on the same data.

The data needs no download: the source code of Python modules shipped with
Python itself, as bytes (a character-level language model, vocabulary 256).

The training loop is torch's own: the model is handed to the cluster with
hybrid_paramd.distribute (nn.Linear weights fetched rowwise for the forward
GEMM and columnwise for dgrad, in --format; the rest BF16) and
hybrid_paramd.ClusterOptimizer steps it (push the gradients, wait for the
daemons' AdamW step, fetch the new version). The baseline is the same
model, same initial weights, same batches, with torch.optim.AdamW on FP32
weights.

    python3 python/examples/train_gpt.py --server_binary=bazel-bin/server/hybrid-paramd
    python3 python/examples/train_gpt.py --coordinator=HOST:PORT   # a running cluster
    torchrun --nproc_per_node=2 python/examples/train_gpt.py --server_binary=...  # data parallel

With --coordinator the cluster must have been started with a matching
optimizer (--optimizer=adamw --lr=... --weight_decay=...) and
--expected_pushers equal to the number of ranks; the example streams the
initial weights to it. Under torchrun each rank trains on its slice of the
global --batch and pushes its gradients (rank 0 starts the --server_binary
cluster and loads the model); the reported loss is the mean over the ranks.
Prints a line per step and a summary, which --summary_json also gets.
Exits 1 if the loss did not fall or ended more than --tolerance above the
baseline.
"""

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

import hybrid_paramd as hp  # noqa: E402
from hybrid_paramd import cluster as hpc  # noqa: E402

FORMATS = sorted(hp.cluster_module.PRESETS)


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab, d, heads, layers, context):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(context, d)
        self.blocks = torch.nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def corpus():
    """Bytes of Python's own standard library sources (no download)."""
    import difflib
    import textwrap
    import argparse as ap
    text = b""
    for m in (textwrap, difflib, ap):
        with open(m.__file__, "rb") as f:
            text += f.read()
    return torch.tensor(list(text), dtype=torch.long)


def batches(data, steps, batch, context, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        i = torch.randint(0, len(data) - context - 1, (batch,), generator=g)
        x = torch.stack([data[j:j + context] for j in i.tolist()])
        y = torch.stack([data[j + 1:j + context + 1] for j in i.tolist()])
        yield x, y


def loss_of(model, x, y):
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             y.reshape(-1))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server_binary", default="",
                   help="hybrid-paramd binary: start a local cluster (coordinator + --daemons)")
    p.add_argument("--coordinator", default=os.environ.get("PARAMD_COORDINATOR", ""),
                   help="or use this running cluster (default $PARAMD_COORDINATOR; the model is "
                        "streamed to it; see --replace_model)")
    p.add_argument("--replace_model", action="store_true",
                   help="--coordinator: replace a model the cluster already holds")
    p.add_argument("--tls_ca", default="",
                   help="--coordinator: CA of the cluster's TLS certificate (default "
                        "$HPCTL_TLS_CA)")
    p.add_argument("--token_file", default="",
                   help="--coordinator: `ROLE TOKEN` file of a cluster with --auth_token_file "
                        "(its operator line loads the model, its trainer line trains; default "
                        "$HPCTL_TOKEN_FILE)")
    p.add_argument("--daemons", type=int, default=2)
    p.add_argument("--daemon_flags", default="",
                   help="extra flags for every daemon (e.g. '--backend=gpu --gpu=0')")
    p.add_argument("--format", default="fp8", choices=FORMATS,
                   help="format of the Linear weights (the output head stays BF16)")
    p.add_argument("--device", default="cpu", help="trainer device (cpu or cuda[:N])")
    p.add_argument("--fetch_device", default="",
                   help="where fetches land (default: cpu: the host data plane, then copied "
                        "to --device; 'cuda' fetches over the device channels)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16, help="global batch (split over the ranks)")
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="allowed relative excess of the final loss over the baseline's")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    p.add_argument("--summary_json", default="")
    a = p.parse_args()
    if not a.server_binary and not a.coordinator:
        p.error("give --server_binary (start a cluster) or --coordinator (or $PARAMD_COORDINATOR)")

    rank, world = _init_distributed()
    if a.batch % world:
        p.error("--batch=%d does not split over %d ranks" % (a.batch, world))
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    data = corpus()
    vocab = 256
    model = GPT(vocab, a.d_model, a.heads, a.layers, a.context)
    baseline = GPT(vocab, a.d_model, a.heads, a.layers, a.context)
    baseline.load_state_dict(model.state_dict())
    model.to(device)
    baseline.to(device)

    cl = None
    address = a.coordinator
    if a.server_binary:
        if rank == 0:
            flags = ["--optimizer=adamw", "--lr=%g" % a.lr, "--beta1=0.9", "--beta2=0.999",
                     "--adam_eps=1e-8", "--weight_decay=%g" % a.weight_decay]
            flags += a.daemon_flags.split()
            cl = hpc.LocalCluster(a.server_binary, daemons=a.daemons, expected_pushers=world,
                                  daemon_flags=flags)
            address = cl.address
        address = _broadcast(address, world)
    try:
        summary = train(a, address, model, baseline, data, device, rank, world)
    except Exception:
        if cl is not None:
            sys.stderr.write(cl.log_tails())
        raise
    finally:
        if world > 1:
            torch.distributed.barrier()  # every rank is done before rank 0 stops the cluster
        if cl is not None:
            cl.stop()
    if rank != 0:
        return 0 if summary["ok"] else 1
    text = json.dumps(summary, indent=1)
    print(text)
    if a.summary_json:
        with open(a.summary_json, "w") as f:
            f.write(text + "\n")
    if not summary["ok"]:
        sys.stderr.write("FAILED: %s\n" % summary["why"])
        return 1
    return 0


def _init_distributed():
    """(rank, world size): torchrun's, over a gloo process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        torch.distributed.init_process_group("gloo")
        return torch.distributed.get_rank(), world
    return 0, 1


def _broadcast(value, world):
    if world == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _mean_over_ranks(x, world):
    if world == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return t.item() / world


def _progress(steps, quiet):
    """The step numbers, with a tqdm bar when tqdm is installed."""
    if quiet:
        return range(steps), None
    try:
        import tqdm
    except ImportError:
        return range(steps), None
    bar = tqdm.tqdm(range(steps), unit="step", file=sys.stderr)
    return bar, bar


def train(a, address, model, baseline, data, device, rank, world):
    security = {"tls_ca": a.tls_ca or None, "token_file": a.token_file or None}
    trainer = hp.Client(address, name="train_gpt-rank%d" % rank, **security)
    # The operator's role loads the model (a trainer's token may not).
    admin = hp.Client(address, observer=True, name="train_gpt-admin", **security) \
        if rank == 0 else None
    model = hp.distribute(model, trainer, recipe=a.format, force=a.replace_model,
                          load_client=admin,
                          linear_filter=lambda name, _: name != "head",
                          fetch_device=a.fetch_device or "cpu")
    opt = hp.ClusterOptimizer(model)
    base_opt = torch.optim.AdamW(baseline.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=a.weight_decay)
    losses, base_losses, step_s, fetch_s, push_s, wait_s = [], [], [], [], [], []
    fetched = dict(opt.last_stats)
    local = a.batch // world
    mine = slice(rank * local, (rank + 1) * local)
    steps, bar = _progress(a.steps, a.quiet or rank != 0)
    data_iter = batches(data, a.steps, a.batch, a.context, a.seed + 1)
    for step in steps:
        x, y = next(data_iter)
        x, y = x.to(device), y.to(device)
        t0 = time.perf_counter()
        loss = loss_of(model, x[mine], y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        step_s.append(time.perf_counter() - t0)
        for k in fetched:
            fetched[k] += opt.last_stats[k]
        losses.append(_mean_over_ranks(loss.item(), world))
        fetch_s.append(opt.fetch_seconds)
        push_s.append(opt.push_seconds)
        wait_s.append(opt.wait_seconds)
        # Baseline: the whole global batch, FP32 weights, torch AdamW.
        base_opt.zero_grad()
        bl = loss_of(baseline, x, y)
        bl.backward()
        base_opt.step()
        base_losses.append(bl.item())
        line = "step %d/%d  loss %.4f (baseline %.4f)  %.0f tokens/s  version %d  " \
               "push %.1f ms  wait %.1f ms  fetch %.1f ms" % (
                   step + 1, a.steps, losses[-1], base_losses[-1],
                   a.batch * a.context / step_s[-1], opt.version, 1e3 * push_s[-1],
                   1e3 * wait_s[-1], 1e3 * fetch_s[-1])
        if bar is not None:
            bar.set_postfix_str("loss %.4f v%d" % (losses[-1], opt.version))
        elif not a.quiet and rank == 0:
            print(line, flush=True)
    version = opt.version
    trainer.close()
    if admin is not None:
        admin.close()
    k = max(1, min(5, len(losses) // 4))
    final, base_final = sum(losses[-k:]) / k, sum(base_losses[-k:]) / k
    start = sum(losses[:k]) / k
    ok, why = True, ""
    if not final < start * 0.9:
        ok, why = False, "loss did not fall: %.4f -> %.4f" % (start, final)
    elif final > base_final * (1 + a.tolerance):
        ok, why = False, "final loss %.4f is %.1f%% above the baseline's %.4f" % (
            final, 100 * (final / base_final - 1), base_final)
    med = lambda s: sorted(s)[len(s) // 2]
    return {
        "ok": ok, "why": why, "format": a.format, "device": str(device),
        "fetch_device": a.fetch_device or "cpu", "ranks": world, "steps": a.steps,
        "final_version": version,
        "loss_start": start, "loss_final": final, "baseline_loss_final": base_final,
        "relative_to_baseline": final / base_final - 1,
        "losses": losses, "baseline_losses": base_losses,
        "bytes_fetched": fetched,
        "fetched_vs_bf16": {
            "rowwise": fetched["rowwise_bytes"] / max(1, fetched["rowwise_bf16_bytes"]),
            "columnwise": fetched["columnwise_bytes"] / max(1, fetched["columnwise_bf16_bytes"]),
        },
        "step_seconds_median": med(step_s), "fetch_seconds_median": med(fetch_s),
        "push_seconds_median": med(push_s), "wait_step_seconds_median": med(wait_s),
        "step_seconds": step_s,
    }


if __name__ == "__main__":
    sys.exit(main())
