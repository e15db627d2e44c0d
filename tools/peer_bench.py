#!/usr/bin/env python3
"""The torch peer of //kernels/cuda:bench.

Times, with PyTorch on the same GPU and the same problem (8 x 8192 x 16384
FP32 masters = 1.07 B parameters, source dtype BF16: the master is rounded to
BF16 on read, FORMATS.md D1), an eager and a torch.compile version of the
work the benchmark times:

  * quantize per format with the scaling rules of FORMATS.md, both
    directions, every output written (data and scales): FP8 per-tensor row +
    col^T with the scale known, MXFP8 1x32 row + 32x1 col (TE's E8M0 ceiling
    rule), NVFP4 16x16 row + col^T and 1x16 row + 16x1 col^T (global amax
    known), FP8 blocks 128x128 and 1x128 (power-of-2 scales);
  * AdamW: torch.optim.AdamW(fused=True) eagerly; torch.compile of a
    foreach AdamW's step;
  * the publish step of FP8 current scaling: AdamW, per-tensor amax, scale,
    FP8 row + col^T (eager: fused AdamW + foreach inf-norm + eager cast;
    compiled: fused AdamW + one compiled amax/scale/cast);
  * the one-pass steps' peers: fused AdamW + FP8 cast with a known (delayed)
    scale, fused AdamW + MXFP8 cast.

Each time is the median of --reps CUDA-event-timed runs after --warmup runs.
Eager and compiled outputs are compared byte for byte (they must agree).
With --ours=bench.json (written by //kernels/cuda:bench --json in the same
call) it prints the table ours / torch and the fraction of the d2d copy
bandwidth (both copies measured in their own program, same run).

Run on the GPU machine (`bash tools/gpu_bench.sh run kernels peer` runs both
from the bundle of tools/gpu_bench.sh), or by hand:
  kernels/cuda/bench --json=bench.json
  python3 tools/peer_bench.py --ours=bench.json --json=peer.json --markdown=peer.md
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch._inductor.config

# Round where the code says so (x.to(bfloat16) then back): without this,
# inductor keeps the fused intermediate in FP32 and the compiled cast skips
# D1's rounding.
torch._inductor.config.emulate_precision_casts = True

F32_MAX = 3.4028234663852886e38
RCP448 = 1.0 / 448.0  # rounded to FP32 on use: RN(1/448) = 0x3B124925
RCP6 = 1.0 / 6.0


def bf16_src(x):
    """D1: the quantizer's input is the master rounded (RNE) to BF16."""
    return x.to(torch.bfloat16).float()


def enc8(y):
    """enc8(., E4M3) = cvt.rn.satfinite: saturate to +-448, RNE, NaN stays NaN."""
    return y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def e8m0_ceil(v):
    """FORMATS.md §3: smallest e with 2^(e-127) >= v (v >= 0), TE's rule."""
    bits = v.view(torch.int32)
    e = (bits >> 23) & 0xFF
    m = bits & 0x7FFFFF
    bump = (m != 0) & (e != 0xFE) & ~((e == 0) & (m <= 0x400000))
    e = e + bump.to(torch.int32)
    e = torch.where(torch.isinf(v), 254, e)
    e = torch.where(torch.isnan(v), 255, e)
    return e


def e8m0_recip(e):
    """2^(127-e) exactly (e = 254: 2^-127, a subnormal; e = 255: NaN)."""
    bits = torch.where(e == 254, 0x00400000, (254 - e) << 23)
    bits = torch.where(e == 255, 0x7FC00000, bits)
    return bits.to(torch.int32).view(torch.float32)


def compute_scale_pow2(a, fmax=448.0, inf_value=F32_MAX):
    """FORMATS.md §2 compute_scale with eps 0 and pow2 (FP8 blocks' default)."""
    s = fmax / a
    s = torch.where(torch.isinf(s), torch.full_like(s, inf_value), s)
    s = (s.view(torch.int32) & -8388608).view(torch.float32)  # & 0xFF800000
    bad = (a == 0) | torch.isinf(a) | torch.isnan(a)
    return torch.where(bad, torch.ones_like(s), s)


def compute_scale(a, fmax=448.0):
    """compute_scale without pow2 (FP8 current scaling's default)."""
    s = fmax / a
    s = torch.where(torch.isinf(s), torch.full_like(s, F32_MAX), s)
    bad = (a == 0) | torch.isinf(a) | torch.isnan(a)
    return torch.where(bad, torch.ones_like(s), s)


def e2m1(y):
    """enc4: RNE on {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating, NaN -> +6, sign kept."""
    a = y.abs()
    c = ((a > 0.25).to(torch.uint8) + (a >= 0.75).to(torch.uint8) + (a > 1.25).to(torch.uint8) +
         (a >= 1.75).to(torch.uint8) + (a > 2.5).to(torch.uint8) + (a >= 3.5).to(torch.uint8) +
         (a > 5.0).to(torch.uint8))
    c = c | (torch.signbit(y).to(torch.uint8) << 3)
    return torch.where(torch.isnan(y), torch.full_like(c, 7), c)


def pack_nibbles(c):
    """Even index in the low nibble, along the last dimension."""
    return c[..., 0::2] | (c[..., 1::2] << 4)


# ---------------------------------------------------------------------------
# The work (x: [B, M, K] FP32 masters; each returns every output buffer)
# ---------------------------------------------------------------------------

def fp8_tensor_rowcol(x, scale):
    """FP8 per-tensor, scale known: row [M][K] + col^T [K][M] (the byte transpose)."""
    q = enc8(bf16_src(x) * scale)
    return q, q.transpose(-1, -2).contiguous()


def mxfp8_rowcol(x):
    B, M, K = x.shape
    s = bf16_src(x)
    sr = s.view(B, M, K // 32, 32)
    er = e8m0_ceil(sr.abs().amax(-1) * RCP448)
    qr = enc8(sr * e8m0_recip(er).unsqueeze(-1)).view(B, M, K)
    sc = s.view(B, M // 32, 32, K)
    ec = e8m0_ceil(sc.abs().amax(-2) * RCP448)
    qc = enc8(sc * e8m0_recip(ec).unsqueeze(-2)).view(B, M, K)
    return qr, er.to(torch.uint8), qc, ec.to(torch.uint8)


def nvfp4_factors(A):
    s_enc = torch.clamp(2688.0 / A, max=F32_MAX)
    s_enc = torch.where((A == 0) | (s_enc == 0) | ~torch.isfinite(A), torch.ones_like(s_enc), s_enc)
    s_dec = 1.0 / s_enc
    return s_enc * RCP6, s_dec


def nvfp4_block_scale(amax, factor, s_dec):
    sd = enc8(amax * factor)  # UE4M3 (amax >= 0)
    sdv = sd.view(torch.float8_e4m3fn).float()
    enc = torch.clamp(1.0 / (sdv * s_dec), max=F32_MAX)
    return sd, enc


def nvfp4_2d_rowcol(x, A):
    """NVFP4 16x16: row [M][K/2] + scales [M][K/16]; col^T [K][M/2] + [K][M/16]."""
    B, M, K = x.shape
    factor, s_dec = nvfp4_factors(A)
    s = bf16_src(x).view(B, M // 16, 16, K // 16, 16)
    sd, enc = nvfp4_block_scale(s.abs().amax(dim=(2, 4)), factor, s_dec)
    c = e2m1(s * enc[:, :, None, :, None]).view(B, M, K)
    row = pack_nibbles(c)
    col = pack_nibbles(c.transpose(-1, -2))
    rs = sd.repeat_interleave(16, dim=1)                    # [B, M, K/16]
    cs = sd.transpose(1, 2).repeat_interleave(16, dim=1)    # [B, K, M/16]
    return row, rs, col, cs


def nvfp4_1d_rowcol(x, A):
    """NVFP4 1x16 row + 16x1 col (quantized from S), col data transposed [K][M/2]."""
    B, M, K = x.shape
    factor, s_dec = nvfp4_factors(A)
    s = bf16_src(x)
    sr = s.view(B, M, K // 16, 16)
    sdr, encr = nvfp4_block_scale(sr.abs().amax(-1), factor, s_dec)
    row = pack_nibbles(e2m1(sr * encr.unsqueeze(-1)).view(B, M, K))
    sc = s.view(B, M // 16, 16, K)
    sdc, encc = nvfp4_block_scale(sc.abs().amax(-2), factor, s_dec)
    cc = e2m1(sc * encc.unsqueeze(-2)).view(B, M, K)
    col = pack_nibbles(cc.transpose(-1, -2))
    return row, sdr, col, sdc.transpose(1, 2).contiguous()


def block128x128_rowcol(x):
    B, M, K = x.shape
    s = bf16_src(x).view(B, M // 128, 128, K // 128, 128)
    sc = compute_scale_pow2(s.abs().amax(dim=(2, 4)))
    q = enc8(s * sc[:, :, None, :, None]).view(B, M, K)
    inv = 1.0 / sc
    return q, inv, q.transpose(-1, -2).contiguous(), inv.transpose(1, 2).contiguous()


def block1x128_rowcol(x):
    B, M, K = x.shape
    s = bf16_src(x)
    sr = s.view(B, M, K // 128, 128)
    scr = compute_scale_pow2(sr.abs().amax(-1))
    qr = enc8(sr * scr.unsqueeze(-1)).view(B, M, K)
    scc_in = s.view(B, M // 128, 128, K)
    scc = compute_scale_pow2(scc_in.abs().amax(-2))
    qc = enc8(scc_in * scc.unsqueeze(-2)).view(B, M, K).transpose(-1, -2).contiguous()
    return qr, (1.0 / scr).transpose(1, 2).contiguous(), qc, 1.0 / scc


def amax_scale_fp8_rowcol(x):
    """Current scaling: per-tensor amax of the BF16 source, scale, row + col^T."""
    s = bf16_src(x)
    a = s.abs().amax(dim=(1, 2), keepdim=True)
    sc = compute_scale(a)
    q = enc8(s * sc)
    return q, q.transpose(-1, -2).contiguous(), 1.0 / sc, a


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------

def time_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    t = []
    for _ in range(reps):
        a.record()
        fn()
        b.record()
        b.synchronize()
        t.append(a.elapsed_time(b))
    return statistics.median(t)


def differing_fraction(u, v):
    """Fraction of output bytes (all buffers together) where u and v differ."""
    if isinstance(u, torch.Tensor):
        u, v = [u], [v]
    diff = total = 0
    for p, q in zip(u, v):
        p, q = p.contiguous().view(torch.uint8), q.contiguous().view(torch.uint8)
        diff += int((p != q).sum())
        total += p.numel()
    return diff / max(total, 1)


def fp8_reference_check(x, scale, q):
    """Independent check of enc8 on a slice: nearest E4M3 value in float64, ties to the even code."""
    codes = torch.arange(0, 0x7F, device=x.device, dtype=torch.uint8)  # +0 .. 448
    grid = codes.view(torch.float8_e4m3fn).double()
    y = (bf16_src(x).double() * float(scale)).clamp(-448.0, 448.0)
    a = y.abs().flatten()
    hi = torch.searchsorted(grid, a).clamp(1, grid.numel() - 1)
    lo = hi - 1
    dlo, dhi = a - grid[lo], grid[hi] - a
    pick = torch.where(dlo < dhi, lo, torch.where(dhi < dlo, hi, torch.where(lo % 2 == 0, lo, hi)))
    ref = (pick.to(torch.uint8) | (torch.signbit(y.flatten()).to(torch.uint8) << 7)).view(y.shape)
    return float((ref != q).double().mean())


# Which //kernels/cuda:bench line each peer line stands beside.
OURS = {
    "fp8 per-tensor row+col^T, scale known": "fp8 per-tensor row+col^T (src bf16)",
    "mxfp8 row+col": "mxfp8 row+col",
    "nvfp4 16x16 row+col^T": "nvfp4 16x16 row+col^T",
    "nvfp4 1x16 row+col^T": "nvfp4 1x16 row+col^T",
    "fp8 block 128x128 row+col^T": "fp8 block 128x128 row+col^T",
    "fp8 block 1x128 row+col^T": "fp8 block 1x128 row+col^T",
    "adamw": "adamw + amax",
    "publish fp8 current: adamw + amax + row+col^T": "publish fp8 current: adamw+amax, scale, row+col^T",
    "adamw + fp8 delayed row+col^T": "fused adamw + fp8 delayed row+col^T",
    "adamw + mxfp8 row+col": "fused adamw + mxfp8 row+col",
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--eager_reps", type=int, default=5, help="timed runs of the eager versions")
    ap.add_argument("--only", default="", help="run only lines whose name contains this")
    ap.add_argument("--no_compile", action="store_true", help="skip the torch.compile versions")
    ap.add_argument("--ours", default="", help="bench.json of //kernels/cuda:bench from the same run")
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--markdown", default="", help="write the table here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("peer_bench: no CUDA device")
    B, M, K = args.tensors, args.rows, args.cols
    if M % 128 or K % 128:
        sys.exit("peer_bench: rows and cols must be multiples of 128")
    dev = torch.device("cuda")
    n = B * M * K
    prop = torch.cuda.get_device_properties(0)
    print(f"torch {torch.__version__}, {prop.name}, {prop.multi_processor_count} SMs; "
          f"{B} x ({M} x {K}) = {n / 1e9:.3f} G params; reps {args.reps} (eager {args.eager_reps})")
    sys.stdout.flush()

    # The same kind of values as the benchmark: a spread of magnitudes, |x| <= 8, no zeros.
    g = torch.Generator(device=dev).manual_seed(17)
    def values(scale, positive=False):
        u = torch.rand((B, M, K), device=dev, generator=g) - 0.5
        u = torch.where(u == 0, torch.full_like(u, 0.25), u)
        u = u * scale * torch.exp2(torch.randint(0, 8, (B, M, K), device=dev, generator=g).float() - 3)
        return u.abs() if positive else u
    master = values(1.0)
    scale = torch.full((1,), 64.0, device=dev)        # FP8 scale, as in the benchmark
    A = torch.full((1,), 8.0, device=dev)              # NVFP4 global amax, as in the benchmark

    results = []
    def record(name, bytes_per_elem, eager_ms, compiled_ms, diff, compile_s):
        r = {"name": name, "bytes_per_elem": bytes_per_elem, "eager_ms": eager_ms,
             "compiled_ms": compiled_ms, "eager_vs_compiled_differing_bytes": diff, "compile_s": compile_s}
        results.append(r)
        print(f"  {name:<48} eager {eager_ms:9.3f} ms  compiled "
              f"{compiled_ms if compiled_ms else float('nan'):9.3f} ms  "
              f"(compile {compile_s:.1f} s, bytes differing eager vs compiled: {diff})")
        sys.stdout.flush()

    def want(name):
        return not args.only or args.only in name

    # d2d copy, the ceiling (read + write), measured here too.
    dst = torch.empty_like(master)
    copy_ms = time_ms(lambda: dst.copy_(master), args.warmup, args.reps)
    copy_gbps = 8.0 * n / (copy_ms * 1e-3) / 1e9
    print(f"  d2d copy (torch copy_) {copy_ms:.3f} ms = {copy_gbps:.1f} GB/s")
    del dst

    def run(name, bytes_per_elem, fn, *fargs):
        if not want(name):
            return
        eager_ms = time_ms(lambda: fn(*fargs), 1, args.eager_reps)
        compiled_ms, diff, compile_s = None, None, 0.0
        if not args.no_compile:
            cfn = torch.compile(fn, dynamic=False)
            t0 = time.time()
            out_c = cfn(*fargs)
            torch.cuda.synchronize()
            compile_s = time.time() - t0
            compiled_ms = time_ms(lambda: cfn(*fargs), args.warmup, args.reps)
            out_e = fn(*fargs)
            diff = differing_fraction(out_e, out_c)
            if fn is fp8_tensor_rowcol:
                sl = (0, slice(0, 1024), slice(0, 1024))
                print(f"    fp8 bytes differing from the float64 reference (1024 x 1024 slice): "
                      f"eager {fp8_reference_check(master[sl], 64.0, out_e[0][sl])}, "
                      f"compiled {fp8_reference_check(master[sl], 64.0, out_c[0][sl])}")
            del out_c, out_e
        record(name, bytes_per_elem, eager_ms, compiled_ms, diff, compile_s)
        torch.cuda.empty_cache()

    run("fp8 per-tensor row+col^T, scale known", 6.0, fp8_tensor_rowcol, master, scale)
    run("mxfp8 row+col", 6.0625, mxfp8_rowcol, master)
    run("nvfp4 16x16 row+col^T", 5.125, nvfp4_2d_rowcol, master, A)
    run("nvfp4 1x16 row+col^T", 5.125, nvfp4_1d_rowcol, master, A)
    run("fp8 block 128x128 row+col^T", 6.0005, block128x128_rowcol, master)
    run("fp8 block 1x128 row+col^T", 6.0625, block1x128_rowcol, master)

    # Optimizer work: one leaf parameter per tensor, sharing the [B, M, K] storage.
    opt_names = ["adamw", "publish fp8 current: adamw + amax + row+col^T",
                 "adamw + fp8 delayed row+col^T", "adamw + mxfp8 row+col"]
    if any(want(nm) for nm in opt_names):
        grad = values(1.0)
        params = [torch.nn.Parameter(master[i]) for i in range(B)]
        for i, p in enumerate(params):
            p.grad = grad[i]
        hyper = dict(lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        fused = torch.optim.AdamW(params, fused=True, **hyper)
        fused.step()  # moments allocated (untimed)
        cast_fp8 = torch.compile(fp8_tensor_rowcol, dynamic=False) if not args.no_compile else None
        cast_mx = torch.compile(mxfp8_rowcol, dynamic=False) if not args.no_compile else None
        publish_c = torch.compile(amax_scale_fp8_rowcol, dynamic=False) if not args.no_compile else None

        def publish_eager():
            fused.step()
            with torch.no_grad():
                a = torch.stack(torch._foreach_norm([p.detach() for p in params], float("inf")))
                a = a.to(torch.bfloat16).float().view(B, 1, 1)  # amax of the BF16 source (monotone)
                sc = compute_scale(a)
                q = enc8(bf16_src(master) * sc)
                return q, q.transpose(-1, -2).contiguous(), 1.0 / sc

        def steps():
            with torch.no_grad():
                if want("adamw"):
                    eager_ms = time_ms(fused.step, 1, args.reps)
                    compiled_ms, compile_s = None, 0.0
                    if not args.no_compile:
                        # The compiled optimizer: torch.compile of a foreach AdamW's step.
                        fe = torch.optim.AdamW(params, foreach=True, **hyper)
                        fe.load_state_dict(fused.state_dict())
                        cstep = torch.compile(fe.step)
                        t0 = time.time()
                        cstep()
                        torch.cuda.synchronize()
                        compile_s = time.time() - t0
                        compiled_ms = time_ms(cstep, args.warmup, args.reps)
                        del fe, cstep
                    record("adamw", 28.0, eager_ms, compiled_ms, None, compile_s)
                    torch.cuda.empty_cache()
                nm = "publish fp8 current: adamw + amax + row+col^T"
                if want(nm):
                    eager_ms = time_ms(publish_eager, 1, args.eager_reps)
                    compiled_ms, compile_s = None, 0.0
                    if publish_c is not None:
                        t0 = time.time()
                        publish_c(master)
                        torch.cuda.synchronize()
                        compile_s = time.time() - t0
                        compiled_ms = time_ms(lambda: (fused.step(), publish_c(master)), args.warmup, args.reps)
                    record(nm, 34.0, eager_ms, compiled_ms, None, compile_s)
                    torch.cuda.empty_cache()
                for nm, cast_e, cast_cc, extra, bpe in (
                        ("adamw + fp8 delayed row+col^T", fp8_tensor_rowcol, cast_fp8, (scale,), 30.0),
                        ("adamw + mxfp8 row+col", mxfp8_rowcol, cast_mx, (), 30.0625)):
                    if not want(nm):
                        continue
                    eager_ms = time_ms(lambda: (fused.step(), cast_e(master, *extra)), 1, args.eager_reps)
                    compiled_ms, compile_s = None, 0.0
                    if cast_cc is not None:
                        t0 = time.time()
                        cast_cc(master, *extra)
                        torch.cuda.synchronize()
                        compile_s = time.time() - t0
                        compiled_ms = time_ms(lambda: (fused.step(), cast_cc(master, *extra)),
                                              args.warmup, args.reps)
                    record(nm, bpe, eager_ms, compiled_ms, None, compile_s)
                    torch.cuda.empty_cache()
        steps()

    ours = {}
    our_copy = None
    if args.ours and os.path.exists(args.ours):
        with open(args.ours) as f:
            j = json.load(f)
        our_copy = j.get("copy_gbps")
        ours = {k["name"]: k for k in j["kernels"]}

    # The table: ours, torch eager, torch.compile, speedup, fractions of copy.
    lines = []
    lines.append(f"torch {torch.__version__} on {prop.name}; {B} x ({M} x {K}) FP32 masters; "
                 f"d2d copy: ours {our_copy or float('nan'):.0f} GB/s, torch {copy_gbps:.0f} GB/s")
    lines.append("")
    lines.append("| work | B/elem | ours ms | torch eager ms | torch.compile ms | torch.compile / ours | "
                 "best torch / ours | ours: of copy | torch.compile: of copy |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        o = ours.get(OURS.get(r["name"], ""), None)
        o_ms = o["ms"] if o else None
        o_frac = o["ratio_to_copy"] if o else None
        c_ms = r["compiled_ms"]
        c_frac = (r["bytes_per_elem"] * n / (c_ms * 1e-3) / 1e9 / copy_gbps) if c_ms else None
        def f(v, fmt):
            return fmt % v if v is not None else "-"
        speed = c_ms / o_ms if (c_ms and o_ms) else None
        best = min(r["eager_ms"], c_ms) / o_ms if (c_ms and o_ms) else (r["eager_ms"] / o_ms if o_ms else None)
        r["ours_ms"], r["ours_of_copy"], r["compiled_of_copy"], r["speedup"] = o_ms, o_frac, c_frac, speed
        r["speedup_vs_best"] = best
        lines.append(f"| {r['name']} | {r['bytes_per_elem']:g} | {f(o_ms, '%.3f')} | {r['eager_ms']:.3f} | "
                     f"{f(c_ms, '%.3f')} | {f(speed, '%.2fx')} | {f(best, '%.2fx')} | {f(o_frac, '%.3f')} | "
                     f"{f(c_frac, '%.3f')} |")
    table = "\n".join(lines)
    print()
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": prop.name, "params": n,
                       "torch_copy_gbps": copy_gbps, "ours_copy_gbps": our_copy, "lines": results}, f, indent=1)
    bad = [r["name"] for r in results if r["eager_vs_compiled_differing_bytes"]]
    if bad:
        print("eager and compiled outputs differ for: " + ", ".join(bad))
    return 0


if __name__ == "__main__":
    sys.exit(main())
