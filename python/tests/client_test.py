"""hybrid_paramd against a real cluster (coordinator + 2 daemons): every
format and direction fetched from Python equals the C++ client's bytes and
dequantizes like ref::Dequantize; a Python push steps the daemons exactly
like the C++ push; errors carry their gRPC codes; the package works beside
grpc and google.protobuf in one process."""

import json
import os
import subprocess
import tempfile
import threading
import time
import unittest

import test_env  # noqa: F401  (sys.path)

# The package must load into a process that already holds grpc and protobuf.
import grpc
from google.protobuf import struct_pb2
import numpy as np
import torch

import hybrid_paramd as hp
from hybrid_paramd import cluster as hpc
from hybrid_paramd import formats as F
from hybrid_paramd import safetensors_io

RECIPE = r'''
name: "python_client_test"
rule { pattern: "bf16" spec { rowwise { format: IDENTITY_BF16 } columnwise { format: IDENTITY_BF16 } } }
rule { pattern: "fp32" spec { rowwise { format: IDENTITY_FP32 } columnwise { format: IDENTITY_FP32 } } }
rule { pattern: "delayed" spec { rowwise { format: FP8_DELAYED } columnwise { format: FP8_DELAYED } } }
rule { pattern: "current" spec { rowwise { format: FP8_CURRENT } columnwise { format: FP8_CURRENT } } }
rule { pattern: "current_e5m2" spec { rowwise { format: FP8_CURRENT fp8_type: E5M2 } columnwise { format: FP8_CURRENT fp8_type: E5M2 } } }
rule { pattern: "mx" spec { rowwise { format: MXFP8 } columnwise { format: MXFP8 } } }
rule { pattern: "mx2d_e5m2" spec { rowwise { format: MXFP8 fp8_type: E5M2 two_d: true } columnwise { format: MXFP8 fp8_type: E5M2 two_d: true } } }
rule { pattern: "nv" spec { rowwise { format: NVFP4 } columnwise { format: NVFP4 } } }
rule { pattern: "nv1d" spec { rowwise { format: NVFP4 two_d: false } columnwise { format: NVFP4 two_d: false } } }
rule { pattern: "blk" spec { rowwise { format: FP8_BLOCK_128X128 } columnwise { format: FP8_BLOCK_128X128 } } }
rule { pattern: "blk1d" spec { rowwise { format: FP8_BLOCK_1X128 } columnwise { format: FP8_BLOCK_1X128 } } }
rule { pattern: "mixed" spec { rowwise { format: NVFP4 } columnwise { format: FP8_BLOCK_128X128 } columnwise_source: ROWWISE_DEQUANTIZED source_dtype: FP32 } }
rule { pattern: "rowonly" spec { rowwise { format: FP8_CURRENT } columnwise_usage: false } }
default_spec { rowwise { format: IDENTITY_BF16 } columnwise { format: IDENTITY_BF16 } }
'''

SHAPES = {
    "bf16": (40, 24), "fp32": (33, 17), "delayed": (64, 48), "current": (70, 50),
    "current_e5m2": (30, 20), "mx": (96, 80), "mx2d_e5m2": (70, 90), "nv": (80, 48),
    "nv1d": (50, 37), "blk": (300, 260), "blk1d": (140, 300), "mixed": (520, 384),
    "rowonly": (16, 16), "conv": (8, 3, 3, 3), "bias": (64,),
}


def model():
    g = torch.Generator().manual_seed(7)
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        t = torch.randn(shape, generator=g) * (0.02 * (1 + i % 5))
        # A spread of magnitudes across rows, so block scales differ.
        t = t * (1 + torch.arange(t.numel()).reshape(shape) % 97 / 20.0)
        out[name] = t.float()
    return out


def cpp_fetch(address, version, outdir):
    subprocess.run([test_env.CPP_TOOL, "fetch", address, str(version), outdir], check=True,
                   timeout=60)
    with open(os.path.join(outdir, "index.json")) as f:
        index = json.load(f)
    out = {}
    for e in index["tensors"]:
        stem = os.path.join(outdir, e["stem"])

        def rd(ext, stem=stem):
            with open(stem + ext, "rb") as f:
                return f.read()
        out[(e["tensor"], F.parse_direction(e["direction"]))] = dict(
            e, data=rd(".data"), scales=rd(".scales"), deq=rd(".deq"))
    return index["version"], out


def start_cluster(expected_pushers=1, optimizer="sgd"):
    return hpc.LocalCluster(test_env.SERVER, daemons=2, expected_pushers=expected_pushers,
                            daemon_flags=["--optimizer=" + optimizer, "--lr=0.5"])


class ClientTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="hp_pytest_")
        cls.cluster = start_cluster()
        cls.model = model()
        cls.model_path = os.path.join(cls.tmp, "model.safetensors")
        safetensors_io.save(cls.model, cls.model_path)
        cls.admin = hp.Client(cls.cluster.address, observer=True)
        hpc.load_when_ready(cls.admin, cls.model_path, RECIPE)

    @classmethod
    def tearDownClass(cls):
        cls.admin.close()
        cls.cluster.stop()

    def test_manifest(self):
        m = self.admin.manifest()
        self.assertEqual(m.num_daemons, 2)
        self.assertEqual(m.committed_version, 0)
        self.assertEqual(sorted(m.names()), sorted(SHAPES))
        self.assertEqual(m["conv"].shape, (8, 3, 3, 3))
        self.assertEqual((m["conv"].rows, m["conv"].cols), (72, 3))
        self.assertEqual((m["bias"].rows, m["bias"].cols), (1, 64))
        self.assertTrue(all(t.num_pieces >= 1 for t in m))
        nv = m["nv"]
        self.assertEqual(nv.rowwise.format_name, "nvfp4")
        self.assertEqual(nv.rowwise.data_shape, (80, 24))
        self.assertTrue(nv.columnwise.transposed)
        self.assertEqual(nv.columnwise.data_shape, (48, 40))
        self.assertEqual(nv.rowwise.scale_shape, (128, 4))
        self.assertEqual(m["blk1d"].rowwise.scale_elem_bytes, 4)
        self.assertFalse(m["rowonly"].columnwise.published)
        self.assertEqual(m["current_e5m2"].rowwise.element, "e5m2")
        # What a user sees printing them.
        self.assertIn("Manifest(committed version 0, 2 daemons, ", repr(m))
        self.assertIn("%d tensors: " % len(SHAPES), repr(m))

    def test_fetch_equals_cpp_client_every_format_and_direction(self):
        r = self.admin.fetch(0, directions=["rowwise", "columnwise"])
        version, want = cpp_fetch(self.cluster.address, 0, tempfile.mkdtemp(dir=self.tmp))
        self.assertEqual(r.version, version)
        self.assertEqual(len(r), len(want))
        formats_seen = set()
        for f in r:
            w = want[(f.tensor, f.direction)]
            what = "%s %s %s" % (f.tensor, F.DIRECTION_NAMES[f.direction], f.format_name)
            self.assertEqual(f.format_name, w["format"], what)
            formats_seen.add((f.format_name, f.direction))
            data = f.data
            self.assertEqual(data.dtype, F.data_dtype(f.format, f.fp8_type), what)
            if f.format in F.FP8_FORMATS:
                self.assertEqual(data.dtype == torch.uint8, not hp.HAS_FP8_DTYPES, what)
            self.assertEqual(tuple(data.shape), f.info.data_shape, what)
            self.assertEqual(data.contiguous().view(torch.uint8).numpy().tobytes(), w["data"],
                             what + ": data")
            got_scales = b"" if f.scales is None else f.scales.numpy().tobytes()
            self.assertEqual(got_scales, w["scales"], what + ": scales")
            self.assertEqual(np.float32(f.scale_inv), np.float32(w["scale_inv"]), what)
            self.assertEqual(np.float32(f.amax), np.float32(w["amax"]), what)
            # Dequantized in torch == ref::Dequantize.
            deq = f.dequantize().reshape(-1).numpy()
            ref = np.frombuffer(w["deq"], dtype=np.float32)
            np.testing.assert_array_equal(deq, ref, err_msg=what + ": dequantized")
        self.assertEqual(len({fmt for fmt, _ in formats_seen}), 8)
        self.assertEqual(len(formats_seen), 16)  # 8 formats x 2 directions
        self.assertEqual(r.stats["rowwise_bf16_bytes"],
                         sum(2 * t.rows * t.cols for t in self.admin.manifest()))

    def test_fetch_named_tensors_one_direction(self):
        r = self.admin.fetch(-1, names=["mixed", "bias"], directions=["columnwise"])
        self.assertEqual(len(r), 2)
        self.assertEqual(r["mixed"].format_name, "fp8_block128x128")
        self.assertTrue(r["mixed"].transposed)
        self.assertEqual(tuple(r["mixed"].data.shape), (384, 520))
        self.assertEqual(r.stats["rowwise_bytes"], 0)
        self.assertGreater(r.stats["columnwise_bytes"], 0)
        self.assertRegex(repr(r), r"^FetchResult\(version \d+, 2 tensor-directions, .*"
                                  r"Fetched\(mixed columnwise fp8_block128x128")
        # A fresh allocation per fetch: the first result is not overwritten.
        r2 = self.admin.fetch(-1, names=["mixed", "bias"], directions=["columnwise"])
        self.assertNotEqual(r["bias"].data.data_ptr(), r2["bias"].data.data_ptr())
        self.assertTrue(torch.equal(r["bias"].data, r2["bias"].data))
        # out=: the same result object, memory and Fetched objects, refilled.
        mixed = r["mixed"]
        mixed.data.view(torch.uint8).fill_(0)
        r3 = self.admin.fetch(-1, names=["mixed", "bias"], directions=["columnwise"], out=r)
        self.assertIs(r3, r)
        self.assertIs(r3["mixed"], mixed)
        self.assertTrue(torch.equal(r3["mixed"].data.view(torch.uint8),
                                    r2["mixed"].data.view(torch.uint8)))
        self.assertEqual(r3["mixed"].scale_inv, r2["mixed"].scale_inv)
        self.assertEqual(r3["bias"].amax, r2["bias"].amax)
        self.assertEqual(r3.stats, r2.stats)

    def test_concurrent_fetches_of_the_same_targets(self):
        """Threads fetching the same targets at once each get their own
        bytes (the shared target array is not repointed under a fetch)."""
        names = [t.name for t in self.admin.manifest()]
        ref = self.admin.fetch(0, names=names)
        bad = []

        def run():
            for _ in range(15):
                r = self.admin.fetch(0, names=names)
                for f in r:
                    if not torch.equal(f.data.view(torch.uint8),
                                       ref[f.tensor].data.view(torch.uint8)):
                        bad.append(f.tensor)
        threads = [threading.Thread(target=run) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(bad, [])

    def test_errors_carry_codes(self):
        c = self.admin
        with self.assertRaises(hp.NotFound) as e:
            c.fetch(0, names=["nope"])
        self.assertEqual(e.exception.code, 5)
        with self.assertRaises(hp.FailedPrecondition):
            c.fetch(0, names=["rowonly"], directions=["columnwise"])
        with self.assertRaises(hp.DeadlineExceeded) as e:
            c.wait_for_version(99, timeout=0.2)
        self.assertEqual(e.exception.code, 4)
        self.assertEqual(e.exception.code_name, "DEADLINE_EXCEEDED")
        with self.assertRaises(hp.DeadlineExceeded):
            c.fetch(5, names=["bias"], timeout=0.3)
        with self.assertRaises(hp.Error) as e:
            c.fetch(0, names=["bias"], device="cuda:0")
        if not hp.has_cuda():
            self.assertIsInstance(e.exception, hp.Unimplemented)
        start = time.time()
        with self.assertRaises(hp.Unavailable) as e:
            hp.Client("127.0.0.1:1", connect_timeout=0.5)
        self.assertEqual(e.exception.code, 14)
        self.assertLess(time.time() - start, 5)
        with self.assertRaises(hp.InvalidArgument):
            hp.Client(self.cluster.address, observer=True, token="t" * 20,
                      token_file=os.path.join(self.tmp, "tokens"))
        with self.assertRaises(hp.NotFound):
            hp.Client(self.cluster.address, observer=True, tls_ca="/nonexistent/ca.pem")
        with self.assertRaises(hp.InvalidArgument):  # a client certificate without its key
            hp.Client(self.cluster.address, observer=True, tls_ca=self.model_path,
                      tls_cert=self.model_path)
        with self.assertRaises(hp.InvalidArgument) as e:  # at once, not after the timeout
            hp.Client("localhost", connect_timeout=20)
        self.assertIn("coordinator address", str(e.exception))
        t = hp.Client(self.cluster.address, observer=True)
        # Shapes must match exactly: a wrong size, a transposed or a flat
        # gradient is refused before anything is sent.
        with self.assertRaises(ValueError) as e:
            t.push_gradients(0, {"bias": torch.zeros(63)}, partial=True)  # 63 of 64 values
        self.assertIn("shape [63]; the tensor's shape is [64]", str(e.exception))
        two_d = next(i for i in t.manifest() if len(i.shape) == 2 and i.shape[0] != i.shape[1])
        with self.assertRaises(ValueError) as e:
            t.push_gradients(0, {two_d.name: torch.zeros(*two_d.shape).t()}, partial=True)
        self.assertIn("the tensor's shape is %s" % list(two_d.shape), str(e.exception))
        with self.assertRaises(ValueError):
            t.push_gradients(0, {two_d.name: torch.zeros(*two_d.shape).reshape(-1)}, partial=True)
        # A push that leaves out tensors is refused, naming them, unless partial.
        with self.assertRaises(hp.InvalidArgument) as e:
            t.push_gradients(0, {"bias": torch.zeros(64)})
        self.assertEqual(e.exception.code, 3)
        self.assertIn("the push misses", str(e.exception))
        self.assertIn(two_d.name, str(e.exception))
        self.assertEqual(t.status()["daemons"][0].get("pushers_received", 0), 0)
        # Misused arguments: TypeError, not a silent truncation or conversion.
        with self.assertRaises(TypeError):
            t.fetch(0.5, names=["bias"])
        with self.assertRaises(TypeError):
            t.push_gradients(0, [torch.zeros(64)])
        with self.assertRaises(TypeError):
            t.push_gradients(0, {"bias": torch.zeros(64, dtype=torch.int32)})
        # A name or a direction alone is a list of one.
        one = t.fetch(0, names="bias", directions="columnwise")
        self.assertEqual([(f.tensor, f.direction) for f in one], [("bias", 1)])
        t.close()
        with self.assertRaises(hp.FailedPrecondition):
            t.manifest(refresh=True)
        t.close()  # idempotent

    def test_device_fetch_on_a_cpu_build_is_unimplemented(self):
        if hp.has_cuda():
            self.skipTest("CUDA build")
        r = self.admin._lib.hpd_fetch_device(self.admin._h, 0, None, 0, 0, None, 0, None, None)
        self.assertEqual(r, 12)

    def test_linear_glue_uses_rowwise_forward_and_columnwise_dgrad(self):
        from hybrid_paramd import torch_glue
        g = torch.Generator().manual_seed(1)
        for name in ("current", "mx", "nv", "blk", "blk1d", "mixed", "bf16"):
            r = self.admin.fetch(0, names=[name], directions=["rowwise", "columnwise"])
            row, col = r[name, "rowwise"], r[name, "columnwise"]
            m, k = row.rows, row.cols
            copies = torch_glue.WeightCopies(row, col, torch.float32)
            w_row, w_col = row.dequantize(), col.dequantize()
            weight = torch.nn.Parameter(torch.zeros(m, k))
            bias = torch.nn.Parameter(torch.randn(m, generator=g))
            x = torch.randn(3, 5, k, generator=g, requires_grad=True)
            y = torch_glue.Linear.apply(x, weight, bias, copies)
            torch.testing.assert_close(y, x @ w_row.t() + bias, msg=name)
            dy = torch.randn(3, 5, m, generator=g)
            y.backward(dy)
            torch.testing.assert_close(x.grad, dy @ w_col, msg=name)
            torch.testing.assert_close(weight.grad, dy.reshape(-1, m).t() @ x.detach().reshape(-1, k),
                                       msg=name)
            torch.testing.assert_close(bias.grad, dy.reshape(-1, m).sum(0), msg=name)
            # The copies differ from the master (quantized), except identity.
            master = self.model[name].reshape(m, k)
            if name != "bf16":
                self.assertFalse(torch.equal(w_row, master), name)

    def test_beside_grpc_and_protobuf(self):
        # grpc and protobuf (imported first) still work, and so do we.
        msg = struct_pb2.Struct()
        msg["a"] = 1.5
        self.assertEqual(struct_pb2.Struct.FromString(msg.SerializeToString())["a"], 1.5)
        ch = grpc.insecure_channel(self.cluster.address)
        grpc.channel_ready_future(ch).result(timeout=10)
        ch.close()
        self.assertEqual(len(self.admin.fetch(0, names=["bf16"])), 1)


class LoadTest(unittest.TestCase):
    """Client.load as hpctl load: streamed directories and indexes with
    progress, force, and the optimizer schedule."""

    def test_streamed_sharded_load_force_and_schedule(self):
        tmp = tempfile.mkdtemp(prefix="hp_pyload_")
        m = model()
        names = sorted(m)
        # A sharded checkpoint: two files and an index beside them.
        shards = {"model-00001-of-00002.safetensors": names[:7],
                  "model-00002-of-00002.safetensors": names[7:]}
        weight_map = {}
        for f, ns in shards.items():
            safetensors_io.save({n: m[n] for n in ns}, os.path.join(tmp, f))
            weight_map.update({n: f for n in ns})
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
        single = os.path.join(tmp, "one", "model.safetensors")
        os.makedirs(os.path.dirname(single))
        safetensors_io.save(m, single)
        with start_cluster() as cl:
            admin = hp.Client(cl.address, observer=True)
            seen = []
            v = hpc.load_when_ready(admin, tmp, RECIPE,
                                    progress=lambda sent, total: seen.append((sent, total)))
            self.assertEqual(v, 0)
            self.assertEqual(sorted(admin.manifest().names()), names)
            total = sum(t.numel() * 4 for t in m.values())
            self.assertTrue(seen)
            self.assertEqual(seen[-1], (total, total))
            self.assertTrue(all(a[0] <= b[0] for a, b in zip(seen, seen[1:])))
            # The streamed values are the model's: BF16 identity copies.
            r = admin.fetch(0, names=["bf16"])
            torch.testing.assert_close(r["bf16"].data.float(), m["bf16"].to(torch.bfloat16).float(),
                                       rtol=0, atol=0)
            # A cluster holding a model refuses another without force.
            with self.assertRaises(hp.FailedPrecondition):
                admin.load(single, RECIPE)
            with self.assertRaises(hp.FailedPrecondition):
                admin.load(os.path.join(tmp, "model.safetensors.index.json"), RECIPE)
            with self.assertRaises(hp.NotFound):
                admin.load(os.path.join(tmp, "missing"), RECIPE, force=True)
            # Train a step, then replace the model: back to version 0.
            with hp.Client(cl.address) as t:
                t.push_gradients(0, {"bf16": torch.ones(40, 24)}, partial=True)
                self.assertEqual(t.wait_for_version(1), 1)
            self.assertEqual(admin.load(single, RECIPE, force=True, stream=True), 0)
            self.assertEqual(admin.wait_for_version(0), 0)
            r = admin.fetch(-1, names=["bf16"])
            self.assertEqual(r.version, 0)
            torch.testing.assert_close(r["bf16"].data.float(), m["bf16"].to(torch.bfloat16).float(),
                                       rtol=0, atol=0)
            self.assertEqual(admin.load(single, RECIPE, force=True), 0)  # read by the daemons

            # The lr schedule, as a dict and as protobuf text.
            cfg = admin.set_optimizer_schedule(
                {"warmup_steps": 10, "decay": "COSINE", "decay_steps": 100, "min_lr": 0.01},
                lr=0.25)
            self.assertEqual(cfg["kind"], "SGD")
            self.assertAlmostEqual(cfg["lr"], 0.25)
            self.assertEqual(cfg["schedule"]["decay"], "COSINE")
            self.assertEqual(int(cfg["schedule"]["warmup_steps"]), 10)
            cfg = admin.set_optimizer_schedule("decay: LINEAR decay_steps: 5")
            self.assertEqual(cfg["schedule"]["decay"], "LINEAR")
            self.assertNotIn("warmup_steps", cfg["schedule"])
            self.assertAlmostEqual(cfg["lr"], 0.25)
            for bad in ("decay: COSINE", "warmup_steps: -1", "no_such_field: 1", '{"decay": 7.5}'):
                with self.assertRaises(hp.InvalidArgument, msg=bad):
                    admin.set_optimizer_schedule(bad)
            # Steps still run under the new schedule.
            with hp.Client(cl.address) as t:
                t.push_gradients(0, {"bf16": torch.ones(40, 24)}, partial=True)
                self.assertEqual(t.wait_for_version(1), 1)
            admin.close()


class PushTest(unittest.TestCase):

    def test_push_then_step_equals_cpp_push(self):
        tmp = tempfile.mkdtemp(prefix="hp_pypush_")
        m = model()
        path = os.path.join(tmp, "model.safetensors")
        safetensors_io.save(m, path)
        g = torch.Generator().manual_seed(3)
        grads = {n: torch.randn(t.shape, generator=g) * 0.01 for n, t in m.items()}
        # Python: fp32 torch, bf16 torch, numpy, flat shapes.
        py = {}
        for i, (n, t) in enumerate(grads.items()):
            if i % 3 == 0:
                py[n] = t
            elif i % 3 == 1:
                py[n] = t.to(torch.bfloat16)
            else:
                py[n] = t.numpy()
        cpp = {n: (py[n] if isinstance(py[n], torch.Tensor) else torch.from_numpy(py[n]))
               for n in grads}
        cpp = {n: t.reshape(grads[n].shape) for n, t in cpp.items()}
        grads_path = os.path.join(tmp, "grads.safetensors")
        safetensors_io.save(cpp, grads_path)
        results = []
        for side in ("python", "cpp"):
            with start_cluster() as cl:
                admin = hp.Client(cl.address, observer=True)
                hpc.load_when_ready(admin, path, RECIPE)
                if side == "python":
                    with hp.Client(cl.address, name="py-trainer") as t:
                        r = t.push_gradients(0, py)
                        self.assertEqual(r["version"], 0)
                        self.assertEqual(r["pushers_received"], 1)
                else:
                    subprocess.run([test_env.CPP_TOOL, "push", cl.address, "0", grads_path],
                                   check=True, timeout=60)
                self.assertEqual(admin.wait_for_version(1, timeout=30), 1)
                results.append(cpp_fetch(cl.address, 1, tempfile.mkdtemp(dir=tmp))[1])
                before = cpp_fetch(cl.address, 0, tempfile.mkdtemp(dir=tmp))[1]
                admin.close()
        self.assertEqual(results[0].keys(), results[1].keys())
        changed = 0
        for k in results[0]:
            self.assertEqual(results[0][k]["data"], results[1][k]["data"], k)
            self.assertEqual(results[0][k]["scales"], results[1][k]["scales"], k)
            changed += results[0][k]["data"] != before[k]["data"]
        self.assertGreater(changed, len(results[0]) // 2)  # the step moved the weights


if __name__ == "__main__":
    unittest.main()
