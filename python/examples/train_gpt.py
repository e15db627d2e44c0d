#!/usr/bin/env python3
"""Trains a small GPT (plain torch) whose weights live in a hybrid-paramd
cluster, beside a plain torch AdamW baseline on the same data.

The data needs no download: the source code of Python modules shipped with
Python itself, as bytes (a character-level language model, vocabulary 256).

Each step the trainer fetches the version's quantized weights (nn.Linear
weights: rowwise for the forward GEMM, columnwise for dgrad, per the recipe;
embeddings / norms / biases rowwise as BF16), runs forward and backward
(hybrid_paramd.torch_glue), pushes every gradient, and waits for the daemons'
AdamW step. The baseline is the same model, same initial weights, same
batches, with torch.optim.AdamW on FP32 weights.

    python3 python/examples/train_gpt.py --server_binary=bazel-bin/server/hybrid-paramd
    python3 python/examples/train_gpt.py --coordinator=HOST:PORT   # a running cluster

With --coordinator the cluster must have been started with a matching
optimizer (--optimizer=adamw --lr=... --weight_decay=...) and one pusher;
the example loads the initial weights into it (a shared path: the daemons
must read --work_dir). Prints a summary and writes it to --summary_json.
Exits 1 if the loss did not fall or ended more than --tolerance above the
baseline.
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

import hybrid_paramd as hp  # noqa: E402
from hybrid_paramd import cluster as hpc  # noqa: E402
from hybrid_paramd import safetensors_io  # noqa: E402
from hybrid_paramd import torch_glue  # noqa: E402

RECIPES = {
    # Linear weights: FP8 per tensor (current scaling) in both directions;
    # everything else BF16 rowwise only.
    "fp8": 'rule { pattern: ".*\\\\.(qkv|proj|fc1|fc2)\\\\.weight" spec { rowwise { format: '
           'FP8_CURRENT } columnwise { format: FP8_CURRENT } columnwise_usage: true } }',
    "mxfp8": 'rule { pattern: ".*\\\\.(qkv|proj|fc1|fc2)\\\\.weight" spec { rowwise { format: '
             'MXFP8 } columnwise { format: MXFP8 } columnwise_usage: true } }',
    "nvfp4": 'rule { pattern: ".*\\\\.(qkv|proj|fc1|fc2)\\\\.weight" spec { rowwise { format: '
             'NVFP4 } columnwise { format: NVFP4 } columnwise_usage: true } }',
    "fp8_block": 'rule { pattern: ".*\\\\.(qkv|proj|fc1|fc2)\\\\.weight" spec { rowwise { '
                 'format: FP8_BLOCK_128X128 } columnwise { format: FP8_BLOCK_128X128 } columnwise_usage: true } }',
    "bf16": 'rule { pattern: ".*\\\\.(qkv|proj|fc1|fc2)\\\\.weight" spec { rowwise { format: '
            'IDENTITY_BF16 } columnwise { format: IDENTITY_BF16 } columnwise_usage: true } }',
}
DEFAULT_SPEC = 'default_spec { rowwise { format: IDENTITY_BF16 } columnwise_usage: false }'


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
    p.add_argument("--coordinator", default="",
                   help="or use this running cluster (the model is streamed to it; see "
                        "--replace_model)")
    p.add_argument("--replace_model", action="store_true",
                   help="--coordinator: replace a model the cluster already holds")
    p.add_argument("--tls_ca", default="", help="--coordinator: CA of the cluster's TLS certificate")
    p.add_argument("--token_file", default="",
                   help="--coordinator: `ROLE TOKEN` file of a cluster with --auth_token_file "
                        "(its operator line loads the model, its trainer line trains)")
    p.add_argument("--daemons", type=int, default=2)
    p.add_argument("--daemon_flags", default="",
                   help="extra flags for every daemon (e.g. '--backend=gpu --gpu=0')")
    p.add_argument("--format", default="fp8", choices=sorted(RECIPES),
                   help="format of the Linear weights")
    p.add_argument("--device", default="cpu", help="trainer device (cpu or cuda[:N])")
    p.add_argument("--fetch_device", default="",
                   help="where fetches land (default: cpu: the host data plane, then copied "
                        "to --device; 'cuda' fetches over the device channels)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="allowed relative excess of the final loss over the baseline's")
    p.add_argument("--work_dir", default="", help="where the initial model file is written")
    p.add_argument("--summary_json", default="")
    a = p.parse_args()
    if not a.server_binary and not a.coordinator:
        p.error("give --server_binary (start a cluster) or --coordinator")

    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    data = corpus()
    vocab = 256
    model = GPT(vocab, a.d_model, a.heads, a.layers, a.context)
    baseline = GPT(vocab, a.d_model, a.heads, a.layers, a.context)
    baseline.load_state_dict(model.state_dict())
    model.to(device)
    baseline.to(device)

    work = a.work_dir or tempfile.mkdtemp(prefix="train_gpt_")
    os.makedirs(work, exist_ok=True)
    model_path = os.path.join(work, "gpt_init.safetensors")
    safetensors_io.save({n: t.detach().float().cpu() for n, t in model.named_parameters()},
                        model_path)
    recipe = 'name: "train_gpt_%s"\n%s\n%s\n' % (a.format, RECIPES[a.format], DEFAULT_SPEC)

    cl = None
    if a.server_binary:
        flags = ["--optimizer=adamw", "--lr=%g" % a.lr, "--beta1=0.9", "--beta2=0.999",
                 "--adam_eps=1e-8", "--weight_decay=%g" % a.weight_decay]
        flags += a.daemon_flags.split()
        cl = hpc.LocalCluster(a.server_binary, daemons=a.daemons, expected_pushers=1,
                              daemon_flags=flags)
        address = cl.address
    else:
        address = a.coordinator
    try:
        summary = train(a, address, model, baseline, data, device, model_path, recipe)
    except Exception:
        if cl is not None:
            sys.stderr.write(cl.log_tails())
        raise
    finally:
        if cl is not None:
            cl.stop()
    text = json.dumps(summary, indent=1)
    print(text)
    if a.summary_json:
        with open(a.summary_json, "w") as f:
            f.write(text + "\n")
    if not summary["ok"]:
        sys.stderr.write("FAILED: %s\n" % summary["why"])
        return 1
    return 0


def train(a, address, model, baseline, data, device, model_path, recipe):
    security = {"tls_ca": a.tls_ca or None, "token_file": a.token_file or None}
    admin = hp.Client(address, observer=True, name="train_gpt-admin", **security)
    # A running cluster may not see this machine's files: stream the model.
    hpc.load_when_ready(admin, model_path, recipe, stream=bool(a.coordinator),
                        force=a.replace_model)
    trainer = hp.Client(address, name="train_gpt", **security)
    fetch_device = a.fetch_device or "cpu"
    cm = torch_glue.ClusterModel(trainer, model, device=fetch_device)
    opt = torch.optim.AdamW(baseline.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=a.weight_decay)
    losses, base_losses, step_s, fetch_s, push_s, wait_s = [], [], [], [], [], []
    fetched = {"rowwise_bytes": 0, "columnwise_bytes": 0, "rowwise_bf16_bytes": 0,
               "columnwise_bf16_bytes": 0}
    v = trainer.wait_for_version(0)
    for x, y in batches(data, a.steps, a.batch, a.context, a.seed + 1):
        x, y = x.to(device), y.to(device)
        t0 = time.perf_counter()
        stats = cm.load(v)
        if fetch_device != a.device:
            _move_copies(cm, device)
        t1 = time.perf_counter()
        loss = loss_of(model, x, y)
        loss.backward()
        t2 = time.perf_counter()
        cm.push(v)
        t3 = time.perf_counter()
        v = trainer.wait_for_version(v + 1)
        t4 = time.perf_counter()
        for k in fetched:
            fetched[k] += stats[k]
        losses.append(loss.item())
        fetch_s.append(t1 - t0)
        push_s.append(t3 - t2)
        wait_s.append(t4 - t3)
        step_s.append(t4 - t0)
        # Baseline: same batch, FP32 weights, torch AdamW.
        opt.zero_grad()
        bl = loss_of(baseline, x, y)
        bl.backward()
        opt.step()
        base_losses.append(bl.item())
    trainer.close()
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
        "fetch_device": fetch_device, "steps": a.steps, "final_version": v,
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


def _move_copies(cm, device):
    """Host-fetched copies -> the trainer's device (one copy per buffer)."""
    for cl in cm.linears.values():
        for f in (cl.copies.rowwise, cl.copies.columnwise):
            if f is not None:
                f._buf = f._buf.to(device) if f._buf.device != device else f._buf
                f._data = f._scales = None
        cl.copies.compute_dtype = torch.bfloat16 if device.type == "cuda" else \
            cl.copies.compute_dtype


if __name__ == "__main__":
    sys.exit(main())
