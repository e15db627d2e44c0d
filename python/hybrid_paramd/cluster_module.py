"""Any nn.Module in two lines: `distribute` puts a module's parameters in a
hybrid-paramd cluster and binds the module to it; `ClusterOptimizer` is the
optimizer-shaped object whose step() pushes the gradients, waits for the
daemons' step and fetches the new version. The training loop stays as it is:

    model = hp.distribute(model, client, recipe="fp8")
    opt = hp.ClusterOptimizer(model)
    for x, y in data:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

The optimizer itself (AdamW or SGD, its learning rate and schedule) runs on
the daemons, configured on the coordinator (hybrid-paramd --optimizer,
--lr, ...), not here. nn.Linear weights are fetched in both directions:
the forward GEMM uses the rowwise copy, the data gradient the columnwise
copy (torch_glue.Linear: torch._scaled_mm for per-tensor FP8 on a Hopper or
newer GPU, a dequantized matmul for every other format and on the CPU).
Every other parameter is fetched rowwise as BF16 and copied into the
parameter.

Data parallel: run the script under torchrun with the coordinator started
with --expected_pushers=WORLD_SIZE. Rank 0 loads the model, every rank
pushes its gradients divided by the number of pushers (the daemons add the
pushes: the sum is the mean over the global batch), and every rank fetches
the same version.
"""

import os
import re
import time

import torch

from . import errors
from .torch_glue import ClusterModel

# Recipe presets: the format of the nn.Linear weights, both directions.
# Everything else is BF16, rowwise only.
PRESETS = {
    "fp8": "FP8_CURRENT",
    "fp8_delayed": "FP8_DELAYED",
    "mxfp8": "MXFP8",
    "nvfp4": "NVFP4",
    "fp8_block": "FP8_BLOCK_128X128",
    "bf16": "IDENTITY_BF16",
    "fp32": "IDENTITY_FP32",
}
_DEFAULT_SPEC = "default_spec { rowwise { format: IDENTITY_BF16 } columnwise_usage: false }"


def linear_weight_names(module, linear_filter=None):
    """Parameter names of the weights of `module`'s nn.Linear layers (those
    for which linear_filter(module name, layer) is true, if given)."""
    out = []
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.Linear) and (linear_filter is None or linear_filter(name, m)):
            out.append((name + "." if name else "") + "weight")
    return out


def recipe_text(module, recipe, linear_filter=None):
    """The recipe (protobuf text) for `recipe`: a preset name (PRESETS) makes
    one rule naming `module`'s nn.Linear weights exactly (those
    linear_filter(name, layer) accepts, as torchao's module_filter_fn), in
    that format in both directions, and BF16 rowwise for the rest; None
    means BF16 rowwise for everything; any other string is taken as recipe
    text."""
    if recipe is None:
        return 'name: "bf16"\n%s\n' % _DEFAULT_SPEC
    if recipe not in PRESETS:
        if "{" not in recipe and ":" not in recipe:
            raise ValueError("recipe %r: give one of %s, or recipe text" %
                             (recipe, ", ".join(sorted(PRESETS))))
        return recipe
    names = linear_weight_names(module, linear_filter)
    lines = ['name: "%s"' % recipe]
    if names:
        # A full-match RE2 pattern, written as a protobuf string literal.
        pattern = "|".join(re.escape(n) for n in names)
        pattern = pattern.replace("\\", "\\\\").replace('"', '\\"')
        fmt = PRESETS[recipe]
        # FP32 copies are of the masters themselves, not of their BF16
        # rounding (the recipe's default source).
        source = " source_dtype: FP32" if fmt == "IDENTITY_FP32" else ""
        lines.append('rule { pattern: "%s" spec { rowwise { format: %s } columnwise { format: %s } '
                     "columnwise_usage: true%s } }" % (pattern, fmt, fmt, source))
    lines.append(_DEFAULT_SPEC)
    return "\n".join(lines) + "\n"


def _rank_and_world():
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _barrier():
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        return True
    return False


def _await_model(client, params, timeout):
    """Until the cluster's manifest holds every parameter in its shape
    (another rank loads it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            m = client.manifest(refresh=True)
            if all(n in m and tuple(m[n].shape) == tuple(p.shape) for n, p in params.items()):
                return
        except errors.Error:
            pass
        if time.monotonic() > deadline:
            raise errors.DeadlineExceeded(
                4, "the cluster holds no model with this module's %d parameters after %.0f s "
                "(rank 0 loads it; is it running?)" % (len(params), timeout))
        time.sleep(0.05)


def distribute(model, client, recipe="fp8", force=False, load=None, load_client=None,
               linear_filter=None, directions=("rowwise", "columnwise"), fetch_device=None,
               timeout=60.0):
    """Puts `model`'s parameters in the cluster `client` is connected to,
    binds the model to it (its nn.Linear layers are replaced in place by
    layers that compute from the fetched copies) and fetches the first
    version. Returns `model`.

    recipe: a preset (PRESETS: "fp8", "mxfp8", "nvfp4", "fp8_block",
    "bf16", ...) for the nn.Linear weights, None for BF16 everywhere, or
    recipe text; linear_filter(name, layer): which nn.Linear layers the
    preset applies to (default all). force: replace a model the cluster
    already holds. load: whether this process loads the parameters
    (default: rank 0 only, the RANK of torchrun or torch.distributed); the
    others wait for them; load=False everywhere binds to the model the
    cluster holds and its newest version (resuming a run). Under an
    initialized torch.distributed every rank must call distribute (its
    barrier orders the load before the other ranks' first fetch). load_client: the client that loads (default
    `client`; a cluster with tokens lets only the operator role load).
    directions: what the Linear weights are fetched in. fetch_device: where
    fetches land ("cpu", the default, uses the host data plane; a CUDA
    device the device channels); the copies are moved to the model's
    device. Buffers stay in the model.
    """
    params = dict(model.named_parameters())
    if not params:
        raise ValueError("the module has no parameters")
    rank, _ = _rank_and_world()
    if load is None:
        load = rank == 0
    if load:
        loader = load_client if load_client is not None else client
        text = recipe_text(model, recipe, linear_filter)
        deadline = time.monotonic() + timeout
        while True:
            try:
                loader.load_state_dict({n: p.detach() for n, p in params.items()},
                                       recipe_text=text, force=force)
                break
            except errors.Unavailable:  # the daemons are still joining
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    if not _barrier() and not load:
        _await_model(client, params, timeout)
    client.manifest(refresh=True)  # the model may have been loaded by another client
    compute = next(iter(params.values())).device
    cm = ClusterModel(client, model, directions=directions,
                      device=fetch_device if fetch_device is not None else "cpu",
                      compute_device=compute)
    cm.version = client.wait_for_version(0, timeout)
    cm.load(cm.version)
    model.hp_cluster = cm
    return model


class ClusterOptimizer:
    """The optimizer of a distribute()d module: step() pushes every
    parameter's gradient for the current version, waits for the daemons'
    step and fetches the next version into the module; zero_grad() clears
    the gradients. After a recovery rewound the cluster, step() fetches
    the version it went back to and raises errors.RewoundError (its
    .version): go back to that step in the data and continue.

    missing_grads: "error" (a parameter without a gradient is named in a
    ValueError; nothing is pushed) or "zero" (pushed as zeros). average:
    divide each gradient by the cluster's pusher count (data parallel: the
    daemons add the pushes). Attributes: version (the one the module holds),
    last_stats (bytes of the last fetch), and seconds of the last step's
    push, wait and fetch (push_seconds, wait_seconds, fetch_seconds).
    """

    def __init__(self, model, missing_grads="error", average=True, timeout=60.0):
        cm = getattr(model, "hp_cluster", None)
        if not isinstance(cm, ClusterModel):
            raise TypeError("ClusterOptimizer needs a module returned by hybrid_paramd.distribute")
        if missing_grads not in ("error", "zero"):
            raise ValueError("missing_grads must be 'error' or 'zero', not %r" % (missing_grads,))
        self.cluster_model = cm
        self.client = cm.client
        self.missing_grads = missing_grads
        self.average = average
        self.timeout = timeout
        self.param_groups = [{"params": list(cm.params.values())}]
        self.push_seconds = self.wait_seconds = self.fetch_seconds = 0.0

    @property
    def version(self):
        return self.cluster_model.version

    @property
    def last_stats(self):
        return self.cluster_model.last_stats

    def _gradients(self):
        cm = self.cluster_model
        missing = [n for n, p in cm.params.items() if p.grad is None]
        if missing and self.missing_grads == "error":
            raise ValueError(
                "no gradient for %d of %d parameters: %s (did the loss use them? "
                "ClusterOptimizer(missing_grads='zero') pushes zeros for them)"
                % (len(missing), len(cm.params), ", ".join(missing[:8]) +
                   (", ..." if len(missing) > 8 else "")))
        grads = cm.gradients()
        pushers = self.client.manifest().expected_pushers if self.average else 1
        if pushers > 1:
            grads = {n: g / pushers for n, g in grads.items()}
        return grads

    def step(self, closure=None):
        """Pushes, waits for the next version, fetches it. Returns the
        closure's loss if one was given (called with gradients enabled)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        cm = self.cluster_model
        t0 = time.perf_counter()
        self.client.push_gradients(cm.version, self._gradients())
        t1 = time.perf_counter()
        try:
            v = self.client.wait_for_version(cm.version + 1, self.timeout)
        except errors.RewoundError as e:
            cm.version = e.version
            cm.load(e.version)
            raise
        t2 = time.perf_counter()
        cm.load(v)
        cm.version = v
        t3 = time.perf_counter()
        self.push_seconds, self.wait_seconds, self.fetch_seconds = t1 - t0, t2 - t1, t3 - t2
        return loss

    def zero_grad(self, set_to_none=True):
        for p in self.cluster_model.params.values():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    def state_dict(self):
        """The optimizer's state is the cluster's (its checkpoints hold the
        moments); this is only the version the module holds."""
        return {"version": self.cluster_model.version}
