import torch
import hybrid_paramd as hp    # the installed wheel, or sys.path.insert(0, "python") in the source tree

c = hp.Client()                                # $PARAMD_COORDINATOR, else 127.0.0.1:7070; a trainer
v = c.wait_for_version(0)                      # (observer=True for tools)
m = c.manifest()                               # names, shapes, formats, buffer sizes
r = c.fetch(v, directions=["rowwise", "columnwise"])   # device="cuda": into CUDA tensors
r = c.fetch(v, directions=["rowwise", "columnwise"], out=r)   # refills r (no allocation)
f = r["layers.0.mlp.fc1.weight", "rowwise"]
f.data        # torch tensor: float8_e4m3fn / float8_e5m2 (torch >= 2.1, else uint8), uint8 for NVFP4,
              # bfloat16 / float32 for identity formats; [K, M] when f.transposed
f.scales, f.scale_inv, f.amax, f.format_name, f.shape, f.dequantize()
grads = {t.name: torch.zeros(t.shape) for t in m}   # your backward pass's gradients
c.push_gradients(v, grads)                     # float32 / bfloat16 torch (CPU or CUDA) or numpy;
                                               # every tensor, or partial=True (the rest count as 0)
try:
    v = c.wait_for_version(v + 1)
except hp.RewoundError as e:                   # a daemon was lost and replaced: the cluster
    v = e.version                              # went back to a checkpoint; train on from e.version
