"""GEMM glue: train a torch module whose weights live in a hybrid-paramd
cluster.

`Linear` (an autograd Function) runs the forward GEMM from a weight's
rowwise copy and dgrad from its columnwise copy:
  * per-tensor FP8 (fp8_delayed / fp8_current) on a CUDA device with
    torch._scaled_mm (Hopper or newer): Y = X W^T with the rowwise [M][K]
    FP8 bytes as the column-major K x M operand, dX = dY W with the
    columnwise copy, which is already the [K][M] byte transpose the GEMM
    wants; the activations / output gradients are cast to E4M3 with a
    per-tensor current scale;
  * every other format (MXFP8, NVFP4, FP8 blocks, identity), and any format
    on the CPU, dequantizes the copy (formats.dequantize) to the compute
    dtype (BF16 on CUDA, the input's dtype on CPU) and uses a plain matmul;
wgrad = dY^T X is computed from the saved activations (BF16 on CUDA, the
input's dtype on CPU) and lands in the weight's .grad as usual, ready to be
pushed.

`ClusterModel` swaps the weights of a module for each fetched version:

    cm = ClusterModel(client, model)          # every parameter in the manifest
    v = client.wait_for_version(0)
    for batch in data:
        cm.load(v)                           # fetch v; nn.Linear weights -> Linear
        loss = loss_fn(model(batch)); loss.backward()
        cm.push(v)                           # every parameter's gradient
        v = client.wait_for_version(v + 1)

Parameters that are not nn.Linear weights (embeddings, norms, biases) are
fetched rowwise, dequantized and copied into the parameter each version.
"""

import torch

from . import formats as F

_E4M3_MAX = 448.0


def _has_scaled_mm(device):
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm") or not F.HAS_FP8_DTYPES:
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 9


def _to_fp8(x):
    """x as E4M3 with a per-tensor current scale; returns (fp8, scale_inv)."""
    amax = x.abs().amax().float().clamp(min=1e-12)
    scale = _E4M3_MAX / amax
    q = (x.float() * scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.reciprocal()


def scaled_mm(a_fp8, b_fp8_colmajor, scale_a, scale_b, out_dtype):
    """torch._scaled_mm across torch versions (2.1-2.3 return (out, amax)).
    The scales are copied into their own allocations: cuBLASLt refuses
    (CUBLAS_STATUS_NOT_SUPPORTED) a scale pointer that is not 16-byte
    aligned (a view into a larger allocation may not be)."""
    r = torch._scaled_mm(a_fp8, b_fp8_colmajor, scale_a=scale_a.reshape(()).float().clone(),
                         scale_b=scale_b.reshape(()).float().clone(), out_dtype=out_dtype)
    return r[0] if isinstance(r, tuple) else r


def _fp8_gemm_ok(fetched, *dims):
    return (fetched is not None and fetched.format in F.PER_TENSOR_FP8 and
            fetched.fp8_type == F.E4M3 and _has_scaled_mm(fetched.data.device) and
            all(d % 16 == 0 for d in dims))


class WeightCopies:
    """The fetched copies of one [M, K] weight (rowwise and columnwise
    Fetched, either may be None) and their dequantized forms, made once per
    version on first use."""

    def __init__(self, rowwise, columnwise, compute_dtype):
        self.rowwise = rowwise
        self.columnwise = columnwise
        self.compute_dtype = compute_dtype
        self._deq = {}

    def dequantized(self, direction):
        """The [M, K] weight from that direction's copy (the rowwise one if
        the columnwise copy was not fetched)."""
        f = self.columnwise if direction == F.COLUMNWISE and self.columnwise is not None \
            else self.rowwise
        key = f.direction
        w = self._deq.get(key)
        if w is None:
            w = f.dequantize(self.compute_dtype)
            self._deq[key] = w
        return w


class Linear(torch.autograd.Function):
    """y = x W^T + b with W from `copies` (WeightCopies); `weight` is the
    parameter whose .grad receives wgrad (its value is not read)."""

    @staticmethod
    def forward(ctx, x, weight, bias, copies):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        m, k = weight.shape
        row = copies.rowwise
        if _fp8_gemm_ok(row, x2.shape[0], m, k):
            xq, x_scale_inv = _to_fp8(x2)
            y = scaled_mm(xq, row.data.t(), x_scale_inv, row.scale_inv_tensor,
                          torch.bfloat16).to(x.dtype)
        else:
            w = copies.dequantized(F.ROWWISE)
            y = (x2.to(w.dtype) @ w.t()).to(x.dtype)
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x2, weight, bias)
        ctx.copies = copies
        ctx.lead = lead
        return y.reshape(*lead, m)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, bias = ctx.saved_tensors
        copies = ctx.copies
        m, k = weight.shape
        dy2 = dy.reshape(-1, m)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            col = copies.columnwise
            if _fp8_gemm_ok(col, dy2.shape[0], m, k) and col.transposed:
                dyq, dy_scale_inv = _to_fp8(dy2)
                # col.data is [K][M] row-major == W as a column-major M x K.
                dx = scaled_mm(dyq, col.data.t(), dy_scale_inv, col.scale_inv_tensor,
                               torch.bfloat16)
            else:
                w = copies.dequantized(F.COLUMNWISE)
                dx = dy2.to(w.dtype) @ w
            dx = dx.to(x2.dtype).reshape(*ctx.lead, k)
        if ctx.needs_input_grad[1]:
            wgrad_dtype = torch.bfloat16 if dy.device.type == "cuda" else dy.dtype
            dw = (dy2.to(wgrad_dtype).t() @ x2.to(wgrad_dtype)).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            db = dy2.sum(0).to(bias.dtype)
        return dx, dw, db, None


class _ClusterLinear(torch.nn.Module):
    """Stands in for an nn.Linear: same parameters (weight only as the
    gradient's home), forward through Linear with the current copies."""

    def __init__(self, linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.copies = None

    def forward(self, x):
        if self.copies is None:
            raise RuntimeError("ClusterModel.load(version) has not been called")
        return Linear.apply(x, self.weight, self.bias, self.copies)


def _indexed(device):
    """`device` as a torch.device with its index ("cuda" -> "cuda:N", the
    current device), so that two names of one device compare equal."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def _move_fetched(result, device):
    """Moves a fetch's buffers to `device` (each shared buffer once)."""
    moved = {}
    for f in result:
        key = id(f._buf)
        if key not in moved:
            moved[key] = f._buf.to(device)
        f._buf = moved[key]
        f._data = f._scales = None


class ClusterModel:
    """Binds `module`'s parameters to the cluster's tensors and swaps its
    nn.Linear layers for _ClusterLinear (in place).

    names: {parameter name: cluster tensor name}; default: every parameter
    under its own name (module.named_parameters()). Linear weights are
    fetched in `directions` (both by default: forward and dgrad); every
    other parameter rowwise. device: where fetches land ("cpu" uses the host
    data plane; a CUDA device the device channels)."""

    def __init__(self, client, module, names=None, directions=("rowwise", "columnwise"),
                 device=None, compute_device=None):
        self.client = client
        self.module = module
        params = dict(module.named_parameters())
        self.names = dict(names) if names is not None else {n: n for n in params}
        first = next(iter(params.values()))
        self.device = _indexed(device if device is not None else first.device)
        # Where the GEMMs run: copies fetched elsewhere are moved there once
        # per version (one copy of the fetch's buffer, not one per tensor).
        self.compute_device = _indexed(compute_device if compute_device is not None
                                       else first.device)
        self.compute_dtype = (torch.bfloat16 if self.compute_device.type == "cuda"
                              else first.dtype)
        self.params = {n: params[n] for n in self.names}
        manifest = client.manifest()
        missing = [c for c in self.names.values() if c not in manifest]
        if missing:
            raise KeyError("not in the cluster's manifest: %s" % ", ".join(missing))
        self.linears = {}  # parameter name of the weight -> _ClusterLinear
        self._swap(module, "")
        self.directions = tuple(directions)
        self.fetched = None
        self.last_stats = None

    def _swap(self, mod, prefix):
        for child_name, child in list(mod.named_children()):
            full = prefix + child_name
            if isinstance(child, torch.nn.Linear) and (full + ".weight") in self.names:
                cl = _ClusterLinear(child)
                setattr(mod, child_name, cl)
                self.linears[full + ".weight"] = cl
            else:
                self._swap(child, full + ".")

    def load(self, version):
        """Fetches `version` (one fetch) and installs it: Linear copies,
        other parameters' values. Returns the fetch's byte counts."""
        c = self.client
        manifest = c.manifest()
        pairs = []
        for pname in self.params:
            t = self.names[pname]
            dirs = self.directions if pname in self.linears else ("rowwise",)
            pairs += [(t, d) for d in dirs if manifest[t].direction(d).published]
        r = c.fetch(version, targets=pairs, device=self.device)
        if self.compute_device != self.device:
            _move_fetched(r, self.compute_device)
        for pname, cl in self.linears.items():
            t = self.names[pname]
            row = r[t, "rowwise"]
            try:
                col = r[t, "columnwise"]
            except KeyError:
                col = None
            cl.copies = WeightCopies(row, col, self.compute_dtype)
        with torch.no_grad():
            for pname, p in self.params.items():
                if pname in self.linears:
                    continue
                f = r[self.names[pname], "rowwise"]
                p.copy_(f.dequantize(torch.float32).reshape(p.shape).to(p.dtype))
        self.fetched = r
        self.last_stats = r.stats
        return r.stats

    def gradients(self):
        """{cluster tensor name: gradient} of every bound parameter (zeros
        where no gradient flowed). Linear wgrads go as BF16 from CUDA."""
        out = {}
        for pname, p in self.params.items():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            if pname in self.linears and g.device.type == "cuda":
                g = g.to(torch.bfloat16)
            out[self.names[pname]] = g
        return out

    def push(self, version, zero_grad=True):
        """Pushes gradients() for `version`; clears the .grads."""
        r = self.client.push_gradients(version, self.gradients())
        if zero_grad:
            for p in self.params.values():
                p.grad = None
        return r
