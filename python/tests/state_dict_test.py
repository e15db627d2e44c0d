"""Whole models in and out of a real cluster (coordinator + 2 daemons) from
Python, without files: Client.load_state_dict of an nn.Module's whole
state_dict (integer, bool and FP64 buffers kept as frozen buffers),
state_dict() read back (FP32 bit for bit, BF16 as the export rounds, the
buffers as they were) and loaded strictly into a fresh module, a pushed
step seen in the next state_dict (buffers unchanged, a push naming one
refused), checkpoint / list / describe, an export read back, and the
refusals: complex tensors named before anything is sent, buffers over the
cluster's --max_frozen_bytes, a .pt path told how to load it, a loaded
cluster without force, an uncommitted version, a non-empty export
directory."""

import collections
import json
import os
import struct
import tempfile
import unittest

import test_env  # noqa: F401  (sys.path)

import torch

import hybrid_paramd as hp
from hybrid_paramd import cluster as hpc
from hybrid_paramd import safetensors_io


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 24)
        self.fc = torch.nn.Linear(24, 40)
        self.norm = torch.nn.LayerNorm(40)
        self.head = torch.nn.Linear(40, 8, bias=False).half()
        self.register_buffer("position_ids", torch.arange(16))
        self.register_buffer("freqs", torch.linspace(0, 1, 8, dtype=torch.float64))
        self.register_buffer("mask", torch.rand(3, 5) > 0.5)
        self.register_buffer("steps", torch.tensor(11, dtype=torch.int32))


FROZEN = ["freqs", "mask", "position_ids", "steps"]


def floating(sd):
    return collections.OrderedDict((k, v) for k, v in sd.items() if k not in FROZEN)


class StateDictTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        torch.manual_seed(3)
        cls.tmp = tempfile.mkdtemp(prefix="hp_state_dict_")
        ckpt = os.path.join(cls.tmp, "checkpoints")
        os.makedirs(ckpt)
        cls.cluster = hpc.LocalCluster(
            test_env.SERVER, daemons=2, expected_pushers=1,
            coordinator_flags=["--checkpoint_dir=" + ckpt, "--max_frozen_bytes=4096"],
            daemon_flags=["--optimizer=sgd", "--lr=0.5", "--checkpoint_dir=" + ckpt])
        cls.admin = hp.Client(cls.cluster.address, observer=True)

    @classmethod
    def tearDownClass(cls):
        cls.admin.close()
        cls.cluster.stop()

    def test_1_refusals_before_anything_is_sent(self):
        sd = Tiny().state_dict()
        sd["phase"] = torch.ones(3, dtype=torch.complex64)
        with self.assertRaises(hp.InvalidArgument) as e:
            hpc.load_when_ready(self.admin, sd)
        message = str(e.exception)
        self.assertIn("phase is complex64", message)
        self.assertNotIn("position_ids", message)
        self.assertLess(len(message), 400)
        self.assertLess(self.admin.manifest(refresh=True).committed_version, 0)
        # Frozen buffers over the coordinator's --max_frozen_bytes (4096 here).
        big = dict(floating(Tiny().state_dict()), ids=torch.arange(1024))
        with self.assertRaises(hp.ResourceExhausted) as e:
            hpc.load_when_ready(self.admin, big)
        self.assertIn("--max_frozen_bytes=4096", str(e.exception))
        self.assertLess(self.admin.manifest(refresh=True).committed_version, 0)
        with self.assertRaises(hp.InvalidArgument) as e:
            self.admin.load(os.path.join(self.tmp, "model.pt"))
        self.assertIn("torch.load", str(e.exception))
        with self.assertRaises(TypeError):
            self.admin.load_state_dict([("w", torch.zeros(2, 2))])
        with self.assertRaises(hp.InvalidArgument):
            self.admin.load_state_dict({"w": torch.zeros(2, 2), "v": "not a tensor"})
        self.assertLess(self.admin.manifest(refresh=True).committed_version, 0)

    def test_2_round_trip_step_checkpoint_export(self):
        model = Tiny()
        whole = model.state_dict()
        sd = floating(whole)
        self.assertEqual(hpc.load_when_ready(self.admin, whole), 0)
        self.assertEqual(sorted(self.admin.manifest().names()), sorted(sd))

        def same_buffers(got):
            for name in FROZEN:
                self.assertEqual(got[name].dtype, whole[name].dtype, name)
                self.assertTrue(torch.equal(got[name], whole[name]), name)

        # FP32 masters bit for bit (FP16 was widened exactly), in the model's
        # shapes, then the frozen buffers as they were.
        back = self.admin.state_dict(dtype=torch.float32)
        self.assertEqual(list(back), list(self.admin.manifest().names()) +
                         [k for k in whole if k in FROZEN])
        for name, t in sd.items():
            self.assertEqual(back[name].shape, t.shape, name)
            self.assertTrue(torch.equal(back[name], t.float()), name)
        same_buffers(back)
        # BF16: the round to nearest even torch does; the buffers keep their dtype.
        bf16 = self.admin.state_dict()
        for name, t in sd.items():
            self.assertEqual(bf16[name].dtype, torch.bfloat16)
            self.assertTrue(torch.equal(bf16[name], t.float().to(torch.bfloat16)), name)
        same_buffers(bf16)
        # What comes back loads into the module, buffers included.
        fresh = Tiny()
        fresh.load_state_dict(back, strict=True)
        self.assertTrue(torch.equal(fresh.position_ids, model.position_ids))

        # A loaded cluster refuses a second load without force, changing nothing.
        with self.assertRaises(hp.FailedPrecondition):
            self.admin.load_state_dict({"other": torch.ones(4, 4)})
        self.assertEqual(sorted(self.admin.manifest(refresh=True).names()), sorted(sd))

        # One pushed step: SGD lr 0.5 with gradient == weight halves every
        # weight (exact); a push naming a frozen buffer is refused first.
        with hp.Client(self.cluster.address) as trainer:
            trainer.wait_for_version(0)
            with self.assertRaises(hp.InvalidArgument) as e:
                trainer.push_gradients(0, dict({k: v.float() for k, v in sd.items()},
                                               position_ids=torch.zeros(16)))
            self.assertIn("frozen buffer", str(e.exception))
            trainer.push_gradients(0, {k: v.float() for k, v in sd.items()})
            self.assertEqual(trainer.wait_for_version(1), 1)
        stepped = self.admin.state_dict(dtype="fp32")
        for name, t in sd.items():
            self.assertTrue(torch.equal(stepped[name], t.float() * 0.5), name)
        same_buffers(stepped)
        with self.assertRaises(hp.FailedPrecondition):
            self.admin.state_dict(version=7)

        # Checkpoint, list, describe.
        saved = self.admin.checkpoint()
        self.assertEqual(saved["version"], 1)
        self.assertTrue(os.path.isdir(saved["path"]), saved)
        listed = self.admin.list_checkpoints()
        self.assertEqual([c["version"] for c in listed], [1])
        described = self.admin.describe_checkpoint(verify=True)
        self.assertEqual(described["manifest"]["version"], 1)
        self.assertEqual(sorted(t["name"] for t in described["manifest"]["tensors"]), sorted(sd))
        self.assertEqual(sorted(f["name"] for f in described["manifest"]["frozen"]), FROZEN)
        self.assertNotIn("data", described["manifest"]["frozen"][0])  # named, not shipped

        # Export: the files hold what state_dict() returns.
        out = os.path.join(self.tmp, "export")
        result = self.admin.export(out)
        self.assertEqual(result["version"], 1)
        self.assertEqual(result["num_tensors"], len(whole))
        self.assertIn("model.safetensors.index.json", result["files"])
        read = {}
        for f in result["files"]:
            if f.endswith(".safetensors"):
                read.update(safetensors_io.load(os.path.join(out, f))[0])
        now = self.admin.state_dict()
        self.assertEqual(sorted(read), sorted(now))
        for name in now:
            self.assertEqual(read[name].dtype, now[name].dtype, name)
            self.assertTrue(torch.equal(read[name], now[name]), name)
        same_buffers(read)
        with self.assertRaises(hp.FailedPrecondition):
            self.admin.export(out)  # not empty
        again = self.admin.export(out, overwrite=True, dtype="fp32")
        self.assertEqual(sorted(again["removed"]), sorted(result["files"]))

        # force=True replaces the model: version 0 of the new values.
        other = {"w": torch.randn(6, 10)}
        self.assertEqual(self.admin.load_state_dict(other, force=True), 0)
        self.assertTrue(torch.equal(self.admin.state_dict(dtype=torch.float32)["w"], other["w"]))

    def test_3_fp8_tensors_of_a_file_are_frozen_buffers(self):
        # A pre-quantized checkpoint's FP8 data and E8M0 scales are kept
        # whole: returned in torch's float8 dtypes where torch has them, and
        # where it does not, state_dict() says which tensor and why.
        w = torch.randn(8, 8)
        fp8 = bytes(range(0x30, 0x38))  # 2 x 4 E4M3 values
        e8m0 = bytes([127, 130])         # scales 1 and 8
        path = os.path.join(self.tmp, "fp8.safetensors")
        write_raw_safetensors(path, [("w", "F32", [8, 8], w.numpy().tobytes()),
                                     ("q.weight", "F8_E4M3", [2, 4], fp8),
                                     ("q.weight_scale", "F8_E8M0", [2], e8m0)])
        self.assertEqual(self.admin.load(path, force=True), 0)
        if hasattr(torch, "float8_e4m3fn") and hasattr(torch, "float8_e8m0fnu"):
            back = self.admin.state_dict(dtype=torch.float32)
            self.assertTrue(torch.equal(back["w"], w))
            self.assertEqual(back["q.weight"].dtype, torch.float8_e4m3fn)
            self.assertEqual(bytes(back["q.weight"].view(torch.uint8).flatten().tolist()), fp8)
            self.assertEqual(back["q.weight_scale"].dtype, torch.float8_e8m0fnu)
            self.assertEqual(bytes(back["q.weight_scale"].view(torch.uint8).tolist()), e8m0)
        else:
            with self.assertRaises(TypeError) as e:
                self.admin.state_dict(dtype=torch.float32)
            self.assertIn("frozen buffer q.weight is F8_E4M3", str(e.exception))
            self.assertIn(torch.__version__, str(e.exception))


def write_raw_safetensors(path, tensors):
    """A safetensors file of (name, dtype, shape, bytes), written by hand:
    torch may have no dtype for them."""
    header, offset = {}, 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in tensors))


if __name__ == "__main__":
    unittest.main()
