"""hybrid_paramd on one GPU (tag gpu; run by tools/gpu_test.sh on the
GPU machine with its torch): a --backend=gpu daemon on GPU 0 and the
trainer's tensors on the same GPU.

* fetch into CUDA tensors (DeviceFetcher's same-GPU path) == host fetch,
  every format and direction;
* push from CUDA tensors, then the step == a host push of the same values;
* torch_glue.Linear with per-tensor FP8 through torch._scaled_mm: forward
  and dgrad against a BF16 reference of the dequantized weight; the other
  formats' dequantization on the GPU == on the CPU;
* hp.distribute + ClusterOptimizer train a module on the GPU (fetches into
  CUDA tensors and through the host plane).
"""

import os
import unittest

import test_env  # noqa: F401

import grpc  # noqa: F401  (pip's grpcio and protobuf loaded first)
import google.protobuf  # noqa: F401
import torch

import hybrid_paramd as hp
from hybrid_paramd import cluster as hpc
from hybrid_paramd import formats as F
from hybrid_paramd import safetensors_io
from hybrid_paramd import torch_glue

import client_test as ct

DAEMON_FLAGS = ["--backend=gpu", "--gpu=0", "--optimizer=sgd", "--lr=0.5"]


def gpu_cluster():
    return hpc.LocalCluster(test_env.SERVER, daemons=1, expected_pushers=1,
                            daemon_flags=DAEMON_FLAGS)


@unittest.skipUnless(torch.cuda.is_available(), "needs a GPU")
class GpuTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = test_env.tmpdir("hp_gpu_")
        cls.model = ct.model()
        cls.path = os.path.join(cls.tmp, "m.safetensors")
        safetensors_io.save(cls.model, cls.path)
        cls.cluster = gpu_cluster()
        cls.c = hp.Client(cls.cluster.address)
        hpc.load_when_ready(cls.c, cls.path, ct.RECIPE, timeout=60)

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        cls.cluster.stop()

    def test_library_has_cuda(self):
        self.assertTrue(hp.has_cuda())

    def test_device_fetch_equals_host_fetch(self):
        host = self.c.fetch(0, directions=["rowwise", "columnwise"])
        dev = self.c.fetch(0, directions=["rowwise", "columnwise"], device="cuda:0")
        self.assertEqual(len(host), len(dev))
        self.assertEqual(dev.stats["rowwise_bytes"], host.stats["rowwise_bytes"])
        self.assertEqual(dev.stats["columnwise_bytes"], host.stats["columnwise_bytes"])
        for h in host:
            d = dev[h.tensor, h.direction]
            what = "%s %s %s" % (h.tensor, F.DIRECTION_NAMES[h.direction], h.format_name)
            self.assertEqual(d.data.device.type, "cuda", what)
            self.assertEqual(d.data.dtype, h.data.dtype, what)
            self.assertTrue(torch.equal(d.data.view(torch.uint8).cpu(),
                                        h.data.view(torch.uint8)), what + ": data")
            if h.scales is not None:
                self.assertTrue(torch.equal(d.scales.cpu(), h.scales), what + ": scales")
            self.assertEqual(d.scale_inv, h.scale_inv, what)
            self.assertEqual(d.scale_inv_tensor.item(), h.scale_inv, what)
            if h.format in (F.NVFP4,) + F.PER_TENSOR_FP8:
                self.assertEqual(d.amax, h.amax, what)
            # Dequantized on the GPU == on the CPU.
            torch.testing.assert_close(d.dequantize().cpu(), h.dequantize(), rtol=0, atol=0,
                                       msg=what)
        # Into the same CUDA memory again (out=): the same result, buffers and
        # scale slots, and the values read lazily from them equal the host's.
        slots = dev._scalars.tensor
        again = self.c.fetch(0, directions=["rowwise", "columnwise"], device="cuda:0", out=dev)
        self.assertIs(again, dev)
        self.assertIs(again._scalars.tensor, slots)
        for h in host:
            a = again[h.tensor, h.direction]
            what = "again: %s %s" % (h.tensor, F.DIRECTION_NAMES[h.direction])
            self.assertTrue(torch.equal(a.data.view(torch.uint8).cpu(),
                                        h.data.view(torch.uint8)), what)
            self.assertEqual(a.scale_inv, h.scale_inv, what)
            self.assertEqual(a.amax_tensor.item(), a.amax, what)

    def test_scaled_mm_forward_and_dgrad_vs_bf16_reference(self):
        calls = []
        real = torch_glue.scaled_mm

        def counting(*a, **k):
            calls.append(1)
            return real(*a, **k)

        torch_glue.scaled_mm = counting
        try:
            r = self.c.fetch(0, names=["current"], directions=["rowwise", "columnwise"],
                             device="cuda:0")
            row, col = r["current", "rowwise"], r["current", "columnwise"]
            m, k = row.rows, row.cols  # 70 x 50: not multiples of 16 -> dequantized path
            copies = torch_glue.WeightCopies(row, col, torch.bfloat16)
            self._check_linear(copies, m, k, expect_scaled_mm=False, calls=calls)
        finally:
            torch_glue.scaled_mm = real
        # A tensor whose dims suit _scaled_mm.
        big = torch.randn(256, 512, generator=torch.Generator().manual_seed(5)) * 0.05
        path = os.path.join(self.tmp, "big.safetensors")
        safetensors_io.save({"w": big}, path)
        with gpu_cluster() as cl:
            c = hp.Client(cl.address, observer=True)
            hpc.load_when_ready(c, path, 'default_spec { rowwise { format: FP8_CURRENT } '
                                         'columnwise { format: FP8_CURRENT } }', timeout=60)
            r = c.fetch(0, names=["w"], directions=["rowwise", "columnwise"], device="cuda:0")
            row, col = r["w", "rowwise"], r["w", "columnwise"]
            self.assertEqual(row.data.dtype, torch.float8_e4m3fn)
            self.assertTrue(col.transposed)
            copies = torch_glue.WeightCopies(row, col, torch.bfloat16)
            torch_glue.scaled_mm = counting
            try:
                self._check_linear(copies, 256, 512, expect_scaled_mm=True, calls=calls)
            finally:
                torch_glue.scaled_mm = real
            c.close()

    def _check_linear(self, copies, m, k, expect_scaled_mm, calls):
        del calls[:]
        g = torch.Generator(device="cuda").manual_seed(2)
        x = torch.randn(4, 32, k, device="cuda", generator=g, dtype=torch.bfloat16,
                        requires_grad=True)
        weight = torch.nn.Parameter(torch.zeros(m, k, device="cuda", dtype=torch.bfloat16))
        y = torch_glue.Linear.apply(x, weight, None, copies)
        w_ref = copies.rowwise.dequantize(torch.float32).to(torch.bfloat16)
        y_ref = (x.detach().float() @ w_ref.float().t())
        rel = (y.float() - y_ref).norm() / y_ref.norm()
        self.assertLess(rel.item(), 0.08, "forward")
        dy = torch.randn(4, 32, m, device="cuda", generator=g, dtype=torch.bfloat16)
        y.backward(dy)
        w_col = copies.columnwise.dequantize(torch.float32)
        dx_ref = dy.float() @ w_col
        rel_dx = (x.grad.float() - dx_ref).norm() / dx_ref.norm()
        self.assertLess(rel_dx.item(), 0.08, "dgrad")
        dw_ref = dy.float().reshape(-1, m).t() @ x.detach().float().reshape(-1, k)
        rel_dw = (weight.grad.float() - dw_ref).norm() / dw_ref.norm()
        self.assertLess(rel_dw.item(), 0.02, "wgrad")
        self.assertEqual(len(calls), 2 if expect_scaled_mm else 0)
        print("linear %dx%d scaled_mm=%s: forward rel err %.4f, dgrad %.4f, wgrad %.4f" % (
            m, k, expect_scaled_mm, rel.item(), rel_dx.item(), rel_dw.item()))

    def test_device_push_then_step_equals_host_push(self):
        g = torch.Generator().manual_seed(9)
        grads = {n: (torch.randn(t.shape, generator=g) * 0.01) for n, t in self.model.items()}
        results = []
        for side in ("cuda", "cpu"):
            with gpu_cluster() as cl:
                admin = hp.Client(cl.address, observer=True)
                hpc.load_when_ready(admin, self.path, ct.RECIPE, timeout=60)
                with hp.Client(cl.address) as t:
                    push = {n: (v.to("cuda:0") if side == "cuda" else v).to(
                        torch.bfloat16 if i % 2 else torch.float32)
                        for i, (n, v) in enumerate(grads.items())}
                    r = t.push_gradients(0, push)
                    self.assertEqual(r["pushers_received"], 1)
                self.assertEqual(admin.wait_for_version(1, timeout=30), 1)
                results.append(admin.fetch(1, directions=["rowwise", "columnwise"]))
                admin.close()
        for a in results[0]:
            b = results[1][a.tensor, a.direction]
            self.assertTrue(torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)),
                            a.tensor)

    def test_distribute_trains_a_cuda_module(self):
        """hp.distribute + ClusterOptimizer with the model on the GPU: fp8
        Linear layers run torch._scaled_mm (dims multiples of 16), fetched
        into CUDA tensors or through the host plane, and the loss falls."""
        for fetch_device in ("cuda", "cpu"):
            torch.manual_seed(5)
            model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                        torch.nn.LayerNorm(128), torch.nn.Linear(128, 32)).cuda()
            x = torch.randn(256, 64, device="cuda")
            y = torch.randint(0, 32, (256,), device="cuda")
            flags = ["--backend=gpu", "--gpu=0", "--optimizer=sgd", "--lr=0.05"]
            with hpc.LocalCluster(test_env.SERVER, daemons=1, expected_pushers=1,
                                  daemon_flags=flags) as cl, hp.Client(cl.address) as client:
                model = hp.distribute(model, client, recipe="fp8", fetch_device=fetch_device)
                opt = hp.ClusterOptimizer(model)
                losses = []
                for _ in range(6):
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
                self.assertEqual(opt.version, 6, fetch_device)
                self.assertTrue(torch_glue._fp8_gemm_ok(model[0].copies.rowwise, 256, 128, 64))
                self.assertLess(losses[-1], losses[0], (fetch_device, losses))


if __name__ == "__main__":
    unittest.main(verbosity=2)
