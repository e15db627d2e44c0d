"""hybrid_paramd.IpcSession on one GPU (tag gpu; `bash tools/gpu_test.sh`):
a --backend=gpu daemon on GPU 0, this process the trainer on the same GPU.

* the views of an acquired version are torch CUDA tensors over the daemon's
  own buffers (no copy: their pointers lie in the mapped regions, and a
  step changes what a view of the next version reads) and equal the host
  fetch, every format and direction;
* the hand-over of v+1 goes through the pin page (no RPC) once each slot
  was acquired; a view of a released version refuses;
* an in-place BF16 push from a gradient buffer == a host push of the same
  values; a NaN push is refused and adds nothing.
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

import client_test as ct

DAEMON_FLAGS = ["--backend=gpu", "--gpu=0", "--optimizer=sgd", "--lr=0.5"]


@unittest.skipUnless(torch.cuda.is_available(), "needs a GPU")
class IpcGpuTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = test_env.tmpdir("hp_ipc_")
        cls.model = ct.model()
        cls.path = os.path.join(cls.tmp, "m.safetensors")
        safetensors_io.save(cls.model, cls.path)
        cls.cluster = hpc.LocalCluster(test_env.SERVER, daemons=1, expected_pushers=1,
                                       daemon_flags=DAEMON_FLAGS)
        cls.c = hp.Client(cls.cluster.address)
        hpc.load_when_ready(cls.c, cls.path, ct.RECIPE, timeout=60)
        torch.cuda.set_device(0)

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        cls.cluster.stop()

    def reload(self):
        hpc.load_when_ready(self.c, self.path, ct.RECIPE, timeout=60, force=True)
        self.c.manifest(refresh=True)

    def test_views_are_the_daemons_bytes_in_place(self):
        self.reload()
        host = self.c.fetch(0, directions=["rowwise", "columnwise"])
        with hp.IpcSession(self.c, daemon=0, device=0) as s:
            v = s.acquire(0)
            self.assertEqual(v.version, 0)
            self.assertEqual(len(v), len(host))
            for h in host:
                d = v[h.tensor, h.direction]
                what = "%s %s %s" % (h.tensor, F.DIRECTION_NAMES[h.direction], h.format_name)
                self.assertTrue(d.whole, what)
                self.assertEqual(d.data.device, torch.device("cuda", 0), what)
                self.assertEqual(d.data.dtype, h.data.dtype, what)
                self.assertEqual(tuple(d.data.shape), tuple(h.data.shape), what)
                self.assertTrue(torch.equal(d.data.view(torch.uint8).cpu(),
                                            h.data.view(torch.uint8)), what + ": data")
                if h.scales is not None:
                    self.assertTrue(torch.equal(d.scales.cpu(), h.scales), what + ": scales")
                self.assertEqual(d.scale_inv, h.scale_inv, what)
                torch.testing.assert_close(d.dequantize().cpu(), h.dequantize(), rtol=0, atol=0,
                                           msg=what)
            # No copy: the tensor's storage is the view's pointer, and two
            # acquires of one version give the same address.
            first = v.views[0]
            ptr = first.data.data_ptr()
            self.assertEqual(ptr, first._ptrs[0])
            again = s.acquire(0)
            self.assertEqual(again[first.tensor, first.direction].data.data_ptr(), ptr)
            with self.assertRaises(hp.FailedPrecondition):
                first.data  # of the acquire before: refused
            s.release()

    def test_hand_over_through_the_pin_page_and_push_in_place(self):
        self.reload()
        m = self.c.manifest()
        names = list(m.names())
        with hp.IpcSession(self.c, daemon=0, device=0) as s:
            # Gradients: BF16, packed in one gradient buffer.
            sizes = [m[n].rows * m[n].cols for n in names]
            buf = s.gradient_buffer(2 * sum(sizes))
            g = torch.Generator().manual_seed(9)
            grads, wide, off = {}, {}, 0
            for n, k in zip(names, sizes):
                vals = (torch.randn(k, generator=g) * 0.3).to(torch.bfloat16)
                view = buf[2 * off:2 * (off + k)].view(torch.bfloat16)
                view.copy_(vals.cuda())
                grads[n] = view
                wide[n] = vals.float().reshape(m[n].shape).numpy()
                off += k
            # A NaN: refused, nothing added.
            saved = grads[names[0]][0].item()
            grads[names[0]][0] = float("nan")
            with self.assertRaises(hp.InvalidArgument):
                s.push(0, grads)
            grads[names[0]][0] = saved
            v = s.acquire(0)
            received, expected = s.push(0, grads)
            self.assertEqual((received, expected), (1, 1))
            self.c.wait_for_version(1, timeout=30)
            in_place = self.c.fetch(1, directions=["rowwise", "columnwise"])
            for ver in range(1, 5):
                v = s.acquire(ver)
                self.assertEqual(v.version, ver)
                if ver < 4:
                    s.push(ver, grads)
                    self.c.wait_for_version(ver + 1, timeout=30)
            page, rpc = s.stats()
            # 0 and 1 are the first of their slots (RPC); 2, 3, 4 the page.
            self.assertEqual((page, rpc), (3, 2))
            s.release()
        # The same push over the host stream, from a fresh load.
        self.reload()
        self.c.push_gradients(0, wide)
        self.c.wait_for_version(1, timeout=30)
        host = self.c.fetch(1, directions=["rowwise", "columnwise"])
        for h in host:
            d = in_place[h.tensor, h.direction]
            self.assertTrue(torch.equal(d.data.view(torch.uint8), h.data.view(torch.uint8)),
                            "%s %s" % (h.tensor, F.DIRECTION_NAMES[h.direction]))


if __name__ == "__main__":
    unittest.main()
