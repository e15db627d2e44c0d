"""Hugging Face in and out through a real cluster (coordinator + 2 daemons):
a checkpoint directory (sharded with model.safetensors.index.json, or one
file) -> `hpctl load DIR` (streamed from this machine) -> `hpctl export`
-> the exported BF16 values equal torch's own FP32 -> BF16 cast of every
tensor. Where `transformers` is installed (the GPU machine), real models
made with save_pretrained (sharded, and with tied embeddings) are loaded
back with from_pretrained and every parameter compared."""

import json
import os
import shutil
import subprocess
import tempfile
import unittest

import test_env

import torch

import hybrid_paramd as hp
from hybrid_paramd import cluster as hpc
from hybrid_paramd import safetensors_io

HPCTL = test_env.path("PARAMD_HPCTL", "bazel-bin/hpctl/hpctl")

try:
    import transformers
except ImportError:
    transformers = None


def hpctl(*args, address):
    r = subprocess.run([HPCTL] + list(args) + ["--address=" + address, "--timeout=60"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise AssertionError("hpctl %s failed (%d):\n%s%s" % (" ".join(args), r.returncode,
                                                              r.stdout, r.stderr))
    return r.stdout + r.stderr


def load_and_export(ckpt, out):
    """hpctl load CKPT; hpctl export --out OUT (BF16); returns the load's output."""
    with hpc.LocalCluster(test_env.SERVER, daemons=2, daemon_flags=["--optimizer=sgd"]) as cl:
        # Wait for the daemons to join (a load before that is UNAVAILABLE).
        c = hp.Client(cl.address, observer=True)
        for _ in range(200):
            if len(c.status().get("daemons", [])) == 2:
                break
            import time
            time.sleep(0.05)
        c.close()
        text = hpctl("load", ckpt, address=cl.address)
        hpctl("export", "--out=" + out, "--max_shard_size=200KB", address=cl.address)
    return text


def read_dir(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(safetensors_io.load(os.path.join(d, f))[0])
    return out


class HfRoundTripTest(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="hp_hf_")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_sharded_directory_round_trip_equals_torch_bf16_cast(self):
        g = torch.Generator().manual_seed(4)
        tensors = {"model.embed.weight": torch.randn(300, 64, generator=g),
                   "model.layers.0.fc.weight": torch.randn(128, 64, generator=g) * 1e-3,
                   "model.layers.0.fc.bias": torch.randn(128, generator=g),
                   "model.norm.weight": torch.ones(64) + torch.randn(64, generator=g) * 0.1,
                   "model.half.weight": torch.randn(32, 16, generator=g).half()}
        ckpt = os.path.join(self.tmp, "ckpt")
        os.makedirs(ckpt)
        names = list(tensors)
        shards = {"model-00001-of-00002.safetensors": names[:2],
                  "model-00002-of-00002.safetensors": names[2:]}
        weight_map = {}
        for f, ns in shards.items():
            safetensors_io.save({n: tensors[n] for n in ns}, os.path.join(ckpt, f),
                                metadata={"format": "pt"})
            weight_map.update({n: f for n in ns})
        with open(os.path.join(ckpt, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
        out = os.path.join(self.tmp, "out")
        text = load_and_export(ckpt, out)
        self.assertIn("streaming 5 tensors from 2 file(s)", text)
        self.assertTrue(os.path.exists(os.path.join(out, "model.safetensors.index.json")))
        got = read_dir(out)
        self.assertEqual(sorted(got), sorted(tensors))
        for n, t in tensors.items():
            self.assertEqual(got[n].dtype, torch.bfloat16, n)
            self.assertEqual(tuple(got[n].shape), tuple(t.shape), n)
            self.assertTrue(torch.equal(got[n], t.float().to(torch.bfloat16)), n)

    @unittest.skipIf(transformers is None, "transformers is not installed")
    def test_transformers_models_round_trip(self):
        from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                                  LlamaForCausalLM)
        torch.manual_seed(0)
        models = {
            # GPT-2 ties lm_head to the token embedding (saved once).
            "gpt2_tied_sharded": (GPT2LMHeadModel(GPT2Config(
                n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=64)), "100KB"),
            "llama_untied_one_file": (LlamaForCausalLM(LlamaConfig(
                hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, vocab_size=400,
                tie_word_embeddings=False)), "50MB"),
            "llama_tied_sharded": (LlamaForCausalLM(LlamaConfig(
                hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, vocab_size=300,
                tie_word_embeddings=True)), "60KB"),
        }
        for name, (model, shard) in models.items():
            src = os.path.join(self.tmp, name)
            model.save_pretrained(src, max_shard_size=shard)
            sharded = os.path.exists(os.path.join(src, "model.safetensors.index.json"))
            self.assertEqual(sharded, shard != "50MB", name)
            out = os.path.join(self.tmp, name + "_out")
            load_and_export(src, out)
            for f in os.listdir(src):
                if f.endswith(".json") and not f.startswith("model.safetensors"):
                    shutil.copy(os.path.join(src, f), out)
            back = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.bfloat16)
            want = {k: v.detach().float().to(torch.bfloat16) for k, v in
                    model.state_dict().items()}
            got = back.state_dict()
            self.assertEqual(sorted(got), sorted(want), name)
            for k in want:
                self.assertTrue(torch.equal(got[k], want[k]), "%s: %s" % (name, k))
            if model.config.tie_word_embeddings:
                self.assertEqual(back.get_output_embeddings().weight.data_ptr(),
                                 back.get_input_embeddings().weight.data_ptr(), name)
            print("%s: %d tensors equal torch's BF16 cast (sharded=%s)" % (name, len(want),
                                                                            sharded))


if __name__ == "__main__":
    unittest.main(verbosity=2)
